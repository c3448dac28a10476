"""Tests of the clip-mask-noise-normalise aggregation."""

import fractions
import math

import numpy as np
import pytest
import tensorflow as tf

from tests import reference
from tf_twice import config as config_lib
from tf_twice import mechanism
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.mechanism import aggregation as agg
from tf_twice.mechanism import randomness

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

SHAPES = [(3, 2), (5,), (1, 4, 3)]


def _grads(batch, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal((batch,) + s)).astype(np.float32)
            for s in SHAPES]


def _reference(grads, weights, masks, noise, c2, c_inf, z, exp_batch, q2):
    """The shared numpy reference, one array per variable of SHAPES."""
    return reference.unflatten(
        reference.private_update(grads, weights, masks, noise, c2=c2,
                                 c_inf=c_inf, z=z,
                                 expected_batch_size=exp_batch, q2=q2),
        SHAPES)


def test_matches_numpy_reference():
    batch, c2, c_inf, z, q2, exp_batch = 7, 1.5, 0.4, 0.8, 0.5, 9.0
    grads = _grads(batch, scale=2.0)
    rng = np.random.default_rng(1)
    weights = np.array([1, 1, 0, 1, 1, 0, 1], np.float32)
    masks = [rng.random((batch,) + s) < q2 for s in SHAPES]
    noise = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    sums = agg.clipped_masked_sum(
        grads, l2_norm_clip=c2, linf_norm_clip=c_inf,
        coordinate_sampling_rate=q2, weights=weights, masks=masks)
    update = agg.add_noise_and_normalize(
        sums, l2_norm_clip=c2, noise_multiplier=z,
        expected_batch_size=exp_batch, coordinate_sampling_rate=q2,
        noise=noise)
    expected = _reference(grads, weights, masks, noise, c2, c_inf, z,
                          exp_batch, q2)
    for got, want in zip(update, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('c_inf', [None, 0.3])
def test_generated_masks_match_reference(c_inf):
    batch, q2 = 6, 0.25
    grads = _grads(batch, seed=3, scale=3.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(5))
    masks = randomness.coordinate_masks(key, SHAPES, q2, batch)
    sums = agg.clipped_masked_sum(
        grads, l2_norm_clip=1.0, linf_norm_clip=c_inf,
        coordinate_sampling_rate=q2, key=key)
    noise = randomness.standard_normal_noise(key, SHAPES, [tf.float32] * 3)
    update = agg.add_noise_and_normalize(
        sums, l2_norm_clip=1.0, noise_multiplier=2.0, expected_batch_size=4,
        coordinate_sampling_rate=q2, key=key)
    expected = _reference(grads, np.ones(batch), [m.numpy() for m in masks],
                          [e.numpy() for e in noise], 1.0, c_inf, 2.0, 4, q2)
    for got, want in zip(update, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


# Batches of 1, 9 and 20 rows are zero-padded to 8, 16 and 24 (1-3 rows in
# each of the fused row sum's 8 slices); 64 needs no padding.
@pytest.mark.parametrize('batch', [1, 9, 20, 64])
@pytest.mark.parametrize('q2, c_inf, dtype', [
    (0.5, 0.3, np.float32), (0.25, None, np.float32),
    (1 / 3, 0.2, np.float64), (1.0, 0.2, np.float32)])
def test_fused_kernel_equals_unfused(q2, c_inf, dtype, batch):
    grads = [g.astype(dtype) for g in _grads(batch, seed=10, scale=2.0)]
    key = randomness.draw_step_key(tf.random.Generator.from_seed(2))
    kwargs = dict(l2_norm_clip=1.0, linf_norm_clip=c_inf,
                  coordinate_sampling_rate=q2, key=key, example_offset=5,
                  weights=np.linspace(0, 1, batch).astype(dtype))
    fused = agg.clipped_masked_sum(grads, jit_compile=True, **kwargs)
    plain = agg.clipped_masked_sum(grads, jit_compile=False, **kwargs)
    for a, b in zip(fused, plain):
        assert a.dtype == dtype
        # The same contributions; the float32 row sums add them in other
        # orders (up to 64 rows of magnitude ~1: a few 1e-7 apart).
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                   atol=1e-6)


def test_fused_kernel_follows_a_changed_clip_or_rate():
    # The XLA kernel is one module-level function, cached per shape and
    # Python argument: the same shapes with a new l-infinity clip or q2 must
    # not run the kernel compiled for the old ones.
    grads = _grads(9, seed=16, scale=3.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(6))
    for c_inf, q2 in [(0.5, 0.5), (0.01, 0.5), (0.01, 0.25), (0.5, 0.5)]:
        kwargs = dict(l2_norm_clip=1.0, linf_norm_clip=c_inf,
                      coordinate_sampling_rate=q2, key=key)
        fused = agg.clipped_masked_sum(grads, jit_compile=True, **kwargs)
        plain = agg.clipped_masked_sum(grads, jit_compile=False, **kwargs)
        for a, b in zip(fused, plain):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                       atol=1e-7)
            assert np.max(np.abs(a.numpy())) <= 9 * c_inf * (1 + 1e-6)


