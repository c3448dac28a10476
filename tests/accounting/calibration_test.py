"""Tests of noise calibration and per-block noise optimisation."""

import dp_accounting
from dp_accounting import mechanism_calibration
import numpy as np
import pytest

from tf_twice.accounting import calibrate_noise_multiplier
from tf_twice.accounting import epsilon_after_steps
from tf_twice.accounting import epsilon_and_optimal_order_after_steps
from tf_twice.accounting import hybrid_clipping_noise_multipliers
from tf_twice.accounting import MAX_NOISE_MULTIPLIER
from tf_twice.accounting import optimize_block_noise
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import blocks as blocks_lib
from tf_twice.accounting import calibration

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

SETTING = dict(delta=1e-5, steps=2000, example_sampling_rate=0.01,
               coordinate_sampling_rate=0.5)


@pytest.mark.parametrize('target', [0.5, 2.0, 8.0])
@pytest.mark.parametrize('linf', [None, 0.1])
def test_calibration_meets_target_tightly(target, linf):
    z = calibrate_noise_multiplier(target_epsilon=target, linf_norm_clip=linf,
                                   **SETTING)
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(TwiceSampledGaussianDpEvent(
        SETTING['example_sampling_rate'], SETTING['coordinate_sampling_rate'],
        z, 1.0, linf), SETTING['steps'])
    eps = accountant.get_epsilon(SETTING['delta'])
    assert 0.99 * target <= eps <= target
    # Smallest: 2% less noise misses the target.
    eps_less = epsilon_after_steps(noise_multiplier=0.98 * z,
                                   linf_norm_clip=linf, **SETTING)
    assert eps_less > target


def test_calibration_without_coordinate_sampling_matches_dp_accounting():
    # Integer orders only: at fractional orders tf_twice uses the next
    # integer order, which is sound but slightly looser than dp_accounting.
    orders = list(range(2, 64)) + [128, 256]
    target, q, steps, delta = 3.0, 0.02, 1500, 1e-6
    ours = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, steps=steps,
        example_sampling_rate=q, coordinate_sampling_rate=1.0,
        linf_norm_clip=None, tolerance=1e-4, orders=orders)

    def make_event(z):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(z)), steps)

    theirs = mechanism_calibration.calibrate_dp_mechanism(
        lambda: dp_accounting.rdp.RdpAccountant(orders), make_event, target,
        delta,
        mechanism_calibration.LowerEndpointAndGuess(0, 1),
        tol=1e-6)
    assert ours == pytest.approx(theirs, rel=1e-3)


def test_epsilon_is_a_float_and_the_pair_adds_the_optimal_order():
    kwargs = dict(noise_multiplier=1.1, l2_norm_clip=1.0, linf_norm_clip=0.1,
                  **SETTING)
    eps = epsilon_after_steps(**kwargs)
    pair = epsilon_and_optimal_order_after_steps(**kwargs)
    assert isinstance(eps, float) and eps == pair[0]
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(TwiceSampledGaussianDpEvent(
        SETTING['example_sampling_rate'], SETTING['coordinate_sampling_rate'],
        1.1, 1.0, 0.1), SETTING['steps'])
    assert pair == accountant.get_epsilon_and_optimal_order(SETTING['delta'])


def test_plain_dp_sgd_needs_no_linf_clip():
    # No l-infinity clip and no coordinate sampling: DP-SGD with Poisson
    # sampling, as dp_accounting computes it (at integer orders, where both
    # are exact).
    orders = list(range(2, 64)) + [128, 256]
    setting = dict(delta=1e-5, steps=1000, example_sampling_rate=0.02,
                   coordinate_sampling_rate=1.0, orders=orders)
    z = calibrate_noise_multiplier(target_epsilon=2.0, **setting)
    assert z == calibrate_noise_multiplier(target_epsilon=2.0,
                                           linf_norm_clip=None, **setting)
    eps = epsilon_after_steps(noise_multiplier=z, **setting)
    assert 0.99 * 2.0 <= eps <= 2.0
    theirs = dp_accounting.rdp.RdpAccountant(orders).compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            0.02, dp_accounting.GaussianDpEvent(z)), 1000))
    assert eps == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-9)


def test_calibration_follows_an_optimal_order_beyond_the_leading_ones():
    # Little privacy loss per step: the optimal order is 256, above the
    # orders a search starts with; the result is still tight against all.
    setting = dict(delta=1e-5, steps=100, example_sampling_rate=0.01,
                   coordinate_sampling_rate=0.5, linf_norm_clip=0.1)
    z = calibrate_noise_multiplier(target_epsilon=0.0327, **setting)
    eps, order = epsilon_and_optimal_order_after_steps(noise_multiplier=z,
                                                       **setting)
    assert 0.99 * 0.0327 <= eps <= 0.0327
    assert order > 64


