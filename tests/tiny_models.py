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


def one_step(dp_model, x, y, sample_weight=None):
    """Runs ONE DP step on the logical batch (x, y[, sample_weight]).

    Through ``fit`` on a one-element dataset (``train_on_batch`` is refused:
    its steps would not be accounted). Returns the step's logs.
    """
    element = (x, y) if sample_weight is None else (x, y, sample_weight)
    history = dp_model.fit(tf.data.Dataset.from_tensors(element), epochs=1,
                           verbose=0)
    return {name: values[-1] for name, values in history.history.items()}


def next_step_key(dp_model):
    """The Philox key the model's next step will draw (without drawing it)."""
    from tf_twice.mechanism import aggregation  # pylint: disable=import-outside-toplevel
    state = dp_model.aggregator.keys.get_state()
    twin = tf.random.Generator.from_state(state['state'], state['algorithm'])
    return aggregation.draw_step_key(twin)
