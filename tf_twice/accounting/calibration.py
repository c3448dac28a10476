"""Epsilon after T steps, and the smallest noise that meets a budget."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

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


def epsilon_of_blocks(
        blocks: blocks_lib.Blocks, *, steps: int, delta: float,
        example_sampling_rate: float, coordinate_sampling_rate: float,
        orders: np.ndarray,
        conversion: conversion_lib.ConversionLike) -> Tuple[float, float]:
    """(epsilon, optimal order) after `steps` identical steps (validated)."""
    rdp = rdp_lib.rdp_of_blocks(orders, example_sampling_rate,
                                coordinate_sampling_rate, blocks)
    return conversion_lib.rdp_to_epsilon(orders, steps * rdp, delta,
                                         conversion)


def epsilon_after_steps(
        *,
        steps: int,
        delta: float,
        example_sampling_rate: float,
        coordinate_sampling_rate: float,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> Tuple[float, float]:
    """(epsilon, optimal RDP order) of `steps` twice-sampled steps at delta.

    Equal to composing `steps` TwiceSampledGaussianDpEvents in a
    TwiceSamplingRdpAccountant with the same orders and converting.
    """
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multiplier, l2_norm_clip, linf_norm_clip, block_dimensions)
    return epsilon_of_blocks(
        blocks,
        steps=blocks_lib.check_steps('steps', steps),
        delta=blocks_lib.check_delta(delta),
        example_sampling_rate=blocks_lib.check_rate('example_sampling_rate',
                                                    example_sampling_rate),
        coordinate_sampling_rate=blocks_lib.check_rate(
            'coordinate_sampling_rate', coordinate_sampling_rate),
        orders=rdp_lib.check_orders(DEFAULT_ORDERS if orders is None
                                    else orders),
        conversion=conversion_lib.as_conversion(conversion))


def smallest_scale_meeting(epsilon_of_scale: Callable[[float], float],
                           target_epsilon: float, *, lower: float,
                           upper: float, tolerance: float,
                           scale_name: str = 'noise_multiplier') -> float:
    """Bisection in log scale for the smallest s in [lower, upper] meeting
    epsilon_of_scale(s) <= target_epsilon, for a non-increasing function.

    Returns s with epsilon in [(1 - tolerance) * target, target], or `lower`
    if even `lower` meets the target. Never returns an s that misses it.

    Raises:
      ValueError: if `upper` does not meet the target.
    """
    eps_upper = epsilon_of_scale(upper)
    if eps_upper > target_epsilon:
        raise ValueError(
            f'target_epsilon={target_epsilon} is unreachable: even '
            f'{scale_name}={upper:g} (the largest searched) gives epsilon='
            f'{eps_upper:.6g}. Allowed: a target above that, or fewer steps '
            'or smaller sampling rates.')
    if epsilon_of_scale(lower) <= target_epsilon:
        return lower
    failing, passing = math.log(lower), math.log(upper)
    while passing - failing > 1e-12:
        middle = 0.5 * (failing + passing)
        eps = epsilon_of_scale(math.exp(middle))
        if eps <= target_epsilon:
            passing = middle
            if eps >= (1.0 - tolerance) * target_epsilon:
                break
        else:
            failing = middle
    return math.exp(passing)


def check_target_epsilon(target_epsilon: float) -> float:
    return blocks_lib.check_positive('target_epsilon', target_epsilon)


def check_tolerance(tolerance: float) -> float:
    tolerance = blocks_lib.check_positive('tolerance', tolerance)
    if tolerance >= 1.0:
        raise ValueError(f'tolerance must be in (0, 1); got {tolerance}.')
    return tolerance


def calibrate_noise_multiplier(
        *,
        target_epsilon: float,
        delta: float,
        steps: int,
        example_sampling_rate: float,
        coordinate_sampling_rate: float,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        tolerance: float = DEFAULT_TOLERANCE,
) -> float:
    """The smallest single noise multiplier meeting (epsilon, delta).

    All blocks share the returned z. After `steps` twice-sampled steps the
    accountant's epsilon at `delta` is within [(1 - tolerance), 1] x
    target_epsilon (or below it if even MIN_NOISE_MULTIPLIER meets it).

    Raises:
      ValueError: on bad arguments, or when no z <= MAX_NOISE_MULTIPLIER
        meets the target.
    """
    target_epsilon = check_target_epsilon(target_epsilon)
    tolerance = check_tolerance(tolerance)
    steps = blocks_lib.check_steps('steps', steps)
    delta = blocks_lib.check_delta(delta)
    q1 = blocks_lib.check_rate('example_sampling_rate', example_sampling_rate)
    q2 = blocks_lib.check_rate('coordinate_sampling_rate',
                               coordinate_sampling_rate)
    orders_array = rdp_lib.check_orders(DEFAULT_ORDERS if orders is None
                                        else orders)
    conversion = conversion_lib.as_conversion(conversion)
    template = blocks_lib.Blocks.from_arguments(
        1.0, l2_norm_clip, linf_norm_clip, block_dimensions)

    def epsilon_of(z: float) -> float:
        blocks = blocks_lib.Blocks(
            (z,) * template.size, template.l2_norm_clips,
            template.linf_norm_clips, template.dimensions)
        return epsilon_of_blocks(
            blocks, steps=steps, delta=delta, example_sampling_rate=q1,
            coordinate_sampling_rate=q2, orders=orders_array,
            conversion=conversion)[0]

    return smallest_scale_meeting(
        epsilon_of, target_epsilon, lower=MIN_NOISE_MULTIPLIER,
        upper=MAX_NOISE_MULTIPLIER, tolerance=tolerance)
