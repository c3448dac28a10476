"""The one clip-mask-noise-normalise aggregation of per-example gradients.

Every training path (the optimizer classes in ``tf_twice.optimizers`` and the
per-example model path in ``tf_twice.keras``) calls the two functions below, so
the released quantity is defined in exactly one place. For a logical batch of
(Poisson-sampled) examples with per-example gradients g_i:

1. flatten g_i over all variables and clip it to l2 norm <= c2;
2. clip every coordinate to [-c_inf, c_inf];
3. multiply by an independent Bernoulli(q2) mask per example and coordinate;
4. multiply by the example's weight w_i in [0, 1] (0 marks padding) and sum;
5. add N(0, (z * c2)^2) once to every coordinate of the sum;
6. divide by expected_batch_size * q2, never by the realised batch size.

Steps 1-4 are ``clipped_masked_sum`` and may run on several physical
microbatches of one logical batch whose sums are added; steps 5-6 are
``add_noise_and_normalize`` and run once per logical batch.

Privacy: one example changes the sum of steps 1-4 by a vector s with
||s||_2 <= c2 and ||s||_inf <= c_inf, of which each coordinate is independently
kept with probability q2. With example-level Poisson sampling of rate q1 this
is the (q1, q2)-twice-sampled Gaussian mechanism of the paper (Theorems
"Privacy Amplification of Coordinate-Wise Sampling" and "Privacy Amplification
from Twice Sampling"); step 6 is post-processing.

Randomness. A logical step draws one Philox key from a ``tf.random.Generator``
(``draw_step_key``); masks and noise are stateless functions of that key. The
mask of an example depends only on the key, the variable index and the
example's position in the logical batch, so the same key gives the same masks
however the batch is split into physical microbatches, and the optimizer path
and the model path give identical updates from identical generator states.
Tests may instead pass explicit ``masks`` and ``noise``.

Hybrid clipping (several blocks, each with its own c2, c_inf and z) will reuse
``_clip_scale`` and ``_sum_block`` per block; the public functions are written
over a list of tensors that forms one block, whose random streams are numbered
by the tensors' positions in that list.
"""

import dataclasses
import math
import numbers
from typing import List, Optional, Sequence, Tuple, Union

import tensorflow as tf

__all__ = [
    'MASK_PRECISION_BITS',
    'AggregationParams',
    'add_noise_and_normalize',
    'clipped_masked_sum',
    'coordinate_masks',
    'draw_step_key',
    'effective_coordinate_sampling_rate',
    'mask_bits_per_coordinate',
    'standard_normal_noise',
    'validate_params',
]

# A mask entry compares a uniform integer of b <= 16 random bits with
# rate * 2**b, so the keep probability is exactly the dyadic rate
# floor(q2 * 2**16) / 2**16. Random-bit generation dominates the cost of
# masking, hence as few bits as the rate allows (``mask_bits_per_coordinate``).
MASK_PRECISION_BITS = 16
_MASK_LEVELS = 2**MASK_PRECISION_BITS
_PHILOX_ALG = 1  # tf.random.Algorithm.PHILOX
# The high 64 bits of the Philox counter select a stream: masks of variable v
# use stream v, noise of variable v uses stream _NOISE_STREAM + v.
_NOISE_STREAM = 2**32

TensorLike = Union[tf.Tensor, int, float]


def effective_coordinate_sampling_rate(
        coordinate_sampling_rate: float) -> float:
    """The keep probability the masks realise: floor(q2 * 2**16) / 2**16.

    It equals q2 for dyadic rates such as 1/2 or 1/4 and is below q2 by less
    than 2**-16 otherwise. The twice-sampling RDP bound is non-decreasing in q2
    (the number of kept coordinates is stochastically increasing in q2), so
    accounting at the nominal q2 covers the realised rate; the update is
    normalised by the realised rate, so it stays unbiased.
    """
    q2 = float(coordinate_sampling_rate)
    if q2 >= 1.0:
        return 1.0
    return math.floor(q2 * _MASK_LEVELS) / _MASK_LEVELS


