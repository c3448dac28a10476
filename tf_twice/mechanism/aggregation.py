"""The one clip-mask-noise-normalise aggregation of per-example gradients.

Every training path (the optimizer classes in ``tf_twice.optimizers`` and the
per-example model path in ``tf_twice.keras``, both through
``tf_twice.mechanism.hybrid``) calls the functions below, so the released
quantity is defined in exactly one place. For a logical batch of
(Poisson-sampled) examples with per-example gradients g_i:

1. flatten g_i over all variables and clip it to l2 norm <= c2;
2. clip every coordinate to [-c_inf, c_inf];
3. multiply by an independent Bernoulli(q2) mask per example and coordinate;
4. multiply by the example's weight w_i in [0, 1] (0 marks padding) and sum;
5. add N(0, (z * c2)^2) once to every coordinate of the sum;
6. divide by expected_batch_size * q2, never by the realised batch size.

Steps 1-4 are ``clipped_masked_sum`` and may run on several physical
microbatches of one logical batch whose sums are added in float64
(``hybrid.zero_block_sums``); steps 5-6 are ``add_noise_and_normalize`` and
run once per logical batch, in float64. A microbatch is summed in its
gradients' dtype (float32 for float32 and 16-bit gradients), whose rounding
grows with the rows summed and comes before the noise: call steps 1-4 on
physical microbatches, not on a whole large batch, and never add their sums
in float32 (``PrivateAggregator`` does both).

Privacy: one example changes the sum of steps 1-4 by a vector s with
||s||_2 <= c2 and ||s||_inf <= c_inf, of which each coordinate is independently
kept with probability q2. With example-level Poisson sampling of rate q1 this
is the (q1, q2)-twice-sampled Gaussian mechanism of the paper (Theorems
"Privacy Amplification of Coordinate-Wise Sampling" and "Privacy Amplification
from Twice Sampling"); step 6 is post-processing.

Randomness: masks and noise come from the step key and the Philox stream
layout of ``tf_twice.mechanism.randomness``, so they do not depend on how a
logical batch is split into microbatches. Tests may instead pass explicit
``masks`` and ``noise``.

Hybrid clipping. ``clipped_masked_block_sums`` and
``add_block_noise_and_normalize`` run the same steps on m blocks, each a list
of tensors [B, ...] with its own c2_j, c_inf_j and z_j: block j is clipped on
its own (l2 over all its tensors, then l-infinity), masked, summed and noised
with N(0, (z_j c2_j)^2). One example then changes the released blocks by
vectors s_j with ||s_j||_2 <= c2_j and ||s_j||_inf <= c_inf_j, each coordinate
of block j kept with probability q2_j (one q2 for all blocks, or one per
block): the multi-block twice-sampled Gaussian mechanism
accounted by ``TwiceSampledGaussianDpEvent`` with per-block tuples.
``clipped_masked_sum`` and ``add_noise_and_normalize`` are the one-block case;
with one block the numbers are exactly those of the block functions for the
same key (block 0 uses the single-block streams).

Validation. These functions are public and take raw numbers, so they check
their arguments (``validate_params``, per block; see ``arguments``) although
the training paths pass a ``TwiceSamplingConfig`` that is already validated:
the checks are host-side Python, run when a step is traced, not in the step's
graph. ``config_block_sums`` and ``config_noisy_block_sums`` take a
``TwiceSamplingConfig`` instead, whose numbers were checked when it was
built: the training step calls them. The per-tensor clip, mask and sum kernels are in ``kernels``; a
tensor that is a batch of outer products (a dense kernel's per-example
gradients) is read from its factors (``outer_products``), the same numbers.
"""

from fractions import Fraction
from typing import List, Optional, Sequence, Union

import tensorflow as tf

# The q2 arithmetic belongs to the TF-free config; the kernel uses the same
# definition.
from tf_twice import config as config_lib
from tf_twice.config import effective_coordinate_sampling_rate
from tf_twice.mechanism import kernels
from tf_twice.mechanism import outer_products
from tf_twice.mechanism import precision
from tf_twice.mechanism import randomness
from tf_twice.mechanism.arguments import check_blocks
from tf_twice.mechanism.arguments import per_block
from tf_twice.mechanism.arguments import scalar_or_per_block
from tf_twice.mechanism.arguments import validate_each_block
# Public here, where users import it from.
from tf_twice.mechanism.arguments import validate_params
from tf_twice.mechanism.randomness import TensorLike

__all__ = [
    'add_block_noise_and_normalize',
    'add_noise_and_normalize',
    'clipped_masked_block_sums',
    'clipped_masked_sum',
    'config_block_sums',
    'config_noisy_block_sums',
    'validate_params',
]


