"""The randomness of a DP step: step keys, Philox streams, masks and noise.

A logical step draws one Philox key from a ``tf.random.Generator``
(``draw_step_key``); the coordinate masks and the Gaussian noise of the step
are stateless functions of that key (``coordinate_masks``,
``standard_normal_noise``). The mask of an example depends only on the key,
the block and tensor index and the example's position in the logical batch,
so the same key gives the same masks however the batch is split into physical
microbatches or replicas, and every training path gives identical updates
from identical generator states.

Random streams. Philox is a pseudorandom function of (key, 128-bit counter);
the high 64 bits of the counter name a stream and the low 64 bits run within
it, so distinct streams under one key are independent. Tensor v of block j
takes its masks from stream j * 2**40 + v (``mask_stream``) and its noise
from stream j * 2**40 + 2**32 + v (``noise_stream``). Every (block, tensor,
masks-or-noise) triple therefore has a stream of its own under the one step
key, and block 0 uses exactly the streams of the single-block layout. This
layout is fixed: changing it changes every mask and every noise draw.

Mask entries. An entry is True with probability
``effective_coordinate_sampling_rate(q2)``: a uniform integer of
``mask_bits_per_coordinate(q2)`` bits compared with the rate times 2**bits
(both from the TF-free ``tf_twice.config``, which the accountant also uses).
"""

import math
import numbers
from typing import List, Optional, Sequence, Union

import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.config import effective_coordinate_sampling_rate
from tf_twice.config import mask_bits_per_coordinate
from tf_twice.config import MAX_BLOCKS
from tf_twice.mechanism import precision

__all__ = [
    'box_muller',
    'check_block_index',
    'coordinate_masks',
    'draw_step_key',
    'mask_stream',
    'masks_from_words',
    'masks_from_words_rows_last',
    'noise_stream',
    'row_mask_words',
    'row_masks',
    'standard_normal_noise',
]

_PHILOX_ALG = 1  # tf.random.Algorithm.PHILOX
# The high 64 bits of the Philox counter select a stream: masks of tensor v of
# block j use stream j * _BLOCK_STREAMS + v, its noise stream
# j * _BLOCK_STREAMS + _NOISE_STREAM + v (block 0: the single-block layout).
_NOISE_STREAM = 2**32
_BLOCK_STREAMS = 2**40

TensorLike = Union[tf.Tensor, int, float]


def draw_step_key(generator: tf.random.Generator) -> tf.Tensor:
    """Draws the Philox key of one logical step (uint64, shape [1])."""
    return generator.uniform_full_int([1], dtype=tf.uint64)


def _counter(low: TensorLike, stream: int) -> tf.Tensor:
    # Philox increments the low 64 bits; the high 64 bits name the stream.
    if isinstance(low, int):  # Known at trace time: one constant op.
        return tf.constant([low, stream], tf.uint64)
    low = tf.cast(low, tf.int64)
    return tf.bitcast(tf.stack([low, tf.constant(stream, tf.int64)]),
                      tf.uint64)


def mask_stream(block: int, v: int) -> int:
    """The Philox stream of the masks of tensor v of block ``block``."""
    return block * _BLOCK_STREAMS + v


def noise_stream(block: int, v: int) -> int:
    """The Philox stream of the noise of tensor v of block ``block``."""
    return block * _BLOCK_STREAMS + _NOISE_STREAM + v


def check_block_index(block, num_tensors: int) -> int:
    """``block`` as an int, if it and its ``num_tensors`` tensors fit the
    stream layout (ValueError otherwise): streams must not overlap."""
    if (isinstance(block, bool) or not isinstance(block, numbers.Integral)
            or not 0 <= block < MAX_BLOCKS):
        raise ValueError(
            f'block must be an integer in [0, {MAX_BLOCKS}), got {block!r}.')
    if num_tensors >= _NOISE_STREAM:
        raise ValueError(
            f'a block may hold at most {_NOISE_STREAM - 1} tensors, got '
            f'{num_tensors}.')
    return int(block)


def row_masks(key, stream, rows, offset, d, q2):
    """[rows, d] masks of one tensor for examples offset..offset+rows-1.

    ``stream`` is the tensor's mask stream (``mask_stream``). Each row takes
    a whole number of 128-bit Philox blocks, starting at the block index of
    its global position, so the entries of an example do not depend on which
    rows are generated together.
    """
    return masks_from_words(row_mask_words(key, stream, rows, offset, d, q2),
                            [d], q2)


def row_mask_words(key, stream, rows, offset, d, q2):
    """The random words [rows, 4 * blocks] (uint32) that `row_masks` reads.

    Drawn apart from `masks_from_words` so that the draw can run as
    TensorFlow's Philox kernel while the rest is compiled with XLA: XLA's
    own Philox ran 10x slower on TensorFlow 2.21's CPU (34 ms against 3 ms
    for [64, 73,728] masks).
    """
    per_block = 128 // mask_bits_per_coordinate(q2)
    blocks = -(-d // per_block)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=tf.stack([rows, blocks * 4]),
        key=key,
        counter=_counter(tf.cast(offset, tf.int64) * blocks, stream),
        alg=_PHILOX_ALG,
        dtype=tf.uint32)