def validate_params(
    *,
    l2_norm_clip: Optional[float] = None,
    linf_norm_clip: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    coordinate_sampling_rate: Optional[float] = None,
    expected_batch_size: Optional[float] = None,
) -> None:
    """Raises ValueError naming the first argument outside its allowed range.

    Arguments left as None are not checked (except ``linf_norm_clip``, for
    which None means "no l-infinity clipping").
    """

    def _finite_number(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f'{name} must be a real number, got {value!r}.')
        if not math.isfinite(value):
            raise ValueError(f'{name} must be finite, got {value!r}.')

    if l2_norm_clip is not None:
        _finite_number('l2_norm_clip', l2_norm_clip)
        if l2_norm_clip <= 0:
            raise ValueError(f'l2_norm_clip must be > 0, got {l2_norm_clip}.')
    if linf_norm_clip is not None:
        _finite_number('linf_norm_clip', linf_norm_clip)
        if linf_norm_clip <= 0:
            raise ValueError(
                'linf_norm_clip must be > 0 (or None for no l-infinity '
                f'clipping), got {linf_norm_clip}.')
    if noise_multiplier is not None:
        _finite_number('noise_multiplier', noise_multiplier)
        if noise_multiplier < 0:
            raise ValueError(
                f'noise_multiplier must be >= 0, got {noise_multiplier}.')
    if coordinate_sampling_rate is not None:
        _finite_number('coordinate_sampling_rate', coordinate_sampling_rate)
        if not 0 < coordinate_sampling_rate <= 1:
            raise ValueError(
                'coordinate_sampling_rate must be in (0, 1], got '
                f'{coordinate_sampling_rate}.')
        if effective_coordinate_sampling_rate(coordinate_sampling_rate) <= 0:
            raise ValueError(
                'coordinate_sampling_rate must be >= '
                f'2**-{MASK_PRECISION_BITS} (the mask resolution), got '
                f'{coordinate_sampling_rate}.')
    if expected_batch_size is not None:
        _finite_number('expected_batch_size', expected_batch_size)
        if expected_batch_size <= 0:
            raise ValueError(
                f'expected_batch_size must be > 0, got {expected_batch_size}.')


@dataclasses.dataclass(frozen=True)
class AggregationParams:
    """Validated parameters of one single-block aggregation.

    Attributes:
      l2_norm_clip: c2 > 0, the l2 bound of one example's flattened gradient.
      noise_multiplier: z >= 0; the noise std on every coordinate is z * c2.
      expected_batch_size: n * q1 > 0, the expected logical batch size (in
        records); the update is divided by expected_batch_size * q2.
      linf_norm_clip: c_inf > 0 or None (no l-infinity clipping). Values >= c2
        have no effect on the sensitivity but are applied as given.
      coordinate_sampling_rate: q2 in (0, 1].
    """

    l2_norm_clip: float
    noise_multiplier: float
    expected_batch_size: float
    linf_norm_clip: Optional[float] = None
    coordinate_sampling_rate: float = 1.0

    def __post_init__(self):
        validate_params(
            l2_norm_clip=self.l2_norm_clip,
            linf_norm_clip=self.linf_norm_clip,
            noise_multiplier=self.noise_multiplier,
            coordinate_sampling_rate=self.coordinate_sampling_rate,
            expected_batch_size=self.expected_batch_size)
        # Plain floats keep configs JSON-serialisable (no numpy scalars).
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                object.__setattr__(self, field.name, float(value))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def draw_step_key(generator: tf.random.Generator) -> tf.Tensor:
    """Draws the Philox key of one logical step (uint64, shape [1])."""
    return generator.uniform_full_int([1], dtype=tf.uint64)


def _counter(low: tf.Tensor, stream: int) -> tf.Tensor:
    # Philox increments the low 64 bits; the high 64 bits name the stream.
    low = tf.cast(low, tf.int64)
    return tf.bitcast(tf.stack([low, tf.constant(stream, tf.int64)]),
                      tf.uint64)


def _num_elements(shape: Sequence[int]) -> int:
    return int(math.prod(int(s) for s in shape))


def mask_bits_per_coordinate(coordinate_sampling_rate: float) -> int:
    """Random bits one mask entry uses: the least b in (1, 2, 4, 8, 16) with
    q2 * 2**b an integer, else 16. Dyadic rates such as 1/2 (b = 1) need far
    fewer random bits, and generating them dominates the cost of masking."""
    levels = effective_coordinate_sampling_rate(
        coordinate_sampling_rate) * _MASK_LEVELS
    for bits in (1, 2, 4, 8):
        if (levels / 2**(MASK_PRECISION_BITS - bits)).is_integer():
            return bits
    return MASK_PRECISION_BITS


