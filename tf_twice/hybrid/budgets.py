"""Per-block clips and noise for hybrid clipping, from PUBLIC data only.

Hybrid clipping gives each block of a ``HybridBasis`` (principal blocks, then
the residual) its own l2 clip c2_j, l-infinity clip c_inf_j and noise
multiplier z_j. ``plan_blocks`` sets all three from a one-block config (the
global l2 budget c, the residual's l-infinity clip, q1, q2, n), the basis and
public per-example gradients:

* l2: the global budget c is split over blocks with sum_j c2_j^2 = c^2, so
  the hybrid set lies inside the global l2 ball, by one of
  ``budget_splits.BUDGET_SPLITS`` (the policies and their rationale are in
  ``budget_splits``), from the public statistics of
  ``block_statistics.public_block_statistics``;
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

from tf_twice import _validate
from tf_twice import accounting
from tf_twice import config as config_lib
from tf_twice.accounting import conversion as conversion_lib
from tf_twice.hybrid import block_statistics
from tf_twice.hybrid import budget_splits
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'DEFAULT_PRINCIPAL_COORDINATE_SAMPLING_RATE',
    'NOISE_OBJECTIVES',
    'hybrid_noise_multipliers',
    'linf_clips_from_d0',
    'plan_blocks',
    'replanned_block_scales',
]

# What plan_blocks's per-block noise minimises (its docstring).
NOISE_OBJECTIVES = ('total_variance', 'public_fisher')
# The principal blocks' keep rate plan_blocks gives by default: no masks
# there (its docstring; the paper masks every block at the config's q2).
DEFAULT_PRINCIPAL_COORDINATE_SAMPLING_RATE = 1.0


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
        coordinate_sampling_rate: Union[float, Sequence[float]],
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        variance_weights: Optional[Sequence[float]] = None,
) -> Tuple[float, ...]:
    """Per-block noise multipliers z_j for ``basis`` meeting a budget.

    ``accounting.optimize_block_noise`` with ``ranks = basis.
    block_dimensions`` (r_1..r_{m-1} principal coefficients, then d residual
    coordinates): the z_j minimise the total noise variance
    sum_j r_j (z_j c2_j)^2 (with ``variance_weights`` w_j: sum_j w_j
    (z_j c2_j)^2) subject to (target_epsilon, delta) after ``steps``
    steps of the twice-sampled hybrid mechanism. Guarantee: the result
    always meets the budget (checked by the full accountant); pass it as
    ``noise_multiplier`` to DPModel or an optimizer with the same clips.

    Args:
      basis: the basis training will use (only its block dimensions are
        read, so any basis of the same structure gives the same answer).
      l2_norm_clips: c2_j per block (principal blocks, then the residual),
        e.g. from ``budget_splits.split_l2_budget``; never from private
        statistics.
      linf_norm_clips: None or c_inf_j (or None) per block.
      target_epsilon, delta, steps, example_sampling_rate,
      coordinate_sampling_rate, orders, conversion, variance_weights: as in
        ``optimize_block_noise``.

    Raises:
      ValueError: wrong lengths, bad arguments or an unreachable target.
    """
    _check_basis(basis)
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
        orders=orders, conversion=conversion,
        variance_weights=variance_weights)


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
        principal_coordinate_sampling_rate: float = (
            DEFAULT_PRINCIPAL_COORDINATE_SAMPLING_RATE),
        budget_split: str = budget_splits.DEFAULT_BUDGET_SPLIT,
        budget_quantile: Optional[float] = None,
        noise_objective: str = 'total_variance',
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
      principal_coordinate_sampling_rate: the keep rate of the principal
        blocks' coordinates; the residual keeps the config's q2. The
        default, 1, keeps every principal coefficient (no mask there): masks
        on the few coefficients that carry the gradient cost progress that
        their privacy gain does not buy back (docs/hybrid_clipping.md). The
        config's q2 gives the paper's algorithm, one rate for every block.
        The split and the noise model each block's update noise
        z_j c2_j / (B q2_j).
      budget_split: how c is split over blocks, one of
        ``budget_splits.BUDGET_SPLITS`` (that module's docstring), always
        with sum_j c2_j^2 = c^2.
        'variance_optimal' models the noise as the config's z on every
        block, or, when the noise is optimised per block, by the paper's
        optimal-noise theorem at the z that the one-block config needs for
        the budget.
      budget_quantile: the public norm quantile of budget_split='quantile'
        (default ``budget_splits.DEFAULT_BUDGET_QUANTILE``); only with that
        split.
      noise_objective: what the per-block noise minimises, when it is
        optimised (one of ``NOISE_OBJECTIVES``): 'total_variance' (the
        paper's: sum_j r_j (z_j c2_j)^2) or 'public_fisher' (sum_j e_j
        (z_j c2_j)^2 with e_j the mean squared public projection norm of
        block j, after the pre-clip at c: the trace of block j of the public
        gradients' second moment, an estimate of how much the loss rises
        per unit of noise variance in that block).
      orders, conversion: of the accountant (``optimize_block_noise``).

    Returns:
      The config with one Block per basis block (principal blocks, then the
      residual), their dimensions set to ``basis.block_dimensions``.

    Raises:
      ValueError: a config that is not one block, a missing or superfluous
        budget, bad clips, or a target no noise meets.
    """
    _check_config_and_basis(config, basis)
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
    try:
        principal_rate = config_lib.check_coordinate_sampling_rate(
            principal_coordinate_sampling_rate)
    except ValueError as e:
        raise ValueError(f'principal_coordinate_sampling_rate: {e}') from e
    # The planned blocks' own rates (None: the config's): the template's
    # is the residual's.
    block_rates = ((principal_rate,) * basis.num_principal_blocks
                   + (template.coordinate_sampling_rate,))
    rates = tuple(config.coordinate_sampling_rate if q is None else q
                  for q in block_rates)
    noise_scales = _divisor_ratios(rates)
    budget_quantile = budget_splits.check_budget_split(budget_split,
                                                     budget_quantile)
    if residual_d0 is not None:
        residual_d0 = _validate.positive('residual_d0', residual_d0)
    budget = (target_epsilon, delta, steps)
    if template.noise_multiplier is None and None in budget:
        raise ValueError(
            'the config has no noise multiplier: give target_epsilon, delta '
            'and steps so that the per-block noise can be optimised.')
    if noise_objective not in NOISE_OBJECTIVES:
        raise ValueError(f'noise_objective must be one of '
                         f'{", ".join(NOISE_OBJECTIVES)}; got '
                         f'{noise_objective!r}.')
    if (template.noise_multiplier is not None
            and noise_objective != 'total_variance'):
        raise ValueError('noise_objective applies only when the per-block '
                         'noise is optimised (a config without a noise '
                         'multiplier).')
    if template.noise_multiplier is not None and budget != (None,) * 3:
        raise ValueError(
            'the config already has a noise multiplier: give either it or '
            '(target_epsilon, delta, steps), not both.')

    c = template.l2_norm_clip
    statistics = block_statistics.public_block_statistics(
        basis, public_gradients, clip_norm=c)
    noise_model, noise_std = None, 0.0
    if budget_split == 'variance_optimal':
        if template.noise_multiplier is not None:
            z, noise_model = template.noise_multiplier, 'shared'
        else:
            # The z of the one-block mechanism (the residual's l-infinity
            # clip on the whole vector) for the same budget.
            one_block = template if residual_d0 is None else attr.evolve(
                template, linf_norm_clip=c / math.sqrt(residual_d0))
            calibrated = attr.evolve(config, blocks=(one_block,)).calibrate(
                target_epsilon=target_epsilon, delta=delta, steps=steps,
                orders=orders, conversion=conversion)
            z, noise_model = calibrated.noise_multipliers[0], 'per_block'
        # The update is divided by B q2 (config.TwiceSamplingConfig).
        noise_std = z / (config.expected_batch_size *
                         config_lib.effective_coordinate_sampling_rate(
                             rates[-1]))
    l2 = _split_budget(c, statistics, basis, budget_split, budget_quantile,
                       noise_model=noise_model, noise_std=noise_std,
                       noise_scales=noise_scales)
    d0s = [min(principal_d0, r) for r in basis.ranks]
    if template.linf_norm_clip is not None:
        d0s.append(max(1.0, (l2[-1] / template.linf_norm_clip)**2))
    else:
        d0s.append(1.0 if residual_d0 is None else residual_d0)
    linf = linf_clips_from_d0(l2, d0s)
    if template.noise_multiplier is not None:
        noise = (template.noise_multiplier,) * basis.num_blocks
    else:
        weights = (np.asarray(basis.block_dimensions, dtype=np.float64)
                   if noise_objective == 'total_variance'
                   else budget_splits.floored(np.mean(
                       statistics.per_example_norms ** 2, axis=0)))
        noise = hybrid_noise_multipliers(
            basis, l2, linf, target_epsilon=target_epsilon, delta=delta,
            steps=steps, example_sampling_rate=config.example_sampling_rate,
            coordinate_sampling_rate=rates, orders=orders,
            conversion=conversion, variance_weights=(
                None if noise_objective == 'total_variance'
                and np.all(noise_scales == 1) else weights * noise_scales**2))
    return attr.evolve(config, blocks=tuple(
        config_lib.Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                         noise_multiplier=z, dimension=r,
                         coordinate_sampling_rate=q2)
        for c2, c_inf, z, r, q2 in zip(l2, linf, noise,
                                       basis.block_dimensions, block_rates)))


