"""Per-block clips and noise for hybrid clipping, from PUBLIC data only.

Hybrid clipping gives each block of a ``HybridBasis`` (principal blocks, then
the residual) its own l2 clip c2_j, l-infinity clip c_inf_j and noise
multiplier z_j. ``plan_blocks`` sets all three from a one-block config (the
global l2 budget c, the residual's l-infinity clip, q1, q2, n), the basis and
public per-example gradients:

* l2: c2_j = c * n_j / ||n||_2 with n_j the mean public projection norm of
  block j (``public_block_norms``, ``split_l2_budget``): sum_j c2_j^2 = c^2,
  so the hybrid set lies inside the global l2 ball (the paper allocates "the
  same global l2-norm budget c to different subspaces, depending on the
  expected norm of public gradients projected into each subspace");
* l-infinity: the residual (natural coordinates) keeps the config's clip,
  capped at its c2, or c2 / sqrt(residual_d0); principal block j gets
  c2_j / sqrt(min(principal_d0, r_j)). The default principal_d0 = 1 leaves
  principal blocks without an l-infinity clip: their energy sits in a few
  leading coefficients, which such a clip would cut, and they are small, so
  the amplification it buys is worth little noise;
* noise: the config's z on every block, or the z_j that minimise the total
  noise variance sum_j r_j (z_j c2_j)^2 under (epsilon, delta) after the
  planned steps (``hybrid_noise_multipliers``, the paper's optimal-noise
  theorem solved numerically and checked by the full accountant).

Privacy: nothing here reads private data. Budgets computed from private
gradients would leak them; feed public gradients (or user constants) only.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import attr
import numpy as np
import tensorflow as tf

from tf_twice import _validate
from tf_twice import accounting
from tf_twice import config as config_lib
from tf_twice.accounting import conversion as conversion_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'hybrid_noise_multipliers',
    'linf_clips_from_d0',
    'plan_blocks',
    'public_block_norms',
    'split_l2_budget',
]

# A block without public energy would get no l2 budget; it gets this
# fraction of the largest block's public norm instead.
MIN_RELATIVE_BLOCK_NORM = 1e-6


def public_block_norms(basis: basis_lib.HybridBasis,
                       public_gradients,
                       *,
                       clip_norm: Optional[float] = None,
                       chunk_size: int = 256) -> np.ndarray:
    """Mean public ||projection onto block j||, residual last: shape [m].

    Block j's projection norm of one example is ||a_j|| with a_j the
    concatenation over groups of its coefficients (= ||U_j a_j|| for an
    orthonormal basis); the residual's is ||g - U a||. Feed only PUBLIC
    gradients: the result sets clip budgets (``split_l2_budget``), and
    budgets computed from private gradients would leak them.

    Args:
      basis: the basis.
      public_gradients: per-variable arrays [k_pub, *shape_v] or a 2-D array
        [k_pub, d] in natural variable order.
      clip_norm: if given (> 0), each example is first scaled to l2 norm
        <= clip_norm, as the DP step clips (and so that a few large public
        gradients do not dominate the means).
      chunk_size: examples projected at a time (bounds memory).
    """
    chunk_size = _validate.integer('chunk_size', chunk_size, 1)
    if clip_norm is not None and not (clip_norm > 0 and math.isfinite(
            clip_norm)):
        raise ValueError(
            f'clip_norm must be a finite number > 0 or None; got {clip_norm}.')
    if isinstance(public_gradients, (np.ndarray, tf.Tensor)):
        per_group = [np.asarray(t) for t in
                     basis.split_flat(np.asarray(public_gradients,
                                                 dtype=np.float32))]
    else:
        per_group = [np.asarray(t) for t in basis.flatten(
            [np.asarray(t, dtype=np.float32) for t in public_gradients])]
    n = per_group[0].shape[0]
    if n < 1:
        raise ValueError('public_gradients must hold at least one example.')
    totals = np.zeros(basis.num_blocks)
    for start in range(0, n, chunk_size):
        chunk = [x[start:start + chunk_size] for x in per_group]
        if clip_norm is not None:
            norms = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64), axis=1)
                                for x in chunk))
            scale = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))
            chunk = [(x * scale[:, None]).astype(np.float32) for x in chunk]
        projection = basis.project(chunk)
        squares = [sum(np.sum(np.square(np.asarray(a, np.float64)), axis=1)
                       for a in block)
                   for block in projection.coefficients]
        squares.append(sum(np.sum(np.square(np.asarray(r, np.float64)),
                                  axis=1) for r in projection.residual))
        totals += np.array([np.sum(np.sqrt(s)) for s in squares])
    return totals / n


def split_l2_budget(total_l2_clip: float,
                    public_projection_norms: Sequence[float]
                    ) -> Tuple[float, ...]:
    """Splits a global l2 budget c over blocks: c2_j proportional to n_j.

    c2_j = c * n_j / ||n||_2, so that sum_j c2_j^2 = c^2: the hybrid set lies
    inside the l2 ball of radius c (the paper allocates "the same global
    l2-norm budget c to different subspaces, depending on the expected norm of
    public gradients projected into each subspace"). ``n`` must come from
    public data (``public_block_norms``) or the user, never from private
    statistics.

    Args:
      total_l2_clip: c > 0.
      public_projection_norms: n_j > 0 per block, residual last.
    """
    c = float(total_l2_clip)
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(
            f'total_l2_clip must be a finite number > 0; got {total_l2_clip}.')
    norms = np.asarray(public_projection_norms, dtype=np.float64)
    if norms.ndim != 1 or norms.size < 1 or not np.all(
            np.isfinite(norms)) or np.any(norms <= 0):
        raise ValueError(
            'public_projection_norms must be finite numbers > 0, one per '
            f'block (a block with no public energy gets no budget: drop it); '
            f'got {public_projection_norms!r}.')
    budgets = c * norms / np.linalg.norm(norms)
    return tuple(float(b) for b in budgets)


def linf_clips_from_d0(l2_norm_clips: Sequence[float],
                       d0: Union[float, Sequence[float]]
                       ) -> Tuple[float, ...]:
    """c_inf_j = c2_j / sqrt(d0_j) for a user-chosen d0 (scalar or per block).

    d0_j = (c2_j / c_inf_j)^2 is how many coordinates the worst-case
    contribution of block j spreads over; d0 <= 1 means no l-infinity effect.
    """
    clips = np.asarray(l2_norm_clips, dtype=np.float64)
    if clips.ndim != 1 or clips.size < 1 or not np.all(
            np.isfinite(clips)) or np.any(clips <= 0):
        raise ValueError(
            'l2_norm_clips must be finite numbers > 0, one per block; got '
            f'{l2_norm_clips!r}.')
    d0 = np.broadcast_to(np.asarray(d0, dtype=np.float64), clips.shape) \
        if np.ndim(d0) == 0 else np.asarray(d0, dtype=np.float64)
    if d0.shape != clips.shape or not np.all(np.isfinite(d0)) or np.any(
            d0 <= 0):
        raise ValueError(
            'd0 must be a finite number > 0 or one per block; got '
            f'{d0!r}.')
    return tuple(float(c) for c in clips / np.sqrt(d0))


def hybrid_noise_multipliers(
        basis: basis_lib.HybridBasis,
        l2_norm_clips: Sequence[float],
        linf_norm_clips: Optional[Sequence[Optional[float]]] = None,
        *,
        target_epsilon: float,
        delta: float,
        steps: int,
        example_sampling_rate: float,
        coordinate_sampling_rate: float,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> Tuple[float, ...]:
    """Per-block noise multipliers z_j for ``basis`` meeting a budget.

    ``accounting.optimize_block_noise`` with ``ranks = basis.
    block_dimensions`` (r_1..r_{m-1} principal coefficients, then d residual
    coordinates): the z_j minimise the total noise variance
    sum_j r_j (z_j c2_j)^2 subject to (target_epsilon, delta) after ``steps``
    steps of the twice-sampled hybrid mechanism. Guarantee: the result
    always meets the budget (checked by the full accountant); pass it as
    ``noise_multiplier`` to DPModel or an optimizer with the same clips.

    Args:
      basis: the basis training will use (only its block dimensions are
        read, so any basis of the same structure gives the same answer).
      l2_norm_clips: c2_j per block (principal blocks, then the residual),
        e.g. from ``split_l2_budget``; never from private statistics.
      linf_norm_clips: None or c_inf_j (or None) per block.
      target_epsilon, delta, steps, example_sampling_rate,
      coordinate_sampling_rate, orders, conversion: as in
        ``optimize_block_noise``.

    Raises:
      ValueError: wrong lengths, bad arguments or an unreachable target.
    """
    if not isinstance(basis, basis_lib.HybridBasis):
        raise ValueError('basis must be a tf_twice HybridBasis; got '
                         f'{type(basis).__name__}.')
    dims = basis.block_dimensions
    clips = list(l2_norm_clips)
    if len(clips) != len(dims):
        raise ValueError(
            f'l2_norm_clips must have one value per block of the basis '
            f'({len(dims)}: principal blocks, then the residual); got '
            f'{len(clips)}.')
    if linf_norm_clips is None:
        linf = [None] * len(dims)
    else:
        linf = list(linf_norm_clips)
        if len(linf) != len(dims):
            raise ValueError(
                f'linf_norm_clips must be None or have one value per block '
                f'({len(dims)}); got {len(linf)}.')
    return accounting.optimize_block_noise(
        target_epsilon=target_epsilon, delta=delta, steps=steps,
        example_sampling_rate=example_sampling_rate,
        coordinate_sampling_rate=coordinate_sampling_rate,
        l2_norm_clips=clips, linf_norm_clips=linf, ranks=dims,
        orders=orders, conversion=conversion)


def plan_blocks(
        config: config_lib.TwiceSamplingConfig,
        basis: basis_lib.HybridBasis,
        public_gradients,
        *,
        target_epsilon: Optional[float] = None,
        delta: Optional[float] = None,
        steps: Optional[int] = None,
        residual_d0: Optional[float] = None,
        principal_d0: float = 1.0,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> config_lib.TwiceSamplingConfig:
    """The hybrid-clipping config for ``basis``, from a one-block config.

    Args:
      config: one Block whose ``l2_norm_clip`` is the global budget c, whose
        ``linf_norm_clip`` (or None) is the residual's l-infinity clip, and
        whose ``noise_multiplier`` is either set (every block gets it) or
        None (per-block noise optimised for ``target_epsilon``); its n, q1
        and q2 are kept.
      basis: the ``HybridBasis`` training will use (learned from public
        data).
      public_gradients: PUBLIC per-example gradients at the current model
        (per-variable arrays [k, *shape] or one [k, d] array), e.g. those the
        basis was learned from.
      target_epsilon, delta, steps: the budget the per-block noise must meet
        after ``steps`` steps; required exactly when the config has no
        noise multiplier.
      residual_d0: c_inf = c2 / sqrt(residual_d0) for the residual, instead
        of the config's ``linf_norm_clip`` (give at most one of them).
      principal_d0: c_inf_j = c2_j / sqrt(min(principal_d0, r_j)) for
        principal block j; 1 means no l-infinity clip there.
      orders, conversion: of the accountant (``optimize_block_noise``).

    Returns:
      The config with one Block per basis block (principal blocks, then the
      residual), their dimensions set to ``basis.block_dimensions``.

    Raises:
      ValueError: a config that is not one block, a missing or superfluous
        budget, bad clips, or a target no noise meets.
    """
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice.TwiceSamplingConfig; got '
                         f'{type(config).__name__}.')
    if not isinstance(basis, basis_lib.HybridBasis):
        raise ValueError('basis must be a tf_twice HybridBasis; got '
                         f'{type(basis).__name__}.')
    if config.num_blocks != 1:
        raise ValueError(
            'config must have one Block (the global l2 budget and the '
            f'residual\'s l-infinity clip); got {config.num_blocks} blocks.')
    template = config.blocks[0]
    if template.dimension is not None:
        raise ValueError('config.blocks[0].dimension must be None: the '
                         'basis sets the blocks\' dimensions.')
    if residual_d0 is not None and template.linf_norm_clip is not None:
        raise ValueError(
            'give the residual\'s l-infinity clip once: residual_d0 or the '
            'config\'s linf_norm_clip, not both.')
    principal_d0 = _validate.positive('principal_d0', principal_d0)
    budget = (target_epsilon, delta, steps)
    if template.noise_multiplier is None and None in budget:
        raise ValueError(
            'the config has no noise multiplier: give target_epsilon, delta '
            'and steps so that the per-block noise can be optimised.')
    if template.noise_multiplier is not None and budget != (None,) * 3:
        raise ValueError(
            'the config already has a noise multiplier: give either it or '
            '(target_epsilon, delta, steps), not both.')

    c = template.l2_norm_clip
    norms = public_block_norms(basis, public_gradients, clip_norm=c)
    norms = np.maximum(norms, MIN_RELATIVE_BLOCK_NORM * float(np.max(norms)))
    l2 = split_l2_budget(c, norms)
    d0s = [min(principal_d0, r) for r in basis.ranks]
    if template.linf_norm_clip is not None:
        d0s.append(max(1.0, (l2[-1] / template.linf_norm_clip)**2))
    else:
        d0s.append(1.0 if residual_d0 is None
                   else _validate.positive('residual_d0', residual_d0))
    linf = linf_clips_from_d0(l2, d0s)
    if template.noise_multiplier is not None:
        noise = (template.noise_multiplier,) * basis.num_blocks
    else:
        noise = hybrid_noise_multipliers(
            basis, l2, linf, target_epsilon=target_epsilon, delta=delta,
            steps=steps, example_sampling_rate=config.example_sampling_rate,
            coordinate_sampling_rate=config.coordinate_sampling_rate,
            orders=orders, conversion=conversion)
    return attr.evolve(config, blocks=tuple(
        config_lib.Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                         noise_multiplier=z, dimension=r)
        for c2, c_inf, z, r in zip(l2, linf, noise, basis.block_dimensions)))

