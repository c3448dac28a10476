"""The policies that split the global l2 budget c over hybrid blocks.

Hybrid clipping gives each block j of a ``HybridBasis`` (principal blocks,
then the residual) its own l2 clip c2_j. Every policy here keeps
sum_j c2_j^2 = c^2, so the hybrid set lies inside the global l2 ball, and
reads public statistics only (``block_statistics.public_block_statistics``).
``budgets.plan_blocks`` picks one of ``BUDGET_SPLITS``:

* 'projection_norms' (default): c2_j proportional to n_j, the mean public
  projection norm of block j (``split_l2_budget``; the paper allocates "the
  same global l2-norm budget c to different subspaces, depending on the
  expected norm of public gradients projected into each subspace");
* 'variance_optimal': the split that minimises the error of the noisy,
  rescaled update against the public mean gradient, with the noise of the
  paper's optimal-noise theorem for hybrid clipping
  (``variance_optimal_l2_budget``);
* 'quantile': c2_j proportional to a quantile of block j's public
  per-example projection norms (``quantile_l2_budget``).

Privacy: budgets computed from private statistics would leak them; feed
public statistics (or user constants) only.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence, Tuple

import numpy as np

from tf_twice import _validate

__all__ = [
    'BUDGET_SPLITS',
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


def split_l2_budget(total_l2_clip: float,
                    public_projection_norms: Sequence[float]
                    ) -> Tuple[float, ...]:
    """Splits a global l2 budget c over blocks: c2_j proportional to n_j.

    c2_j = c * n_j / ||n||_2, so that sum_j c2_j^2 = c^2: the hybrid set lies
    inside the l2 ball of radius c (the paper allocates "the same global
    l2-norm budget c to different subspaces, depending on the expected norm of
    public gradients projected into each subspace"). ``n`` must come from
    public data (``block_statistics.public_block_norms``) or the user, never
    from private statistics.

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
    (``block_statistics.PublicBlockStatistics.per_example_norms``);
    c2_j = c * q_j / ||q||_2, so sum_j c2_j^2 = c^2. Before the rescaling, a
    clip of q_j would leave that fraction of public examples unclipped in
    block j; the rescaling keeps the proportions, so every block clips its
    public examples alike. A block whose quantile is 0 gets
    ``MIN_RELATIVE_BLOCK_NORM`` of the largest.

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
    return split_l2_budget(total_l2_clip, floored(levels))


def variance_optimal_l2_budget(total_l2_clip: float,
                               alignments: Sequence[float],
                               direction_energies: Sequence[float],
                               ranks: Sequence[int],
                               *,
                               noise_std: float,
                               noise: str = 'per_block',
                               noise_scales: Optional[Sequence[float]] = None
                               ) -> Tuple[float, ...]:
    """Splits c over blocks to minimise the error of the noisy update.

    Model (public statistics only, ``block_statistics.PublicBlockStatistics``):
    every public example is clipped in every block (the usual small-clip
    regime), so the clipped mean gradient is m = sum_j c2_j u_j; the update
    is m + e with DP noise of total variance N. Measured as in the paper's
    applications section (the cosine between the raw gradient mean
    v_0 = mu and the noisy clipped mean), after the best rescaling k (the
    learning rate)

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
      noise_scales: f_j > 0 per block, block j's update noise relative to
        ``noise_std`` (q2 / q2_j where block j keeps its coordinates at a
        rate of its own, its sum being divided by B q2_j); default all 1.
        The model then has a_j = f_j sqrt(r_j) ('per_block') or diag(f_j^2
        r_j) ('shared').

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
    f = np.ones_like(w) if noise_scales is None else np.asarray(
        noise_scales, dtype=np.float64)
    if f.shape != w.shape or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise ValueError('noise_scales must be finite numbers > 0, one per '
                         f'block ({w.size}); got {noise_scales!r}.')
    a = f * np.sqrt(r)
    m = np.diag(v) + s**2 * (np.outer(a, a) if noise == 'per_block'
                             else np.diag(a * a))
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
    return split_l2_budget(c, floored(shares))


def floored(levels: np.ndarray) -> np.ndarray:
    """A block without public signal would get no l2 budget; it gets
    ``MIN_RELATIVE_BLOCK_NORM`` of the largest instead."""
    return np.maximum(levels, MIN_RELATIVE_BLOCK_NORM * float(np.max(levels)))


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