@pytest.mark.parametrize('z', [0.3, 1.0, 5.0, 30.0])
def test_leading_orders_bound_all_orders(z):
    setting = dict(SETTING)
    blocks = blocks_lib.Blocks.from_arguments(
        z, 1.0, 0.1,
        coordinate_sampling_rate=setting.pop('coordinate_sampling_rate'))
    function = calibration.checked_epsilon_function(
        orders=None, conversion='dp_accounting', **setting)
    eps, order = function.epsilon_and_optimal_order(blocks)
    leading, leading_order = function.leading_epsilon_and_optimal_order(
        blocks)
    assert leading >= eps
    # The leading orders grow until they hold the optimum of all orders.
    assert (leading, leading_order) == (eps, order)


def test_search_on_a_loose_bound_is_made_tight_by_the_exact_function():
    def exact(s):
        return 1.0 / s

    def loose(s):  # A sound but loose upper bound of `exact`.
        return 1.5 / s

    s = calibration.smallest_scale_meeting(
        loose, 1.0, lower=0.01, upper=100.0, tolerance=1e-3,
        exact_epsilon_of_scale=exact)
    assert 0.999 <= exact(s) <= 1.0
    # A bound that never meets the target: the exact function decides.
    s = calibration.smallest_scale_meeting(
        lambda s: 10.0, 1.0, lower=0.1, upper=10.0, tolerance=1e-2,
        exact_epsilon_of_scale=exact)
    assert 0.99 <= exact(s) <= 1.0
    with pytest.raises(ValueError, match='unreachable'):
        calibration.smallest_scale_meeting(
            lambda s: 10.0, 0.01, lower=0.1, upper=10.0, tolerance=1e-2,
            exact_epsilon_of_scale=exact)


@pytest.mark.parametrize('start', [None, 1e-3, 0.5, 3.0, 1e3])
def test_search_from_any_start_is_tight_or_at_the_lower_end(start):
    def epsilon(s):
        return 2.0 / s ** 2

    s = calibration.smallest_scale_meeting(
        epsilon, 1.0, lower=0.01, upper=100.0, tolerance=1e-4, start=start)
    assert 1.0 - 1e-4 <= epsilon(s) <= 1.0
    assert calibration.smallest_scale_meeting(
        epsilon, 1e3, lower=0.1, upper=100.0, tolerance=1e-4,
        start=start) == 0.1


def test_search_handles_kinks_jumps_and_infinities():
    # A minimum of curves (as over RDP orders): kinks.
    def kinked(s):
        return min(3.0 / s, 1.0 + 1.0 / s ** 3, 0.2 + 4.0 / s ** 0.5)

    s = calibration.smallest_scale_meeting(kinked, 1.5, lower=0.01,
                                           upper=1e4, tolerance=1e-6)
    assert 1.5 * (1 - 1e-6) <= kinked(s) <= 1.5
    # A jump from 2 to 0.5 at s = 3 never lands in [0.99, 1]: the smallest
    # passing scale is returned, to the search's resolution.
    s = calibration.smallest_scale_meeting(
        lambda s: 2.0 if s < 3.0 else 0.5, 1.0, lower=0.01, upper=1e4,
        tolerance=0.01)
    assert 3.0 <= s <= 3.0 * (1 + 1e-9)
    # Infinite epsilon at small scales.
    s = calibration.smallest_scale_meeting(
        lambda s: np.inf if s < 1.0 else 1.0 / s, 0.5, lower=0.01, upper=1e4,
        tolerance=0.01)
    assert 0.99 * 0.5 <= 1.0 / s <= 0.5


def test_unreachable_target_is_a_clear_error():
    with pytest.raises(ValueError, match='target_epsilon=1e-06 is unreachable'):
        calibrate_noise_multiplier(target_epsilon=1e-6, delta=1e-5,
                                   steps=100_000, example_sampling_rate=1.0,
                                   coordinate_sampling_rate=1.0,
                                   linf_norm_clip=None)


@pytest.mark.parametrize('overrides,message', [
    (dict(target_epsilon=0.0), 'target_epsilon must be a finite number > 0'),
    (dict(delta=0.0), r'delta must be in \(0, 1\)'),
    (dict(delta=1.0), r'delta must be in \(0, 1\)'),
    (dict(steps=0), 'steps must be an integer >= 1'),
    (dict(steps=2.5), 'steps must be an integer >= 1'),
    (dict(example_sampling_rate=0.0), 'example_sampling_rate'),
    (dict(tolerance=1.0), r'tolerance must be in \(0, 1\)'),
])
def test_calibration_bad_arguments(overrides, message):
    kwargs = dict(target_epsilon=1.0, linf_norm_clip=0.1, **SETTING)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        calibrate_noise_multiplier(**kwargs)


