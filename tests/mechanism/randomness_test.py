"""Tests of the mask bits: which random bits each coordinate reads, whatever
the shape the masks are laid out in."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import randomness

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).


def _reference_masks(words, d, q2):
    """Coordinate c of a row reads bits c * b .. (c + 1) * b - 1 of the
    row's words (as little-endian bytes), low bits first."""
    bits = config_lib.mask_bits_per_coordinate(q2)
    threshold = int(config_lib.effective_coordinate_sampling_rate(q2)
                    * 2**bits)
    rows = []
    for row in words:
        stream = np.unpackbits(row.astype('<u4').view(np.uint8),
                               bitorder='little')
        values = [int(sum(int(stream[c * bits + k]) << k
                          for k in range(bits))) for c in range(d)]
        rows.append(np.array(values) < threshold)
    return np.array(rows)


# Bits per coordinate: 0.5 -> 1, 0.25 -> 2, 0.0625 -> 4, 3/256 -> 8,
# 1/3 -> 16.
@pytest.mark.parametrize('q2', [0.5, 0.25, 0.0625, 3 / 256, 1 / 3])
# Last axes of 8, 16 and 24 hold whole bytes at every rate, and 32 and 64
# whole 32-bit words at rates of 1 bit (8 and 16 at rates of 4 and 2 bits);
# 5, 7 and 1 do not (the masks are split flat); () is one coordinate;
# (0,), (3, 0) and (0, 32) none.
@pytest.mark.parametrize('shape', [(3, 8), (2, 3, 24), (16,), (2, 64),
                                   (32,), (3, 5), (7,), (4, 1), (),
                                   (0,), (3, 0), (0, 32)])
@pytest.mark.parametrize('jit_compile', [False, True])
def test_each_coordinate_reads_its_own_bits(q2, shape, jit_compile):
    d = math.prod(shape)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    words = randomness.row_mask_words(key, 3, 4, 5, d, q2)
    masks = tf.function(
        lambda w: randomness.masks_from_words(w, shape, q2),
        jit_compile=jit_compile)(words)
    assert masks.shape == (4,) + shape
    want = _reference_masks(words.numpy(), d, q2)
    np.testing.assert_array_equal(np.reshape(masks, (4, d)), want)


@pytest.mark.parametrize('q2', [0.5, 0.25, 0.0625, 3 / 256, 1 / 3])
@pytest.mark.parametrize('shape', [(3, 10), (2, 3, 24), (7,), (4, 1), (),
                                   (3, 0)])
def test_rows_last_masks_read_the_same_bits(q2, shape):
    # The factored kernels read the masks with the rows last (words
    # transposed): each coordinate must get the bits it gets rows first.
    d = math.prod(shape)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(2))
    words = randomness.row_mask_words(key, 1, 5, 7, d, q2)
    masks = tf.function(
        lambda w: randomness.masks_from_words_rows_last(
            tf.transpose(w), shape, q2), jit_compile=True)(words)
    assert masks.shape == shape + (5,)
    want = _reference_masks(words.numpy(), d, q2)
    np.testing.assert_array_equal(
        np.reshape(np.moveaxis(masks.numpy(), -1, 0), (5, d)), want)


@pytest.mark.parametrize('dtype', [tf.int32, tf.int64, tf.complex64])
def test_noise_of_a_non_float_dtype_is_refused(dtype):
    # An int64 or complex64 tensor once picked a transform in its own dtype
    # (8 bytes wide, like float64): garbage or a TensorFlow error deep in
    # the sampler; an int32 one got float32 draws truncated to integers.
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    with pytest.raises(ValueError, match=f'floating-point dtype.*got '
                                         f'{dtype.name}'):
        randomness.standard_normal_noise(key, [[4]], [dtype])


@pytest.mark.parametrize('dtype', [tf.float32, tf.float64])
def test_noise_reaches_past_tensorflows_normal_sampler(dtype):
    # tf.random's normal draws stop at sqrt(-2 ln 1e-7) = 5.68 (Box-Muller
    # with its uniform clamped at 1e-7); the accountant integrates the whole
    # Gaussian tail. Here the smallest uniform gives the largest radius,
    # sqrt(2 ln 2**53) = 8.57, and the largest a radius near 0, both finite.
    extreme = randomness.box_muller(tf.constant(
        [[0.0, 1.0 - 2.0**-52], [0.0, 0.25]], tf.float64), dtype).numpy()
    assert extreme.dtype == dtype.as_numpy_dtype
    np.testing.assert_allclose(extreme[0], math.sqrt(2 * 53 * math.log(2)),
                               rtol=1e-6)
    assert np.all(np.isfinite(extreme)) and np.all(np.abs(extreme[1:]) < 1e-3)


