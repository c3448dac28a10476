"""Tiny models and data shared by the training-path tests."""

import contextlib

import numpy as np
import tensorflow as tf

from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel

NUM_FEATURES, NUM_CLASSES = 4, 3


@contextlib.contextmanager
def dtype_policy(policy):
    """Keras's global dtype policy is ``policy`` inside, the one found
    outside (a failing test must not leave it set for the next)."""
    before = tf.keras.mixed_precision.global_policy()
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        yield
    finally:
        tf.keras.mixed_precision.set_global_policy(before)


def data(batch, seed=0):
    """`batch` random examples: float32 features, integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, NUM_FEATURES)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, batch)
    return x, y


def mlp(seed=0, width=5, dtypes=(None, None)):
    """A two-layer tanh network; d = 8 width + 3 parameters (43 for the
    default width 5). ``dtypes``: the two layers' dtypes (None: the global
    policy's)."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.layers.Dense(width, activation='tanh',
                              input_shape=(NUM_FEATURES,), dtype=dtypes[0]),
        tf.keras.layers.Dense(NUM_CLASSES, dtype=dtypes[1]),
    ])


def linear(seed=0):
    """Softmax regression with random (non-zero) initial weights."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.layers.Dense(NUM_CLASSES, input_shape=(NUM_FEATURES,),
                              kernel_initializer='random_normal',
                              bias_initializer='random_normal')])


def dp_config(*, expected_batch_size, num_examples=1000, l2_norm_clip=1.0,
              noise_multiplier=1.0, linf_norm_clip=None,
              coordinate_sampling_rate=1.0):
    """The ``TwiceSamplingConfig`` of a mechanism in per-argument terms.

    Sequences of ``l2_norm_clip``/``noise_multiplier`` (and
    ``linf_norm_clip``, or None for every block) give one Block per
    hybrid-clipping block. A noise multiplier of 0 gives a
    ``non_private`` config (a noise-free baseline, never accounted).
    """
    clips = (tuple(l2_norm_clip) if isinstance(l2_norm_clip, (list, tuple))
             else (l2_norm_clip,))
    noise = (tuple(noise_multiplier)
             if isinstance(noise_multiplier, (list, tuple))
             else (noise_multiplier,) * len(clips))
    linf = (tuple(linf_norm_clip) if isinstance(linf_norm_clip, (list, tuple))
            else (linf_norm_clip,) * len(clips))
    return TwiceSamplingConfig(
        num_examples=num_examples, expected_batch_size=expected_batch_size,
        coordinate_sampling_rate=coordinate_sampling_rate,
        blocks=tuple(Block(l2_norm_clip=c, noise_multiplier=z,
                           linf_norm_clip=i)
                     for c, z, i in zip(clips, noise, linf, strict=True)),
        non_private=0 in noise)


def dp_model(model, *, physical_batch_size=None, seed=None, basis=None,
             **mechanism):
    """``DPModel(model, dp_config(**mechanism), ...)``."""
    return DPModel(model, dp_config(**mechanism),
                   physical_batch_size=physical_batch_size, seed=seed,
                   basis=basis)


def one_step(dp_model, x, y, sample_weight=None):
    """Runs ONE DP step on the logical batch (x, y[, sample_weight]).

    Through ``fit`` on a one-element dataset (``train_on_batch`` is refused:
    its steps would not be accounted). Returns the step's logs.
    """
    element = (x, y) if sample_weight is None else (x, y, sample_weight)
    history = dp_model.fit(tf.data.Dataset.from_tensors(element), epochs=1,
                           verbose=0)
    return {name: values[-1] for name, values in history.history.items()}


# A fixed Philox state (counter 0, key 12345) for tests that predict keys.
FIXED_KEY_STATE = {'format': 'tf_twice.SecretRandomState', 'version': 1,
                   'algorithm': 1, 'state': [0, 0, 12345]}


def fix_next_step_key(dp_model):
    """Sets the model's step keys to a fixed state; returns the next key."""
    from tf_twice.mechanism import randomness  # pylint: disable=import-outside-toplevel
    dp_model.aggregator.keys.set_state(FIXED_KEY_STATE)
    twin = tf.random.Generator.from_state(FIXED_KEY_STATE['state'],
                                          FIXED_KEY_STATE['algorithm'])
    return randomness.draw_step_key(twin)
