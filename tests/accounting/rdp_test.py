"""Tests of the one-step RDP of twice sampling against independent numbers."""

import functools
import itertools
import math

from dp_accounting.rdp import rdp_privacy_accountant
import mpmath
import numpy as np
from numpy.polynomial import hermite_e
import pytest
from scipy import special

from tf_twice.accounting import blocks as blocks_lib
from tf_twice.accounting import rdp as rdp_lib
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import twice_sampling_rdp
from tf_twice.accounting.rdp import MAX_ORDER

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

DEFAULT_ORDERS = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
INTEGER_ORDERS = DEFAULT_ORDERS[DEFAULT_ORDERS == np.round(DEFAULT_ORDERS)]


def _poisson_gaussian_rdp(q, z, orders):
    """dp_accounting's own RDP of the Poisson-subsampled Gaussian."""
    return rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(  # pylint: disable=protected-access
        q, z, orders)


# ---------------------------------------------------------------------------
# Degenerate cases that dp_accounting computes itself.


@pytest.mark.parametrize('q1', [1e-3, 0.01, 0.2, 0.7])
@pytest.mark.parametrize('z', [0.6, 1.0, 3.0])
@pytest.mark.parametrize('linf', [None, 0.5, 0.05])
def test_no_coordinate_sampling_is_poisson_subsampled_gaussian(q1, z, linf):
    ours = twice_sampling_rdp(
        INTEGER_ORDERS, example_sampling_rate=q1, coordinate_sampling_rate=1.0,
        noise_multiplier=z, l2_norm_clip=2.0, linf_norm_clip=linf)
    reference = _poisson_gaussian_rdp(q1, z, INTEGER_ORDERS)
    np.testing.assert_allclose(ours, reference, rtol=1e-8, atol=1e-15)


def test_multi_block_without_coordinate_sampling_uses_effective_noise():
    z = np.array([0.8, 2.0, 5.0])
    z_eff = np.sum(z ** -2.0) ** -0.5
    ours = twice_sampling_rdp(
        INTEGER_ORDERS, example_sampling_rate=0.05,
        coordinate_sampling_rate=1.0, noise_multiplier=z,
        l2_norm_clip=[0.3, 1.0, 4.0], linf_norm_clip=[0.1, None, 0.2])
    reference = _poisson_gaussian_rdp(0.05, z_eff, INTEGER_ORDERS)
    np.testing.assert_allclose(ours, reference, rtol=1e-8, atol=1e-15)


@pytest.mark.parametrize('linf', [None, 0.3, 0.01])
def test_no_sampling_is_the_gaussian(linf):
    z = [0.7, 1.5]
    c2 = [1.0, 0.5]
    sigma = np.multiply(z, c2)
    ours = twice_sampling_rdp(
        DEFAULT_ORDERS, example_sampling_rate=1.0,
        coordinate_sampling_rate=1.0, noise_multiplier=z, l2_norm_clip=c2,
        linf_norm_clip=linf)
    integer = np.ceil(DEFAULT_ORDERS)
    expected = integer * np.sum(np.square(c2) / (2 * sigma ** 2))
    np.testing.assert_allclose(ours, expected, rtol=1e-12)


def test_fractional_orders_use_the_next_integer_order():
    orders = np.array([1.1, 1.5, 2.0, 2.25, 3.7, 10.0, 10.5])
    kwargs = dict(example_sampling_rate=0.02, coordinate_sampling_rate=0.4,
                  noise_multiplier=0.9, linf_norm_clip=0.2)
    ours = twice_sampling_rdp(orders, **kwargs)
    at_ceiling = twice_sampling_rdp(np.ceil(orders), **kwargs)
    np.testing.assert_array_equal(ours, at_ceiling)
    # And it is an upper bound on dp_accounting's fractional-order values.
    reference = _poisson_gaussian_rdp(0.02, 0.9, orders)
    no_coordinate_sampling = twice_sampling_rdp(
        orders, example_sampling_rate=0.02, coordinate_sampling_rate=1.0,
        noise_multiplier=0.9, linf_norm_clip=None)
    assert np.all(no_coordinate_sampling >= reference * (1 - 1e-10))


# ---------------------------------------------------------------------------
# Numerical integration of D_alpha(Q || P) for the dominating pair.