@pytest.mark.parametrize('q2, c_inf', [(0.5, 0.3), (1.0, None)])
def test_batch_size_known_only_at_run_time(q2, c_inf):
    # The training paths cut logical batches into chunks whose size is known
    # only at run time.
    grads = _grads(10, seed=13, scale=2.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    kwargs = dict(l2_norm_clip=1.0, linf_norm_clip=c_inf,
                  coordinate_sampling_rate=q2, key=key)

    @tf.function(input_signature=[
        tf.TensorSpec([None] + list(s), tf.float32) for s in SHAPES])
    def dynamic(*grads):
        assert grads[0].shape[0] is None
        return agg.clipped_masked_sum(list(grads), **kwargs)

    want = agg.clipped_masked_sum(grads, **kwargs)
    for a, b in zip(want, dynamic(*grads)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                   atol=1e-7)


def test_callable_inside_a_caller_compiled_with_xla():
    # XLA has no Euclidean-norm kernel: inside a caller's jit_compile=True
    # function the norms must take another form, with the same result.
    grads = _grads(9, seed=14, scale=2.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(4))
    kwargs = dict(l2_norm_clip=1.0, linf_norm_clip=0.3,
                  coordinate_sampling_rate=0.5, key=key)
    compiled = tf.function(
        lambda *g: agg.clipped_masked_sum(list(g), **kwargs),
        jit_compile=True)
    want = agg.clipped_masked_sum(grads, **kwargs)
    for a, b in zip(want, compiled(*grads)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                   atol=1e-7)


@pytest.mark.parametrize('jit_compile', [True, False])
def test_a_weight_outside_the_range_counts_zero_where_xla_drops_the_check(
        jit_compile):
    # XLA drops the run-time assertion that refuses weights outside [0, 1]
    # (a weight of 2 would count an example twice): the sum gives them
    # weight 0 instead. Without XLA the assertion refuses them.
    grads = _grads(4, seed=14)
    compiled = tf.function(
        lambda w, *g: agg.clipped_masked_sum(list(g), l2_norm_clip=1.0,
                                             weights=w),
        jit_compile=jit_compile)
    bad = np.array([1, 2, np.nan, -1], np.float32)
    if not jit_compile:
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r'per-example weights must be in \[0, 1\]'):
            compiled(bad, *grads)
        return
    got = compiled(bad, *grads)
    want = compiled(np.array([1, 0, 0, 0], np.float32), *grads)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.any(want[0].numpy() != 0)


def test_linf_clip_applies_after_l2_clip():
    # One example with a single large coordinate: the l2 clip scales it to
    # c2, then the l-infinity clip cuts it to c_inf.
    g = [np.zeros((1, 3, 2), np.float32), np.zeros((1, 5), np.float32),
         np.zeros((1, 1, 4, 3), np.float32)]
    g[1][0, 2] = 10.0
    g[1][0, 3] = 0.5
    sums = agg.clipped_masked_sum(g, l2_norm_clip=2.0, linf_norm_clip=0.15)
    scaled = 2.0 / math.hypot(10.0, 0.5)
    np.testing.assert_allclose(
        sums[1].numpy(), [0, 0, 0.15, min(0.5 * scaled, 0.15), 0], rtol=1e-6)


@pytest.mark.parametrize('jit_compile', [True, False])
def test_a_clip_is_rounded_down_to_the_dtype(jit_compile):
    # float32(0.1) is 0.10000000149: rounded to nearest, the l-infinity
    # clip let each coordinate exceed the c_inf the accountant assumes.
    grads = np.diag([5.0, -5.0, 1e4]).astype(np.float32)
    (total,) = agg.clipped_masked_sum([grads], l2_norm_clip=10.0,
                                      linf_norm_clip=0.1,
                                      jit_compile=jit_compile)
    each = total.numpy().astype(np.float64)
    assert np.all(np.abs(each) <= 0.1) and np.all(np.abs(each) > 0.0999999)


@pytest.mark.parametrize('dtype, z, c2', [(tf.float32, 1.0, 0.7),
                                           (tf.float16, 1.0, 0.1),
                                           (tf.float64, 1.78, 0.87)])
def test_a_noise_std_is_rounded_up_to_the_dtype(dtype, z, c2):
    # 0.7 rounds down in float32 (0.69999999) and 0.1 in float16 (0.09998),
    # and the float64 product 1.78 * 0.87 rounds below the exact one: to
    # nearest, the step added less noise than accounted.
    (update,) = agg.add_noise_and_normalize(
        [tf.zeros([3], dtype)], l2_norm_clip=c2, noise_multiplier=z,
        expected_batch_size=1.0, noise=[tf.ones([3], dtype)])
    std = fractions.Fraction(z) * fractions.Fraction(c2)
    for got in update.numpy():
        assert std <= fractions.Fraction(float(got)) < std * (1 + 2e-3)


@pytest.mark.parametrize('clip', [1e-45, 1e-40])
def test_an_linf_clip_below_the_smallest_normal_value_is_refused(clip):
    # (l2_norm_clip is validated to [1e-12, 1e30].) Rounded to nearest,
    # 1e-45 became float32's 1.4e-45, 1.4 times the clip; rounded down it
    # is 0. 1e-40 is a subnormal float32, which CPUs flush to 0.
    with pytest.raises(ValueError, match=f'linf_norm_clip={clip} is below '
                                         '1.17549e-38, the smallest normal '
                                         'float32 value'):
        agg.clipped_masked_sum(_grads(3), l2_norm_clip=1.0,
                               linf_norm_clip=clip)
    # In float64 the same clip is representable, and holds.
    (total, *_) = agg.clipped_masked_sum(
        [1e6 * g.astype(np.float64) for g in _grads(3)], l2_norm_clip=1.0,
        linf_norm_clip=clip)
    assert total.dtype == tf.float64
    assert 0 < np.abs(total.numpy()).max() <= 3 * clip


