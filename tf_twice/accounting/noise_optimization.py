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
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize

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
    z_eff = blocks_lib.check_positive('effective_noise_multiplier',
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
        coordinate_sampling_rate: float,
        l2_norm_clips: Sequence[float],
        linf_norm_clips: Sequence[Optional[float]],
        ranks: Sequence[int],
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> Tuple[float, ...]:
    """Per-block noise multipliers minimising sum_j r_j (z_j c2_j)^2.

    Solves [NOISE-OPT]: minimise the total noise variance subject to the
    (epsilon, delta) budget after `steps` twice-sampled steps with hybrid
    clipping. Guarantee: the returned z always meets the budget, as checked
    by the full accountant (all orders, the chosen conversion); the
    optimisation itself is numerical, so optimality is approximate.

    Method: the budget is min over orders alpha of
    conversion(alpha, steps * rdp_alpha(z)); for one alpha the constraint is
    smooth, so SLSQP in log z is run at the orders near the optimal order of
    the best single-shape start (uniform z or the [HYBRID-OPT] shape), and the
    best solution after a final feasibility check wins.

    Args:
      ranks: r_j, the number of coordinates of each block (also used to
        tighten the worst case of blocks with r_j < (c2_j/c_inf_j)^2).
      Other arguments as in `calibrate_noise_multiplier`, one per block.

    Raises:
      ValueError: on bad arguments or an unreachable target.
    """
    target_epsilon = calibration.check_target_epsilon(target_epsilon)
    steps = blocks_lib.check_steps('steps', steps)
    delta = blocks_lib.check_delta(delta)
    q1 = blocks_lib.check_rate('example_sampling_rate', example_sampling_rate)
    q2 = blocks_lib.check_rate('coordinate_sampling_rate',
                               coordinate_sampling_rate)
    orders_array = rdp_lib.check_orders(
        calibration.DEFAULT_ORDERS if orders is None else orders)
    conversion = conversion_lib.as_conversion(conversion)
    template = blocks_lib.Blocks.from_arguments(
        1.0, l2_norm_clips, linf_norm_clips, ranks,
        l2_norm_clip_name='l2_norm_clips',
        linf_norm_clip_name='linf_norm_clips', block_dimensions_name='ranks')
    if template.dimensions is None:
        raise ValueError('ranks must be given, one positive integer per '
                         'block.')
    c2 = np.array(template.l2_norm_clips)
    weights = np.array(template.dimensions, dtype=np.float64) * c2 ** 2

    def with_noise(z) -> blocks_lib.Blocks:
        return blocks_lib.Blocks(tuple(float(x) for x in z),
                                 template.l2_norm_clips,
                                 template.linf_norm_clips, template.dimensions)

    def epsilon(z) -> Tuple[float, float]:
        return calibration.epsilon_of_blocks(
            with_noise(z), steps=steps, delta=delta, example_sampling_rate=q1,
            coordinate_sampling_rate=q2, orders=orders_array,
            conversion=conversion)

    def total_variance(z) -> float:
        return float(np.sum(weights * np.asarray(z) ** 2))

    def feasible_scaling(shape: np.ndarray, lower: float) -> np.ndarray:
        """Smallest multiple t * shape (t >= lower) meeting the budget."""
        upper = calibration.MAX_NOISE_MULTIPLIER / float(np.min(shape))
        t = calibration.smallest_scale_meeting(
            lambda t: epsilon(t * shape)[0], target_epsilon,
            lower=min(lower, upper), upper=upper,
            tolerance=1e-4, scale_name='the noise scale')
        return t * shape

    closed_form = np.array(hybrid_clipping_noise_multipliers(
        l2_norm_clips=template.l2_norm_clips, ranks=template.dimensions,
        effective_noise_multiplier=1.0))
    lowest = calibration.MIN_NOISE_MULTIPLIER / float(np.max(closed_form))
    candidates: List[np.ndarray] = [
        feasible_scaling(shape, lowest)
        for shape in (np.ones(template.size), closed_form)]
    start = min(candidates, key=total_variance)
    _, start_order = epsilon(start)

    for order in _orders_near(orders_array, start_order):
        solution = _solve_at_order(
            order, start, weights, target_epsilon, steps, delta, q1, q2,
            with_noise, conversion)
        if solution is None:
            continue
        # Repair any slack SLSQP left in the constraint, against all orders.
        if epsilon(solution)[0] > target_epsilon:
            solution = feasible_scaling(solution, 1.0)
        candidates.append(solution)

    best = min(candidates, key=total_variance)
    if epsilon(best)[0] > target_epsilon:  # Unreachable by construction.
        raise AssertionError('noise optimisation produced an infeasible '
                             'result')
    return tuple(float(z) for z in best)


def _orders_near(orders: np.ndarray, center: float,
                 max_count: int = 8) -> List[int]:
    """Distinct integer orders (ceil of `orders`) within a factor 2 of center.

    At integer orders the RDP is exact; the optimum of a fractional order
    equals that of its ceiling.
    """
    integers = np.unique(np.ceil(orders - 1e-12).astype(np.int64))
    near = integers[(integers >= center / 2) & (integers <= center * 2)]
    if near.size > max_count:
        near = near[np.unique(np.round(
            np.geomspace(1, near.size, max_count)).astype(int) - 1)]
    return [int(a) for a in near] or [int(np.ceil(center))]


def _solve_at_order(order, start, weights, target_epsilon, steps, delta, q1,
                    q2, with_noise, conversion) -> Optional[np.ndarray]:
    """SLSQP for min sum w_j z_j^2 s.t. conversion(order, steps*rdp) <= eps.

    The conversion is affine in the RDP with unit slope, so the budget on the
    per-step RDP at this order is (target - offset(order)) / steps.
    """
    big = 10.0
    offset = conversion_lib.rdp_to_epsilon([order], [big], delta,
                                           conversion)[0] - big
    rdp_budget = (target_epsilon - offset) / steps
    if rdp_budget <= 0:
        return None
    order_array = np.array([float(order)])
    scale = float(np.sum(weights * start ** 2))

    def objective(u):
        return float(np.sum(weights * np.exp(2 * u))) / scale

    def slack(u):
        rdp = rdp_lib.rdp_of_blocks(order_array, q1, q2,
                                    with_noise(np.exp(u)))[0]
        return 1.0 - rdp / rdp_budget

    bounds = [(math.log(calibration.MIN_NOISE_MULTIPLIER),
               math.log(calibration.MAX_NOISE_MULTIPLIER))] * len(start)
    result = optimize.minimize(
        objective, np.log(start), method='SLSQP', bounds=bounds,
        constraints=[{'type': 'ineq', 'fun': slack}],
        options={'ftol': 1e-12, 'maxiter': 200})
    if not np.all(np.isfinite(result.x)):
        return None
    return np.exp(result.x)
