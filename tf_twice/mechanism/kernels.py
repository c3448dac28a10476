"""The per-tensor kernels of one block: clip, mask, weight and sum.

``tf_twice.mechanism.aggregation`` runs these on every block of a logical
batch (steps 1-4 of its docstring): ``squared_norms`` and ``clip_scale`` give
each example's l2 clip factor over a block, ``drop_non_finite`` zeroes the
examples whose norm is not finite, and ``sum_block`` applies the factor, the
l-infinity clip, the Bernoulli(q2) masks and the weights and sums over the
examples, tensor by tensor. Each tensor is a [B, ...] tensor or, for a dense
kernel's gradients, `outer_products.OuterProducts` (the same numbers, never
written out). Masks come from ``randomness`` (stream ``mask_stream(block,
k)`` for tensor k of a block): they do not depend on how a batch is split.
"""

import math
import re
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_twice.mechanism import outer_products
from tf_twice.mechanism import precision
from tf_twice.mechanism import randomness
from tf_twice.mechanism.outer_products import OuterProducts
from tf_twice.mechanism.outer_products import PerExample
from tf_twice.mechanism.randomness import TensorLike

__all__ = [
    'clip_scale',
    'drop_non_finite',
    'representable',
    'squared_norms',
    'sum_block',
]


def _num_elements(shape: Sequence[int]) -> int:
    return int(math.prod(int(s) for s in shape))


# Squares are summed in the gradients' dtype over at most this many numbers
# at a time (`_inner_length`), those partial sums in float64: the bound on a
# float32 sum's rounding grows with the numbers summed (gamma_1026 = 6e-5).
_INNER_TERMS = 2**10
# Roundings in `clip_scale` and `sum_block` after the bound (float64 square
# root and division, the scale cast to the gradients' dtype, at most three
# products per coordinate: scale, weight, coefficient), and room to spare.
_ROUNDINGS_AFTER_NORMS = 8


def _inner_length(d: int) -> int:
    """Numbers per partial sum of a [B, d] tensor (a reshape to
    [B, d / L, L], never a copy): its largest divisor <= `_INNER_TERMS`, or
    1 where that divisor is so small (a large d with no divisor >= 64) that
    the squares are better summed in float64 at once."""
    if d <= _INNER_TERMS:
        return d
    length = max(k for k in range(1, _INNER_TERMS + 1) if d % k == 0)
    return length if length >= 64 else 1