def test_numpy_float64_clips_are_python_floats():
    grads = _grads(4, scale=4.0)
    want = agg.clipped_masked_sum(grads, l2_norm_clip=1.0, linf_norm_clip=0.2)
    got = agg.clipped_masked_sum(grads, l2_norm_clip=np.float64(1.0),
                                 linf_norm_clip=np.float64(1.0) / np.sqrt(25))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_padding_contributes_nothing():
    grads = _grads(5, scale=4.0)
    real = agg.clipped_masked_sum([g[:3] for g in grads], l2_norm_clip=1.0,
                                  linf_norm_clip=0.2)
    padded = agg.clipped_masked_sum(
        grads, l2_norm_clip=1.0, linf_norm_clip=0.2,
        weights=np.array([1, 1, 1, 0, 0], np.float32))
    for a, b in zip(real, padded):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


# 1e38: a finite entry whose square overflows, so the norm is not finite.
@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf, 1e38])
@pytest.mark.parametrize('linf_norm_clip', [0.3, None])
@pytest.mark.parametrize('jit_compile', [True, False])
def test_non_finite_example_is_dropped(bad, linf_norm_clip, jit_compile):
    grads = _grads(4, seed=2)
    poisoned = [g.copy() for g in grads]
    poisoned[2][1, 0, 3, 1] = bad  # example 1
    good = [np.delete(g, 1, axis=0) for g in grads]
    kwargs = dict(l2_norm_clip=0.7, linf_norm_clip=linf_norm_clip,
                  jit_compile=jit_compile)
    want = agg.clipped_masked_sum(good, **kwargs)
    got = agg.clipped_masked_sum(poisoned, **kwargs)
    for a, b in zip(want, got):
        assert np.all(np.isfinite(b.numpy()))
        # The zeroed row changes the order of the float32 sum, not its terms.
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                   atol=1e-7)


@pytest.mark.parametrize('linf_norm_clip', [0.3, None])
@pytest.mark.parametrize('jit_compile', [True, False])
def test_a_huge_finite_example_is_clipped(linf_norm_clip, jit_compile):
    # Entries of 1e18: a squared norm of 5e36, near float32's limit
    # (3.4e38), finite, so the example is clipped to c2, not dropped.
    grads = [np.full((1, 3), 1e18, np.float32), np.full((1, 2), -1e18,
                                                        np.float32)]
    sums = agg.clipped_masked_sum(grads, l2_norm_clip=0.7,
                                  linf_norm_clip=linf_norm_clip,
                                  jit_compile=jit_compile)
    flat = np.concatenate([s.numpy().ravel() for s in sums]).astype(
        np.float64)
    assert np.all(np.isfinite(flat)) and np.any(flat != 0)
    assert np.linalg.norm(flat) <= 0.7 * (1 + 1e-6)
    if linf_norm_clip is not None:
        assert np.abs(flat).max() <= linf_norm_clip * (1 + 1e-6)


def _one_slice_per_example(batch, width, seed):
    """[batch, batch * width] gradients, example i non-zero only in
    coordinates [width i, width (i + 1)): that slice of a sum over the
    examples is exactly example i's contribution."""
    rng = np.random.default_rng(seed)
    grads = np.zeros((batch, batch * width))
    for i in range(batch):
        grads[i, i * width:(i + 1) * width] = (
            rng.standard_normal(width) * rng.uniform(1, 30))
    return grads


@pytest.mark.parametrize('dtype', [tf.float16, tf.bfloat16])
@pytest.mark.parametrize('linf_norm_clip', [0.3, None])
@pytest.mark.parametrize('jit_compile', [True, False])
@pytest.mark.parametrize('q2, weighted', [(1.0, False), (0.5, True)])
def test_16_bit_gradients_are_clipped_in_float32(dtype, linf_norm_clip,
                                                  jit_compile, q2, weighted):
    # Computed in 16 bits, scale * g rounded after the norm was measured:
    # up to 1.0012 (float16) and 1.0058 (bfloat16) times c2 here, and past
    # c_inf.
    batch, width = 64, 16
    grads_16 = tf.constant(_one_slice_per_example(batch, width, 5), dtype)
    weights = (np.random.default_rng(6).uniform(0.5, 1, batch).astype(
        np.float32) if weighted else None)
    kwargs = dict(l2_norm_clip=0.7, linf_norm_clip=linf_norm_clip,
                  coordinate_sampling_rate=q2, weights=weights,
                  key=randomness.draw_step_key(
                      tf.random.Generator.from_seed(3)),
                  jit_compile=jit_compile)
    (total,) = agg.clipped_masked_sum([grads_16], **kwargs)
    assert total.dtype == tf.float32
    each = total.numpy().astype(np.float64).reshape(batch, width)
    bound = np.ones(batch) if weights is None else weights
    assert np.all(np.linalg.norm(each, axis=1) <= 0.7 * bound * (1 + 1e-6))
    if linf_norm_clip is not None:
        assert np.all(np.abs(each).max(axis=1)
                      <= linf_norm_clip * bound * (1 + 1e-6))
    # The same numbers (masks included) as the float32 aggregation of the
    # 16-bit values.
    (want,) = agg.clipped_masked_sum([tf.cast(grads_16, tf.float32)],
                                     **kwargs)
    np.testing.assert_array_equal(total.numpy(), want.numpy())


