"""Epsilon after T steps, and the smallest noise that meets a budget."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib
from tf_twice.accounting import conversion as conversion_lib
from tf_twice.accounting import rdp as rdp_lib

# Calibration searches noise multipliers in [MIN_NOISE_MULTIPLIER,
# MAX_NOISE_MULTIPLIER]; a budget that needs more noise is refused.
MIN_NOISE_MULTIPLIER = 1e-2
MAX_NOISE_MULTIPLIER = 1e4
# The achieved epsilon is within [1 - DEFAULT_TOLERANCE, 1] * target.
DEFAULT_TOLERANCE = 0.01

DEFAULT_ORDERS = tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

# Searches start from the integer orders up to this one (and the fractional
# orders below them): an order alpha costs an (alpha+1)^2 table.
_LEADING_ORDER_CAP = 64


class EpsilonOfBlocks:
    """Epsilon after `steps` identical twice-sampled steps, per block setting.

    `epsilon[_and_optimal_order]` converts the RDP at all `orders`.
    `leading_epsilon[_and_optimal_order]` converts only the leading orders
    (integer ceiling <= a cap) and is much cheaper. It is a sound bound too:
    every order's RDP gives a valid (epsilon, delta) conversion, so the
    minimum over some orders is >= the minimum over all of them and both
    bound the true epsilon. A search may therefore run on the leading orders
    and stay sound; only its tightness needs all orders. The cap doubles
    while the optimal order is the largest one included, and never shrinks,
    so the leading orders follow the optimum of the settings searched.
    """

    def __init__(self, *, steps: int, delta: float,
                 example_sampling_rate: float, orders: np.ndarray,
                 conversion: conversion_lib.Conversion):
        """All arguments already validated."""
        self._steps = steps
        self._delta = delta
        self._q1 = example_sampling_rate
        self._orders = orders
        self._conversion = conversion
        self._ceilings = rdp_lib.integer_order_ceilings(orders).astype(
            np.float64)
        self._cap = max(_LEADING_ORDER_CAP, float(self._ceilings.min()))
        # The last result at all orders: searches ask for it twice.
        self._last: Tuple[Optional[blocks_lib.Blocks], Tuple[float, float]] = (
            None, (math.nan, math.nan))

    def epsilon_and_optimal_order(
            self, blocks: blocks_lib.Blocks,
            orders: Optional[np.ndarray] = None) -> Tuple[float, float]:
        """(epsilon, optimal order) at `orders` (default: all)."""
        if orders is None:
            if self._last[0] != blocks:
                self._last = (blocks,
                              self.epsilon_and_optimal_order(blocks,
                                                             self._orders))
            return self._last[1]
        rdp = rdp_lib.rdp_of_blocks(orders, self._q1, blocks)
        return conversion_lib.rdp_to_epsilon(orders, self._steps * rdp,
                                             self._delta, self._conversion)

    def epsilon(self, blocks: blocks_lib.Blocks) -> float:
        return self.epsilon_and_optimal_order(blocks)[0]

    @property
    def orders(self) -> np.ndarray:
        return self._orders

    def rdp_budget(self, order: float, target_epsilon: float) -> float:
        """The largest one-step RDP at `order` whose conversion after `steps`
        steps is <= target_epsilon (may be <= 0: none is).

        Both conversions are affine in the RDP with unit slope.
        """
        big = 10.0
        offset = conversion_lib.rdp_to_epsilon(
            [order], [big], self._delta, self._conversion)[0] - big
        return (target_epsilon - offset) / self._steps

    def rdp_and_noise_gradient(self, order: int, blocks: blocks_lib.Blocks
                               ) -> Tuple[float, np.ndarray]:
        """One-step RDP at an integer order and its gradient in log z_j."""
        return rdp_lib.rdp_and_noise_gradient(order, self._q1, blocks)

    def leading_epsilon_and_optimal_order(
            self, blocks: blocks_lib.Blocks) -> Tuple[float, float]:
        """(epsilon, optimal order) at the leading orders; >= all orders'."""
        while True:
            leading = self._orders[self._ceilings <= self._cap]
            eps, order = self.epsilon_and_optimal_order(blocks, leading)
            largest = float(self._ceilings[self._ceilings <= self._cap].max())
            if (math.ceil(order) < largest
                    or largest == self._ceilings.max()):
                return eps, order
            self._cap *= 2.0

    def leading_epsilon(self, blocks: blocks_lib.Blocks) -> float:
        return self.leading_epsilon_and_optimal_order(blocks)[0]


def checked_epsilon_function(
        *, steps: int, delta: float, example_sampling_rate: float,
        orders: Optional[Sequence[float]],
        conversion: conversion_lib.ConversionLike) -> EpsilonOfBlocks:
    """Validates the setting shared by every block configuration (the
    blocks, rates included, are each `Blocks`'s own)."""
    return EpsilonOfBlocks(
        steps=_validate.integer('steps', steps, 1),
        delta=_validate.probability('delta', delta),
        example_sampling_rate=_validate.rate('example_sampling_rate',
                                             example_sampling_rate),
        orders=rdp_lib.check_orders(DEFAULT_ORDERS if orders is None
                                    else orders),
        conversion=conversion_lib.as_conversion(conversion))


