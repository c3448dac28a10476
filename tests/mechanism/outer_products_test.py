"""Tests of dense kernels' per-example gradients kept as outer products:
recognised by their op, aggregated to what their written-out gradients
give, their norms right at the float32 extremes, never written out."""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice.mechanism import aggregation as agg
from tf_twice.mechanism import outer_products
from tf_twice.mechanism import randomness

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

M, N = 7, 5


def _factors(batch, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, M)).astype(np.float32),
            rng.standard_normal((batch, N)).astype(np.float32))


def _batch_matmul(left, right, adj_x, adj_y):
    """left [B, m] and right [B, n] as a batched matrix product with inner
    dimension 1, in each of its four layouts."""
    x = left[:, None, :] if adj_x else left[:, :, None]
    y = right[:, :, None] if adj_y else right[:, None, :]
    return tf.linalg.matmul(x, y, adjoint_a=adj_x, adjoint_b=adj_y)


@pytest.mark.parametrize('adj_x', [False, True])
@pytest.mark.parametrize('adj_y', [False, True])
@pytest.mark.parametrize('static_rows', [False, True])
def test_batch_matmuls_with_inner_dimension_1_are_factored(adj_x, adj_y,
                                                           static_rows):
    left, right = _factors(6)
    spec = [tf.TensorSpec([6 if static_rows else None, k], tf.float32)
            for k in (M, N)]

    @tf.function(input_signature=spec)
    def run(a, b):
        g = _batch_matmul(a, b, adj_x, adj_y)
        factored = outer_products.factor(g)
        assert isinstance(factored, outer_products.OuterProducts)
        assert factored.shape[1:] == (M, N)
        return g, factored.materialize(), factored.left, factored.right

    g, materialized, got_left, got_right = run(left, right)
    np.testing.assert_array_equal(materialized, g)
    np.testing.assert_array_equal(got_left, left)
    np.testing.assert_array_equal(got_right, right)


def test_a_batch_dimension_the_op_broadcasts_is_broadcast():
    left, right = _factors(4, seed=1)

    @tf.function
    def run(a, b):
        g = tf.linalg.matmul(a[:1, :, None], b[:, None, :])  # [1] x [4]
        factored = outer_products.factor(g)
        assert isinstance(factored, outer_products.OuterProducts)
        return g, factored.materialize()

    g, materialized = run(tf.constant(left), tf.constant(right))
    assert materialized.shape == g.shape == (4, M, N)
    np.testing.assert_array_equal(materialized, g)


def test_other_tensors_are_left_as_they_are():
    left, right = _factors(3)
    eager = _batch_matmul(left, right, True, False)
    assert outer_products.factor(eager) is eager

    @tf.function
    def run(a, b):
        outer = _batch_matmul(a, b, True, False)
        kept = [
            tf.identity(outer),
            outer + outer,  # A kernel used twice: a sum of two.
            tf.linalg.matmul(tf.reshape(a, [-1, M, 1])[:, :, :1] * tf.ones(
                [1, 1, 2]), tf.ones([1, 2, N])),  # Inner dimension 2.
            tf.cast(outer, tf.float64),
            _batch_matmul(tf.cast(a, tf.float64), tf.cast(b, tf.float64),
                          True, False),  # float32 only.
        ]
        for g in kept:
            assert outer_products.factor(g) is g, g.op.type
        return 0

    run(left, right)


def _aggregate(left, right, other, *, written_out, l2_norm_clip=1.0,
               **kwargs):
    """clipped_masked_sum of [outer products, other] in a graph, with the
    outer products factored or (behind an identity) written out."""

    @tf.function
    def run(a, b, o):
        g = _batch_matmul(a, b, True, False)
        if written_out:
            g = tf.identity(g)
        return agg.clipped_masked_sum([g, o], l2_norm_clip=l2_norm_clip,
                                      **kwargs)

    return run(tf.constant(left), tf.constant(right), tf.constant(other))


# 1, 9 and 20 rows pad the fused row sum; 64 fills it.
@pytest.mark.parametrize('batch', [1, 9, 20, 64])
@pytest.mark.parametrize('q2, c_inf', [(0.5, 0.05), (0.25, None),
                                       (1.0, 0.05), (1.0, None)])
