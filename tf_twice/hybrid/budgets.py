"""Per-block clips and noise for hybrid clipping, from PUBLIC data only.

Hybrid clipping gives each block of a ``HybridBasis`` (principal blocks, then
the residual) its own l2 clip c2_j, l-infinity clip c_inf_j and noise
multiplier z_j. ``plan_blocks`` sets all three from a one-block config (the
global l2 budget c, the residual's l-infinity clip, q1, q2, n), the basis and
public per-example gradients:

* l2: the global budget c is split over blocks with sum_j c2_j^2 = c^2, so
  the hybrid set lies inside the global l2 ball, by one of
  ``BUDGET_SPLITS`` (all read public statistics only,
  ``public_block_statistics``):
  - 'projection_norms' (default): c2_j proportional to n_j, the mean public
    projection norm of block j (``split_l2_budget``; the paper allocates
    "the same global l2-norm budget c to different subspaces, depending on
    the expected norm of public gradients projected into each subspace");
  - 'variance_optimal': the split that minimises the error of the noisy,
    rescaled update against the public mean gradient, with the noise of the
    paper's optimal-noise theorem for hybrid clipping
    (``variance_optimal_l2_budget``);
  - 'quantile': c2_j proportional to a quantile of block j's public
    per-example projection norms (``quantile_l2_budget``);
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

import itertools
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
    'BUDGET_SPLITS',
    'PublicBlockStatistics',
    'hybrid_noise_multipliers',
    'linf_clips_from_d0',
    'plan_blocks',
    'public_block_norms',
    'public_block_statistics',
    'quantile_l2_budget',
    'split_l2_budget',
    'variance_optimal_l2_budget',
]

# A block without public energy would get no l2 budget; it gets this
# fraction of the largest block's public norm instead.
MIN_RELATIVE_BLOCK_NORM = 1e-6

# plan_blocks's ways of splitting the global l2 budget c over blocks.
BUDGET_SPLITS = ('projection_norms', 'variance_optimal', 'quantile')
DEFAULT_BUDGET_SPLIT = 'projection_norms'
DEFAULT_BUDGET_QUANTILE = 0.5
_NOISE_MODELS = ('per_block', 'shared')
# variance_optimal tries every support: 2^m small solves.
_MAX_SEARCHED_BLOCKS = 16


@attr.s(frozen=True)
class PublicBlockStatistics:
    """What the budget splits read of public gradients, per block.

    Blocks are the basis's principal blocks, then the residual (m in all).

    Attributes:
      per_example_norms: [k, m] projection norms ||a_ij|| of every public
        example, after the optional pre-clip of ``public_block_statistics``.
      alignments: [m] w_j = <mu_j, u_j>, with mu_j block j of the mean raw
        public gradient (the paper's "raw gradient mean" v_0) and u_j the
        mean over examples of a_ij / ||a_ij|| (their clipped mean per unit
        clip when every example is clipped).
      direction_energies: [m] v_j = ||u_j||^2.
    """

    per_example_norms: np.ndarray = attr.ib()
    alignments: np.ndarray = attr.ib()
    direction_energies: np.ndarray = attr.ib()

    @property
    def mean_norms(self) -> np.ndarray:
        """n_j: the mean public projection norm of block j, shape [m]."""
        return np.mean(self.per_example_norms, axis=0)


def public_block_statistics(basis: basis_lib.HybridBasis,
                            public_gradients,
                            *,
                            clip_norm: Optional[float] = None,
                            chunk_size: int = 256) -> PublicBlockStatistics:
    """Per-block statistics of PUBLIC gradients under ``basis``.

    Block j's projection of one example is a_j, the concatenation over groups
    of its coefficients (||a_j|| = ||U_j a_j|| for an orthonormal basis); the
    residual's is g - U a. Feed only PUBLIC gradients: the result sets clip
    budgets, and budgets computed from private gradients would leak them.

    Args:
      basis: the basis.
      public_gradients: per-variable arrays [k_pub, *shape_v] or a 2-D array
        [k_pub, d] in natural variable order.
      clip_norm: if given (> 0), each example is first scaled to l2 norm
        <= clip_norm before its norms are taken, as the DP step clips (and so
        that a few large public gradients do not dominate the norms); the
        alignments read the raw gradients (the scaling keeps directions).
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
    norms = []
    raw_sums = None  # Per block, sum_i a_ij (one array per group).
    unit_sums = None  # Per block, sum_i a_ij / ||a_ij||.
    for start in range(0, n, chunk_size):
        chunk = [x[start:start + chunk_size] for x in per_group]
        projection = basis.project(chunk)
        blocks = [[np.asarray(a, np.float64) for a in block]
                  for block in projection.coefficients]
        blocks.append([np.asarray(r, np.float64)
                       for r in projection.residual])
        block_norms = np.stack(
            [np.sqrt(sum(np.sum(np.square(a), axis=1) for a in block))
             for block in blocks], axis=1)
        inverse = np.where(block_norms > 0, 1.0 / np.maximum(
            block_norms, 1e-300), 0.0)
        raw = [[np.sum(a, axis=0) for a in block] for block in blocks]
        unit = [[inverse[:, j] @ a for a in block]
                for j, block in enumerate(blocks)]
        if raw_sums is None:
            raw_sums, unit_sums = raw, unit
        else:
            raw_sums = [[s + x for s, x in zip(b, c)]
                        for b, c in zip(raw_sums, raw)]
            unit_sums = [[s + x for s, x in zip(b, c)]
                         for b, c in zip(unit_sums, unit)]
        if clip_norm is not None:
            # Projection is linear: scaling the example scales its norms.
            total = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64),
                                       axis=1) for x in chunk))
            block_norms *= np.minimum(
                1.0, clip_norm / np.maximum(total, 1e-300))[:, None]
        norms.append(block_norms)
    alignments = np.array([sum(float(np.dot(m, u)) for m, u in zip(mb, ub))
                           for mb, ub in zip(raw_sums, unit_sums)]) / n**2
    energies = np.array([sum(float(np.dot(u, u)) for u in ub)
                         for ub in unit_sums]) / n**2
    return PublicBlockStatistics(np.concatenate(norms, axis=0), alignments,
                                 energies)