@pytest.mark.parametrize('dtype', [tf.float32, tf.float64])
def test_largest_uniforms_give_the_float64_radius_not_zero(dtype):
    # A u within 2**-25 of 1 rounded to 1.0 in float32: ln(1) = 0, so both
    # draws of the pair were exactly 0 (2**-25 per pair, the two
    # coordinates of the update released without noise), and the next
    # float32 below 1 gave a radius of 3.45e-4, so no pair had a radius in
    # (0, 3.45e-4). Every radius must be the float64 one, and positive.
    ks = np.array([2**52 - 1, 2**52 - 2**26, 2**52 - 2**27,
                   2**52 - 2**28, 2**52 - 2**40], np.float64)
    uniform = np.stack([ks * 2.0**-52, np.full(ks.size, 0.1)])
    pairs = randomness.box_muller(tf.constant(uniform, tf.float64),
                                  dtype).numpy().astype(np.float64)
    radius = np.hypot(pairs[:ks.size], pairs[ks.size:])
    u = ks * 2.0**-52 + 2.0**-53
    want = np.sqrt(-2.0 * np.log1p(-(1.0 - u)))  # 1 - u is exact here.
    assert (radius > 0).all(), radius
    np.testing.assert_allclose(radius, want, rtol=1e-5)


def test_float32_noise_of_a_fixed_key_has_no_exact_zero():
    # 2**24 float32 draws of this key held an exactly-zero pair (indices
    # 2401508 and 2401508 + 2**23), where PrivateAggregator.finish then
    # released the noise-free sum.
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    noise = randomness.standard_normal_noise(key, [[2**24]],
                                             [tf.float32])[0].numpy()
    assert np.count_nonzero(noise == 0) == 0


def test_each_tensors_noise_is_box_muller_of_its_own_stream():
    # The transform runs once over the bits of every tensor of one
    # accumulation dtype; each tensor's draws must still be those of its
    # own stream alone, in its own layout (radius times cosine of each
    # pair, then times sine, cut to an odd size), whatever the other
    # tensors' sizes and dtypes. The reference: numpy from the raw bits.
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    shapes = [(3,), (2, 2), (0,), (5, 1), (7,)]
    dtypes = [tf.float32, tf.float64, tf.float32, tf.float16, tf.float64]
    noise = randomness.standard_normal_noise(key, shapes, dtypes, block=1)
    for v, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        size = math.prod(shape)
        bits = tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=[2, (size + 1) // 2], key=key,
            counter=tf.constant([0, randomness.noise_stream(1, v)],
                                tf.uint64),
            alg=1, dtype=tf.uint64).numpy()
        u = (bits >> np.uint64(12)).astype(np.float64) * 2.0**-52 + 2.0**-53
        radius, angle = np.sqrt(-2 * np.log(u[0])), 2 * math.pi * u[1]
        want = np.concatenate([radius * np.cos(angle),
                               radius * np.sin(angle)])[:size]
        assert noise[v].dtype == dtype and noise[v].shape == shape
        np.testing.assert_allclose(
            noise[v].numpy().astype(np.float64), want.reshape(shape),
            rtol={tf.float16: 1e-3, tf.float32: 1e-5}.get(dtype, 1e-12),
            atol=1e-6, err_msg=f'tensor {v}')


@pytest.mark.parametrize('dtype', [tf.float32, tf.float64, tf.float16])
def test_noise_is_standard_normal(dtype):
    # 400,001 draws (odd: the last Box-Muller pair is cut) in two tensors.
    key = randomness.draw_step_key(tf.random.Generator.from_seed(5))
    draws = randomness.standard_normal_noise(key, [(200000,), (401, 499)],
                                             [dtype, dtype])
    assert [d.dtype for d in draws] == [dtype, dtype]
    assert draws[1].shape == (401, 499)
    values = np.concatenate([d.numpy().astype(np.float64).ravel()
                             for d in draws])
    n = values.size
    assert abs(values.mean()) < 5 / math.sqrt(n)
    assert abs(values.std() - 1) < 5 / math.sqrt(2 * n)
    # Probabilities of the half-lines beyond 0, 1 and 2: P(N > t).
    for t, tail in [(0, 0.5), (1, 0.15865525), (2, 0.02275013)]:
        for side in (values, -values):
            share = np.mean(side > t)
            assert abs(share - tail) < 5 * math.sqrt(tail * (1 - tail) / n)
    # The two tensors' streams are independent.
    first, second = (d.numpy().astype(np.float64).ravel()[:200000]
                     for d in draws)
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / math.sqrt(200000)