def _d_alpha_1d(alpha, q1, q2, s, sigma):
    """mpmath integral of Q^alpha P^(1-alpha), one coordinate of size s."""
    mpmath.mp.dps = 30
    q, s, sigma = mpmath.mpf(q1) * q2, mpmath.mpf(s), mpmath.mpf(sigma)

    def integrand(x):
        p = mpmath.npdf(x, 0, sigma)
        ratio = 1 - q + q * mpmath.exp((2 * x * s - s * s) / (2 * sigma ** 2))
        return p * ratio ** alpha

    center = alpha * s
    total = mpmath.quad(integrand, [-mpmath.inf, -40 * sigma, 0, center,
                                    center + 40 * sigma, mpmath.inf])
    return float(mpmath.log(total) / (alpha - 1))


def _divergences_2d(alpha, q1, q2, s, sigma, nodes=160):
    """Gauss-Hermite quadrature over two coordinates of sizes s = (s1, s2).

    Returns (D_alpha(Q || P), D_alpha(P || Q)) for
    P = N(0, sigma^2 I), Q = (1-q1) P + q1 prod_l [(1-q2) N(0) + q2 N(s_l)].
    """
    x, w = hermite_e.hermegauss(nodes)  # Weight exp(-x^2/2).
    w = w / math.sqrt(2 * math.pi)
    x1, x2 = np.meshgrid(x * sigma, x * sigma, indexing='ij')
    weight = np.outer(w, w)
    ratio = 1.0
    for coordinate, size in ((x1, s[0]), (x2, s[1])):
        ratio = ratio * (1 - q2 + q2 * np.exp(
            (2 * coordinate * size - size * size) / (2 * sigma ** 2)))
    ratio = 1 - q1 + q1 * ratio
    forward = np.log(np.sum(weight * ratio ** alpha)) / (alpha - 1)
    backward = np.log(np.sum(weight * ratio ** (1 - alpha))) / (alpha - 1)
    return forward, backward


@pytest.mark.parametrize('alpha', [2, 3, 5, 8])
@pytest.mark.parametrize('q1,q2,sigma', [(0.1, 0.5, 1.0), (0.02, 0.3, 0.7),
                                         (0.5, 0.9, 2.0)])
def test_d0_one_matches_numerical_integration(alpha, q1, q2, sigma):
    # d0 = 1: the whole l2 budget sits on one coordinate.
    ours = twice_sampling_rdp(
        [alpha], example_sampling_rate=q1, coordinate_sampling_rate=q2,
        noise_multiplier=sigma, l2_norm_clip=1.0, linf_norm_clip=1.0)[0]
    assert ours == pytest.approx(_d_alpha_1d(alpha, q1, q2, 1.0, sigma),
                                 rel=1e-9)


def test_one_dimensional_quadratures_agree():
    # The 2-d quadrature with a zero second coordinate is the 1-d integral.
    forward, _ = _divergences_2d(4, 0.1, 0.5, (1.0, 0.0), 1.0)
    assert forward == pytest.approx(_d_alpha_1d(4, 0.1, 0.5, 1.0, 1.0),
                                    rel=1e-9)


@pytest.mark.parametrize('alpha', [2, 4, 6])
@pytest.mark.parametrize('d0', [2.0, 1.5])
@pytest.mark.parametrize('q1,q2,sigma', [(0.1, 0.5, 1.0), (0.3, 0.25, 0.8)])
def test_d0_two_and_fractional_match_numerical_integration(
        alpha, d0, q1, q2, sigma):
    c2 = 1.0
    cinf = c2 / math.sqrt(d0)
    c_last = math.sqrt(max(c2 ** 2 - cinf ** 2, 0.0))  # n = 1 for d0 < 2.
    ours = twice_sampling_rdp(
        [alpha], example_sampling_rate=q1, coordinate_sampling_rate=q2,
        noise_multiplier=sigma / c2, l2_norm_clip=c2,
        linf_norm_clip=cinf)[0]
    forward, backward = _divergences_2d(alpha, q1, q2, (cinf, c_last), sigma)
    assert ours == pytest.approx(forward, rel=1e-8)
    # The other direction is smaller, so the pair's RDP is the forward one.
    assert backward <= forward


