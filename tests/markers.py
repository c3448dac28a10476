"""Which optional parts of the stack a test needs, as pytest skip markers.

The DP optimizer classes subclass TensorFlow Privacy's, which subclass Keras 2
(legacy) optimizers: they exist only where tensorflow-privacy is installed
(the ``tf_twice[tf-privacy]`` extra) and Keras is Keras 2 (TensorFlow 2.15, or
tf-keras with TF_USE_LEGACY_KERAS=1). CI runs one environment with them and
one without, so every test still runs somewhere. The answers are
``tf_twice._keras``'s, the ones ``tf_twice.optimizers`` acts on.
"""

import pytest

from tf_twice import _keras

KERAS_MAJOR = _keras.KERAS_MAJOR
HAS_TF_PRIVACY = _keras.has_tf_privacy()

needs_keras_2 = pytest.mark.skipif(
    KERAS_MAJOR != 2, reason='needs Keras 2 (TensorFlow <= 2.15 or tf-keras)')
needs_keras_3 = pytest.mark.skipif(
    KERAS_MAJOR != 3, reason='needs Keras 3 (TensorFlow >= 2.16, no tf-keras)')
needs_tf_privacy_optimizers = pytest.mark.skipif(
    KERAS_MAJOR != 2 or not HAS_TF_PRIVACY,
    reason='the DP optimizer classes need tensorflow-privacy and Keras 2')

# Gradient accumulation in the DP optimizer classes: tensorflow-privacy's
# (Keras 2) or Keras 3's own; tf-keras's non-legacy optimizers have none.
needs_gradient_accumulation = pytest.mark.skipif(
    KERAS_MAJOR == 2 and not HAS_TF_PRIVACY,
    reason='gradient accumulation needs Keras 3 or tensorflow-privacy')