def public_block_norms(basis: basis_lib.HybridBasis,
                       public_gradients,
                       *,
                       clip_norm: Optional[float] = None,
                       chunk_size: int = 256) -> np.ndarray:
    """Mean public ||projection onto block j||, residual last: shape [m].

    The ``mean_norms`` of ``public_block_statistics`` (same arguments); they
    set the 'projection_norms' split (``split_l2_budget``).
    """
    return public_block_statistics(basis, public_gradients,
                                   clip_norm=clip_norm,
                                   chunk_size=chunk_size).mean_norms


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


def quantile_l2_budget(total_l2_clip: float,
                       public_per_example_norms,
                       quantile: float = 0.5) -> Tuple[float, ...]:
    """Splits c over blocks: c2_j proportional to a public norm quantile.

    q_j is the ``quantile`` of block j's public per-example projection norms
    (``PublicBlockStatistics.per_example_norms``); c2_j = c * q_j / ||q||_2,
    so sum_j c2_j^2 = c^2. Before the rescaling, a clip of q_j would leave
    that fraction of public examples unclipped in block j; the rescaling
    keeps the proportions, so every block clips its public examples alike.
    A block whose quantile is 0 gets ``MIN_RELATIVE_BLOCK_NORM`` of the
    largest.

    Args:
      total_l2_clip: c > 0.
      public_per_example_norms: [k, m] public norms, one column per block
        (residual last); never private statistics.
      quantile: in (0, 1].
    """
    quantile = _validate.rate('quantile', quantile)
    norms = np.asarray(public_per_example_norms, dtype=np.float64)
    if norms.ndim != 2 or norms.size < 1 or not np.all(
            np.isfinite(norms)) or np.any(norms < 0):
        raise ValueError(
            'public_per_example_norms must be a [k, m] array of finite '
            f'numbers >= 0 (k >= 1 examples, m >= 1 blocks); got shape '
            f'{norms.shape}.')
    levels = np.quantile(norms, quantile, axis=0)
    if not np.max(levels) > 0:
        raise ValueError(f'every block\'s public norm quantile {quantile} is '
                         '0: the public gradients carry no energy.')
    return split_l2_budget(total_l2_clip, _floored(levels))