def _check_basis(basis) -> None:
    if not isinstance(basis, basis_lib.HybridBasis):
        raise ValueError('basis must be a tf_twice HybridBasis; got '
                         f'{type(basis).__name__}.')


def _check_config_and_basis(config, basis) -> None:
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice.TwiceSamplingConfig; got '
                         f'{type(config).__name__}.')
    _check_basis(basis)


def _divisor_ratios(rates: Sequence[float]) -> np.ndarray:
    """Block j's update noise relative to the residual's at the same z and
    clip: its sum is divided by B q2_j (the effective rates), the residual's
    by B q2_residual."""
    q2 = np.array([config_lib.effective_coordinate_sampling_rate(q)
                   for q in rates])
    return q2[-1] / q2


def _split_budget(c: float, statistics, basis: basis_lib.HybridBasis,
                  budget_split: str, budget_quantile: Optional[float], *,
                  noise_model: Optional[str], noise_std: float,
                  noise_scales: np.ndarray) -> Tuple[float, ...]:
    """c split over the blocks by ``budget_split`` (``plan_blocks``)."""
    if budget_split == 'projection_norms':
        return budget_splits.split_l2_budget(
            c, budget_splits.floored(statistics.mean_norms))
    if budget_split == 'quantile':
        return budget_splits.quantile_l2_budget(
            c, statistics.per_example_norms, budget_quantile)
    return budget_splits.variance_optimal_l2_budget(
        c, statistics.alignments, statistics.direction_energies,
        basis.block_dimensions, noise=noise_model, noise_std=noise_std,
        noise_scales=noise_scales)


