"""Per-example gradients that are outer products, kept as their factors.

A dense layer's kernel gradient for one example whose input is one row is
the outer product of the layer's input a_i [m] and its output gradient
dy_i [n]: g_i = a_i dy_i^T, [m, n]. Under `tf.vectorized_map` TensorFlow
computes it as a batched matrix product with inner dimension 1, writing
[B, m, n] floats (the reference CNN's first dense kernel: 73,728 per
example, 93 % of its parameters) that the aggregation then reads again.
Kept as the factors, the aggregation needs none of it:

* the l2 norm is ||g_i|| = ||a_i|| ||dy_i|| (the Frobenius norm of a rank-1
  matrix), from [B, m] + [B, n] numbers;
* without masks or l-infinity clip, sum_i c_i g_i = A^T diag(c) DY is one
  matrix product;
* with them, `kernels` forms each g_i inside the XLA kernel that clips,
  masks and sums it, so [B, m, n] is never written.

The contribution of every example is the same vector as when its g_i is
written out (the same masks, coordinate by coordinate; only float rounding
of the norm and of the unmasked sum's order differ), so the sensitivity
argument of `aggregation` is unchanged.

`factor` recognises such a tensor by the op that produced it: whatever
built the graph, a ``BatchMatMul`` whose inner dimension is 1 is an outer
product by that op's definition. Anything else (eager tensors, a gradient
summed from two uses of a kernel, a regulariser's term added, 16-bit
types) stays a plain tensor on the general path.
"""

from typing import NamedTuple, Optional, Union

import numpy as np
import tensorflow as tf

from tf_twice.mechanism import precision

__all__ = ['OuterProducts', 'factor', 'squared_norms']

_BATCH_MATMULS = ('BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3')


class OuterProducts(NamedTuple):
    """Per-example gradients g_i = left_i right_i^T, shape [B, m, n]."""
    left: tf.Tensor  # [B, m]
    right: tf.Tensor  # [B, n]

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape([self.left.shape[0], self.left.shape[1],
                               self.right.shape[1]])

    @property
    def dtype(self) -> tf.DType:
        return self.left.dtype

    def materialize(self) -> tf.Tensor:
        return self.left[:, :, None] * self.right[:, None, :]

    def weighted_sum(self, coef: tf.Tensor) -> tf.Tensor:
        """sum_i coef_i g_i, [m, n]: one matrix product, in float64.

        In float32, coef_i left_i could fall below the normal range where
        no entry of g_i or coef_i g_i does: rounded there (e.g. to the
        smallest subnormal), it can double an example's contribution past
        c2, or flush it to 0. In float64 a product of float32 numbers and
        a clip factor stays normal. The coefficients scale the factor of
        fewer columns (scaling the other was a pass over [B, 3,969] float64
        numbers per chunk of the ScatterNet linear model). The product is
        left^T (coef right), [3,969, 10] there: right^T left transposed,
        faster alone, took 1.5x its CPU time in the DP-SGD step's profile
        (the transpose ran as a copy, 0.5 ms a chunk).
        """
        left = tf.cast(self.left, tf.float64)
        right = tf.cast(self.right, tf.float64)
        coef = tf.cast(coef, tf.float64)[:, None]
        if (left.shape[1] or 0) > (right.shape[1] or 0):
            right = right * coef
        else:
            left = left * coef
        return tf.cast(tf.matmul(left, right, transpose_a=True), self.dtype)


PerExample = Union[tf.Tensor, OuterProducts]


def factor(g: tf.Tensor) -> PerExample:
    """``g`` as `OuterProducts` where its op makes it one, else ``g``."""
    if tf.executing_eagerly() or not isinstance(g, tf.Tensor) or (
            g.dtype != tf.float32 or g.shape.rank != 3):
        return g
    op = g.op
    if op.type not in _BATCH_MATMULS:
        return g
    x, y = op.inputs[0], op.inputs[1]
    if x.dtype != g.dtype or y.dtype != g.dtype or (
            x.shape.rank != 3 or y.shape.rank != 3):
        return g
    # g[b] = op_x(x[b]) @ op_y(y[b]): inner dimension x[b]'s rows when
    # adjointed (transposed, real), else its columns; likewise for y.
    inner_x = x.shape[1] if op.get_attr('adj_x') else x.shape[2]
    inner_y = y.shape[2] if op.get_attr('adj_y') else y.shape[1]
    if inner_x != 1 or inner_y != 1:
        return g
    m, n = g.shape[1], g.shape[2]
    left, right = tf.reshape(x, [-1, m]), tf.reshape(y, [-1, n])
    if x.shape[0] is None or x.shape[0] != y.shape[0]:
        # The op broadcasts its batch dimensions; the factors must not. The
        # row count is read from the factors: reading g's would make g run.
        rows = tf.maximum(tf.shape(x)[0], tf.shape(y)[0])
        left = tf.broadcast_to(left, tf.stack([rows, m]))
        right = tf.broadcast_to(right, tf.stack([rows, n]))
    return OuterProducts(_flushed_unless_norms_cover(left),
                         _flush_subnormal(right))