@pytest.mark.parametrize('alpha', [3, 6])
def test_dominating_sensitivity_beats_other_points_of_the_set(alpha):
    # Any s with ||s||_2 <= c2 and ||s||_inf <= c_inf has a smaller
    # divergence than the claimed worst case (remark after [COORD]).
    q1, q2, sigma, c2, d0 = 0.2, 0.5, 0.9, 1.0, 1.6
    cinf = c2 / math.sqrt(d0)
    ours = twice_sampling_rdp(
        [alpha], example_sampling_rate=q1, coordinate_sampling_rate=q2,
        noise_multiplier=sigma, l2_norm_clip=c2, linf_norm_clip=cinf)[0]
    rng = np.random.default_rng(0)
    for _ in range(12):
        s = rng.uniform(0, cinf, size=2)
        s *= min(1.0, c2 / np.linalg.norm(s))
        forward, _ = _divergences_2d(alpha, q1, q2, tuple(s), sigma)
        assert forward <= ours * (1 + 1e-9)


# ---------------------------------------------------------------------------
# Structure.


def _rdp(**overrides):
    kwargs = dict(example_sampling_rate=0.05, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=0.1)
    kwargs.update(overrides)
    return twice_sampling_rdp(DEFAULT_ORDERS, **kwargs)


@pytest.mark.parametrize('name,smaller,larger', [
    ('example_sampling_rate', 0.01, 0.05),
    ('coordinate_sampling_rate', 0.25, 0.5),
    ('linf_norm_clip', 0.05, 0.1),
    ('noise_multiplier', 2.0, 1.0),  # More noise, less privacy loss.
])
def test_monotone(name, smaller, larger):
    low, high = _rdp(**{name: smaller}), _rdp(**{name: larger})
    assert np.all(low <= high)
    assert np.any(low < high)


def test_nondecreasing_in_order():
    values = _rdp()
    assert np.all(np.diff(values) >= -1e-15)


def test_coordinate_sampling_helps_and_twice_is_between():
    twice = _rdp()
    standard_at_q1 = _poisson_gaussian_rdp(0.05, 1.0, DEFAULT_ORDERS)
    assert np.all(twice <= standard_at_q1 * (1 + 1e-12))


def test_block_dimensions_tighten_small_blocks():
    # d0 = 100 but the block has 30 coordinates: worst case is 30 at c_inf.
    loose = _rdp(linf_norm_clip=0.1)
    tight = _rdp(linf_norm_clip=0.1, block_dimensions=30)
    assert np.all(tight <= loose) and np.any(tight < loose)
    # 30 coordinates at 0.1 have the l2 norm of a block with c2 = sqrt(0.3)
    # and d0 = 30 exactly.
    same = _rdp(l2_norm_clip=math.sqrt(0.3), linf_norm_clip=0.1,
                noise_multiplier=1.0 / math.sqrt(0.3))
    np.testing.assert_allclose(tight, same, rtol=1e-10)
    # A block larger than d0 is unaffected.
    np.testing.assert_array_equal(_rdp(block_dimensions=1000), loose)


def test_integer_d0_has_no_spurious_extra_coordinate():
    # (1/0.1)^2 is 100.00000000000001 in floating point.
    np.testing.assert_allclose(
        _rdp(linf_norm_clip=0.1),
        _rdp(l2_norm_clip=10.0, linf_norm_clip=1.0, noise_multiplier=1.0),
        rtol=1e-12)


def test_numpy_scalars_and_arrays_are_accepted():
    np.testing.assert_array_equal(
        _rdp(noise_multiplier=np.float64(1.0), l2_norm_clip=np.array(1.0)),
        _rdp(noise_multiplier=1.0, l2_norm_clip=1.0))
    np.testing.assert_array_equal(
        _rdp(noise_multiplier=np.array([1.0, 2.0]), l2_norm_clip=[1.0, 1.0]),
        _rdp(noise_multiplier=[1.0, 2.0], l2_norm_clip=1.0))


def test_large_orders_stay_finite():
    values = twice_sampling_rdp(
        [2, 256, 1024, MAX_ORDER], example_sampling_rate=0.5,
        coordinate_sampling_rate=0.5, noise_multiplier=0.3,
        linf_norm_clip=0.2)
    assert np.all(np.isfinite(values)) and np.all(values > 0)