def replanned_block_scales(
        config: config_lib.TwiceSamplingConfig,
        basis: basis_lib.HybridBasis,
        public_gradients,
        *,
        budget_split: str = budget_splits.DEFAULT_BUDGET_SPLIT,
        budget_quantile: Optional[float] = None) -> Tuple[float, ...]:
    """Block scales s_j that re-split a planned config's l2 budget from
    PUBLIC gradients at the current model, at the same epsilon.

    The clips s_j c2_j split the same total c = sqrt(sum_j c2_j^2) by
    ``budget_split`` (as ``plan_blocks`` does, from the statistics of
    ``public_gradients``; 'variance_optimal' models the config's own z_j,
    fixed, and splits by the projection norms where no block's public mean
    agrees with the mean gradient). Every block keeps its noise multiplier z_j and d0_j = (c2_j /
    c_inf_j)^2: the mechanism scales block j's l2 and l-infinity clips and
    its noise by s_j (``BasisHolder.set_basis(basis, block_scales=...)``),
    which is post-processing of the config's own event
    (``tf_twice.mechanism.hybrid.split_into_blocks``), so the ledger's
    epsilon does not change. A block's RDP depends on z_j, d0_j, its rate
    and dimension only, not on the scale of c2_j.

    Args:
      config: the hybrid config training runs (one Block per basis block,
        noise multipliers set), e.g. from ``plan_blocks``.
      basis: the basis the next steps use (learned from public data).
      public_gradients: PUBLIC per-example gradients at the current model,
        as in ``plan_blocks``.
      budget_split, budget_quantile: as in ``plan_blocks``.

    Returns:
      s_j > 0 per block (principal blocks, then the residual).

    Raises:
      ValueError: a config without one block per basis block or without
        noise multipliers, or bad split arguments (named).
    """
    _check_config_and_basis(config, basis)
    if config.num_blocks != basis.num_blocks or not config.is_calibrated:
        raise ValueError(
            f'config must have one Block per basis block ({basis.num_blocks})'
            ' and its noise multipliers (plan_blocks\'s result); got '
            f'{config.num_blocks} blocks, noise multipliers '
            f'{config.noise_multipliers}.')
    budget_quantile = budget_splits.check_budget_split(budget_split,
                                                     budget_quantile)
    clips = np.asarray(config.l2_norm_clips, dtype=np.float64)
    c = float(np.sqrt(np.sum(clips ** 2)))
    statistics = block_statistics.public_block_statistics(
        basis, public_gradients, clip_norm=c)
    # Block j's update noise std per unit clip, z_j / (B q2_j), relative to
    # the residual's.
    z = np.asarray(config.noise_multipliers, dtype=np.float64)
    noise_std = z[-1] / (config.expected_batch_size *
                         config_lib.effective_coordinate_sampling_rate(
                             config.coordinate_sampling_rates[-1]))
    noise_scales = (z / z[-1]) * _divisor_ratios(
        config.coordinate_sampling_rates)
    if budget_split == 'variance_optimal' and not np.any(
            np.asarray(statistics.alignments) > 0):
        # No public signal to split by (e.g. near a minimum): a refresh must
        # not stop training, so the projection norms split it.
        budget_split = 'projection_norms'
    l2 = _split_budget(c, statistics, basis, budget_split, budget_quantile,
                       noise_model='shared', noise_std=noise_std,
                       noise_scales=noise_scales)
    return tuple(float(s) for s in np.asarray(l2) / clips)