def squared_norms(grads: Sequence[PerExample]) -> tf.Tensor:
    """Per-example squared l2 norms [B] over all tensors of one block, in
    float64, each ROUNDED UP: at least the exact squared norm of the
    example's numbers, whatever order the reductions add in.

    Squares are summed in the gradients' dtype over `_inner_length`
    numbers at a time (at most gamma_(L+2) low: the squares, the sum, a
    square root squared back in float64), the partial sums in
    float64; squares that flush to 0 below the smallest normal number lose
    at most that much each (a dense kernel's factors: a share of the norm,
    `outer_products.flushed_share`). The sum is divided by 1 - (those
    bounds) and raised by the flushed amount, so
    that `clip_scale`'s factor bounds every contribution by the clip. An
    earlier rounding to nearest let a record built for it (entries at half
    a float32 unit of its largest) exceed the clip by 7.5e-6 of it.
    """
    # One multi-threaded reduction pass over g for each partial sum: a
    # square and a sum would first write a second [B, d] copy, and
    # einsum('bi,bi->b') runs as B one-by-one matrix products (measured on
    # the reference CNN's gradients: 1.4 ms CPU against 3.5 and 12.4). XLA
    # has no kernel for the Euclidean norm; there the squares fuse with the
    # sum instead (for callers that compile this step with XLA).
    in_xla = precision.in_xla_context()
    dtype = grads[0].dtype
    # inner: the longest float32 (the gradients' dtype) sum, 0 for none.
    parts, inner, partials, numbers, flushed_share = [], 0, 0, 0, 0.0
    for g in grads:
        d = _num_elements(g.shape[1:])
        if isinstance(g, OuterProducts):
            m, n = int(g.left.shape[1]), int(g.right.shape[1])
            parts.append(outer_products.squared_norms(g, not in_xla))
            partials += n + 2
            if outer_products.sums_left_in_float32(m, not in_xla):
                inner = max(inner, m)
                flushed_share = max(flushed_share,
                                    outer_products.flushed_share(m))
            else:
                partials += m
        elif d > 0:
            length = _inner_length(d)
            if length == 1:  # All in float64.
                parts.append(tf.reduce_sum(tf.square(tf.cast(
                    tf.reshape(g, [-1, d]), tf.float64)), axis=1))
                partials += d
                continue
            x = tf.reshape(g, [-1, d // length, length])
            partial = (tf.cast(tf.reduce_sum(tf.square(x), axis=2),
                               tf.float64) if in_xla else
                       tf.square(tf.cast(
                           tf.math.reduce_euclidean_norm(x, axis=2),
                           tf.float64)))
            parts.append(tf.reduce_sum(partial, axis=1))
            inner, partials = max(inner, length), partials + d // length
            numbers += d
    if not parts:  # Only empty tensors: every example has norm 0.
        return tf.zeros([tf.shape(grads[0])[0]], tf.float64)
    # + 5: the float64 square of a float64 norm (exact for float32 ones),
    # the sum over tensors' rounding beyond `partials`, the flushed amount's
    # addition and the division below, and one to spare.
    low = (precision.summation_error(inner + 2 if inner else 0, dtype)
           + precision.summation_error(partials + len(parts) + 5,
                                       tf.float64) + flushed_share)
    flushed = 2 * numbers * float(np.finfo(dtype.as_numpy_dtype).tiny)
    return (tf.add_n(parts) + flushed) / (1 - low)


def representable(sq_norms: Sequence[tf.Tensor], dtype: tf.DType
                  ) -> tf.Tensor:
    """[B]: whether every block's squared norm (`squared_norms`) is at
    most ``dtype``'s largest number, so that no entry of the example's
    gradient, scaled or not, overflows in ``dtype``. False for NaN and
    inf; such an example is dropped from every block."""
    largest = float(np.finfo(dtype.as_numpy_dtype).max)
    keep = sq_norms[0] <= largest
    for sq_norm in sq_norms[1:]:
        keep = tf.logical_and(keep, sq_norm <= largest)
    return keep


def clip_scale(sq_norm: tf.Tensor, finite: tf.Tensor,
                l2_norm_clip: float, dtype: tf.DType) -> tf.Tensor:
    """Per-example l2 clip factors of one block in ``dtype``:
    min(1, c2 / ||g_i||) where ``finite``, 0 elsewhere, from the rounded-up
    squared norms of `squared_norms` (float64), themselves raised by the
    roundings still to come (`_ROUNDINGS_AFTER_NORMS`), and c2 rounded down
    into ``dtype``."""
    raise_by = 1 + precision.summation_error(_ROUNDINGS_AFTER_NORMS, dtype)
    norm = tf.sqrt(tf.where(finite, sq_norm * raise_by,
                            tf.zeros_like(sq_norm)))
    c2 = tf.cast(precision.clip_constant('l2_norm_clip', l2_norm_clip,
                                         dtype), tf.float64)
    return tf.cast(tf.where(finite, c2 / tf.maximum(norm, c2),
                            tf.zeros_like(norm)), dtype)


def _per_row(v: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    """[B] -> [B, 1, ...], broadcasting against x [B, ...]."""
    return tf.reshape(v, [-1] + [1] * (x.shape.rank - 1))


def _zero_rows(x: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    return tf.where(_per_row(keep, x), x, tf.zeros_like(x))


def drop_non_finite(grads: Sequence[PerExample],
                     finite: tf.Tensor) -> List[PerExample]:
    # 0 * NaN is NaN, so non-finite examples must be zeroed, not scaled,
    # before any sum over rows (a factor's as much as a written-out
    # gradient's). The selects only run when such an example is present.
    def zeroed(g):
        if isinstance(g, OuterProducts):
            return OuterProducts(*(_zero_rows(t, finite) for t in g))
        return _zero_rows(g, finite)

    return tf.cond(
        tf.reduce_all(finite),
        lambda: tf.nest.map_structure(tf.identity, list(grads)),
        lambda: [zeroed(g) for g in grads])


def _contributions(
    x: tf.Tensor,
    scale: tf.Tensor,
    coef: Optional[tf.Tensor],
    mask: Optional[tf.Tensor],
    mask_words: Optional[tf.Tensor],
    coordinate_sampling_rate: float,
    linf_norm_clip: Optional[float],
    rows_last: bool = False,
) -> tf.Tensor:
    """Each example's contribution on one [B, ...] tensor, elementwise:
    coef * mask * clip_inf(scale * g), for the caller to sum over B.

    The mask is ``mask`` if given, else drawn from ``mask_words``
    (`randomness.row_mask_words`, coordinates in row-major order), else
    none. Without l-infinity clipping the scale is left to the caller's
    per-row coefficient (masking commutes with a per-row scale).
    ``rows_last``: x is [..., B] and ``mask_words`` [units, B] instead
    (`randomness.masks_from_words_rows_last`).
    """
    per_row = (lambda v, _: v) if rows_last else _per_row
    if linf_norm_clip is not None:
        c_inf = precision.clip_constant('linf_norm_clip', linf_norm_clip,
                                        x.dtype)
        x = tf.clip_by_value(x * per_row(scale, x), -c_inf, c_inf)
    if mask is None and mask_words is not None:
        mask = (randomness.masks_from_words_rows_last(
            mask_words, x.shape[:-1], coordinate_sampling_rate) if rows_last
            else randomness.masks_from_words(mask_words, x.shape[1:],
                                             coordinate_sampling_rate))
    if mask is not None:
        x = tf.where(mask, x, tf.zeros_like(x))
    if coef is not None:
        x = x * per_row(coef, x)
    return x


# `_sum_rows` cuts the rows into this many slices (a power of 2).
_ROW_SLICES = 8


def _xla_prefers_reducing_slices_first() -> bool:
    """Which order of `_sum_rows` XLA's CPU code runs fast. Measured on the
    reference CNN's [64, 73,728] dense kernel: adding the slices first on
    TensorFlow 2.15, reducing them first on 2.21, each about twice as fast
    as the other order there (`benchmarks/step_breakdown_benchmark.py`);
    later versions are taken to behave like 2.21. Both give the same sum up
    to the order of float additions."""
    match = re.match(r'(\d+)\.(\d+)', tf.__version__)
    return match is None or (int(match[1]), int(match[2])) >= (2, 16)


_REDUCE_SLICES_FIRST = _xla_prefers_reducing_slices_first()


def _add_halves(x: tf.Tensor) -> tf.Tensor:
    """sum_i x[i], a power-of-2 leading dimension, by adding halves (one
    tf.split a level): elementwise, so XLA fuses it with what makes x."""
    while x.shape[0] > 1:
        low, high = tf.split(x, 2)
        x = low + high
    return tf.squeeze(x, 0)


def _sum_rows(x: tf.Tensor, reduce_slices_first: bool) -> tf.Tensor:
    """sum_i x[i] of a [B, ...] tensor, B a multiple of 8 (`_pad_rows`),
    inside XLA.

    XLA's CPU reduction over all B rows, and the matrix-vector product
    after an XLA kernel that writes [B, d], cost two to six times one pass
    over x. Cut into 8 slices of rows, the sum is a reduction within each
    slice and elementwise additions across slices: one fused pass that reads
    [B, d] once and never writes it. Which comes first runs fast depends on
    the XLA version (`_xla_prefers_reducing_slices_first`). B may be known
    only at run time (XLA compiles for each size).
    """
    x = tf.reshape(x, [_ROW_SLICES, -1] + x.shape[1:].as_list())
    if reduce_slices_first:
        return _add_halves(tf.reduce_sum(x, axis=1))
    return tf.reduce_sum(_add_halves(x), axis=0)


def _clip_mask_and_sum(
    x: tf.Tensor,
    scale: tf.Tensor,
    coef: Optional[tf.Tensor],
    mask: Optional[tf.Tensor],
    mask_words: Optional[tf.Tensor],
    coordinate_sampling_rate: float,
    linf_norm_clip: Optional[float],
) -> tf.Tensor:
    """sum_i coef_i * mask_i * clip_inf(scale_i * g_i), for one XLA kernel
    that reads [B, ...] once."""
    return _sum_rows(_contributions(x, scale, coef, mask, mask_words,
                                    coordinate_sampling_rate, linf_norm_clip),
                     _REDUCE_SLICES_FIRST)


# Rows per group of `_outer_clip_mask_and_sum`'s loop, on a CPU.
_GROUP_ROWS = 32


def _group_rows() -> Optional[int]:
    """Rows per group of the factored sums: `_GROUP_ROWS` on a CPU; where
    TensorFlow sees a GPU, whose kernels are parallel over the rows
    themselves, one group of all rows (None)."""
    return None if tf.config.list_logical_devices('GPU') else _GROUP_ROWS


def _rows_last_groups(t: Optional[tf.Tensor],
                      rows: Optional[int]) -> Optional[tf.Tensor]:
    """[B, ...] (B a multiple of ``rows``) -> [B / rows, ..., rows]: groups
    of rows, the rows last (None: one group of all B rows). A TensorFlow
    transpose, outside XLA: XLA's own took as long as the rest of the
    kernel on TensorFlow 2.21."""
    if t is None:
        return None
    t = tf.reshape(t, [-1 if rows else 1, rows or -1]
                   + t.shape[1:].as_list())
    return tf.transpose(t, [0] + list(range(2, t.shape.rank)) + [1])


def _launch(jobs: Any, groups: Any, shapes: Sequence[Sequence[int]],
            coordinate_sampling_rate: float,
            linf_norm_clip: Optional[float]) -> List[tf.Tensor]:
    """`_clip_mask_and_sum_all_fused` of ``jobs`` (jobs, scale, coef) and
    ``groups`` (the factored ones, `_rows_last_groups`), its sums flat, or
    zeros of ``shapes`` where ``groups`` has no row group: XLA cannot
    compile the loop's slice of an empty axis (a chunk without rows)."""
    def run():
        return tf.nest.flatten(_clip_mask_and_sum_all_fused(
            *jobs, groups, coordinate_sampling_rate, linf_norm_clip))

    if groups is None:
        return run()
    return tf.cond(tf.shape(groups[1])[0] > 0, run,
                   lambda: [tf.zeros(shape, groups[1].dtype)
                            for shape in shapes])


def _outer_clip_mask_and_sum(
    groups: OuterProducts,
    scale: tf.Tensor,
    coef: Optional[tf.Tensor],
    mask_words: Optional[tf.Tensor],
    coordinate_sampling_rate: float,
    linf_norm_clip: Optional[float],
) -> tf.Tensor:
    """`_clip_mask_and_sum` of g_i = left_i right_i^T, each g_i formed
    inside the kernel, so [B, m, n] is never written.

    Its arguments come in `_rows_last_groups` (left [B / G, m, G], scale
    [B / G, G], ...), and a loop adds one group of G rows at a time: each
    round forms [m, n, G] in the cache and sums its last axis in the same
    fused pass (on a GPU one round of all rows, `_group_rows`).
    Summed over all B rows at once, XLA (TensorFlow 2.21) wrote [B, m, n]
    out before its sum: 3x the time on the ScatterNet linear model's
    [512, 3,969, 10] (one CPU thread). With the rows first the loop took
    1.6x as long: rows last, a coordinate's mask bits are one shift of one
    word, the same in every row.
    """
    left, right = groups
    m, n = left.shape[1], right.shape[1]

    def body(t, total):
        x = left[t][:, None, :] * right[t][None, :, :]  # [m, n, G]
        x = _contributions(
            x, scale[t], None if coef is None else coef[t], None,
            None if mask_words is None else mask_words[t],
            coordinate_sampling_rate, linf_norm_clip, rows_last=True)
        return t + 1, total + tf.reduce_sum(x, axis=-1)

    _, total = tf.while_loop(
        lambda t, _: t < tf.shape(left)[0], body,
        (tf.constant(0), tf.zeros([m, n], left.dtype)))
    return total


class _Job(NamedTuple):
    """One tensor's share of `_clip_mask_and_sum_all`: its [B, d] gradients
    or their outer-product factors, and its explicit masks or mask words
    (or neither)."""
    gradients: Union[tf.Tensor, OuterProducts]
    mask: Optional[tf.Tensor]
    mask_words: Optional[tf.Tensor]


def _clip_mask_and_sum_all(
    jobs: Sequence[_Job],
    scale: tf.Tensor,
    coef: Optional[tf.Tensor],
    outer: Optional[Tuple[Sequence[_Job], tf.Tensor, Optional[tf.Tensor]]],
    coordinate_sampling_rate: float,
    linf_norm_clip: Optional[float],
) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """`_clip_mask_and_sum` of every tensor of a block, for one XLA kernel
    launch per block and chunk instead of one per tensor: the sums of
    ``jobs`` ([B, d] gradients), then of ``outer`` (its factored jobs,
    scale and coef, in `_rows_last_groups`), or none."""
    sums = [_clip_mask_and_sum(job.gradients, scale, coef, job.mask,
                               job.mask_words, coordinate_sampling_rate,
                               linf_norm_clip) for job in jobs]
    if outer is None:
        return sums, []
    outer_jobs, outer_scale, outer_coef = outer
    return sums, [
        _outer_clip_mask_and_sum(job.gradients, outer_scale, outer_coef,
                                 job.mask_words, coordinate_sampling_rate,
                                 linf_norm_clip) for job in outer_jobs]


# Unpacking the mask bits, clipping, selection and the sum over examples in
# one XLA kernel: on CPU it avoids materialising the masks and [B, d]
# intermediates (the twice-sampling pass about halves against an XLA
# elementwise kernel followed by a matrix-vector product). All tensors of a
# block in one kernel: a launch has a fixed cost, and one per tensor made
# the reference CNN's block of 8 tensors 1.10-1.16x slower per chunk.
_clip_mask_and_sum_all_fused = tf.function(_clip_mask_and_sum_all,
                                           jit_compile=True)


def _pad_rows(tensors: Any, multiple: int = _ROW_SLICES) -> Any:
    """Zero rows up to a multiple of 8, as `_sum_rows` needs (or of
    ``multiple``), for every tensor of the nest (None stays None). XLA
    compiles its kernel once per row count (300-500 ms CPU for the
    reference CNN's tensors), so this also bounds the compiles where a
    Poisson batch is aggregated whole (`clipped_masked_sum` in a custom
    loop: a new count at almost every step; DPModel's chunks already come
    in at most 8 sizes, `per_example.chunk_of`). Zero rows (zero gradient,
    scale, weight, mask words) contribute nothing; padding by 0 rows
    forwards the tensor."""
    flat = [t for t in tf.nest.flatten(tensors) if t is not None]
    extra = (-tf.shape(flat[0])[0]) % multiple
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.pad(
            t, [[0, extra]] + [[0, 0]] * (t.shape.rank - 1)), tensors)


def sum_block(
    grads: Sequence[PerExample],
    scale: tf.Tensor,
    weights: Optional[tf.Tensor],
    linf_norm_clip: Optional[float],
    coordinate_sampling_rate: float,
    masks: Optional[Sequence[tf.Tensor]],
    key: Optional[tf.Tensor],
    example_offset: TensorLike,
    jit_compile: bool,
    block: int = 0,
) -> List[tf.Tensor]:
    """sum_i w_i * mask_i * clip_inf(scale_i * g_i) for each tensor of a block.

    Tensor k of block ``block`` draws its masks from
    ``randomness.mask_stream(block, k)``.

    The sums over examples are elementwise products and reductions, or a
    float64 matrix product for factored gradients, never a float32 matrix
    product: one of those may round its factors (TensorFloat-32 on GPUs by
    default, float16 under automatic mixed precision, a oneDNN math mode),
    and an example's contribution, rounded up after its norm was measured,
    could exceed the clip by about 2**-10 of it.
    """
    offset = tf.cast(example_offset, tf.int64)
    if linf_norm_clip is None:
        # Masking commutes with a per-row scale: it joins the weights.
        coef = scale if weights is None else scale * weights
    else:
        coef = weights
    sums: List[Optional[tf.Tensor]] = [None] * len(grads)
    jobs: List[Tuple[int, _Job]] = []  # For the XLA kernel.
    for k, g in enumerate(grads):
        d = _num_elements(g.shape[1:])
        if d == 0:  # E.g. a group with no column in this principal block.
            sums[k] = tf.zeros(g.shape[1:], g.dtype)
            continue
        mask = None if masks is None else tf.reshape(masks[k], [-1, d])
        elementwise = not (linf_norm_clip is None
                           and coordinate_sampling_rate >= 1 and mask is None)
        factored = isinstance(g, OuterProducts)
        if factored and (mask is not None or (elementwise
                                              and not jit_compile)):
            # Explicit masks (tests) or no XLA: the written-out path.
            g, factored = g.materialize(), False
        words = None
        if mask is None and coordinate_sampling_rate < 1:
            words = randomness.row_mask_words(
                key, randomness.mask_stream(block, k),
                tf.shape(g.left if factored else g)[0], offset, d,
                coordinate_sampling_rate)
        if factored and not elementwise:
            sums[k] = g.weighted_sum(coef)  # In float64.
            continue
        if jit_compile:
            jobs.append((k, _Job(g if factored else tf.reshape(g, [-1, d]),
                                 mask, words)))
            continue
        flat = _contributions(tf.reshape(g, [-1, d]), scale, coef, mask,
                              words, coordinate_sampling_rate, linf_norm_clip)
        sums[k] = tf.reshape(tf.reduce_sum(flat, axis=0), g.shape[1:])
    if jobs:
        written = [(k, job) for k, job in jobs
                   if not isinstance(job.gradients, OuterProducts)]
        factored = [(k, job) for k, job in jobs
                    if isinstance(job.gradients, OuterProducts)]
        outer = None
        if factored:
            rows = _group_rows()
            outer = tf.nest.map_structure(
                lambda t: _rows_last_groups(t, rows), _pad_rows(
                    ([job for _, job in factored], scale, coef), rows or 1))
        # Sums: [d] of each written-out tensor, then [m, n] of each factored.
        shapes = ([[_num_elements(grads[k].shape[1:])] for k, _ in written]
                  + [grads[k].shape[1:] for k, _ in factored])
        totals = _launch(_pad_rows(([job for _, job in written], scale,
                                    coef)), outer, shapes,
                         coordinate_sampling_rate, linf_norm_clip)
        for (k, _), total in zip(written + factored, totals):
            sums[k] = tf.reshape(total, grads[k].shape[1:])
    return sums