def test_16_bit_and_float32_blocks_are_each_clipped():
    batch, width = 32, 8
    grads = _one_slice_per_example(batch, width, 7)
    blocks = [[tf.constant(grads, tf.float16)],
              [tf.constant(grads, tf.float32)],
              [tf.constant(grads, tf.bfloat16)]]
    sums = agg.clipped_masked_block_sums(
        blocks, l2_norm_clips=[0.3, 0.2, 0.1],
        linf_norm_clips=[None, 0.05, 0.04])
    for block, c2, c_inf in zip(sums, [0.3, 0.2, 0.1], [None, 0.05, 0.04]):
        assert block[0].dtype == tf.float32
        each = block[0].numpy().astype(np.float64).reshape(batch, width)
        assert np.linalg.norm(each, axis=1).max() <= c2 * (1 + 1e-6)
        if c_inf is not None:
            assert np.abs(each).max() <= c_inf * (1 + 1e-6)


@pytest.mark.parametrize('other', [tf.float32, tf.float16])
@pytest.mark.parametrize('jit_compile', [True, False])
def test_a_block_of_float64_and_narrower_tensors_is_summed_in_float64(
        other, jit_compile):
    # An example's norm adds squares over all tensors of its block, so a
    # float64 layer next to float32 (or float16) ones puts the whole block
    # in float64: the same numbers, masks included, as all-float64 input.
    grads = _grads(9, seed=21, scale=2.0)
    mixed = [tf.constant(grads[0], tf.float64)] + [
        tf.constant(g, other) for g in grads[1:]]
    kwargs = dict(l2_norm_clip=0.7, linf_norm_clip=0.2,
                  coordinate_sampling_rate=0.5,
                  weights=np.linspace(0.2, 1, 9).astype(np.float32),
                  key=randomness.draw_step_key(
                      tf.random.Generator.from_seed(4)),
                  jit_compile=jit_compile)
    got = agg.clipped_masked_sum(mixed, **kwargs)
    assert [s.dtype for s in got] == [tf.float64] * len(grads)
    want = agg.clipped_masked_sum([tf.cast(g, tf.float64) for g in mixed],
                                  **kwargs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize('jit_compile', [True, False])
def test_16_bit_rows_are_dropped_or_clipped_by_their_float32_norm(
        jit_compile):
    # NaN and inf rows are dropped. A float16 row of 65504s (float16's
    # largest) has a float16 squared norm of inf but a finite float32 one:
    # it is clipped, like any finite gradient.
    batch, width = 8, 4
    grads = _one_slice_per_example(batch, width, 8)
    grads[1, 4:8] = [np.nan, 1, 1, 1]
    grads[2, 8:12] = [np.inf, 1, 1, 1]
    grads[3, 12:16] = 65504
    kwargs = dict(l2_norm_clip=0.7, jit_compile=jit_compile)
    (got,) = agg.clipped_masked_sum([tf.constant(grads, tf.float16)],
                                    **kwargs)
    each = got.numpy().astype(np.float64).reshape(batch, width)
    assert np.all(each[1:3] == 0)
    np.testing.assert_allclose(each[3], np.full(width, 0.35), rtol=2e-6)
    clean = grads.copy()
    clean[1:3] = 0
    (want,) = agg.clipped_masked_sum([tf.constant(clean, tf.float16)],
                                     **kwargs)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_a_weight_above_1_is_refused_with_16_bit_gradients():
    # Checked in float32: cast to float16, 1 + 2**-12 would round to 1.
    grads = _grads(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match='in \\[0, 1\\]'):
        agg.clipped_masked_sum(
            [tf.constant(g, tf.float16) for g in grads], l2_norm_clip=1.0,
            weights=np.array([1, 1 + 2**-12, 1], np.float32))


def test_weights_outside_unit_interval_are_refused():
    grads = _grads(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match='in \\[0, 1\\]'):
        agg.clipped_masked_sum(grads, l2_norm_clip=1.0,
                               weights=np.array([1, 2, 1], np.float32))


@pytest.mark.parametrize('q2', [0.5, 0.25, 1 / 3])
def test_masks_do_not_depend_on_chunking(q2):
    key = randomness.draw_step_key(tf.random.Generator.from_seed(11))
    full = randomness.coordinate_masks(key, SHAPES, q2, 10)
    parts = [randomness.coordinate_masks(key, SHAPES, q2, size, offset)
             for offset, size in [(0, 3), (3, 4), (7, 3)]]
    for k in range(len(SHAPES)):
        joined = np.concatenate([p[k].numpy() for p in parts])
        np.testing.assert_array_equal(full[k].numpy(), joined)
    # And the chunked sums add up to the one-chunk sum.
    grads = _grads(10, seed=4)
    kwargs = dict(l2_norm_clip=1.0, linf_norm_clip=0.3,
                  coordinate_sampling_rate=q2, key=key)
    whole = agg.clipped_masked_sum(grads, **kwargs)
    chunked = [agg.clipped_masked_sum([g[a:b] for g in grads],
                                      example_offset=a, **kwargs)
               for a, b in [(0, 3), (3, 7), (7, 10)]]
    for k in range(len(SHAPES)):
        np.testing.assert_allclose(
            whole[k].numpy(), sum(c[k].numpy() for c in chunked), rtol=1e-5,
            atol=1e-6)


@pytest.mark.parametrize('q2', [0.5, 0.75, 1 / 16, 3 / 256, 1 / 3, 0.05])
def test_mask_rate(q2):
    # 400 x 1000 Bernoulli draws: the kept fraction is within 5 standard
    # errors of the realised rate, which is within 2**-16 of q2.
    rate = agg.effective_coordinate_sampling_rate(q2)
    assert 0 <= q2 - rate < 2.0**-16
    key = randomness.draw_step_key(tf.random.Generator.from_seed(7))
    masks = randomness.coordinate_masks(key, [(1000,), (1000,)], q2, 400)
    kept = masks[0].numpy()
    n = kept.size
    stderr = math.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - rate) < 5 * stderr
    # Different variables and examples get different draws.
    assert not np.array_equal(kept, masks[1].numpy())
    assert not np.array_equal(kept[0], kept[1])


