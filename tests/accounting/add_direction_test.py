"""The add direction of one twice-sampling step, against the accountant.

The accountant (`tf_twice.accounting.rdp`) evaluates the remove direction,
D_alpha(Q || P) for P = N(0, sigma^2 I) and Q = (1 - q1) P + q1 prod_l
[(1 - q2) N(0) + q2 N(s_l)], at the dominating allocation s (d0 coordinates
at c_inf). Under add-or-remove adjacency the add direction D_alpha(P || Q)
must be bounded too, over every allocation within the clips. Here it is
integrated (Gauss-Hermite, product rule) for allocations of the l2 budget
over k equal coordinates, from the fewest the l-infinity clip allows up to
3, and in the thin-spread limit (k -> infinity), where the inner mixture
becomes a Gaussian shift by q2 c2 and Q a Poisson-subsampled Gaussian. Both
trends occur: at small q1 the add direction falls as the mass spreads, at
large q1 and alpha it rises towards the thin limit. It stayed below the
accountant's value at every point; the ratio approaches 1 as q1 -> 0, where
both directions agree to second order in q1.
"""

import itertools
import math

import numpy as np
import pytest
from numpy.polynomial.hermite_e import hermegauss

from tf_twice.accounting import twice_sampling_rdp

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).


def _add_direction(alpha, q1, q2, sigma, sizes, points, power=None):
    """D_alpha(P || Q) = log E_P[(1 - q1 + q1 prod_l L_l)^(1 - alpha)] /
    (alpha - 1), L_l = 1 - q2 + q2 exp(s_l x_l / sigma^2 - s_l^2 / (2
    sigma^2)), x ~ P: the integrand is at most (1 - q1)^(1 - alpha).
    ``power=alpha`` gives the remove direction, D_alpha(Q || P). ``q2``
    and ``sigma`` are one for every coordinate or one per coordinate (per-
    block rates and noise)."""
    nodes, weights = hermegauss(points)
    weights = weights / weights.sum()
    ratio, weight = 1.0, 1.0
    q2s = np.broadcast_to(q2, len(sizes))
    sigmas = np.broadcast_to(sigma, len(sizes))
    for axis, (s, q2_l, sigma_l) in enumerate(zip(sizes, q2s, sigmas)):
        shape = [1] * len(sizes)
        shape[axis] = points
        a = s / sigma_l
        x = nodes.reshape(shape)
        ratio = ratio * (1 - q2_l + q2_l * np.exp(a * x - a * a / 2))
        weight = weight * weights.reshape(shape)
    power = 1 - alpha if power is None else power
    mean = np.sum(weight * (1 - q1 + q1 * ratio)**power)
    return math.log(mean) / (alpha - 1)


_POINTS = {1: 120, 2: 60, 3: 40}


@pytest.mark.parametrize('q2, d0', [(1.0, 1), (0.5, 1), (0.5, 2)])
def test_the_integration_gives_the_accountants_remove_direction(q2, d0):
    # The same quadrature with the remove direction's power: the
    # accountant's exact value at its own allocation (d0 at c_inf).
    for z, q1, alpha in itertools.product([0.5, 2.0], [0.02, 0.5], [2, 8]):
        got = _add_direction(alpha, q1, q2, z, [1 / math.sqrt(d0)] * d0,
                             _POINTS[d0], power=alpha)
        want = float(twice_sampling_rdp(
            [alpha], example_sampling_rate=q1, coordinate_sampling_rate=q2,
            noise_multiplier=z, l2_norm_clip=1.0,
            linf_norm_clip=1 / math.sqrt(d0))[0])
        assert got == pytest.approx(want, rel=1e-6), (z, q1, alpha)


@pytest.mark.parametrize('z, q1', list(itertools.product([0.5, 1.0, 2.0],
                                                         [0.02, 0.5])))
def test_add_direction_stays_below_the_accountant(z, q1):
    c2 = 1.0
    sigma = z * c2
    worst = 0.0
    for q2, alpha, d0 in itertools.product([1 / 3, 0.5], [2, 8, 32],
                                           [1, 2, 3]):
        remove = float(twice_sampling_rdp(
            [alpha], example_sampling_rate=q1, coordinate_sampling_rate=q2,
            noise_multiplier=z, l2_norm_clip=c2,
            linf_norm_clip=c2 / math.sqrt(d0))[0])
        adds = [_add_direction(alpha, q1, q2, sigma, [c2 / math.sqrt(k)] * k,
                               _POINTS[k]) for k in range(d0, 4)]
        # The thin-spread limit: one coordinate shifted by q2 c2, unmasked.
        adds.append(_add_direction(alpha, q1, 1.0, sigma, [q2 * c2], 200))
        worst = max(worst, max(adds) / remove)
    assert worst <= 1.0, worst


# Per-block rates: a principal block of one coordinate kept always (its
# whole clip c2_0 on it) and a residual of two coordinates at c_inf, kept
# at rate q2, each block with its own noise.
_BLOCKS = dict(l2_norm_clip=[0.6, 1.0], linf_norm_clip=[None, 1 / math.sqrt(2)])
_SIZES = [0.6, 1 / math.sqrt(2), 1 / math.sqrt(2)]


def test_the_integration_gives_the_accountants_per_block_rates():
    # Given the example is sampled, the blocks' masks are independent: the
    # inner likelihood ratio is a product over every block's coordinates.
    for zs, q1, q2, alpha in itertools.product(
            [(1.0, 1.0), (2.0, 2.0), (15.0, 2.0)], [0.05, 0.5, 0.9],
            [0.25, 0.5], [2, 8]):
        got = _add_direction(alpha, q1, [1.0, q2, q2],
                             [zs[0] * 0.6, zs[1], zs[1]], _SIZES, 60,
                             power=alpha)
        want = float(twice_sampling_rdp(
            [alpha], example_sampling_rate=q1,
            coordinate_sampling_rate=[1.0, q2], noise_multiplier=list(zs),
            **_BLOCKS)[0])
        assert got == pytest.approx(want, rel=1e-6), (zs, q1, q2, alpha)


# Noise multipliers per block, equal and unequal (a planner may give the
# principal block far more noise than the residual, or less), and q1 up to
# 0.9, where the add direction comes closest to the remove direction.
@pytest.mark.parametrize('zs, q1', list(itertools.product(
    [(1.0, 1.0), (2.0, 2.0), (15.0, 2.0), (1.0, 4.0)], [0.05, 0.5, 0.9])))
def test_add_direction_stays_below_the_accountant_with_per_block_rates(
        zs, q1):
    z_principal, z_residual = zs
    sigmas = [z_principal * 0.6, z_residual, z_residual]
    worst = 0.0
    for q2, alpha in itertools.product([0.25, 0.5], [2, 8, 32]):
        remove = float(twice_sampling_rdp(
            [alpha], example_sampling_rate=q1,
            coordinate_sampling_rate=[1.0, q2], noise_multiplier=list(zs),
            **_BLOCKS)[0])
        # The principal block's clip on its coordinate; the residual's on
        # two coordinates at c_inf (the fewest the clip allows) or spread
        # thin (the limit: one coordinate shifted by q2 c2, unmasked).
        adds = [_add_direction(alpha, q1, [1.0, q2, q2], sigmas, _SIZES, 60),
                _add_direction(alpha, q1, [1.0, 1.0], sigmas[:2],
                               [0.6, q2 * 1.0], 120)]
        worst = max(worst, max(adds) / remove)
    assert worst <= 1.0, worst