@pytest.mark.parametrize('jit_compile', [True, False])
def test_factored_sum_equals_the_written_out_sum(batch, q2, c_inf,
                                                 jit_compile):
    left, right = _factors(batch, seed=batch)
    other = np.random.default_rng(7).standard_normal(
        (batch, 3)).astype(np.float32)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    kwargs = dict(linf_norm_clip=c_inf, coordinate_sampling_rate=q2, key=key,
                  example_offset=5, jit_compile=jit_compile,
                  weights=np.linspace(0, 1, batch).astype(np.float32))
    factored = _aggregate(left, right, other, written_out=False, **kwargs)
    written = _aggregate(left, right, other, written_out=True, **kwargs)
    # The same masks and clip factors; the norms round differently.
    for got, want in zip(factored, written):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_explicit_masks_apply_to_the_factored_gradients():
    left, right = _factors(5, seed=4)
    other = np.ones((5, 3), np.float32)
    rng = np.random.default_rng(8)
    masks = [rng.random((5, M, N)) < 0.5, rng.random((5, 3)) < 0.5]
    kwargs = dict(linf_norm_clip=0.1, coordinate_sampling_rate=0.5,
                  masks=masks)
    factored = _aggregate(left, right, other, written_out=False, **kwargs)
    written = _aggregate(left, right, other, written_out=True, **kwargs)
    for got, want in zip(factored, written):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('c_inf', [None, 5e-5])
@pytest.mark.parametrize('written_out', [False, True])
def test_norms_at_the_float32_extremes(c_inf, written_out):
    # Row 0: left 1e19, right 1e-23: every product is 1e-4 (norm 5.9e-4,
    # above c2), but right's squares (1e-46) underflow in float32, so a
    # float32 norm of the factors would be 0 and leave the row unclipped.
    # Row 1: 1e30 against 1e-30, products 1. Row 2: a NaN. Row 3: products
    # 1e38, finite, but the norm overflows. Row 4: ordinary.
    left = np.ones((5, M), np.float32)
    right = np.ones((5, N), np.float32)
    left[0], right[0] = 1e19, 1e-23
    left[1], right[1] = 1e30, 1e-30
    left[2, 3] = np.nan
    left[3], right[3] = 1e19, 1e19
    c2 = 3e-4
    for row in range(5):
        contribution = np.asarray(_aggregate(
            left, right, np.zeros((5, 1), np.float32), written_out=written_out,
            l2_norm_clip=c2, linf_norm_clip=c_inf,
            weights=np.eye(5, dtype=np.float32)[row])[0], np.float64)
        if row in (2, 3):  # A non-finite norm: the row is dropped.
            np.testing.assert_array_equal(contribution, 0)
        elif c_inf is None:  # Clipped to the l2 bound.
            np.testing.assert_allclose(np.linalg.norm(contribution), c2,
                                       rtol=1e-5)
        else:  # Every coordinate at c_inf, below c2 / sqrt(35).
            np.testing.assert_allclose(contribution, c_inf, rtol=1e-6)


# Ordinary rows (their left norms summed in float32); rows so small or so
# large that float32 sums of squares would lose or overflow them; a zero
# (padding) row among ordinary ones; a NaN row. All but the first are
# summed in float64.
@pytest.mark.parametrize('scale, odd_row', [
    (1.0, None), (1e-15, None), (1e20, None), (1.0, 0.0), (1.0, np.nan)])
@pytest.mark.parametrize('float32_first', [True, False])
def test_norms_are_the_float64_ones(scale, odd_row, float32_first):
    rng = np.random.default_rng(5)
    left = (rng.standard_normal((6, 300)) * scale).astype(np.float32)
    right = rng.standard_normal((6, N)).astype(np.float32)
    if odd_row is not None:
        left[4] = odd_row
    got = tf.function(lambda a, b: outer_products.squared_norms(
        outer_products.OuterProducts(a, b), float32_first))(left, right)
    want = ((left.astype(np.float64)**2).sum(1)
            * (right.astype(np.float64)**2).sum(1))
    assert got.dtype == tf.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6)


@pytest.mark.parametrize('q2, c_inf', [(1.0, None), (0.5, None),
                                       (1.0, 1.0)])