def masks_from_words(words, shape, q2):
    """[rows, *shape] Bernoulli(q2) masks from `row_mask_words`: coordinate
    c (row-major in ``shape``) compares its own ``mask_bits_per_coordinate
    (q2)`` bits, bits c * b to (c + 1) * b - 1 of the row's words, with the
    threshold.

    The words are read in units of 32, 16 or 8 bits: 32 where ``shape``'s
    last axis takes whole words (and a coordinate less than a byte), else
    one coordinate's 16 or 8 bits, else bytes. Where the last axis takes
    whole units, they are laid out in ``shape`` before their bits are split,
    the same bits in the same places (bit k of a word is bit k % 8 of its
    byte k // 8, little-endian as TensorFlow runs). Inside an XLA kernel,
    on a dense kernel's [m, n] masks: bytes laid out in shape ran 1.7x
    faster than split flat and reshaped on TensorFlow 2.15 (no change on
    2.21); words 1.2x faster than bytes on 2.15 and 2.21.
    """
    shape = [int(s) for s in shape]
    d = math.prod(shape)
    if d == 0:  # No coordinate: nothing to read (and no unit to lay out).
        return tf.zeros(tf.concat([tf.shape(words)[:1], shape], 0), tf.bool)
    bits = mask_bits_per_coordinate(q2)
    threshold = int(effective_coordinate_sampling_rate(q2) * 2**bits)
    last = shape[-1] if shape else 1
    if bits < 8 and last % (32 // bits) == 0:
        unit, width, units = tf.uint32, 32, words
    else:
        unit, width = (tf.uint16, 16) if bits == 16 else (tf.uint8, 8)
        units = tf.reshape(tf.bitcast(words, unit), [tf.shape(words)[0], -1])
    per_unit = max(1, width // bits)  # Coordinates per unit.
    if last % per_unit == 0:
        units = tf.reshape(units[:, :d // per_unit],
                           [-1] + shape[:-1] + [last // per_unit])
    if per_unit > 1:
        shifts = tf.constant(list(range(0, width, bits)), unit)
        units = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(units[..., None], shifts),
            tf.constant(2**bits - 1, unit))
    if last % per_unit != 0:
        units = tf.reshape(units, [tf.shape(units)[0], -1])[:, :d]
    return tf.less(tf.reshape(units, [-1] + shape),
                   tf.constant(threshold, unit))


def masks_from_words_rows_last(words, shape, q2):
    """`masks_from_words` with the rows last: ``words`` [units, rows] (the
    transpose of `row_mask_words`' [rows, units]) -> [*shape, rows] masks,
    each coordinate reading the same bits as there.

    For a kernel that runs over the rows innermost (`kernels`' factored
    sums): coordinate c's bits then sit at one shift of one word for every
    row. Every mask width b divides 32, so coordinate c is bits
    (c % (32 / b)) * b onwards of word c // (32 / b), the place the bytes
    of `masks_from_words` give it (little-endian).
    """
    shape = [int(s) for s in shape]
    d = math.prod(shape)
    rows = tf.shape(words)[1]
    if d == 0:
        return tf.zeros(tf.concat([shape, [rows]], 0), tf.bool)
    bits = mask_bits_per_coordinate(q2)
    threshold = int(effective_coordinate_sampling_rate(q2) * 2**bits)
    shifts = tf.constant(list(range(0, 32, bits)), tf.uint32)
    units = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(words[:, None, :], shifts[None, :, None]),
        tf.constant(2**bits - 1, tf.uint32))
    units = tf.reshape(units, [-1, rows])[:d]  # Coordinate-major.
    return tf.less(tf.reshape(units, shape + [rows]),
                   tf.constant(threshold, tf.uint32))


def coordinate_masks(
    key: tf.Tensor,
    shapes: Sequence[Sequence[int]],
    coordinate_sampling_rate: float,
    batch_size: TensorLike,
    example_offset: TensorLike = 0,
    *,
    block: int = 0,
) -> List[tf.Tensor]:
    """Boolean Bernoulli masks of shape [batch_size, *shape], one per shape.

    Each entry is True independently with probability
    ``effective_coordinate_sampling_rate(q2)``: a uniform draw of
    ``mask_bits_per_coordinate(q2)`` bits is compared with the rate times
    2**bits. Row i of the masks for tensor v of block ``block`` is a function
    of (key, block, v, example_offset + i) only, so masks do not depend on
    how a logical batch is split into microbatches, and different blocks
    (or tensors) draw from disjoint Philox streams.
    """
    config_lib.check_coordinate_sampling_rate(coordinate_sampling_rate)
    block = check_block_index(block, len(shapes))
    batch_size = tf.cast(batch_size, tf.int32)
    if coordinate_sampling_rate >= 1:
        return [tf.ones(tf.concat([[batch_size], shape], 0), tf.bool)
                for shape in shapes]
    masks = []
    for v, shape in enumerate(shapes):
        shape = [int(s) for s in shape]
        d = int(math.prod(shape))
        if d == 0:
            masks.append(tf.zeros(tf.concat([[batch_size], shape], 0),
                                  tf.bool))
            continue
        mask = row_masks(key, mask_stream(block, v), batch_size,
                         example_offset, d, coordinate_sampling_rate)
        masks.append(tf.reshape(mask, [-1] + shape))
    return masks


def standard_normal_noise(
    key: tf.Tensor,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[tf.DType],
    *,
    block: int = 0,
) -> List[tf.Tensor]:
    """Independent N(0, 1) tensors of the given shapes, one stream each.

    Tensor v of block ``block`` uses its own Philox stream, distinct from
    every other tensor's and block's noise and masks under the same key.

    Box-Muller on float64 uniforms (k + 1/2) 2**-52, k < 2**52, so that
    draws reach sqrt(2 ln 2**53) = 8.57 standard deviations. TensorFlow's
    own normal sampler (the same transform with its uniform clamped at
    1e-7) stops at 5.68, while the accountant integrates the whole Gaussian
    tail. The two draws of a pair share their radius, so the support of a
    pair is a disc of radius T: one example's shift Delta of a sum moves
    outputs out of the other dataset's support with a probability of about
    (T / pi) exp(-T**2 / 2) ||Delta||_1 / sigma per step that nothing
    charges, 1.8e-7 at T = 5.68 against 3.0e-16 at 8.57 (||Delta||_1 /
    sigma reaches sqrt(d) / z). The transform runs in the tensor's
    ``precision.accumulation_dtype`` (float64 for float64, else float32).
    """
    block = check_block_index(block, len(shapes))
    shapes = [[int(s) for s in shape] for shape in shapes]
    halves = [(math.prod(shape) + 1) // 2 for shape in shapes]
    # k 2**-52 from the top 52 of 64 Philox bits, k < 2**52: from integer
    # draws, which XLA computes as the CPU kernel does (its float uniforms
    # take other bits). Tensor v's bits come from its own stream; the
    # transform is elementwise, so it runs once over the bits of every
    # tensor of one accumulation dtype (a graph of a few ops per tensor,
    # not some thirty).
    bits = [tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[2, half], key=key,
        counter=_counter(0, noise_stream(block, v)),
        alg=_PHILOX_ALG, dtype=tf.uint64) for v, half in enumerate(halves)]
    groups: dict = {}
    for v, dtype in enumerate(dtypes):
        groups.setdefault(precision.accumulation_dtype(dtype), []).append(v)
    noise: List[Optional[tf.Tensor]] = [None] * len(shapes)
    for accumulation_dtype, members in groups.items():
        uniform = tf.cast(tf.bitwise.right_shift(
            tf.concat([bits[v] for v in members], 1),
            tf.constant(12, tf.uint64)), tf.float64) * 2.0**-52
        # Row 0: the radius times the cosine of every pair; row 1: the sine.
        pairs = tf.reshape(box_muller(uniform, accumulation_dtype), [2, -1])
        for v, draws in zip(members, tf.split(
                pairs, [halves[v] for v in members], axis=1)):
            size = math.prod(shapes[v])
            draws = tf.reshape(draws, [-1])  # Tensor v's pairs, as alone.
            if size % 2:
                draws = draws[:size]
            noise[v] = tf.cast(tf.reshape(draws, shapes[v]), dtypes[v])
    return noise


def box_muller(uniform: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """[2, n] float64 uniforms k 2**-52 in [0, 1) -> 2n N(0, 1) draws.

    Shifted by 2**-53 (exact in float64), the uniforms are never 0; then
    the transform runs in ``dtype``. In float32 a uniform keeps its
    relative precision down to 2**-53, so the radius sqrt(-2 ln u) is
    finite and reaches sqrt(2 ln 2**53) = 8.57 there too, at about half
    of float64's cost on CPU. Near 1 it does not: a u within 2**-25 of 1
    rounds to 1.0 in float32, ln u = 0, and both draws of the pair are
    exactly 0 (2**-25 per pair: the two coordinates released without
    noise). So ln u of u >= 1/2 is log1p(-(1 - u)), 1 - u taken exactly in
    float64 before the cast.
    """
    uniform = uniform + 2.0**-53
    u = uniform[0]
    log_u = tf.where(u < 0.5, tf.math.log(tf.cast(u, dtype)),
                     tf.math.log1p(-tf.cast(1.0 - u, dtype)))
    radius = tf.sqrt(-2.0 * log_u)
    angle = (2.0 * math.pi) * tf.cast(uniform[1], dtype)
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