# ---------------------------------------------------------------------------
# The same formula in 100-digit arithmetic, at extreme d0, q1 and q2.
#
# With d0 = (c2/c_inf)^2 = 1e8..1e30, M(v, a) - 1 is ~1e-9..1e-31 and is then
# multiplied by n = floor(d0); with q1 = 1e-6 the outer sum is 1 + O(1e-12).
# Both need more digits than a float has, unless nothing cancels.

REFERENCE_ORDERS = (2, 3, 10, 64)


@functools.lru_cache(maxsize=None)
def _reference_log_moments(max_order, q2, z, c2, cinf):
    """mpmath L(v) = n log M(v, a_inf) + log M(v, a_last), v = 0..max_order.

    d0, n = floor(d0) and c'^2 = c2^2 - n c_inf^2 are exact here (remark after
    [COORD]), from the same float inputs.
    """
    mp = mpmath.mp
    q2, z, c2, cinf = (mpmath.mpf(x) for x in (q2, z, c2, cinf))
    n = mpmath.floor((c2 / cinf) ** 2)
    two_sigma2 = 2 * (z * c2) ** 2
    a_inf, a_last = cinf ** 2 / two_sigma2, (c2 ** 2 - n * cinf ** 2) / two_sigma2

    def log_m(v, a):
        return mpmath.log(mp.fsum(
            mpmath.binomial(v, l) * (1 - q2) ** (v - l) * q2 ** l
            * mpmath.exp(l * (l - 1) * a) for l in range(v + 1)))

    return tuple(n * log_m(v, a_inf) + log_m(v, a_last)
                 for v in range(max_order + 1))


def _reference_rdp(orders, q1, q2, z, c2, cinf):
    """mpmath eps(alpha) of [TWICE] for integer orders, as floats."""
    with mpmath.workdps(100):
        log_moments = _reference_log_moments(max(orders), q2, z, c2, cinf)
        q1 = mpmath.mpf(q1)
        rdp = [mpmath.log(mpmath.mp.fsum(
            mpmath.binomial(alpha, v) * (1 - q1) ** (alpha - v) * q1 ** v
            * mpmath.exp(log_moments[v]) for v in range(alpha + 1)))
               / (alpha - 1) for alpha in orders]
        return np.array([float(x) for x in rdp])


# c2 with c_inf = 1: d0 = 1e8, 1e12, 1e16 exactly; ~1e19 (past int64);
# ~1e30; and a d0 of 152,415,765.279... with a remainder coordinate.
EXTREME_L2_CLIPS = (1e4, 1e6, 1e8, math.sqrt(1e19), 1e15, 12345.678)


@pytest.mark.parametrize('c2', EXTREME_L2_CLIPS)
@pytest.mark.parametrize('q1', [1e-6, 0.5, 1.0])
@pytest.mark.parametrize('q2', [1e-6, 0.5, 1.0])
def test_extreme_d0_matches_high_precision_reference(c2, q1, q2):
    ours = twice_sampling_rdp(
        REFERENCE_ORDERS, example_sampling_rate=q1,
        coordinate_sampling_rate=q2, noise_multiplier=1.0, l2_norm_clip=c2,
        linf_norm_clip=1.0)
    reference = _reference_rdp(REFERENCE_ORDERS, q1, q2, 1.0, c2, 1.0)
    np.testing.assert_allclose(ours, reference, rtol=1e-9, atol=0)


@pytest.mark.parametrize('d0', [1.0, 2.5, 100.0])
@pytest.mark.parametrize('q2', [1e-6, 0.5, 1.0])
def test_small_noise_and_large_orders_match_high_precision_reference(d0, q2):
    # a = c_inf^2/(2 sigma^2) = 50/d0: exp(l(l-1)a) overflows a float for
    # l >= 16 at every d0 here.
    orders = (2, 17, 128)
    for q1 in (1e-6, 0.5, 1.0):  # One reference L(v) serves all three.
        ours = twice_sampling_rdp(
            orders, example_sampling_rate=q1, coordinate_sampling_rate=q2,
            noise_multiplier=0.1, l2_norm_clip=1.0,
            linf_norm_clip=1.0 / math.sqrt(d0))
        reference = _reference_rdp(orders, q1, q2, 0.1, 1.0,
                                   1.0 / math.sqrt(d0))
        np.testing.assert_allclose(ours, reference, rtol=1e-9, atol=0)