def test_noiseless_update_is_unbiased():
    # E[update] = mean clipped gradient when expected_batch_size = B. Over T
    # steps each coordinate's average has standard error
    # sqrt(sum_i c_i^2 q2 (1 - q2)) / (B q2 sqrt(T)); allow 5 of them.
    batch, q2, steps = 6, 0.3, 400
    rate = agg.effective_coordinate_sampling_rate(q2)
    grads = _grads(batch, seed=8, scale=0.5)
    gen = tf.random.Generator.from_seed(9)

    @tf.function
    def one_step():
        key = randomness.draw_step_key(gen)
        sums = agg.clipped_masked_sum(
            grads, l2_norm_clip=1.0, linf_norm_clip=0.25,
            coordinate_sampling_rate=q2, key=key)
        return agg.add_noise_and_normalize(
            sums, l2_norm_clip=1.0, noise_multiplier=0.0,
            expected_batch_size=batch, coordinate_sampling_rate=q2)

    total = [np.zeros(s) for s in SHAPES]
    for _ in range(steps):
        for acc, u in zip(total, one_step()):
            acc += u.numpy()
    ones = [np.ones((batch,) + s, bool) for s in SHAPES]
    clipped = _reference(grads, np.ones(batch), ones,
                         [np.zeros(s) for s in SHAPES], 1.0, 0.25, 0.0, 1.0,
                         1.0)  # sum of clipped gradients
    flat = np.concatenate([g.reshape(batch, -1) for g in grads], axis=1)
    flat = flat * np.minimum(1, 1.0 / np.linalg.norm(flat, axis=1))[:, None]
    flat = np.clip(flat, -0.25, 0.25)
    stderr = (np.sqrt((flat**2).sum(0) * rate * (1 - rate))
              / (batch * rate * math.sqrt(steps)))
    mean = np.concatenate([t.reshape(-1) for t in total]) / steps
    want = np.concatenate([c.reshape(-1) for c in clipped]) / batch
    assert np.all(np.abs(mean - want) <= 5 * stderr + 1e-7)


def test_noise_std_and_normalisation():
    # Zero gradients: the update is pure noise with std z c2 / (B_exp q2).
    # With n = 120,000 draws the sample std has relative standard error
    # 1 / sqrt(2 n) ~ 0.2%; allow 5 of them.
    z, c2, exp_batch, q2 = 1.3, 0.7, 50.0, 0.25
    shapes = [(300, 200), (60000,)]
    zeros = [np.zeros((2,) + s, np.float32) for s in shapes]
    key = randomness.draw_step_key(tf.random.Generator.from_seed(13))
    sums = agg.clipped_masked_sum(zeros, l2_norm_clip=c2,
                                  coordinate_sampling_rate=q2, key=key)
    update = agg.add_noise_and_normalize(
        sums, l2_norm_clip=c2, noise_multiplier=z,
        expected_batch_size=exp_batch, coordinate_sampling_rate=q2, key=key)
    values = np.concatenate([u.numpy().reshape(-1) for u in update])
    n = values.size
    sigma = z * c2 / (exp_batch * q2)
    assert abs(values.std() / sigma - 1) < 5 / math.sqrt(2 * n)
    assert abs(values.mean()) < 5 * sigma / math.sqrt(n)
    # The two variables use independent streams.
    assert abs(np.corrcoef(update[0].numpy().reshape(-1)[:60000],
                           update[1].numpy())[0, 1]) < 5 / math.sqrt(60000)


def test_same_key_same_result_and_new_key_differs():
    grads = _grads(5, seed=6)
    gen = tf.random.Generator.from_seed(1)
    k1, k2 = randomness.draw_step_key(gen), randomness.draw_step_key(gen)
    kwargs = dict(l2_norm_clip=1.0, coordinate_sampling_rate=0.5)
    a = agg.clipped_masked_sum(grads, key=k1, **kwargs)
    b = agg.clipped_masked_sum(grads, key=k1, **kwargs)
    c = agg.clipped_masked_sum(grads, key=k2, **kwargs)
    np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    assert not np.array_equal(a[0].numpy(), c[0].numpy())


