"""Tests of the per-tensor kernels' row sum (the fused clip-mask-sum)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice.mechanism import kernels


# 1, 7 and 9 rows pad the last group; 72 rows make 9 groups, an odd count for
# the halving additions; 8 and 64 need neither.
@pytest.mark.parametrize('rows', [1, 7, 8, 9, 64, 72])
@pytest.mark.parametrize('group_reductions', [False, True])
def test_both_forms_of_the_row_sum_sum_every_row(rows, group_reductions):
    x = np.random.default_rng(rows).standard_normal((rows, 37))
    sum_rows = tf.function(
        lambda t: kernels._sum_rows(t, group_reductions), jit_compile=True)
    np.testing.assert_allclose(sum_rows(tf.constant(x)).numpy(),
                               x.sum(axis=0), rtol=1e-12, atol=1e-12)
