"""Per-block noise for hybrid clipping: the closed form and the optimiser.

[HYBRID-OPT] ("optimal noise for hybrid clipping", no sampling, no
l-infinity clip): with blocks of rank r_j clipped to l2 <= c2_j, the noise
minimising the total variance sum_j r_j sigma_j^2 for a Gaussian RDP budget
has sigma_j^2 proportional to c2_j / sqrt(r_j).

[NOISE-OPT] ("Noise Optimization for Hybrid Clipping and Twice Sampling"):
with sampling rates (q1, q2) and l-infinity clips there is no closed form;
`optimize_block_noise` solves it numerically.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib
from tf_twice.accounting import calibration
from tf_twice.accounting import conversion as conversion_lib
from tf_twice.accounting import rdp as rdp_lib


def hybrid_clipping_noise_multipliers(
        *, l2_norm_clips: Sequence[float], ranks: Sequence[int],
        effective_noise_multiplier: float) -> Tuple[float, ...]:
    """[HYBRID-OPT]'s optimal per-block noise multipliers (closed form).

    sigma_j^2 = z_eff^2 * (sum_l c2_l sqrt(r_l)) * c2_j / sqrt(r_j), i.e.
    sigma_j^2 proportional to c2_j / sqrt(r_j), scaled so that
    sum_j c2_j^2 / sigma_j^2 = 1 / z_eff^2: the Gaussian mechanism on the
    hybrid sensitivity set then has exactly the RDP (and (epsilon, delta)) of
    a single Gaussian with noise multiplier z_eff, at the smallest total
    variance sum_j r_j sigma_j^2 = z_eff^2 (sum_j c2_j sqrt(r_j))^2.

    Returns:
      z_j = sigma_j / c2_j for every block.
    """
    z_eff = _validate.positive('effective_noise_multiplier',
                               effective_noise_multiplier)
    blocks = blocks_lib.Blocks.from_arguments(
        1.0, l2_norm_clips, None, ranks, l2_norm_clip_name='l2_norm_clips',
        block_dimensions_name='ranks')
    c2 = np.array(blocks.l2_norm_clips)
    r = np.array(blocks.dimensions, dtype=np.float64)
    variances = z_eff ** 2 * np.sum(c2 * np.sqrt(r)) * c2 / np.sqrt(r)
    return tuple(float(z) for z in np.sqrt(variances) / c2)


def optimize_block_noise(
        *,
        target_epsilon: float,
        delta: float,
        steps: int,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        l2_norm_clips: Sequence[float],
        linf_norm_clips: Sequence[Optional[float]],
        ranks: Sequence[int],
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        variance_weights: Optional[Sequence[float]] = None,
) -> Tuple[float, ...]:
    """Per-block noise multipliers minimising sum_j w_j (z_j c2_j)^2.

    With the default weights w_j = r_j the objective is the total noise
    variance of the update; other weights trade the blocks' noise
    differently (e.g. a public estimate of the loss curvature per block).

    Solves [NOISE-OPT]: minimise the total noise variance subject to the
    (epsilon, delta) budget after `steps` twice-sampled steps with hybrid
    clipping. Guarantee: the returned z always meets the budget, as checked
    by the full accountant (all orders, the chosen conversion); the
    optimisation itself is numerical, so optimality is approximate.

    Method: the budget is min over orders alpha of
    conversion(alpha, steps * rdp_alpha(z)); for one alpha the constraint is
    smooth, so SLSQP in log z, with the analytic gradient of rdp_alpha, is
    run at the orders near the optimal order of the best single-shape start
    (uniform z or the [HYBRID-OPT] shape). Every candidate is made to meet the
    budget at the leading orders (a sound bound on all orders, see
    `calibration.EpsilonOfBlocks`); the one of least variance wins and is
    then scaled to be tight against all orders.

    Args:
      ranks: r_j, the number of coordinates of each block (also used to
        tighten the worst case of blocks with r_j < (c2_j/c_inf_j)^2).
      variance_weights: None (w_j = r_j) or one finite w_j > 0 per block.
        Privacy never depends on them: every candidate is checked against
        the budget.
      Other arguments as in `calibrate_noise_multiplier`, one per block.

    Raises:
      ValueError: on bad arguments or an unreachable target.
    """
    target_epsilon = calibration.check_target_epsilon(target_epsilon)
    epsilon_function = calibration.checked_epsilon_function(
        steps=steps, delta=delta, example_sampling_rate=example_sampling_rate,
        orders=orders, conversion=conversion)
    template = blocks_lib.Blocks.from_arguments(
        1.0, l2_norm_clips, linf_norm_clips, ranks, coordinate_sampling_rate,
        l2_norm_clip_name='l2_norm_clips',
        linf_norm_clip_name='linf_norm_clips', block_dimensions_name='ranks')
    if template.dimensions is None:
        raise ValueError('ranks must be given, one positive integer per '
                         'block.')
    c2 = np.array(template.l2_norm_clips)
    weighted_by_ranks = variance_weights is None
    if weighted_by_ranks:
        variance_weights = template.dimensions
    elif len(variance_weights) != template.size:
        raise ValueError(
            f'variance_weights must have one value per block ({template.size}'
            f'); got {len(variance_weights)}.')
    weights = np.array([
        _validate.positive(f'variance_weights[{j}]', w)
        for j, w in enumerate(variance_weights)]) * c2 ** 2

    with_noise = template.with_noise_multipliers

    def objective(z) -> float:  # sum_j w_j (z_j c2_j)^2
        return float(np.sum(weights * np.asarray(z) ** 2))

    def feasible_scaling(shape: np.ndarray, lower: float,
                         exact: bool = False) -> np.ndarray:
        """Smallest multiple t * shape (t >= lower) meeting the budget.

        Searched on the leading orders (sound, see EpsilonOfBlocks); with
        `exact`, also tight against all orders.
        """
        upper = calibration.MAX_NOISE_MULTIPLIER / float(np.min(shape))
        lower = min(lower, upper)
        t = calibration.smallest_scale_meeting(
            lambda t: epsilon_function.leading_epsilon(with_noise(t * shape)),
            target_epsilon, lower=lower, upper=upper, tolerance=1e-4,
            scale_name='the noise scale', start=max(lower, 1.0),
            exact_epsilon_of_scale=(
                (lambda t: epsilon_function.epsilon(with_noise(t * shape)))
                if exact else None))
        return t * shape

    closed_form = np.array(hybrid_clipping_noise_multipliers(
        l2_norm_clips=template.l2_norm_clips, ranks=template.dimensions,
        effective_noise_multiplier=1.0))
    lowest = calibration.MIN_NOISE_MULTIPLIER / float(np.max(closed_form))
    # Starts: one z for all blocks and [HYBRID-OPT]'s shape (optimal for the
    # total variance in its model); for other weights also one noise std
    # z_j c2_j for all blocks.
    shapes = [np.ones(template.size), closed_form]
    if not weighted_by_ranks:
        shapes.append(float(np.max(c2)) / c2)
    candidates: List[np.ndarray] = [
        feasible_scaling(shape, lowest) for shape in shapes]
    start = min(candidates, key=objective)
    _, start_order = epsilon_function.leading_epsilon_and_optimal_order(
        with_noise(start))

    for order in _orders_near(epsilon_function.orders, start_order):
        solution = _solve_at_order(
            order, start, weights, target_epsilon, epsilon_function,
            with_noise)
        if solution is None:
            continue
        # Repair any slack SLSQP left in the constraint, against the leading
        # orders (a sound bound on all of them).
        if epsilon_function.leading_epsilon(with_noise(solution)) > (
                target_epsilon):
            solution = feasible_scaling(solution, 1.0)
        candidates.append(solution)

    best = min(candidates, key=objective)
    # Every candidate meets the budget; all orders may allow a little less
    # noise than the leading ones, so the winner is made tight against them.
    best = feasible_scaling(
        best, calibration.MIN_NOISE_MULTIPLIER / float(np.max(best)),
        exact=True)
    if epsilon_function.epsilon(with_noise(best)) > target_epsilon:
        raise AssertionError('noise optimisation produced an infeasible '
                             'result')  # Unreachable by construction.
    return tuple(float(z) for z in best)


def _orders_near(orders: np.ndarray, center: float,
                 max_count: int = 8) -> List[int]:
    """Distinct integer orders (ceil of `orders`) within a factor 2 of center.

    At integer orders the RDP is exact; the optimum of a fractional order
    equals that of its ceiling.
    """
    integers = np.unique(rdp_lib.integer_order_ceilings(orders))
    near = integers[(integers >= center / 2) & (integers <= center * 2)]
    if near.size > max_count:
        near = near[np.unique(np.round(
            np.geomspace(1, near.size, max_count)).astype(int) - 1)]
    return [int(a) for a in near] or [int(np.ceil(center))]


def _solve_at_order(order: int, start: np.ndarray, weights: np.ndarray,
                    target_epsilon: float,
                    epsilon_function: calibration.EpsilonOfBlocks,
                    with_noise: Callable[[np.ndarray], blocks_lib.Blocks]
                    ) -> Optional[np.ndarray]:
    """SLSQP for min sum w_j z_j^2 s.t. conversion(order, steps*rdp) <= eps.

    The conversion is affine in the RDP with unit slope, so the budget on the
    per-step RDP at this order is (target - offset(order)) / steps. Works in
    u = log z with the analytic gradient of the RDP
    (`rdp.rdp_and_noise_gradient`).
    """
    rdp_budget = epsilon_function.rdp_budget(order, target_epsilon)
    if rdp_budget <= 0:
        return None
    scale = float(np.sum(weights * start ** 2))

    def objective(u: np.ndarray) -> Tuple[float, np.ndarray]:
        terms = weights * np.exp(2.0 * u) / scale
        return float(np.sum(terms)), 2.0 * terms

    last: Dict[bytes, Tuple[float, np.ndarray]] = {}

    def rdp_and_gradient(u: np.ndarray) -> Tuple[float, np.ndarray]:
        key = u.tobytes()
        if key not in last:  # SLSQP asks for the value, then the gradient.
            last.clear()
            last[key] = epsilon_function.rdp_and_noise_gradient(
                order, with_noise(np.exp(u)))
        return last[key]

    bounds = [(math.log(calibration.MIN_NOISE_MULTIPLIER),
               math.log(calibration.MAX_NOISE_MULTIPLIER))] * len(start)
    result = optimize.minimize(
        objective, np.log(start), jac=True, method='SLSQP', bounds=bounds,
        constraints=[{
            'type': 'ineq',
            'fun': lambda u: 1.0 - rdp_and_gradient(u)[0] / rdp_budget,
            'jac': lambda u: -rdp_and_gradient(u)[1] / rdp_budget}],
        options={'ftol': 1e-12, 'maxiter': 200})
    if not np.all(np.isfinite(result.x)):
        return None
    return np.exp(result.x)