def test_randomness_is_required():
    grads = _grads(2)
    with pytest.raises(ValueError, match='key'):
        agg.clipped_masked_sum(grads, l2_norm_clip=1.0,
                               coordinate_sampling_rate=0.5)
    with pytest.raises(ValueError, match='key'):
        agg.add_noise_and_normalize([g[0] for g in grads], l2_norm_clip=1.0,
                                    noise_multiplier=1.0,
                                    expected_batch_size=2)


@pytest.mark.parametrize('kwargs, name', [
    (dict(l2_norm_clip=0.0), 'l2_norm_clip'),
    (dict(l2_norm_clip=float('nan')), 'l2_norm_clip'),
    (dict(l2_norm_clip=1e-20), 'l2_norm_clip'),  # Its square is 0.
    (dict(linf_norm_clip=-1.0), 'linf_norm_clip'),
    (dict(noise_multiplier=-0.1), 'noise_multiplier'),
    (dict(coordinate_sampling_rate=0.0), 'coordinate_sampling_rate'),
    (dict(coordinate_sampling_rate=1.5), 'coordinate_sampling_rate'),
    (dict(coordinate_sampling_rate=1e-6), 'coordinate_sampling_rate'),
    (dict(expected_batch_size=0), 'expected_batch_size'),
    (dict(expected_batch_size='8'), 'expected_batch_size'),
])
def test_invalid_parameters_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        agg.validate_params(**kwargs)
    # The config, which every training path takes, has the same checks.
    full = dict(l2_norm_clip=1.0, noise_multiplier=1.0,
                expected_batch_size=4.0, num_examples=100)
    full.update(kwargs)
    with pytest.raises(ValueError, match=name):
        TwiceSamplingConfig.single(**full)


def test_mask_bits_per_coordinate():
    assert randomness.mask_bits_per_coordinate(0.5) == 1
    assert randomness.mask_bits_per_coordinate(0.75) == 2
    assert randomness.mask_bits_per_coordinate(1 / 16) == 4
    assert randomness.mask_bits_per_coordinate(3 / 256) == 8
    assert randomness.mask_bits_per_coordinate(1 / 3) == 16


def test_effective_rate():
    assert agg.effective_coordinate_sampling_rate(1.0) == 1.0
    assert agg.effective_coordinate_sampling_rate(0.5) == 0.5
    assert agg.effective_coordinate_sampling_rate(0.25) == 0.25
    assert agg.effective_coordinate_sampling_rate(1 / 3) == 21845 / 65536



# --- several blocks ---------------------------------------------------------