def _row_masks(key, v, rows, offset, d, q2):
    """[rows, d] masks of variable ``v`` for examples offset..offset+rows-1.

    Each row takes a whole number of 128-bit Philox blocks, starting at the
    block index of its global position, so the entries of an example do not
    depend on which rows are generated together.
    """
    bits = mask_bits_per_coordinate(q2)
    threshold = int(effective_coordinate_sampling_rate(q2)
                    * 2**bits)
    per_block = 128 // bits
    blocks = -(-d // per_block)
    words = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=tf.stack([rows, blocks * 4]),
        key=key,
        counter=_counter(tf.cast(offset, tf.int64) * blocks, v),
        alg=_PHILOX_ALG,
        dtype=tf.uint32)
    if bits == 16:
        draws = tf.bitcast(words, tf.uint16)
        limit = tf.constant(threshold, tf.uint16)
    else:
        draws = tf.bitcast(words, tf.uint8)  # [rows, 4 * blocks, 4]
        if bits < 8:
            shifts = tf.constant(list(range(0, 8, bits)), tf.uint8)
            draws = tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(draws[..., None], shifts),
                tf.constant(2**bits - 1, tf.uint8))
        limit = tf.constant(threshold, tf.uint8)
    draws = tf.reshape(draws, [-1, blocks * per_block])
    if blocks * per_block != d:
        draws = draws[:, :d]
    return tf.less(draws, limit)


def coordinate_masks(
    key: tf.Tensor,
    shapes: Sequence[Sequence[int]],
    coordinate_sampling_rate: float,
    batch_size: TensorLike,
    example_offset: TensorLike = 0,
) -> List[tf.Tensor]:
    """Boolean Bernoulli masks of shape [batch_size, *shape], one per shape.

    Each entry is True independently with probability
    ``effective_coordinate_sampling_rate(q2)``: a uniform draw of
    ``mask_bits_per_coordinate(q2)`` bits is compared with the rate times
    2**bits. Row i of the masks for variable v is a function of
    (key, v, example_offset + i) only, so masks do not depend on how a
    logical batch is split into microbatches.
    """
    validate_params(coordinate_sampling_rate=coordinate_sampling_rate)
    batch_size = tf.cast(batch_size, tf.int32)
    if coordinate_sampling_rate >= 1:
        return [tf.ones(tf.concat([[batch_size], shape], 0), tf.bool)
                for shape in shapes]
    masks = []
    for v, shape in enumerate(shapes):
        shape = [int(s) for s in shape]
        mask = _row_masks(key, v, batch_size, example_offset,
                          _num_elements(shape), coordinate_sampling_rate)
        masks.append(tf.reshape(mask, [-1] + shape))
    return masks


def standard_normal_noise(
    key: tf.Tensor,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[tf.DType],
) -> List[tf.Tensor]:
    """Independent N(0, 1) tensors of the given shapes, one stream each."""
    return [
        tf.raw_ops.StatelessRandomNormalV2(
            shape=[int(s) for s in shape],
            key=key,
            counter=_counter(0, _NOISE_STREAM + v),
            alg=_PHILOX_ALG,
            dtype=dtype)
        for v, (shape, dtype) in enumerate(zip(shapes, dtypes))
    ]


def _check_weights(weights: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    # A weight above 1 would scale an example's contribution past the clip
    # bound, so it is refused rather than silently accepted.
    weights = tf.reshape(tf.cast(weights, dtype), [-1])
    in_range = tf.reduce_all(
        tf.logical_and(weights >= 0, weights <= 1))
    check = tf.debugging.Assert(in_range, [
        'per-example weights must be in [0, 1] (1 real, 0 padding); a larger '
        'weight would break the sensitivity bound. Got min/max:',
        tf.reduce_min(weights), tf.reduce_max(weights)
    ])
    with tf.control_dependencies([check]):
        return tf.identity(weights)


def _clip_scale(
    grads: Sequence[tf.Tensor], l2_norm_clip: float
) -> Tuple[tf.Tensor, tf.Tensor]:
    """Per-example l2 clip factors of one block and the finite-example flags.

    Returns (scale [B], finite [B]): scale_i = min(1, c2 / ||g_i||) where the
    squared norm is finite and 0 elsewhere.
    """
    dtype = grads[0].dtype
    squares = [
        tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1)
        for g in grads
    ]
    sq_norm = tf.add_n(squares)
    finite = tf.math.is_finite(sq_norm)
    norm = tf.sqrt(tf.where(finite, sq_norm, tf.zeros_like(sq_norm)))
    c2 = tf.constant(l2_norm_clip, dtype)
    scale = tf.where(finite, c2 / tf.maximum(norm, c2), tf.zeros_like(norm))
    return scale, finite