def epsilon_and_optimal_order_after_steps(
        *,
        steps: int,
        delta: float,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> Tuple[float, float]:
    """(epsilon, optimal RDP order) of `steps` twice-sampled steps at delta.

    Equal to composing `steps` TwiceSampledGaussianDpEvents in a
    TwiceSamplingRdpAccountant with the same orders and calling its
    `get_epsilon_and_optimal_order`. `linf_norm_clip=None` (the default) is
    plain l2 clipping; with `coordinate_sampling_rate=1` too this is DP-SGD
    with Poisson sampling.
    """
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multiplier, l2_norm_clip, linf_norm_clip, block_dimensions,
        coordinate_sampling_rate)
    return checked_epsilon_function(
        steps=steps, delta=delta, example_sampling_rate=example_sampling_rate,
        orders=orders, conversion=conversion).epsilon_and_optimal_order(blocks)


def epsilon_after_steps(
        *,
        steps: int,
        delta: float,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> float:
    """Epsilon of `steps` twice-sampled steps at delta.

    The accountant's `get_epsilon`; see
    `epsilon_and_optimal_order_after_steps` for the order too.
    """
    return epsilon_and_optimal_order_after_steps(
        steps=steps, delta=delta, example_sampling_rate=example_sampling_rate,
        coordinate_sampling_rate=coordinate_sampling_rate,
        noise_multiplier=noise_multiplier, l2_norm_clip=l2_norm_clip,
        linf_norm_clip=linf_norm_clip, block_dimensions=block_dimensions,
        orders=orders, conversion=conversion)[0]


# Each step of the bracket search multiplies or divides the scale by this.
_BRACKET_FACTOR = 4.0


def smallest_scale_meeting(
        epsilon_of_scale: Callable[[float], float], target_epsilon: float, *,
        lower: float, upper: float, tolerance: float,
        scale_name: str = 'noise_multiplier', start: Optional[float] = None,
        exact_epsilon_of_scale: Optional[Callable[[float], float]] = None
) -> float:
    """The smallest s in [lower, upper] meeting epsilon_of_scale(s) <= target,
    for a non-increasing function.

    Returns s with epsilon in [(1 - tolerance) * target, target], or `lower`
    if even `lower` meets the target. Never returns an s that misses it.
    Where epsilon is not continuous in s and jumps over that window (e.g.
    from above the target to 0), no s lands in it: the result is then the
    passing end of a bracket narrowed to a relative width of 1e-12, so its
    epsilon may be well below the target.

    Search: from `start` (default: the geometric middle) the bracket widens
    by factors of 4 until it holds the answer; then regula falsi on
    log epsilon against log s (nearly linear), Illinois-damped and every
    third step a bisection, so the bracket always shrinks.

    `epsilon_of_scale` may be a cheaper upper bound of
    `exact_epsilon_of_scale` (e.g. from the leading RDP orders only). The
    result then meets the target by the bound, hence also exactly; the
    exact function confirms a refusal and the result, and the search is run
    again on it when the bound was loose there, or (which a true bound rules
    out, but a bound evaluated separately could miss by a rounding error)
    when the result misses the target exactly. Every scale returned has
    been evaluated by the exact function at or below the target.

    Raises:
      ValueError: if `upper` does not meet the target.
    """
    exact = exact_epsilon_of_scale or epsilon_of_scale
    scale = _smallest_scale_by(epsilon_of_scale, exact, target_epsilon,
                               lower, upper, tolerance, scale_name, start)
    if exact is epsilon_of_scale:
        return scale
    eps = exact(scale)
    if eps > target_epsilon:  # Not a bound here: search above, exactly.
        return _smallest_scale_by(exact, exact, target_epsilon, scale, upper,
                                  tolerance, scale_name, scale)
    if scale == lower or eps >= (1.0 - tolerance) * target_epsilon:
        return scale
    return _smallest_scale_by(exact, exact, target_epsilon, lower, scale,
                              tolerance, scale_name, scale)


class _Found(Exception):
    """Ends a search early with a scale that meets the target tightly."""

    def __init__(self, scale: float):
        super().__init__(scale)
        self.scale = scale


def _smallest_scale_by(epsilon_of_scale: Callable[[float], float],
                       exact: Callable[[float], float], target_epsilon: float,
                       lower: float, upper: float, tolerance: float,
                       scale_name: str, start: Optional[float]) -> float:
    """`smallest_scale_meeting` with one function (`exact` only refuses)."""
    low_enough = (1.0 - tolerance) * target_epsilon

    def excess(log_scale: float) -> float:
        """log(epsilon / target): > 0 fails, in [log(1-tol), 0] is found."""
        eps = epsilon_of_scale(math.exp(log_scale))
        if low_enough <= eps <= target_epsilon:
            raise _Found(math.exp(log_scale))
        with np.errstate(divide='ignore'):
            return float(np.log(eps / target_epsilon))

    try:
        bracket = _bracket(excess, math.log(lower), math.log(upper),
                           None if start is None else math.log(start))
    except _Found as found:
        return found.scale
    if bracket is None:  # Even the upper end fails.
        eps_upper = exact(upper)
        if eps_upper > target_epsilon:
            raise ValueError(
                f'target_epsilon={target_epsilon} is unreachable: even '
                f'{scale_name}={upper:g} (the largest searched) gives '
                f'epsilon={eps_upper:.6g}. Allowed: a target above that, or '
                'fewer steps or smaller sampling rates.')
        return upper
    if bracket[0] is None:  # Even the lower end passes.
        return lower
    try:
        return math.exp(_refine(excess, *bracket,
                                goal=math.log1p(-0.5 * tolerance)))
    except _Found as found:
        return found.scale


def _bracket(excess: Callable[[float], float], log_lower: float,
             log_upper: float, log_start: Optional[float]):
    """(failing, its excess, passing, its excess) with failing < passing;
    (None, ...) when log_lower passes, None when log_upper fails."""
    point = 0.5 * (log_lower + log_upper) if log_start is None else min(
        max(log_start, log_lower), log_upper)
    step = math.log(_BRACKET_FACTOR)
    failing = passing = None
    while True:
        value = excess(point)
        if value <= 0.0:
            passing = (point, value)
            if point <= log_lower:
                return (None, None) + passing
            point = max(point - step, log_lower)
        else:
            if point >= log_upper:
                return None
            failing = (point, value)
            point = min(point + step, log_upper)
        if failing is not None and passing is not None:
            return failing + passing


def _refine(excess: Callable[[float], float], failing: float,
            failing_excess: float, passing: float, passing_excess: float, *,
            goal: float) -> float:
    """Shrinks [failing, passing] around excess = goal; returns `passing`."""
    failing_value, passing_value = failing_excess - goal, passing_excess - goal
    kept = 0  # +1: the passing end moved last, -1: the failing end.
    iteration = 0
    while passing - failing > 1e-12:
        iteration += 1
        point = 0.5 * (failing + passing)
        if iteration % 3 and math.isfinite(failing_value + passing_value):
            # Regula falsi: the zero of the chord, strictly inside.
            point = passing - passing_value * (passing - failing) / (
                passing_value - failing_value)
            if not failing < point < passing:
                point = 0.5 * (failing + passing)
        value = excess(point) - goal
        if value + goal <= 0.0:
            passing, passing_value = point, value
            if kept == 1:  # Illinois: the failing end stayed, damp it.
                failing_value *= 0.5
            kept = 1
        else:
            failing, failing_value = point, value
            if kept == -1:
                passing_value *= 0.5
            kept = -1
    return passing


def check_target_epsilon(target_epsilon: float) -> float:
    return _validate.positive('target_epsilon', target_epsilon)


def check_tolerance(tolerance: float) -> float:
    tolerance = _validate.positive('tolerance', tolerance)
    if tolerance >= 1.0:
        raise ValueError(f'tolerance must be in (0, 1); got {tolerance}.')
    return tolerance


def calibrate_noise_multiplier(
        *,
        target_epsilon: float,
        delta: float,
        steps: int,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        tolerance: float = DEFAULT_TOLERANCE,
) -> float:
    """The smallest single noise multiplier meeting (epsilon, delta).

    All blocks share the returned z. After `steps` twice-sampled steps the
    accountant's epsilon at `delta` (all `orders`) is at most
    target_epsilon, and within [(1 - tolerance), 1] x target_epsilon unless
    even MIN_NOISE_MULTIPLIER meets it or epsilon jumps over that window (see
    `smallest_scale_meeting`). `linf_norm_clip=None` (the default) is
    plain l2 clipping; with `coordinate_sampling_rate=1` too this calibrates
    DP-SGD with Poisson sampling.

    Raises:
      ValueError: on bad arguments, or when no z <= MAX_NOISE_MULTIPLIER
        meets the target.
    """
    target_epsilon = check_target_epsilon(target_epsilon)
    tolerance = check_tolerance(tolerance)
    epsilon_function = checked_epsilon_function(
        steps=steps, delta=delta, example_sampling_rate=example_sampling_rate,
        orders=orders, conversion=conversion)
    template = blocks_lib.Blocks.from_arguments(
        1.0, l2_norm_clip, linf_norm_clip, block_dimensions,
        coordinate_sampling_rate)

    def with_noise(z: float) -> blocks_lib.Blocks:
        return template.with_noise_multipliers((z,) * template.size)

    return smallest_scale_meeting(
        lambda z: epsilon_function.leading_epsilon(with_noise(z)),
        target_epsilon, lower=MIN_NOISE_MULTIPLIER,
        upper=MAX_NOISE_MULTIPLIER, tolerance=tolerance, start=1.0,
        exact_epsilon_of_scale=lambda z: epsilon_function.epsilon(
            with_noise(z)))