def test_one_block_is_exactly_the_single_block_aggregation():
    grads = _grads(7, seed=12, scale=2.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    kwargs = dict(coordinate_sampling_rate=0.5, key=key, example_offset=2,
                  weights=np.linspace(0, 1, 7).astype(np.float32))
    single = agg.clipped_masked_sum(grads, l2_norm_clip=0.8,
                                    linf_norm_clip=0.2, **kwargs)
    blocks = agg.clipped_masked_block_sums(
        [grads], l2_norm_clips=[0.8], linf_norm_clips=[0.2], **kwargs)
    for a, b in zip(single, blocks[0]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    noisy = agg.add_noise_and_normalize(
        single, l2_norm_clip=0.8, noise_multiplier=1.5,
        expected_batch_size=5.0, coordinate_sampling_rate=0.5, key=key)
    noisy_blocks = agg.add_block_noise_and_normalize(
        [single], l2_norm_clips=[0.8], noise_multipliers=[1.5],
        expected_batch_size=5.0, coordinate_sampling_rate=0.5, key=key)
    for a, b in zip(noisy, noisy_blocks[0]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _corr(a, b):
    return np.corrcoef(np.ravel(a).astype(float),
                       np.ravel(b).astype(float))[0, 1]


def test_blocks_draw_independent_masks_and_noise_from_one_key():
    # Two blocks of identical shapes under the same step key: their masks
    # and noise must come from different streams, i.e. differ and be
    # uncorrelated (|corr| < 5 standard errors of 1/sqrt(n)).
    key = randomness.draw_step_key(tf.random.Generator.from_seed(21))
    shapes = [(1000,), (30, 20)]
    masks = [np.concatenate([m.numpy().reshape(200, -1) for m in
                             randomness.coordinate_masks(
                                 key, shapes, 0.5, 200, block=j)], axis=1)
             for j in range(3)]
    noise = [np.concatenate([e.numpy().ravel() for e in
                             randomness.standard_normal_noise(
                                 key, [(100000,), (30, 20)], [tf.float32] * 2,
                                 block=j)]) for j in range(3)]
    for j, k in [(0, 1), (0, 2), (1, 2)]:
        assert not np.array_equal(masks[j], masks[k])
        assert abs(_corr(masks[j], masks[k])) < 5 / math.sqrt(masks[j].size)
        assert not np.array_equal(noise[j], noise[k])
        assert abs(_corr(noise[j], noise[k])) < 5 / math.sqrt(noise[j].size)
    # Block 0 is the single-block layout.
    np.testing.assert_array_equal(
        masks[0][:, :1000],
        randomness.coordinate_masks(key, shapes, 0.5, 200)[0].numpy())


def test_block_sums_use_each_blocks_own_streams():
    # Identical gradients in two blocks: generated masks make their sums
    # differ, and each block's sum equals the sum with block j's masks.
    grads = _grads(6, seed=14, scale=0.2)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(8))
    sums = agg.clipped_masked_block_sums(
        [grads, grads], l2_norm_clips=[10.0, 10.0],
        coordinate_sampling_rate=0.5, key=key, jit_compile=False)
    assert not np.allclose(sums[0][0].numpy(), sums[1][0].numpy())
    for j in range(2):
        masks = randomness.coordinate_masks(key, SHAPES, 0.5, 6, block=j)
        want = agg.clipped_masked_sum(grads, l2_norm_clip=10.0,
                                      coordinate_sampling_rate=0.5,
                                      masks=masks)
        for a, b in zip(sums[j], want):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6,
                                       atol=1e-7)
    noisy = agg.add_block_noise_and_normalize(
        [[tf.zeros(s) for s in SHAPES]] * 2, l2_norm_clips=[1.0, 1.0],
        noise_multipliers=[1.0, 1.0], expected_batch_size=1.0, key=key)
    for j in range(2):
        # Float64 noise on the float64 sums (``precision.BATCH_SUM_DTYPE``).
        want = randomness.standard_normal_noise(key, SHAPES, [tf.float64] * 3,
                                                block=j)
        for a, b in zip(noisy[j], want):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_blocks_are_clipped_on_their_own():
    # Block 0: one big coordinate; block 1: many small ones. Each block is
    # clipped to its own l2 and l-infinity bounds; no budget is shared.
    big = [np.zeros((1, 4), np.float32)]
    big[0][0, 0] = 10.0
    small = [np.full((1, 100), 0.5, np.float32)]
    sums = agg.clipped_masked_block_sums(
        [big, small], l2_norm_clips=[2.0, 1.0], linf_norm_clips=[None, 0.05])
    # Within 1e-6 below the clip: norms are rounded up by their error
    # bound (kernels.squared_norms).
    np.testing.assert_allclose(sums[0][0].numpy(), [2.0, 0, 0, 0],
                               rtol=1e-6)
    np.testing.assert_allclose(sums[1][0].numpy(), np.full(100, 0.05),
                               rtol=1e-6)


def test_non_finite_example_is_dropped_from_every_block():
    grads = _grads(4, seed=15)
    other = [g.copy() for g in grads]
    other[0][2, 0, 0] = np.nan  # example 2, block 1 only
    got = agg.clipped_masked_block_sums([grads, other],
                                        l2_norm_clips=[1.0, 1.0])
    good = [np.delete(g, 2, axis=0) for g in grads]
    want = agg.clipped_masked_sum(good, l2_norm_clip=1.0)
    for j in range(2):
        for a, b in zip(got[j], want):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_empty_tensors_in_a_block_sum_to_empty():
    grads = [np.ones((3, 0), np.float32), np.ones((3, 2), np.float32)]
    sums = agg.clipped_masked_block_sums(
        [grads], l2_norm_clips=[1.0], coordinate_sampling_rate=0.5,
        key=randomness.draw_step_key(tf.random.Generator.from_seed(1)))
    assert sums[0][0].shape == (0,) and sums[0][1].shape == (2,)


@pytest.mark.parametrize('kwargs, match', [
    (dict(l2_norm_clips=[1.0]), 'l2_norm_clips must have one entry per '
     'block'),
    (dict(l2_norm_clips=[1.0, 0.0]), 'block 1: l2_norm_clip must be a finite '
     'number > 0'),
    (dict(l2_norm_clips=[1.0, 1.0], linf_norm_clips=[0.1]),
     'linf_norm_clips must have one entry per block'),
    (dict(l2_norm_clips=[1.0, 1.0], masks=[[np.ones((2, 3))]]),
     'masks must have one entry per block'),
])
def test_block_arguments_are_validated(kwargs, match):
    block = [np.ones((2, 3), np.float32)]
    with pytest.raises(ValueError, match=match):
        agg.clipped_masked_block_sums([block, block], **kwargs)


@pytest.mark.parametrize('blocks, match', [
    (lambda: (Block(l2_norm_clip=1.0), Block(l2_norm_clip=-2.0)),
     'l2_norm_clip'),
    (lambda: (Block(l2_norm_clip=1.0, linf_norm_clip=0.0),),
     'linf_norm_clip'),
    (lambda: (Block(l2_norm_clip=1.0, noise_multiplier=-1.0),),
     'noise_multiplier'),
    (lambda: (Block(l2_norm_clip=1.0, noise_multiplier=1.0),
              Block(l2_norm_clip=2.0, noise_multiplier=0.0)),
     r'blocks\[1\].noise_multiplier must be > 0'),
])
def test_per_block_settings_are_validated(blocks, match):
    with pytest.raises(ValueError, match=match):
        TwiceSamplingConfig(num_examples=100, expected_batch_size=4.0,
                            blocks=blocks())


def test_per_block_config():
    config = TwiceSamplingConfig(
        num_examples=100, expected_batch_size=8,
        blocks=(Block(l2_norm_clip=np.float64(0.5), noise_multiplier=2,
                      linf_norm_clip=0.1),
                Block(l2_norm_clip=1.0, noise_multiplier=3)))
    assert config.num_blocks == 2
    assert config.l2_norm_clips == (0.5, 1.0)
    assert config.noise_multipliers == (2.0, 3.0)
    assert config.linf_norm_clips == (0.1, None)
    assert all(type(c) is float for c in config.l2_norm_clips)
    assert config.to_dict()['blocks'][0]['l2_norm_clip'] == 0.5
    assert TwiceSamplingConfig.from_dict(config.to_dict()) == config
    one = TwiceSamplingConfig.single(num_examples=100, expected_batch_size=4,
                                     noise_multiplier=1.0)
    assert one.num_blocks == 1 and one.linf_norm_clips == (None,)
    # The kernel's arguments follow the config's block order.
    grads = _grads(3, seed=9)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(4))
    sums = agg.clipped_masked_block_sums(
        [grads, grads], l2_norm_clips=config.l2_norm_clips,
        linf_norm_clips=config.linf_norm_clips, key=key)
    want = agg.clipped_masked_sum(grads, l2_norm_clip=0.5,
                                  linf_norm_clip=0.1, key=key)
    for a, b in zip(sums[0], want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_q2_arithmetic_is_the_configs():
    assert agg.effective_coordinate_sampling_rate is (
        config_lib.effective_coordinate_sampling_rate)
    assert randomness.effective_coordinate_sampling_rate is (
        config_lib.effective_coordinate_sampling_rate)
    assert randomness.mask_bits_per_coordinate is (
        config_lib.mask_bits_per_coordinate)
    assert mechanism.MASK_PRECISION_BITS == config_lib.MASK_PRECISION_BITS


def test_each_block_is_masked_and_normalised_at_its_own_rate():
    # Block 0 unmasked (q2_0 = 1), block 1 at q2_1 = 1/4: each gets the
    # numbers the one-rate aggregation gives it for the same key (its own
    # streams), and its sum is divided by B_exp q2_j.
    grads = _grads(7, seed=3)
    blocks = [grads[:1], grads[1:]]
    key = randomness.draw_step_key(tf.random.Generator.from_seed(4))
    kwargs = dict(l2_norm_clips=[0.5, 1.0], linf_norm_clips=[None, 0.2],
                  key=key)
    got = agg.clipped_masked_block_sums(
        blocks, coordinate_sampling_rate=[1.0, 0.25], **kwargs)
    for j, rate in enumerate([1.0, 0.25]):
        want = agg.clipped_masked_block_sums(
            blocks, coordinate_sampling_rate=rate, **kwargs)[j]
        for g, w in zip(got[j], want):
            np.testing.assert_array_equal(g.numpy(), w.numpy())
    unmasked = agg.clipped_masked_block_sums(
        blocks, coordinate_sampling_rate=1.0, **kwargs)
    assert not np.array_equal(got[1][0].numpy(), unmasked[1][0].numpy())
    update = agg.add_block_noise_and_normalize(
        got, l2_norm_clips=[0.5, 1.0], noise_multipliers=[0.0, 0.0],
        expected_batch_size=5.0, coordinate_sampling_rate=[1.0, 0.25])
    for j, rate in enumerate([1.0, 0.25]):
        for u, s in zip(update[j], got[j]):
            np.testing.assert_allclose(u.numpy(), s.numpy().astype(
                np.float64) / (5.0 * rate),
                                       rtol=1e-12)
    with pytest.raises(ValueError, match='one entry per block'):
        agg.clipped_masked_block_sums(
            blocks, coordinate_sampling_rate=[1.0, 0.5, 0.5], **kwargs)


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))


