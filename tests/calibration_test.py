"""Tests of noise calibration and per-block noise optimisation."""

import dp_accounting
from dp_accounting import mechanism_calibration
import numpy as np
import pytest

from tf_twice.accounting import calibrate_noise_multiplier
from tf_twice.accounting import epsilon_after_steps
from tf_twice.accounting import hybrid_clipping_noise_multipliers
from tf_twice.accounting import MAX_NOISE_MULTIPLIER
from tf_twice.accounting import optimize_block_noise
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import calibration

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
    eps_less, _ = epsilon_after_steps(noise_multiplier=0.98 * z,
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
    eps, _ = epsilon_after_steps(
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
    eps, _ = epsilon_after_steps(
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
                linf_norm_clip=linf, block_dimensions=RANKS, **SETTING)[0],
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
