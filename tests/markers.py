"""Which optional parts of the stack a test needs, as pytest skip markers.

The DP optimizer classes subclass TensorFlow Privacy's, which subclass Keras 2
(legacy) optimizers: they exist only where tensorflow-privacy is installed
(the ``tf_twice[tf-privacy]`` extra) and Keras is Keras 2 (TensorFlow 2.15, or
tf-keras with TF_USE_LEGACY_KERAS=1). CI runs one environment with them and
one without, so every test still runs somewhere.
"""

import importlib
import importlib.util

import pytest
import tensorflow as tf

# tf.keras is the package `keras` (Keras 2 up to TensorFlow 2.15, Keras 3
# after) or `tf_keras` (TF_USE_LEGACY_KERAS=1); the package has the version.
_KERAS_PACKAGE = importlib.import_module(tf.keras.Model.__module__.split('.')[0])
KERAS_MAJOR = int(_KERAS_PACKAGE.__version__.split('.')[0])
HAS_TF_PRIVACY = importlib.util.find_spec('tensorflow_privacy') is not None

needs_keras_2 = pytest.mark.skipif(
    KERAS_MAJOR != 2, reason='needs Keras 2 (TensorFlow <= 2.15 or tf-keras)')
needs_tf_privacy_optimizers = pytest.mark.skipif(
    KERAS_MAJOR != 2 or not HAS_TF_PRIVACY,
    reason='the DP optimizer classes need tensorflow-privacy and Keras 2')