# ---------------------------------------------------------------------------
# [HYBRID-OPT] closed form and [NOISE-OPT].

CLIPS = [0.6, 0.3, 0.2, 0.4, 1.0]
RANKS = [10, 50, 200, 1000, 50_000]


def test_closed_form_has_the_gaussian_budget_and_the_right_shape():
    z = np.array(hybrid_clipping_noise_multipliers(
        l2_norm_clips=CLIPS, ranks=RANKS, effective_noise_multiplier=2.0))
    sigma2 = (z * CLIPS) ** 2
    assert np.sum(np.square(CLIPS) / sigma2) == pytest.approx(1 / 4.0)
    shape = np.array(CLIPS) / np.sqrt(RANKS)
    np.testing.assert_allclose(sigma2 / sigma2[0], shape / shape[0],
                               rtol=1e-12)
    total = np.sum(np.array(RANKS) * sigma2)
    assert total == pytest.approx(4.0 * np.sum(CLIPS * np.sqrt(RANKS)) ** 2)


def test_optimizer_reproduces_the_closed_form_without_sampling():
    # Without sampling the l-infinity clip plays no role (it binds no block
    # here: c2 / c_inf <= sqrt(rank) everywhere, so ranks do not tighten).
    z = np.array(optimize_block_noise(
        target_epsilon=4.0, delta=1e-5, steps=1, example_sampling_rate=1.0,
        coordinate_sampling_rate=1.0, l2_norm_clips=CLIPS,
        linf_norm_clips=[None] * 5, ranks=RANKS))
    sigma2 = (z * CLIPS) ** 2
    shape = np.array(CLIPS) / np.sqrt(RANKS)
    np.testing.assert_allclose(sigma2 / sigma2[0], shape / shape[0],
                               rtol=2e-3)
    eps = epsilon_after_steps(
        steps=1, delta=1e-5, example_sampling_rate=1.0,
        coordinate_sampling_rate=1.0, noise_multiplier=z, l2_norm_clip=CLIPS,
        linf_norm_clip=None)
    assert 0.999 * 4.0 <= eps <= 4.0


def _total_variance(z):
    return float(np.sum(np.array(RANKS) * (np.asarray(z) * CLIPS) ** 2))


def test_optimizer_with_twice_sampling_meets_budget_and_beats_uniform_noise():
    linf = [0.1, 0.05, 0.02, 0.02, 0.01]
    setting = dict(target_epsilon=3.0, **SETTING)
    z = optimize_block_noise(l2_norm_clips=CLIPS, linf_norm_clips=linf,
                             ranks=RANKS, **setting)
    eps = epsilon_after_steps(
        noise_multiplier=z, l2_norm_clip=CLIPS, linf_norm_clip=linf,
        block_dimensions=RANKS, **SETTING)
    assert 0.99 * 3.0 <= eps <= 3.0
    uniform = calibrate_noise_multiplier(
        l2_norm_clip=CLIPS, linf_norm_clip=linf, block_dimensions=RANKS,
        **setting)
    assert _total_variance(z) < 0.5 * _total_variance([uniform] * 5)
    # Local optimality: random feasible perturbations do not do better.
    rng = np.random.default_rng(1)
    for _ in range(4):
        shape = np.asarray(z) * np.exp(rng.normal(scale=0.05, size=5))
        scale = calibration.smallest_scale_meeting(
            lambda s, shape=shape: epsilon_after_steps(
                noise_multiplier=s * shape, l2_norm_clip=CLIPS,
                linf_norm_clip=linf, block_dimensions=RANKS, **SETTING),
            3.0, lower=0.5, upper=2.0, tolerance=1e-4)
        assert _total_variance(scale * shape) >= _total_variance(z) * (1 - 1e-3)


def test_optimizer_bad_arguments():
    with pytest.raises(ValueError, match='ranks'):
        optimize_block_noise(target_epsilon=1.0, l2_norm_clips=[1.0, 1.0],
                             linf_norm_clips=[None, None], ranks=[10, 0],
                             **SETTING)
    with pytest.raises(ValueError, match='equal lengths'):
        optimize_block_noise(target_epsilon=1.0, l2_norm_clips=[1.0, 1.0],
                             linf_norm_clips=[None, None], ranks=[10, 20, 30],
                             **SETTING)
    with pytest.raises(ValueError, match='unreachable'):
        optimize_block_noise(target_epsilon=1e-7, delta=1e-5, steps=10 ** 6,
                             example_sampling_rate=1.0,
                             coordinate_sampling_rate=1.0,
                             l2_norm_clips=[1.0, 1.0],
                             linf_norm_clips=[None, None], ranks=[10, 10])
    assert MAX_NOISE_MULTIPLIER >= 1e3
