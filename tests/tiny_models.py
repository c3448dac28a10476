"""Tiny models and data shared by the training-path tests."""

import numpy as np
import tensorflow as tf

NUM_FEATURES, NUM_CLASSES = 4, 3


def data(batch, seed=0):
    """`batch` random examples: float32 features, integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, NUM_FEATURES)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, batch)
    return x, y


def mlp(seed=0):
    """A two-layer tanh network; d = 20 + 5 + 15 + 3 = 43 parameters."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.layers.Dense(5, activation='tanh',
                              input_shape=(NUM_FEATURES,)),
        tf.keras.layers.Dense(NUM_CLASSES),
    ])


def linear(seed=0):
    """Softmax regression with random (non-zero) initial weights."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.layers.Dense(NUM_CLASSES, input_shape=(NUM_FEATURES,),
                              kernel_initializer='random_normal',
                              bias_initializer='random_normal')])