@pytest.mark.parametrize('c2', [1e4, 1e8, 1e15])
def test_extreme_d0_epsilon_matches_high_precision_reference(c2):
    # The accountant's epsilon after T steps against dp_accounting's own
    # conversion of the reference RDP.
    q1, q2, steps, delta = 0.01, 0.5, 10_000, 1e-5
    accountant = TwiceSamplingRdpAccountant(orders=REFERENCE_ORDERS)
    accountant.compose(TwiceSampledGaussianDpEvent(q1, q2, 1.0, c2, 1.0),
                       steps)
    reference, _ = rdp_privacy_accountant.compute_epsilon(
        np.array(REFERENCE_ORDERS, dtype=float),
        steps * _reference_rdp(REFERENCE_ORDERS, q1, q2, 1.0, c2, 1.0), delta)
    assert accountant.get_epsilon(delta) == pytest.approx(reference, rel=1e-9)


@pytest.mark.parametrize('c2,dimension', [
    (1e4, 30), (1e4, 1000), (1e8, 1000), (1e15, 30), (1e15, 10 ** 20)])
def test_block_dimension_below_d0_is_that_many_coordinates(c2, dimension):
    # r < d0 = c2^2: the worst case is r coordinates at c_inf and nothing
    # else, i.e. the block with c2 = sqrt(r) c_inf under the same noise std.
    sigma, cinf = 3.0, 1.0
    kwargs = dict(example_sampling_rate=0.01, coordinate_sampling_rate=0.5,
                  linf_norm_clip=cinf)
    capped = twice_sampling_rdp(
        REFERENCE_ORDERS, noise_multiplier=sigma / c2, l2_norm_clip=c2,
        block_dimensions=dimension, **kwargs)
    c2_of_r = math.sqrt(dimension) * cinf
    same = twice_sampling_rdp(
        REFERENCE_ORDERS, noise_multiplier=sigma / c2_of_r,
        l2_norm_clip=c2_of_r, **kwargs)
    np.testing.assert_allclose(capped, same, rtol=1e-12)
    assert np.all(np.isfinite(capped)) and np.all(capped > 0)


# ---------------------------------------------------------------------------
# The analytic gradient in log z and the evaluation shortcuts.


GRADIENT_SETTINGS = [
    # order, q1, q2, z, c2, c_inf, block dimensions
    (10, 0.01, 0.5, 1.0, 1.0, 0.1, None),
    (32, 0.01, 0.5, [1.0, 2.0, 0.5, 3.0, 1.0], [0.6, 0.3, 0.2, 0.4, 1.0],
     [0.1, 0.05, 0.02, 0.02, 0.01], [250, 500, 1000, 1500, 288_648]),
    (7, 1.0, 1.0, [1.0, 2.0], 1.0, None, None),
    (7, 0.3, 1.0, [1.0, 2.0], 1.0, 0.37, None),
    (7, 1.0, 0.3, [1.0, 2.0], 1.0, 0.37, None),  # A remainder coordinate.
    (64, 0.5, 0.5, 0.3, 1.0, 0.2, None),
    (128, 1e-6, 1e-6, 3.0, 1e4, 1.0, None),
    (200, 0.02, 0.7, [0.8, 1.5], [1.0, 2.0], [0.3, 0.5], None),
]


@pytest.mark.parametrize('order,q1,q2,z,c2,cinf,dims', GRADIENT_SETTINGS)
def test_noise_gradient_matches_finite_differences(order, q1, q2, z, c2,
                                                   cinf, dims):
    blocks = blocks_lib.Blocks.from_arguments(z, c2, cinf, dims, q2)

    def rdp_with(noise_multipliers):
        return twice_sampling_rdp(
            [order], example_sampling_rate=q1, coordinate_sampling_rate=q2,
            noise_multiplier=noise_multipliers,
            l2_norm_clip=blocks.l2_norm_clips,
            linf_norm_clip=blocks.linf_norm_clips,
            block_dimensions=dims)[0]

    def rdp_at(log_z):
        return rdp_with(np.exp(log_z))

    value, gradient = rdp_lib.rdp_and_noise_gradient(order, q1, blocks)
    # At z itself: exp(log(z)) may differ from z in the last bit.
    assert value == rdp_with(np.asarray(blocks.noise_multipliers))
    log_z = np.log(blocks.noise_multipliers)
    step = 1e-5
    for j in range(blocks.size):
        shift = np.zeros(blocks.size)
        shift[j] = step
        central = (rdp_at(log_z + shift) - rdp_at(log_z - shift)) / (2 * step)
        assert gradient[j] == pytest.approx(central, rel=1e-6)
    assert np.all(gradient < 0)  # More noise, less privacy loss.


