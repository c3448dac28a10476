"""Tests of the per-tensor kernels' row sum (the fused clip-mask-sum),
the zero rows it is padded with, and the ops that sum over examples."""

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from tf_twice.mechanism import kernels
from tf_twice.mechanism import outer_products
from tf_twice.mechanism import precision
from tf_twice.mechanism import randomness

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).


# 1, 7 and 9 rows pad the last slice with zero rows; 8 and 64 fill the 8
# slices exactly.
# [B, 5, 3]: a dense kernel's gradients formed inside the kernel.
@pytest.mark.parametrize('rows', [1, 7, 8, 9, 64])
@pytest.mark.parametrize('reduce_slices_first', [False, True])
@pytest.mark.parametrize('static_rows', [False, True])
@pytest.mark.parametrize('shape', [(37,), (5, 3)])
def test_both_orders_of_the_row_sum_sum_every_row(rows, reduce_slices_first,
                                                  static_rows, shape):
    x = np.random.default_rng(rows).standard_normal((rows,) + shape)
    spec = tf.TensorSpec([rows if static_rows else None] + list(shape),
                         tf.float64)
    sum_rows = tf.function(
        lambda t: kernels._sum_rows(kernels._pad_rows([t])[0],
                                    reduce_slices_first),
        jit_compile=True, input_signature=[spec])
    np.testing.assert_allclose(sum_rows(tf.constant(x)).numpy(),
                               x.sum(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('rows', [1, 8, 13])
def test_rows_are_zero_padded_to_a_multiple_of_8(rows):
    # Bounds the row counts XLA compiles the fused kernel for.
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 1
    words = np.full((rows, 4), 7, np.uint32)
    padded_x, none, padded_words = kernels._pad_rows(
        [tf.constant(x), None, tf.constant(words)])
    assert none is None
    want_rows = -(-rows // 8) * 8
    assert padded_x.shape == (want_rows, 3)
    np.testing.assert_array_equal(padded_x[:rows], x)
    np.testing.assert_array_equal(padded_x[rows:], 0)
    np.testing.assert_array_equal(padded_words[:rows], words)
    np.testing.assert_array_equal(padded_words[rows:], 0)


# Rows per group: a CPU's, another, and a GPU's one group of all rows. 0
# rows: no group (the XLA loop is not run).
@pytest.mark.parametrize('group_rows', [32, 8, None])
@pytest.mark.parametrize('rows', [0, 1, 40, 100])
@pytest.mark.parametrize('q2, c_inf', [(0.5, 0.05), (0.25, None),
                                       (1.0, 0.05)])
def test_factored_sums_are_the_written_out_ones_in_every_layout(
        group_rows, rows, q2, c_inf):
    rng = np.random.default_rng(rows)
    left = tf.constant(rng.standard_normal((rows, 7)), tf.float32)
    right = tf.constant(rng.standard_normal((rows, 3)), tf.float32)
    plain = tf.constant(rng.standard_normal((rows, 2)), tf.float32)
    scale = tf.constant(rng.uniform(0.1, 1.0, rows), tf.float32)
    weights = tf.constant(rng.uniform(0.0, 1.0, rows), tf.float32)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(0))

    @tf.function
    def sums(factored):
        g = outer_products.OuterProducts(left, right)
        return kernels.sum_block(
            [g if factored else g.materialize(), plain], scale, weights,
            c_inf, q2, None, key, 3, True)

    with mock.patch.object(kernels, '_group_rows', lambda: group_rows):
        got = sums(True)
    for a, b in zip(got, sums(False)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=1e-6)


_MATRIX_PRODUCTS = ('MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3',
                    'Einsum')


def _matrix_product_dtypes(concrete) -> list:
    """The dtypes of the matrix products in a traced function and in every
    function it calls (the XLA kernel among them)."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node) + [
        node for function in graph_def.library.function
        for node in function.node_def]
    return [tf.dtypes.as_dtype(node.attr[key].type) for node in nodes
            if node.op in _MATRIX_PRODUCTS
            for key in ('T', 'Ta', 'Tb') if key in node.attr]


@pytest.mark.parametrize('q2, c_inf', [(1.0, None), (1.0, 0.1), (0.5, None),
                                       (0.5, 0.1)])
@pytest.mark.parametrize('jit_compile', [False, True])
@pytest.mark.parametrize('with_weights', [False, True])
def test_sums_over_examples_are_no_float32_matrix_products(
        q2, c_inf, jit_compile, with_weights):
    # A float32 matrix product may round its factors (TensorFloat-32 on
    # GPUs, float16 under automatic mixed precision), after the norms were
    # measured; float64 ones (the factored sum) keep every float32 exact.
    rows, rng = 16, np.random.default_rng(0)
    written = tf.constant(rng.standard_normal((rows, 4, 3)), tf.float32)
    left = tf.constant(rng.standard_normal((rows, 5)), tf.float32)
    right = tf.constant(rng.standard_normal((rows, 2)), tf.float32)
    scale = tf.constant(rng.uniform(0.1, 1.0, rows), tf.float32)
    weights = tf.constant(rng.uniform(0.0, 1.0, rows), tf.float32)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(0))

    @tf.function
    def block_sums(g, left, right, scale, weights, key):
        return kernels.sum_block(
            [g, outer_products.OuterProducts(left, right)], scale,
            weights if with_weights else None, c_inf, q2, None, key, 0,
            jit_compile)

    args = (written, left, right, scale, weights, key)
    dtypes = _matrix_product_dtypes(block_sums.get_concrete_function(*args))
    assert all(dtype == tf.float64 for dtype in dtypes), dtypes
    if q2 == 1:  # No masks: the sums have a closed form.
        coef = weights.numpy() if with_weights else np.ones(rows, np.float32)
        for got, g in zip(block_sums(*args), (
                written.numpy(), left.numpy()[:, :, None] *
                right.numpy()[:, None, :])):
            clipped = g * scale.numpy()[:, None, None]
            if c_inf is not None:
                clipped = np.clip(clipped, -c_inf, c_inf)
            np.testing.assert_allclose(
                got.numpy(), np.einsum('i,ijk->jk', coef, clipped),
                rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('q2, c_inf', [(1.0, None), (0.5, 0.1)])
@pytest.mark.parametrize('jit_compile', [False, True])
def test_contributions_stay_clipped_under_automatic_mixed_precision(
        q2, c_inf, jit_compile):
    # oneDNN's automatic mixed precision rewrites float32 matrix products
    # to bfloat16 (8-bit mantissas) on CPUs with bfloat16 instructions;
    # with a float32 matrix-vector sum over examples, one example's
    # contribution reached 1.0029 times the clip on this project's 2-core
    # AMD EPYC host (TensorFlow 2.15 and 2.21); elsewhere the option may
    # change nothing, and the test above still holds.
    rng = np.random.default_rng(0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(0))
    option = 'auto_mixed_precision_onednn_bfloat16'
    before = tf.config.optimizer.get_experimental_options().get(option, False)
    tf.config.optimizer.set_experimental_options({option: True})
    try:
        worst, largest = 0.0, 0.0
        for _ in range(10):
            g = tf.constant(rng.standard_normal((1, 4096)) * 37.3, tf.float32)

            @tf.function
            def contribution(g):
                sq_norm = kernels.squared_norms([g])
                scale = kernels.clip_scale(
                    sq_norm, kernels.representable([sq_norm], g.dtype), 1.0,
                    g.dtype)
                return kernels.sum_block([g], scale, tf.ones([1]), c_inf, q2,
                                         None, key, 0, jit_compile)[0]

            out = contribution(g).numpy().astype(np.float64)
            worst = max(worst, np.linalg.norm(out))
            largest = max(largest, np.abs(out).max())
    finally:
        tf.config.optimizer.set_experimental_options({option: before})
    assert worst <= 1 + 1e-6
    if c_inf is not None:
        assert largest <= c_inf * (1 + 1e-6)


def _clipped(grads, l2_norm_clip):
    """Each row's clip factor, as the aggregation takes it."""
    sq_norm = kernels.squared_norms(grads)
    finite = kernels.representable([sq_norm], tf.float32)
    return kernels.clip_scale(sq_norm, finite, l2_norm_clip, tf.float32)


def _absorbing_row(m):
    # One entry 1 and m - 1 entries whose squares are just under half a
    # float32 unit of the running sum: summed one by one in float32 each
    # square is rounded away, so the float32 norm is 1 while the exact
    # one is sqrt(1 + (m - 1) 2**-24): rounded to nearest, the clip factor
    # let this record past the clip by 7.5e-6 of it at m = 2**16.
    row = np.full((1, m), np.sqrt(2.0**-24 * 0.999), np.float32)
    row[0, 0] = 1.0
    return row


@pytest.mark.parametrize('factored', [False, True])
@pytest.mark.parametrize('m', [4096, 2**16])
def test_a_record_built_to_round_its_norm_down_stays_within_the_clip(
        factored, m):
    row = _absorbing_row(m)
    c2 = 1e-3
    if factored:
        grads = [outer_products.OuterProducts(tf.constant(row),
                                              tf.ones([1, 1]))]
    else:
        grads = [tf.constant(row)]
    scale = tf.function(_clipped)(grads, c2).numpy().astype(np.float64)
    # The contribution as sum_block forms it: scale * g in float32.
    contribution = (row * scale[:, None].astype(np.float32)).astype(
        np.float64)
    norm = np.linalg.norm(contribution)
    assert norm <= c2
    # Rounded up by no more than the bound: float32 sums of at most 2**10
    # numbers written out, of m (a factor's row) factored.
    terms = m if factored else 2**10
    assert norm >= c2 * (1 - precision.summation_error(terms + 16,
                                                       tf.float32))


def test_one_rows_norm_does_not_depend_on_the_others():
    # A zero, huge or non-finite record sends its own row's norm through
    # float64; every other row's factor stays bit for bit the same.
    rng = np.random.default_rng(3)
    left = rng.standard_normal((40, 300)).astype(np.float32)
    right = rng.standard_normal((40, 10)).astype(np.float32)
    clipped = tf.function(lambda a, b: _clipped(
        [outer_products.OuterProducts(a, b)], 0.1))
    want = clipped(left, right).numpy()
    for odd in (0.0, 1e30, np.inf, np.nan):
        changed = left.copy()
        changed[7] = odd
        got = clipped(changed, right).numpy()
        np.testing.assert_array_equal(np.delete(got, 7), np.delete(want, 7))


@pytest.mark.parametrize('factored', [False, True])
def test_norms_summed_in_float64_are_not_charged_float32_bounds(factored):
    # A factor's row longer than 2**16, and a written-out tensor with no
    # divisor in [64, 2**10] (1031 * 1033, both prime), are summed in
    # float64: rounded up by float64's bound only, not by float32's
    # gamma_m (which cost 3-17 % of the clip factor at these sizes).
    rng = np.random.default_rng(1)
    m = 2**17 if factored else 1031 * 1033
    row = rng.standard_normal((2, m)).astype(np.float32)
    grads = ([outer_products.OuterProducts(tf.constant(row), tf.ones([2, 1]))]
             if factored else [tf.constant(row)])
    got = tf.function(kernels.squared_norms)(grads).numpy()
    exact = (row.astype(np.float64)**2).sum(axis=1)
    assert np.all(got >= exact)
    np.testing.assert_allclose(got, exact, rtol=1e-9)
