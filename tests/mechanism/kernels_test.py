"""Tests of the per-tensor kernels' row sum (the fused clip-mask-sum)
and the zero rows it is padded with."""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice.mechanism import kernels


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