def _drop_non_finite(grads: Sequence[tf.Tensor],
                     finite: tf.Tensor) -> List[tf.Tensor]:
    # 0 * NaN is NaN, so non-finite examples must be zeroed, not scaled. The
    # full-size select only runs when such an example is present.
    def _zeroed():
        out = []
        for g in grads:
            keep = tf.reshape(finite, [-1] + [1] * (g.shape.rank - 1))
            out.append(tf.where(keep, g, tf.zeros_like(g)))
        return out

    return tf.cond(
        tf.reduce_all(finite), lambda: [tf.identity(g) for g in grads],
        _zeroed)


def _clip_and_mask(
    flat: tf.Tensor,
    scale: tf.Tensor,
    mask: Optional[tf.Tensor],
    key: Optional[tf.Tensor],
    offset: tf.Tensor,
    stream: int,
    coordinate_sampling_rate: float,
    linf_norm_clip: Optional[float],
) -> tf.Tensor:
    """The elementwise part on one [B, d] tensor: mask * clip_inf(scale * g).

    Without l-infinity clipping the scale is left to the caller's
    matrix-vector product (masking commutes with a per-row scale).
    """
    if linf_norm_clip is not None:
        c_inf = tf.constant(linf_norm_clip, flat.dtype)
        flat = tf.clip_by_value(flat * scale[:, None], -c_inf, c_inf)
    if mask is None and coordinate_sampling_rate < 1:
        mask = _row_masks(key, stream, tf.shape(flat)[0], offset,
                          flat.shape[1], coordinate_sampling_rate)
    if mask is not None:
        flat = tf.where(mask, flat, tf.zeros_like(flat))
    return flat


# One fused XLA kernel for mask generation, clipping and selection: on CPU it
# avoids materialising the random bits and several [B, d] intermediates.
_clip_and_mask_fused = tf.function(_clip_and_mask, jit_compile=True)


def _sum_block(
    grads: Sequence[tf.Tensor],
    scale: tf.Tensor,
    weights: Optional[tf.Tensor],
    linf_norm_clip: Optional[float],
    coordinate_sampling_rate: float,
    masks: Optional[Sequence[tf.Tensor]],
    key: Optional[tf.Tensor],
    example_offset: TensorLike,
    jit_compile: bool,
) -> List[tf.Tensor]:
    """sum_i w_i * mask_i * clip_inf(scale_i * g_i) for each tensor of a block.

    Mask streams are numbered by the tensor's position in ``grads``.
    """
    offset = tf.cast(example_offset, tf.int64)
    elementwise = _clip_and_mask_fused if jit_compile else _clip_and_mask
    sums = []
    for k, g in enumerate(grads):
        d = _num_elements(g.shape[1:])
        flat = tf.reshape(g, [-1, d])
        mask = None if masks is None else tf.reshape(masks[k], [-1, d])
        if linf_norm_clip is None:
            coef = scale if weights is None else scale * weights
        else:
            coef = weights
        if linf_norm_clip is not None or coordinate_sampling_rate < 1 or (
                mask is not None):
            flat = elementwise(flat, scale, mask, key, offset, k,
                               coordinate_sampling_rate, linf_norm_clip)
        if coef is None:
            total = tf.reduce_sum(flat, axis=0)
        else:
            total = tf.linalg.matvec(flat, coef, transpose_a=True)
        sums.append(tf.reshape(total, g.shape[1:]))
    return sums


