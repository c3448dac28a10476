"""Adversarial checks of PrivacyBudget's write-ahead and accounting promise."""

import json
import random

import pytest

from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting.budget import PrivacyBudget

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

DELTA = 1e-5
EVENT = TwiceSampledGaussianDpEvent(
    example_sampling_rate=0.25, coordinate_sampling_rate=0.5,
    noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=0.5)


def _file_steps(path):
    with open(path) as f:
        state = json.load(f)
    return state['steps'], sum(s['count'] for s in state['segments'])


@pytest.mark.parametrize('save_every', [1, 3, 10])
def test_crash_after_reserve_never_undercounts(tmp_path, save_every):
    """Random executions: reserve_ahead(k), then the k steps 'run' (crash
    point: the file must charge >= steps that ran), then charge(k)."""
    path = str(tmp_path / 'ledger.json')
    rng = random.Random(save_every)
    b = PrivacyBudget(EVENT, DELTA, state_path=path,
                      save_every_steps=save_every)
    ran = 0
    for i in range(60):
        k = rng.choice([1, 1, 2, 4, 7, 13])
        b.reserve_ahead(k)
        ran += k  # Steps executed; crash here.
        steps, seg_total = _file_steps(path)
        assert steps >= ran and seg_total >= ran, (i, steps, ran)
        b.charge(k)
        steps, seg_total = _file_steps(path)
        assert steps >= ran and seg_total >= ran
        assert steps == seg_total
        if i % 17 == 0:
            b.write()
            assert _file_steps(path)[0] == ran == b.steps
    # A crash-resumed ledger never reports fewer steps than ran.
    assert PrivacyBudget(EVENT, DELTA, state_path=path).steps >= ran


@pytest.mark.parametrize('max_steps,save_every,ks', [
    (5, 10, [1, 1, 1, 1, 1]),
    (7, 3, [2, 2, 2, 1]),
    (4, 10, [3, 3]),       # Second execution runs past max_steps.
    (0, 10, [1]),          # Nothing allowed, yet a step runs anyway.
])
def test_max_steps_cap_never_below_charged(tmp_path, max_steps, save_every,
                                           ks):
    path = str(tmp_path / 'ledger.json')
    b = PrivacyBudget(EVENT, DELTA, max_steps=max_steps, state_path=path,
                      save_every_steps=save_every)
    ran = 0
    for k in ks:
        b.reserve_ahead(k)
        ran += k
        steps, _ = _file_steps(path)
        assert steps >= ran, (steps, ran)
        # The cap only limits steps ahead when within max_steps.
        if ran <= max_steps:
            assert steps <= max(max_steps, ran)
        b.charge(k)
        assert _file_steps(path)[0] >= ran
    assert b.steps == ran


@pytest.mark.parametrize('k', [1, 7, 100, 1234])
def test_epsilon_matches_fresh_accountant(k):
    b = PrivacyBudget(EVENT, DELTA)
    for chunk in [k // 3, k - k // 3 - k // 5, k // 5]:
        if chunk:
            b.charge(chunk)
    assert b.steps == k
    fresh = TwiceSamplingRdpAccountant().compose(EVENT, k).get_epsilon(DELTA)
    assert b.epsilon == pytest.approx(fresh, rel=1e-9)
    # epsilon_after: arithmetic extrapolation agrees with real composition.
    fresh2 = TwiceSamplingRdpAccountant().compose(EVENT, k + 37).get_epsilon(
        DELTA)
    assert b.epsilon_after(37) == pytest.approx(fresh2, rel=1e-9)
    # A fresh zero-step budget's epsilon_after(k) equals it too.
    assert PrivacyBudget(EVENT, DELTA).epsilon_after(k) == pytest.approx(
        fresh, rel=1e-9)


def test_resume_from_state_file_continues(tmp_path):
    path = str(tmp_path / 'ledger.json')
    b = PrivacyBudget(EVENT, DELTA, state_path=path, save_every_steps=4)
    for _ in range(9):
        b.reserve_ahead(1)
        b.charge(1)
    b.write()
    r = PrivacyBudget(EVENT, DELTA, state_path=path, save_every_steps=4)
    assert r.resumed
    assert r.steps == b.steps == 9
    assert r.epsilon == pytest.approx(b.epsilon, rel=1e-9)
    # Continue: the resumed ledger adds to, never restarts from, the file.
    r.reserve_ahead(5)
    r.charge(5)
    r.write()
    r2 = PrivacyBudget(EVENT, DELTA, state_path=path)
    assert r2.steps == 14
    fresh = TwiceSamplingRdpAccountant().compose(EVENT, 14).get_epsilon(DELTA)
    assert r2.epsilon == pytest.approx(fresh, rel=1e-9)
    # Crash without write(): reserved steps stay charged (over-count only).
    r2.reserve_ahead(2)
    r3 = PrivacyBudget(EVENT, DELTA, state_path=path)
    assert r3.steps >= 16
    # from_state round trip keeps steps and epsilon.
    r4 = PrivacyBudget.from_state(r2.get_state())
    assert r4.steps == r2.steps == 14
    assert r4.epsilon == pytest.approx(r2.epsilon, rel=1e-9)


def test_write_or_save_between_reserve_and_charge_keeps_the_running_steps(
        tmp_path):
    # A save from another callback while a step runs must not cancel the
    # step's write-ahead: a crash before charge would lose it.
    for finish in ('write', 'save'):
        path = str(tmp_path / f'{finish}.json')
        budget = PrivacyBudget(EVENT, DELTA, state_path=path,
                               save_every_steps=10)
        budget.reserve_ahead(1)
        getattr(budget, finish)()
        assert _file_steps(path)[0] >= 1  # The running step stays charged.
        budget.charge(1)
        budget.write()
        assert _file_steps(path) == (1, 1)  # Exact once it is charged.


def test_another_event_composed_between_reserve_and_charge_reaches_the_file(
        tmp_path):
    path = str(tmp_path / 'state.json')
    budget = PrivacyBudget(EVENT, DELTA, state_path=path, save_every_steps=10)
    other = TwiceSampledGaussianDpEvent(
        example_sampling_rate=EVENT.example_sampling_rate,
        coordinate_sampling_rate=EVENT.coordinate_sampling_rate,
        noise_multiplier=0.5 * EVENT.noise_multiplier,
        l2_norm_clip=EVENT.l2_norm_clip, linf_norm_clip=EVENT.linf_norm_clip,
        block_dimensions=EVENT.block_dimensions)
    budget.reserve_ahead(1)
    budget.compose(other, 5)
    budget.charge(1)
    with open(path) as f:
        on_disk = json.load(f)
    assert on_disk['epsilon'] >= budget.epsilon * (1 - 1e-12)