def test_a_tiny_factor_times_the_clip_factor_is_exact(q2, c_inf):
    # ||g|| = 1e-30 * 3e38 = 3e8 and c2 = 2.1e-7: the clip factor times
    # left (7e-46) is subnormal in float32, though no entry of g or of the
    # clipped g is. Formed in float32 it is flushed to 0 on this CPU (the
    # row dropped) or rounded to 1.4e-45 where subnormals are kept (the
    # contribution doubled past c2).
    left = np.array([[1e-30, 0, 0]], np.float32)
    right = np.array([[3e38, 0]], np.float32)
    c2 = 2.144e-7
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    factored, written = (np.asarray(_aggregate(
        left, right, np.zeros((1, 1), np.float32), written_out=w,
        l2_norm_clip=c2, linf_norm_clip=c_inf, coordinate_sampling_rate=q2,
        key=key)[0], np.float64) for w in (False, True))
    np.testing.assert_allclose(factored, written, rtol=1e-6)
    if q2 == 1:  # Nothing masked: the contribution is clipped to c2.
        np.testing.assert_allclose(np.linalg.norm(factored), c2, rtol=1e-6)


def test_written_out_gradients_are_never_computed():
    # The speed of the factored path: nothing reads the [B, m, n] tensor,
    # so TensorFlow prunes the op that would write it.
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    graph_outer = []

    @tf.function(input_signature=[tf.TensorSpec([None, M], tf.float32),
                                  tf.TensorSpec([None, N], tf.float32)])
    def run(a, b):
        g = _batch_matmul(a, b, True, False)
        graph_outer.append(g)
        for q2, c_inf in [(0.5, 0.1), (1.0, None), (1.0, 0.1)]:
            agg.clipped_masked_sum([g], l2_norm_clip=1.0,
                                   linf_norm_clip=c_inf,
                                   coordinate_sampling_rate=q2, key=key,
                                   weights=tf.ones([tf.shape(a)[0]]))
        return 0

    run.get_concrete_function()
    assert graph_outer[0].consumers() == []


def test_subnormal_factors_are_read_as_zero_by_the_norm_and_the_sums():
    # A CPU flushes them; XLA on a GPU keeps them. Flushed where the
    # factors are taken (the right one always; the left one here, its
    # row's norm 3e38 * sqrt(M) being out of the float32 range), the clip
    # factor and the sums see the same numbers on every device: here the
    # row contributes exactly 0.
    left = np.full((1, M), 3e38, np.float32)
    right = np.full((1, N), 1e-39, np.float32)  # Subnormal in float32.
    factors = tf.function(
        lambda a, b: tuple(outer_products.factor(tf.matmul(
            a[:, :, None], b[:, None, :]))))(left, right)
    np.testing.assert_array_equal(factors[1].numpy(), 0)
    np.testing.assert_array_equal(factors[0].numpy(), left)
    nan = tf.function(lambda a, b: outer_products.factor(tf.matmul(
        a[:, :, None], b[:, None, :])).left)(
            np.full((1, M), np.nan, np.float32), right)
    assert np.isnan(nan.numpy()).all()  # NaN stays: its row is dropped.


def _factored(left, right):
    return tf.function(lambda a, b: tuple(outer_products.factor(tf.matmul(
        a[:, :, None], b[:, None, :]))))(left, right)


def test_subnormal_left_entries_are_flushed_only_where_a_norm_needs_it():
    # Row 0: ordinary entries and one subnormal; its float32 norm lies in
    # the range where its flushed share is counted, so left is kept as it
    # is. Row 1 (all subnormal): its norm is 0, outside that range, and
    # every row is flushed. Either way the contribution stays within c2.
    row = np.full((M,), 1e-3, np.float32)
    row[2] = 1e-39
    right = np.full((2, N), 3e38, np.float32)
    kept, _ = _factored(row[None], right[:1])
    np.testing.assert_array_equal(kept.numpy(), row[None])
    flushed, _ = _factored(np.stack([row, np.full((M,), 1e-39, np.float32)]),
                           right)
    np.testing.assert_array_equal(flushed[0].numpy()[2], 0)
    np.testing.assert_array_equal(flushed[1].numpy(), 0)
    np.testing.assert_array_equal(flushed[0].numpy()[[0, 1, 3]], row[0])
    c2 = 0.1
    for rows in (1, 2):
        left = np.stack([row, np.full((M,), 1e-39, np.float32)])[:rows]
        total = np.asarray(_aggregate(
            left, right[:rows], np.zeros((rows, 1), np.float32),
            written_out=False, l2_norm_clip=c2)[0], np.float64)
        assert np.linalg.norm(total) <= c2 * (1 + 1e-6)