def variance_optimal_l2_budget(total_l2_clip: float,
                               alignments: Sequence[float],
                               direction_energies: Sequence[float],
                               ranks: Sequence[int],
                               *,
                               noise_std: float,
                               noise: str = 'per_block') -> Tuple[float, ...]:
    """Splits c over blocks to minimise the error of the noisy update.

    Model (public statistics only, ``PublicBlockStatistics``): every public
    example is clipped in every block (the usual small-clip regime), so the
    clipped mean gradient is m = sum_j c2_j u_j; the update is m + e with DP
    noise of total variance N. Measured as in the paper's applications
    section (the cosine between the raw gradient mean v_0 = mu and the
    noisy clipped mean), after the best rescaling k (the learning rate)

      min_k E||k (m + e) - mu||^2 = ||mu||^2 (1 - rho),
      rho = (sum_j c2_j w_j)^2 / (||mu||^2 (sum_j c2_j^2 v_j + N)),

    with w_j = <mu_j, u_j>, v_j = ||u_j||^2. The noise N, per unit update
    noise s = z / (B q2):

    * noise='per_block' (per-block noise optimised for a budget): the
      paper's Theorem "optimal noise for hybrid clipping" (Section
      "Sensitivity Geometry and Optimal Gaussian Noise"): at the privacy of
      one Gaussian of multiplier z, the least total variance is
      E||e||^2 = b_0^2 (sum_l c2_l sqrt(r_l))^2, so N = s^2 (a . c2)^2 with
      a_j = sqrt(r_j);
    * noise='shared' (one z on every block): N = s^2 sum_j r_j c2_j^2.

    rho is invariant to scaling c2, so maximising it is the convex problem
    min c2^T M c2 s.t. w . c2 = 1, c2 >= 0, with M = diag(v) + s^2 a a^T
    ('per_block') or diag(v) + s^2 diag(r) ('shared'); on the optimum's
    support S, c2_S is proportional to M_SS^-1 w_S (for 'per_block', by
    Sherman-Morrison, c2_j proportional to (w_j - beta sqrt(r_j)) / v_j for
    one beta >= 0). Without noise this is c2_j = w_j / v_j, the clip that
    makes block j's clipped mean best match mu_j (about n_j when examples
    agree in direction: the 'projection_norms' split); noise shrinks large
    blocks, and may leave one out (it gets ``MIN_RELATIVE_BLOCK_NORM`` of
    the largest). The result is rescaled to sum_j c2_j^2 = c^2.

    Pure noise variance alone is no criterion: by the same theorem it is
    least with all of c on the smallest block, whatever the gradients.

    Args:
      total_l2_clip: c > 0.
      alignments, direction_energies: w_j and v_j per block (residual last),
        from public gradients.
      ranks: r_j, the dimension of each block (``basis.block_dimensions``).
      noise_std: s = z / (expected_batch_size * q2) >= 0, the update's noise
        standard deviation per unit clip (0: no noise).
      noise: 'per_block' or 'shared', as above.

    Raises:
      ValueError: bad arguments, or no block whose public mean direction
        agrees with the mean gradient (w_j > 0).
    """
    c = _validate.positive('total_l2_clip', total_l2_clip)
    s = _validate.non_negative('noise_std', noise_std)
    if noise not in _NOISE_MODELS:
        raise ValueError(f'noise must be one of {", ".join(_NOISE_MODELS)}; '
                         f'got {noise!r}.')
    w = np.asarray(alignments, dtype=np.float64)
    v = np.asarray(direction_energies, dtype=np.float64)
    r = np.asarray(ranks, dtype=np.float64)
    if w.ndim != 1 or w.size < 1 or not np.all(np.isfinite(w)):
        raise ValueError('alignments must be finite numbers, one per block; '
                         f'got {alignments!r}.')
    if v.shape != w.shape or not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ValueError('direction_energies must be finite numbers > 0, one '
                         f'per block ({w.size}); got {direction_energies!r}.')
    if r.shape != w.shape or np.any(r < 1) or np.any(r != np.round(r)):
        raise ValueError('ranks must be integers >= 1, one per block '
                         f'({w.size}); got {ranks!r}.')
    useful = np.flatnonzero(w > 0)
    if useful.size == 0:
        raise ValueError(
            'no block\'s public mean direction agrees with the public mean '
            'gradient (every alignment <= 0): use another budget split.')
    if useful.size > _MAX_SEARCHED_BLOCKS:
        raise ValueError(
            f'variance_optimal searches at most {_MAX_SEARCHED_BLOCKS} '
            f'blocks; got {useful.size}.')
    a = np.sqrt(r)
    m = np.diag(v) + s**2 * (np.outer(a, a) if noise == 'per_block'
                             else np.diag(r))
    # A block with w_j <= 0 only adds error; the rest: the best support.
    best, best_value = None, -np.inf
    for size in range(1, useful.size + 1):
        for support in itertools.combinations(useful, size):
            support = list(support)
            x = np.linalg.solve(m[np.ix_(support, support)], w[support])
            value = float(np.dot(w[support], x))
            if np.all(x > 0) and value > best_value:
                best, best_value = (support, x), value
    shares = np.zeros(w.size)
    shares[best[0]] = best[1]
    return split_l2_budget(c, _floored(shares))