def clipped_masked_sum(
    per_example_grads: Sequence[tf.Tensor],
    *,
    l2_norm_clip: float,
    linf_norm_clip: Optional[float] = None,
    coordinate_sampling_rate: float = 1.0,
    weights: Optional[tf.Tensor] = None,
    key: Optional[tf.Tensor] = None,
    example_offset: TensorLike = 0,
    masks: Optional[Sequence[tf.Tensor]] = None,
    jit_compile: bool = True,
) -> List[tf.Tensor]:
    """Clips, masks, weights and sums per-example gradients (steps 1-4).

    Args:
      per_example_grads: one tensor [B, *var_shape] per variable; row i of all
        tensors together is example i's gradient.
      l2_norm_clip: c2 > 0; the l2 norm is global over all the tensors.
      linf_norm_clip: c_inf > 0 applied to every coordinate after the l2 clip,
        or None for none.
      coordinate_sampling_rate: q2 in (0, 1]; 1 skips mask generation.
      weights: optional [B] weights in [0, 1] (1 real example, 0 padding that
        contributes exactly nothing). Values outside [0, 1] raise at run time.
      key: the step key from ``draw_step_key``; required when q2 < 1 and
        ``masks`` is None.
      example_offset: position of row 0 in the logical batch, so that masks do
        not depend on how a logical batch is split into microbatches.
      masks: optional explicit masks (bool or 0/1), one [B, *var_shape] per
        variable, replacing generated ones (for tests).
      jit_compile: fuse mask generation, clipping and masking into one XLA
        kernel per tensor (the result is the same; it is faster on CPU).

    Returns:
      One tensor of shape var_shape per variable. For every example, its
      contribution has l2 norm <= c2 and every coordinate in [-c_inf, c_inf].

    Non-finite gradients: an example whose squared gradient norm is not finite
    (a NaN or Inf coordinate, or a norm beyond the dtype's range) is dropped:
    it contributes exactly zero, which stays inside the sensitivity set, so the
    guarantee holds; the update is not poisoned.
    """
    validate_params(
        l2_norm_clip=l2_norm_clip,
        linf_norm_clip=linf_norm_clip,
        coordinate_sampling_rate=coordinate_sampling_rate)
    grads = [tf.convert_to_tensor(g) for g in per_example_grads]
    if not grads:
        raise ValueError('per_example_grads must contain at least one tensor.')
    for g in grads:
        if g.shape.rank is None or not g.shape[1:].is_fully_defined():
            raise ValueError(
                'per_example_grads must have static shapes [B, *var_shape]; '
                f'got {g.shape}.')
    dtype = grads[0].dtype
    if masks is not None:
        if len(masks) != len(grads):
            raise ValueError(
                f'masks must have one tensor per gradient ({len(grads)}), '
                f'got {len(masks)}.')
        masks = [tf.cast(m, tf.bool) for m in masks]
    elif coordinate_sampling_rate < 1 and key is None:
        raise ValueError(
            'key (from draw_step_key) or masks is required when '
            f'coordinate_sampling_rate < 1, got {coordinate_sampling_rate}.')
    if weights is not None:
        weights = _check_weights(weights, dtype)

    scale, finite = _clip_scale(grads, l2_norm_clip)
    grads = _drop_non_finite(grads, finite)
    return _sum_block(grads, scale, weights, linf_norm_clip,
                      coordinate_sampling_rate, masks, key, example_offset,
                      jit_compile)


def add_noise_and_normalize(
    sums: Sequence[tf.Tensor],
    *,
    l2_norm_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    coordinate_sampling_rate: float = 1.0,
    key: Optional[tf.Tensor] = None,
    noise: Optional[Sequence[tf.Tensor]] = None,
) -> List[tf.Tensor]:
    """Adds N(0, (z c2)^2) per coordinate, divides by B_exp q2 (steps 5-6).

    Args:
      sums: the accumulated ``clipped_masked_sum`` of one logical batch.
      l2_norm_clip: c2 > 0.
      noise_multiplier: z >= 0; 0 adds no noise (not private; for tests).
      expected_batch_size: n * q1 > 0; the normaliser never depends on the
        realised batch size, which would leak it.
      coordinate_sampling_rate: q2; the divisor uses the realised mask rate
        ``effective_coordinate_sampling_rate(q2)`` so the update is an unbiased
        estimate of the mean clipped gradient.
      key: the step key; required when z > 0 and ``noise`` is None.
      noise: optional explicit N(0, 1) draws, one per sum (for tests); they are
        scaled by z * c2 here.

    Returns:
      The noisy, normalised update, one tensor per sum.
    """
    validate_params(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        coordinate_sampling_rate=coordinate_sampling_rate,
        expected_batch_size=expected_batch_size)
    sums = [tf.convert_to_tensor(s) for s in sums]
    if noise_multiplier > 0:
        if noise is None:
            if key is None:
                raise ValueError(
                    'key (from draw_step_key) or noise is required when '
                    f'noise_multiplier > 0, got {noise_multiplier}.')
            noise = standard_normal_noise(key, [s.shape for s in sums],
                                          [s.dtype for s in sums])
        elif len(noise) != len(sums):
            raise ValueError(
                f'noise must have one tensor per sum ({len(sums)}), got '
                f'{len(noise)}.')
        std = noise_multiplier * l2_norm_clip
        sums = [s + tf.cast(std, s.dtype) * tf.cast(e, s.dtype)
                for s, e in zip(sums, noise)]
    denom = expected_batch_size * effective_coordinate_sampling_rate(
        coordinate_sampling_rate)
    return [s / tf.cast(denom, s.dtype) for s in sums]