def test_floored_logsumexp_never_undercuts_the_exact_one():
    # Terms far below the largest are raised to exp(-700) relative: the sum
    # can only grow, and by far less than its rounding.
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-5000.0, 50.0, size=(40, 300)),
                        np.full((40, 20), -np.inf)], axis=1)
    x[0] = -np.inf
    x[1, :] = -1e4
    x[1, 7] = 3.0
    exact = special.logsumexp(x, axis=-1)
    ours = rdp_lib._logsumexp_last_axis(x.copy())  # pylint: disable=protected-access
    assert ours[0] == -np.inf
    assert np.all(ours[1:] >= exact[1:])
    np.testing.assert_allclose(ours[1:], exact[1:], rtol=1e-15, atol=0)


def test_many_blocks_are_the_sum_of_single_blocks():
    # 7 blocks with a remainder coordinate each: 14 exponents, more than one
    # batch of them; orders past one batch of rows.
    z = np.linspace(0.5, 3.0, 7)
    c2 = np.linspace(0.3, 2.0, 7)
    cinf = c2 / np.sqrt(np.linspace(1.5, 40.5, 7))
    blocks = blocks_lib.Blocks.from_arguments(z, c2, cinf,
                                              coordinate_sampling_rate=0.4)
    together = rdp_lib.log_moments_of_coordinate_sampling(300, blocks)
    apart = sum(rdp_lib.log_moments_of_coordinate_sampling(
        300, blocks_lib.Blocks.from_arguments(
            z[j], c2[j], cinf[j], coordinate_sampling_rate=0.4))
                for j in range(7))
    np.testing.assert_allclose(together, apart, rtol=1e-13, atol=0)


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize('overrides,message', [
    (dict(example_sampling_rate=0.0), r'example_sampling_rate must be in \(0, 1\]'),
    (dict(example_sampling_rate=1.5), r'example_sampling_rate must be in \(0, 1\]'),
    (dict(coordinate_sampling_rate=-0.1), r'coordinate_sampling_rate must be in \(0, 1\]'),
    (dict(noise_multiplier=0.0), r'noise_multiplier\[0\] must be a finite number > 0'),
    (dict(noise_multiplier=math.inf), r'noise_multiplier\[0\] must be a finite number > 0'),
    (dict(l2_norm_clip=-1.0), r'l2_norm_clip\[0\] must be a finite number > 0'),
    (dict(linf_norm_clip=0.0), r'linf_norm_clip\[0\] must be a finite number > 0'),
    (dict(noise_multiplier=[1.0, 2.0], l2_norm_clip=[1.0, 2.0, 3.0]),
     'per-block arguments must have equal lengths'),
    (dict(block_dimensions=0), r'block_dimensions\[0\] must be an integer >= 1'),
    (dict(noise_multiplier='1.0'), 'noise_multiplier must be a number'),
])
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        _rdp(**overrides)


@pytest.mark.parametrize('orders', [[1.0], [0.5, 2.0], [MAX_ORDER + 1], [],
                                    [math.nan], [math.inf]])
def test_bad_orders(orders):
    with pytest.raises(ValueError, match='orders must'):
        twice_sampling_rdp(orders, example_sampling_rate=0.1,
                           coordinate_sampling_rate=0.5, noise_multiplier=1.0,
                           linf_norm_clip=0.1)