def _floored(levels: np.ndarray) -> np.ndarray:
    """A block without public signal would get no l2 budget; it gets
    ``MIN_RELATIVE_BLOCK_NORM`` of the largest instead."""
    return np.maximum(levels, MIN_RELATIVE_BLOCK_NORM * float(np.max(levels)))


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


def check_budget_split(budget_split: str,
                       budget_quantile: Optional[float]) -> Optional[float]:
    """Checks plan_blocks's split arguments; returns the quantile to use
    (None unless budget_split='quantile')."""
    if budget_split not in BUDGET_SPLITS:
        raise ValueError(f'budget_split must be one of '
                         f'{", ".join(BUDGET_SPLITS)}; got {budget_split!r}.')
    if budget_split != 'quantile':
        if budget_quantile is not None:
            raise ValueError(
                'budget_quantile applies only to budget_split=\'quantile\'; '
                f'got budget_quantile={budget_quantile!r} with '
                f'budget_split={budget_split!r}.')
        return None
    if budget_quantile is None:
        return DEFAULT_BUDGET_QUANTILE
    return _validate.rate('budget_quantile', budget_quantile)


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
        budget_split: str = DEFAULT_BUDGET_SPLIT,
        budget_quantile: Optional[float] = None,
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
      budget_split: how c is split over blocks, one of ``BUDGET_SPLITS``
        (module docstring), always with sum_j c2_j^2 = c^2.
        'variance_optimal' models the noise as the config's z on every
        block, or, when the noise is optimised per block, by the paper's
        optimal-noise theorem at the z that the one-block config needs for
        the budget.
      budget_quantile: the public norm quantile of budget_split='quantile'
        (default ``DEFAULT_BUDGET_QUANTILE``); only with that split.
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
    budget_quantile = check_budget_split(budget_split, budget_quantile)
    if residual_d0 is not None:
        residual_d0 = _validate.positive('residual_d0', residual_d0)
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
    statistics = public_block_statistics(basis, public_gradients, clip_norm=c)
    if budget_split == 'projection_norms':
        l2 = split_l2_budget(c, _floored(statistics.mean_norms))
    elif budget_split == 'quantile':
        l2 = quantile_l2_budget(c, statistics.per_example_norms,
                                budget_quantile)
    else:
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
        l2 = variance_optimal_l2_budget(
            c, statistics.alignments, statistics.direction_energies,
            basis.block_dimensions, noise=noise_model,
            noise_std=z / (config.expected_batch_size *
                           config.effective_coordinate_sampling_rate))
    d0s = [min(principal_d0, r) for r in basis.ranks]
    if template.linf_norm_clip is not None:
        d0s.append(max(1.0, (l2[-1] / template.linf_norm_clip)**2))
    else:
        d0s.append(1.0 if residual_d0 is None else residual_d0)
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