def test_a_configs_step_is_the_raw_functions_step_on_its_numbers():
    config = TwiceSamplingConfig(
        num_examples=50, expected_batch_size=5.0, coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=1.0, noise_multiplier=1.5,
                      linf_norm_clip=0.3, coordinate_sampling_rate=1.0),
                Block(l2_norm_clip=0.5, noise_multiplier=2.0)))
    rng = np.random.default_rng(3)
    blocks = [[rng.standard_normal((4, 6)).astype(np.float32)],
              [rng.standard_normal((4, 3, 2)).astype(np.float32)]]
    key = randomness.draw_step_key(tf.random.Generator.from_seed(4))
    raw = agg.clipped_masked_block_sums(
        blocks, l2_norm_clips=config.l2_norm_clips,
        linf_norm_clips=config.linf_norm_clips,
        coordinate_sampling_rate=config.coordinate_sampling_rates, key=key)
    ours = agg.config_block_sums(blocks, config, key=key)
    sums = [[tf.cast(t, tf.float64) for t in block] for block in ours]
    noisy_raw = agg.add_block_noise_and_normalize(
        sums, l2_norm_clips=config.l2_norm_clips,
        noise_multipliers=config.noise_multipliers,
        expected_batch_size=config.expected_batch_size,
        coordinate_sampling_rate=config.coordinate_sampling_rates, key=key)
    noisy = agg.config_noisy_block_sums(sums, config, key=key)
    for a, b in zip(raw + noisy_raw, ours + noisy):
        np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    # What the config cannot vouch for is refused by name.
    with pytest.raises(ValueError, match='one block per Block'):
        agg.config_block_sums(blocks[:1], config, key=key)
    with pytest.raises(ValueError, match='one block per Block'):
        agg.config_noisy_block_sums(sums[:1], config, key=key)
    with pytest.raises(ValueError, match='calibrate'):
        agg.config_noisy_block_sums(
            sums, config.with_noise_multipliers((1.0, None)), key=key)
    with pytest.raises(ValueError, match='TwiceSamplingConfig'):
        agg.config_noisy_block_sums(sums, dict(config.to_dict()), key=key)