def _check_weights(weights: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``weights`` as a flat ``dtype`` tensor, refused at run time outside
    [0, 1]: a weight above 1 would scale an example's contribution past the
    clip bound.

    A weight outside [0, 1] (or NaN) is also set to 0, so that no example
    ever weighs more than 1 where the refusal cannot run: XLA drops run-time
    assertions (``jit_compile=True``); there the caller refuses such input
    before the step (``DPModel.fit`` checks its dataset's weights).
    """
    weights = tf.reshape(tf.cast(weights, dtype), [-1])
    in_range = tf.logical_and(weights >= 0, weights <= 1)
    bounded = tf.where(in_range, weights, tf.zeros_like(weights))
    if precision.in_xla_context():
        return bounded
    check = tf.debugging.Assert(tf.reduce_all(in_range), [
        'per-example weights must be in [0, 1] (1 real, 0 padding); a larger '
        'weight would break the sensitivity bound. Got min/max:',
        tf.reduce_min(weights), tf.reduce_max(weights)
    ])
    with tf.control_dependencies([check]):
        return tf.identity(bounded)


def clipped_masked_block_sums(
    blocks: Sequence[Sequence[tf.Tensor]],
    *,
    l2_norm_clips: Sequence[float],
    linf_norm_clips: Optional[Sequence[Optional[float]]] = None,
    coordinate_sampling_rate: Union[float, Sequence[float]] = 1.0,
    weights: Optional[tf.Tensor] = None,
    key: Optional[tf.Tensor] = None,
    example_offset: TensorLike = 0,
    masks: Optional[Sequence[Sequence[tf.Tensor]]] = None,
    jit_compile: bool = True,
) -> List[List[tf.Tensor]]:
    """Steps 1-4 on m blocks, each clipped on its own.

    Args:
      blocks: m blocks; block j is a list of tensors [B, *shape] (e.g. the
        coefficients of principal block j, one tensor per parameter group, or
        the residual in natural coordinates); row i of all of block j's
        tensors together is example i's vector in block j. All blocks hold
        the same B examples.
      l2_norm_clips: c2_j > 0 per block; block j's l2 norm is over all its
        tensors.
      linf_norm_clips: None (no l-infinity clipping), or c_inf_j > 0 or None
        per block, applied to every coordinate of block j after its l2 clip.
      coordinate_sampling_rate: q2 in (0, 1] for every block, or q2_j per
        block.
      weights: optional [B] weights in [0, 1] shared by all blocks.
      key: the step key; required when q2 < 1 and ``masks`` is None.
      example_offset: position of row 0 in the logical batch.
      masks: optional explicit masks, ``masks[j][k]`` for tensor k of block j.
      jit_compile: fuse mask generation, clipping and masking (same result).

    Returns:
      ``sums[j][k]``: the weighted sum over examples of the clipped masked
      tensor k of block j, of shape ``blocks[j][k].shape[1:]``, in float32
      for 16-bit input (``precision.accumulation_dtype``); add microbatches'
      sums in float64 (module docstring). Every
      example's contribution to block j has l2 norm <= c2_j and every
      coordinate in [-c_inf_j, c_inf_j]; its masks are independent of every
      other block's (disjoint Philox streams, see the module docstring).

    Non-finite gradients: an example whose vector in ANY block has a
    non-finite squared norm, or one above the dtype's largest number, is
    dropped from every block (it contributes exactly zero, inside every
    block's sensitivity set).
    """
    blocks = check_blocks(blocks)
    num_blocks = len(blocks)
    clips = per_block('l2_norm_clips', l2_norm_clips, num_blocks)
    linf = per_block('linf_norm_clips', linf_norm_clips, num_blocks)
    rates = scalar_or_per_block('coordinate_sampling_rate',
                                coordinate_sampling_rate, num_blocks)
    validate_each_block(l2_norm_clip=clips, linf_norm_clip=linf,
                        coordinate_sampling_rate=rates)
    return _block_sums(blocks, clips, linf, rates, weights, key,
                       example_offset, masks, jit_compile)


def config_block_sums(
    blocks: Sequence[Sequence[tf.Tensor]],
    config: config_lib.TwiceSamplingConfig,
    *,
    weights: Optional[tf.Tensor] = None,
    key: Optional[tf.Tensor] = None,
    example_offset: TensorLike = 0,
    masks: Optional[Sequence[Sequence[tf.Tensor]]] = None,
    jit_compile: bool = True,
) -> List[List[tf.Tensor]]:
    """``clipped_masked_block_sums`` with ``config``'s clips and rates,
    one block per Block: the config validated them when it was built, so
    they are not checked again at every trace."""
    _check_config(config)
    blocks = check_blocks(blocks)
    if len(blocks) != config.num_blocks:
        raise ValueError(f'blocks must hold one block per Block of the '
                         f'config ({config.num_blocks}); got {len(blocks)}.')
    return _block_sums(blocks, config.l2_norm_clips, config.linf_norm_clips,
                       config.coordinate_sampling_rates, weights, key,
                       example_offset, masks, jit_compile)


def _check_config(config) -> None:
    # Its numbers are trusted because its constructor checked them.
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice TwiceSamplingConfig; got '
                         f'{type(config).__name__}.')


def _block_sums(blocks, clips, linf, rates, weights, key, example_offset,
                masks, jit_compile) -> List[List[tf.Tensor]]:
    """Steps 1-4 on checked blocks, clips and rates."""
    num_blocks = len(blocks)
    dtype = precision.accumulation_dtype(
        *(g.dtype for block in blocks for g in block))
    blocks = [[tf.cast(g, dtype) for g in block] for block in blocks]
    if masks is not None:
        masks = per_block('masks', masks, num_blocks)
        for j, (block, block_masks) in enumerate(zip(blocks, masks)):
            if len(block_masks) != len(block):
                raise ValueError(
                    f'masks[{j}] must have one tensor per tensor of '
                    f'blocks[{j}] ({len(block)}), got {len(block_masks)}.')
        masks = [[tf.cast(m, tf.bool) for m in block_masks]
                 for block_masks in masks]
    elif min(rates) < 1 and key is None:
        raise ValueError(
            'key (from draw_step_key) or masks is required when '
            f'coordinate_sampling_rate < 1, got {tuple(rates)}.')
    if weights is not None:
        weights = _check_weights(weights, dtype)

    # A dense kernel's per-example gradients are read from their factors.
    blocks = [[outer_products.factor(g) for g in block] for block in blocks]
    sq_norms = [kernels.squared_norms(block) for block in blocks]
    finite = kernels.representable(sq_norms, dtype)
    sums = []
    for j, block in enumerate(blocks):
        scale = kernels.clip_scale(sq_norms[j], finite, clips[j], dtype)
        block = kernels.drop_non_finite(block, finite)
        sums.append(kernels.sum_block(
            block, scale, weights, linf[j], rates[j],
            None if masks is None else masks[j], key, example_offset,
            jit_compile, block=j))
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

    The one-block case of ``clipped_masked_block_sums`` (block 0, whose
    random streams are those of the single-block layout).

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
      One tensor of shape var_shape per variable, in float32 for 16-bit
      gradients (``precision.accumulation_dtype``). For every example, its
      contribution has l2 norm <= c2 and every coordinate in [-c_inf, c_inf].

    Non-finite gradients: an example whose squared gradient norm is not finite
    (a NaN or Inf coordinate, or a squared norm beyond the range of the
    dtype it is computed in: float32 for 16-bit gradients) is dropped:
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
    if masks is not None and len(masks) != len(grads):
        raise ValueError(
            f'masks must have one tensor per gradient ({len(grads)}), '
            f'got {len(masks)}.')
    return clipped_masked_block_sums(
        [grads],
        l2_norm_clips=[l2_norm_clip],
        linf_norm_clips=[linf_norm_clip],
        coordinate_sampling_rate=coordinate_sampling_rate,
        weights=weights,
        key=key,
        example_offset=example_offset,
        masks=None if masks is None else [masks],
        jit_compile=jit_compile)[0]


def add_block_noise_and_normalize(
    block_sums: Sequence[Sequence[tf.Tensor]],
    *,
    l2_norm_clips: Sequence[float],
    noise_multipliers: Sequence[float],
    expected_batch_size: float,
    coordinate_sampling_rate: Union[float, Sequence[float]] = 1.0,
    key: Optional[tf.Tensor] = None,
    noise: Optional[Sequence[Sequence[tf.Tensor]]] = None,
    noise_dtype: tf.DType = precision.BATCH_SUM_DTYPE,
) -> List[List[tf.Tensor]]:
    """Steps 5-6 on m blocks: N(0, (z_j c2_j)^2) per coordinate of block j,
    then division by expected_batch_size * q2_j, in float64.

    The sums are taken to float64 (``precision.BATCH_SUM_DTYPE``) and the
    noise is added there: rounding the result to the variables' dtype
    afterwards is post-processing. Sums added over microbatches should be
    added in float64 too (``hybrid.zero_block_sums``): a float32
    accumulator's rounding grows with the sum, and it comes before the
    noise.

    Args:
      block_sums: ``sums[j][k]`` from ``clipped_masked_block_sums``
        (accumulated over the physical microbatches of one logical batch).
      l2_norm_clips: c2_j > 0 per block.
      noise_multipliers: z_j >= 0 per block (0: no noise in that block; not
        private, for tests).
      expected_batch_size: n * q1 > 0 (never the realised batch size).
      coordinate_sampling_rate: q2, or q2_j per block; block j's divisor
        uses its realised mask rate.
      key: the step key; required when some z_j > 0 and ``noise`` is None.
        Block j's noise comes from its own streams (``standard_normal_noise
        (..., block=j)``), independent of every other block's.
      noise: optional explicit N(0, 1) draws, ``noise[j][k]`` (for tests).
      noise_dtype: the dtype the N(0, 1) draws are computed in
        (``randomness.standard_normal_noise``) before they are added in
        float64: float64, or float32 where the gradients are float32 or
        16-bit (``PrivateAggregator.finish``), whose update is float32 at
        most. In float64 the reference CNN's noise cost about 2.5 times
        as much (``benchmarks/noise_benchmark.py``).

    Returns:
      ``update[j][k]``: the noisy normalised sums, one per input sum, in
      float64.
    """
    num_blocks = len(block_sums)
    if num_blocks < 1:
        raise ValueError('block_sums must hold at least one block.')
    clips = per_block('l2_norm_clips', l2_norm_clips, num_blocks)
    zs = per_block('noise_multipliers', noise_multipliers, num_blocks)
    rates = scalar_or_per_block('coordinate_sampling_rate',
                                coordinate_sampling_rate, num_blocks)
    validate_each_block(l2_norm_clip=clips, noise_multiplier=zs,
                        coordinate_sampling_rate=rates)
    validate_params(expected_batch_size=expected_batch_size)
    return _noisy_block_sums(block_sums, clips, zs, expected_batch_size,
                             rates, key, noise, noise_dtype)


def config_noisy_block_sums(
    block_sums: Sequence[Sequence[tf.Tensor]],
    config: config_lib.TwiceSamplingConfig,
    *,
    key: Optional[tf.Tensor] = None,
    noise: Optional[Sequence[Sequence[tf.Tensor]]] = None,
    noise_dtype: tf.DType = precision.BATCH_SUM_DTYPE,
) -> List[List[tf.Tensor]]:
    """``add_block_noise_and_normalize`` with ``config``'s clips, noise
    multipliers, expected batch size and rates (validated when the config
    was built, not again at every trace). A config not yet calibrated is
    refused."""
    _check_config(config)
    if len(block_sums) != config.num_blocks:
        raise ValueError(f'block_sums must hold one block per Block of the '
                         f'config ({config.num_blocks}); got '
                         f'{len(block_sums)}.')
    if not config.is_calibrated:
        raise ValueError('the config has no noise multiplier yet: calibrate '
                         'it (TwiceSamplingConfig.calibrate) before a step.')
    return _noisy_block_sums(block_sums, config.l2_norm_clips,
                             config.noise_multipliers,
                             config.expected_batch_size,
                             config.coordinate_sampling_rates, key, noise,
                             noise_dtype)


def _noisy_block_sums(block_sums, clips, zs, expected_batch_size, rates, key,
                      noise, noise_dtype) -> List[List[tf.Tensor]]:
    """Steps 5-6 on checked clips, noise multipliers and rates."""
    num_blocks = len(block_sums)
    if noise is not None:
        noise = per_block('noise', noise, num_blocks)
    out = []
    for j, sums in enumerate(block_sums):
        sums = [tf.cast(s, precision.BATCH_SUM_DTYPE) for s in sums]
        if zs[j] > 0:
            block_noise = None if noise is None else noise[j]
            if block_noise is None:
                if key is None:
                    raise ValueError(
                        'key (from draw_step_key) or noise is required when '
                        f'noise_multiplier > 0, got {zs[j]}.')
                block_noise = randomness.standard_normal_noise(
                    key, [s.shape for s in sums], [noise_dtype] * len(sums),
                    block=j)
            elif len(block_noise) != len(sums):
                raise ValueError(
                    f'noise must have one tensor per sum ({len(sums)}), got '
                    f'{len(block_noise)}' + (f' in block {j}.'
                                             if num_blocks > 1 else '.'))
            std = Fraction(float(zs[j])) * Fraction(float(clips[j]))
            sums = [s + precision.constant_toward(std, s.dtype, up=True)
                    * tf.cast(e, s.dtype) for s, e in zip(sums, block_noise)]
        denom = expected_batch_size * effective_coordinate_sampling_rate(
            rates[j])
        out.append([s / tf.cast(denom, s.dtype) for s in sums])
    return out


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

    The one-block case of ``add_block_noise_and_normalize``.

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
      The noisy, normalised update, one float64 tensor per sum (round it to
      the variables' dtype: post-processing).
    """
    validate_params(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        coordinate_sampling_rate=coordinate_sampling_rate,
        expected_batch_size=expected_batch_size)
    return add_block_noise_and_normalize(
        [sums],
        l2_norm_clips=[l2_norm_clip],
        noise_multipliers=[noise_multiplier],
        expected_batch_size=expected_batch_size,
        coordinate_sampling_rate=coordinate_sampling_rate,
        key=key,
        noise=None if noise is None else [noise])[0]
