"""PrivateAggregator: a logical batch's sum, its noise and its rounding.

A logical batch's clipped masked sums are added over its chunks in float64,
and the noise is added to them in float64, before anything is rounded to the
variables' dtype: the rounding is then post-processing of the noisy sum.
Summed in float32, one example of a large batch moved the sum by more than
its contribution (the accumulator's rounding grows with its size).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import randomness

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

CHUNK = 64


def _aggregator(noise_multiplier=0.0, **kwargs):
    config = config_lib.TwiceSamplingConfig.single(
        num_examples=10**6, expected_batch_size=1024.0, l2_norm_clip=1.0,
        noise_multiplier=noise_multiplier,
        non_private=noise_multiplier == 0, **kwargs)
    return aggregator_lib.PrivateAggregator(config, seed=0)


def _aligned_gradients(batch, d, seed):
    """[batch, d] float32 gradients of norm just above 1, nearly parallel:
    the case where a sum's size, and so its rounding, grows with the batch."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    g = base / np.linalg.norm(base) + 0.01 * rng.standard_normal((batch, d))
    return (1.001 * g / np.linalg.norm(g, axis=1, keepdims=True)).astype(
        np.float32)


def _batch_sums(aggregator, variables, key):
    """A function of (grads, weights): the aggregator's float64 sums of a
    logical batch, chunk by chunk as DPModel runs them (``dp_step``)."""

    @tf.function
    def run(grads, weights):
        def body(i, sums):
            rows = tf.range(i * CHUNK, (i + 1) * CHUNK)
            return i + 1, aggregator.accumulate(
                sums, [tf.gather(grads, rows)], variables,
                weights=tf.gather(weights, rows), key=key,
                example_offset=i * CHUNK)
        return tf.while_loop(
            lambda i, _: i < tf.shape(grads)[0] // CHUNK, body,
            (tf.constant(0), aggregator.zero_sums(variables)))[1][0][0]

    def sums(grads, weights):
        total = run(tf.constant(grads), tf.constant(weights))
        assert total.dtype == tf.float64
        return total.numpy()
    return sums


@pytest.mark.parametrize('coordinate_sampling_rate', [1.0, 0.5])
def test_one_example_of_a_large_batch_moves_its_sum_by_its_contribution(
        coordinate_sampling_rate):
    # 65,536 nearly parallel gradients in 1,024 chunks of 64. Removing one
    # example (weight 0) must move the sum by its clipped masked
    # contribution, up to the float32 rounding of its own chunk's sum (64
    # rows, bounded by the chunk, not the batch: up to 1.6e-6 and 2.1e-6 of
    # the clip in norm on TensorFlow 2.15 and 2.21, 4.2e-6 in a
    # coordinate). Summed over chunks in float32, a late
    # example moved it by up to 1.001 times the clip, and a coordinate by
    # 1e-3 more or less than the example's (about 1 % of it).
    batch, d = 2**16, 32
    aggregator = _aggregator(coordinate_sampling_rate=coordinate_sampling_rate)
    variables = [tf.Variable(tf.zeros([d]))]
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    batch_sums = _batch_sums(aggregator, variables, key)
    worst_norm = worst_error = 0.0
    for seed in range(2):
        grads = _aligned_gradients(batch, d, seed)
        weights = np.ones(batch, np.float32)
        total = batch_sums(grads, weights)
        for removed in (70, 40000, 50000, 60000, 65000):
            weights[:] = 1.0
            weights[removed] = 0.0
            moved = total - batch_sums(grads, weights)
            g = grads[removed].astype(np.float64)
            mask = randomness.row_masks(
                key, randomness.mask_stream(0, 0), 1, removed, d,
                coordinate_sampling_rate)[0].numpy()
            contribution = mask * g / np.linalg.norm(g)
            worst_norm = max(worst_norm, np.linalg.norm(moved))
            worst_error = max(worst_error,
                              np.abs(moved - contribution).max())
    print(f'q2 = {coordinate_sampling_rate}: moved by {worst_norm:.9f} times '
          f'the clip at most, a coordinate by {worst_error:.2e} more or less')
    assert worst_norm > 0.5 * coordinate_sampling_rate  # The sum moved.
    assert worst_norm <= 1.0 + 1e-5, worst_norm
    assert worst_error <= 1e-5, worst_error