def _flush_subnormal(t: tf.Tensor) -> tf.Tensor:
    """``t`` with its subnormal entries set to 0, as a CPU reads them:
    the norm (TensorFlow kernels) and the sums (XLA, which on a GPU keeps
    subnormals) then see the same numbers; a subnormal factor read as 0 by
    one and not the other would escape the clip (3e38 * 1e-39). The
    right factor is always flushed, the left one where
    `_flushed_unless_norms_cover` says."""
    tiny = float(np.finfo(t.dtype.as_numpy_dtype).tiny)
    # NaN compares false: it stays, and its row is dropped.
    return tf.where(tf.abs(t) < tiny, tf.zeros_like(t), t)


def _flushed_unless_norms_cover(left: tf.Tensor) -> tf.Tensor:
    """``left`` as it is where `squared_norms` will sum it in float32 (not
    under XLA, m <= `_FLOAT32_MAX_TERMS`) and every row's float32 norm
    lies in `_FLOAT32_NORMS`; else `_flush_subnormal` of it (one row out
    of that range, e.g. a zero padding row, flushes the chunk). In that
    range `flushed_share` already counts each entry whose square is below
    the smallest normal number (subnormal entries among them), whether a
    reader keeps it or reads it as 0, so a sum that keeps one stays
    within the clip (the product is rank 1: a kept entry only adds to
    ||left_i||).
    The flush took 9 % of the ScatterNet linear model's DP-SGD step's CPU
    time (a select over [B, 3,969] floats), the norms 1 %."""
    if not sums_left_in_float32(left.shape[1],
                                not precision.in_xla_context()):
        return _flush_subnormal(left)
    return tf.cond(tf.reduce_all(_in_float32_range(_float32_norms(left))),
                   lambda: left,
                   lambda: _flush_subnormal(left))


# ||left_i|| computed in float32 is used for the rows whose norm lies in this
# range: no square or partial sum of squares overflows there, and the
# squares that flush to 0 (each < 2**-126) add up to less than m 2**-46 of
# the sum (also in `kernels.squared_norms`' bound). Elsewhere float64.
_FLOAT32_NORMS = (2.0**-40, 2.0**60)


def _float32_norms(left: tf.Tensor) -> tf.Tensor:
    return tf.math.reduce_euclidean_norm(left, axis=1)


def _in_float32_range(norms: tf.Tensor) -> tf.Tensor:
    low, high = _FLOAT32_NORMS
    return tf.logical_and(norms >= low, norms <= high)  # NaN: False.


def flushed_share(m: int) -> float:
    """At most this share of ||left_i||^2 is lost where ``squared_norms``
    sums m squares in float32 (squares below the smallest normal number
    flush to 0; the row's norm is at least `_FLOAT32_NORMS`' low end)."""
    return m * 2.0**-126 / _FLOAT32_NORMS[0]**2


# Longer rows are summed in float64: the bound on a float32 sum's rounding
# grows with m (`kernels.squared_norms`).
_FLOAT32_MAX_TERMS = 2**16


def sums_left_in_float32(m: Optional[int], float32_first: bool) -> bool:
    """Whether `squared_norms` sums ||left_i||^2 of m numbers in float32
    first."""
    return float32_first and m is not None and m <= _FLOAT32_MAX_TERMS


def squared_norms(g: OuterProducts, float32_first: bool = True
                  ) -> tf.Tensor:
    """||g_i||^2 = ||left_i||^2 ||right_i||^2, [B], in float64.

    In float64, neither a factor's square nor the product can overflow or
    underflow for float32 factors (at most m (3.4e38)^2 (3.4e38)^2 n, at
    least (2^-149)^4): a tiny right_i
    whose float32 square underflows
    against a huge left_i cannot give a norm of 0 to a gradient above the
    clip. `kernels.squared_norms` rounds the result up.

    With ``float32_first`` (not under XLA, which has no Euclidean norm) and
    m <= `_FLOAT32_MAX_TERMS`, ||left_i|| (m numbers) is first summed in
    float32 and taken for each row whose norm is in `_FLOAT32_NORMS`; any other
    row's (zero, tiny, huge or non-finite: padding, or a bad record) in
    float64. Row by row, so that no row's norm depends on another's: chosen
    for the chunk at once, one record moved every other row's norm by its
    float32 rounding. Casting [B, m] to float64 and squaring it took about
    6 % of the ScatterNet linear model's DP-SGD step (one CPU thread).
    """
    right = tf.reduce_sum(tf.square(tf.cast(g.right, tf.float64)), axis=1)

    def exact():
        return tf.reduce_sum(tf.square(tf.cast(g.left, tf.float64)), axis=1)

    if sums_left_in_float32(g.left.shape[1], float32_first):
        norms = _float32_norms(g.left)
        ok = _in_float32_range(norms)
        fast = tf.square(tf.cast(norms, tf.float64))  # Exact in float64.
        left = tf.cond(tf.reduce_all(ok), lambda: fast,
                       lambda: tf.where(ok, fast, exact()))
    else:
        left = exact()
    return left * right