def test_a_blocks_rdp_depends_on_its_d0_and_noise_not_on_its_clip_scale():
    # Block j's worst case is d0_j coordinates at c_inf_j = c2_j / sqrt(d0_j)
    # under noise z_j c2_j: every exponent is a ratio to c2_j. So budgets
    # re-split between blocks at the same z_j and d0_j account the same.
    kwargs = dict(example_sampling_rate=0.05,
                  coordinate_sampling_rate=[1.0, 0.5],
                  noise_multiplier=[1.3, 0.8], block_dimensions=[16, 5000])
    orders = [2, 8, 32, 256]
    planned = twice_sampling_rdp(orders, l2_norm_clip=[0.9, 0.3],
                                 linf_norm_clip=[0.9, 0.03], **kwargs)
    replanned = twice_sampling_rdp(orders, l2_norm_clip=[0.2, 0.7],
                                   linf_norm_clip=[0.2, 0.07], **kwargs)
    np.testing.assert_allclose(replanned, planned, rtol=1e-12)
    other_d0 = twice_sampling_rdp(orders, l2_norm_clip=[0.2, 0.7],
                                  linf_norm_clip=[0.2, 0.1], **kwargs)
    assert (other_d0 > planned).all()


def _remove_direction_by_expansion(alpha, q1, coordinates):
    """D_alpha(Q || P) for integer alpha by the multinomial expansion of
    E_P[(Q/P)^alpha] over Q's Gaussian components (independent of the
    accountant's binomial tables): Q = (1 - q1) P + q1 sum_mask p(mask)
    N(mask * s, sigma^2), coordinates = [(s, q2, sigma)]."""
    components = [(1 - q1, np.zeros(len(coordinates)))]
    for mask in itertools.product([0, 1], repeat=len(coordinates)):
        p = math.prod(q2 if bit else 1 - q2
                      for bit, (_, q2, _) in zip(mask, coordinates))
        mean = np.array([bit * s / sigma
                         for bit, (s, _, sigma) in zip(mask, coordinates)])
        components.append((q1 * p, mean))
    total = 0.0
    for counts in itertools.product(range(alpha + 1), repeat=len(components)):
        if sum(counts) != alpha:
            continue
        coefficient = math.factorial(alpha)
        summed = np.zeros(len(coordinates))
        squares = 0.0
        for k, (w, mu) in zip(counts, components):
            coefficient *= w**k / math.factorial(k)
            summed += k * mu
            squares += k * mu @ mu
        total += coefficient * math.exp((summed @ summed - squares) / 2)
    return math.log(total) / (alpha - 1)


@pytest.mark.parametrize('alpha', [2, 3])
def test_per_block_rates_equal_the_multinomial_expansion(alpha):
    # An unmasked block of one coordinate at c2_0 = 0.6, a block at
    # q2 = 0.3 with d0 = 2 (c2_1 = 0.5 sqrt(2)), noise z_j c2_j: three
    # coordinates.
    z = (1.2, 0.9)
    sigma = (z[0] * 0.6, z[1] * 0.5 * math.sqrt(2))
    coordinates = [(0.6, 1.0, sigma[0]), (0.5, 0.3, sigma[1]),
                   (0.5, 0.3, sigma[1])]
    for q1 in (0.05, 0.6):
        want = _remove_direction_by_expansion(alpha, q1, coordinates)
        got = float(twice_sampling_rdp(
            [alpha], example_sampling_rate=q1,
            coordinate_sampling_rate=[1.0, 0.3], noise_multiplier=z,
            l2_norm_clip=[0.6, 0.5 * math.sqrt(2)],
            linf_norm_clip=[None, 0.5])[0])
        assert got == pytest.approx(want, rel=1e-10), q1


def test_rdp_is_non_decreasing_in_each_blocks_rate():
    # So accounting at the nominal q2_j covers the realised mask rate
    # floor(q2_j 2**16) / 2**16 <= q2_j.
    kwargs = dict(example_sampling_rate=0.1, noise_multiplier=[1.0, 0.7],
                  l2_norm_clip=[1.0, 1.0], linf_norm_clip=[0.5, 0.1])
    rates = np.linspace(2**-16, 1.0, 9)
    for block in (0, 1):
        curve = np.array([twice_sampling_rdp(
            [2, 8, 64], coordinate_sampling_rate=[q if j == block else 0.5
                                                  for j in (0, 1)],
            **kwargs) for q in rates])
        assert (np.diff(curve, axis=0) >= 0).all(), block
