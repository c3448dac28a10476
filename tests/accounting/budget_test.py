"""Tests of the ledger's TF-free state (tf_twice.accounting.budget).

The Keras callback over it is tested in ledger_test.
"""

import errno
import json
import os
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest

from tf_twice import accounting
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import ledger_state
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting.budget import PrivacyBudget
from tests.paths import ROOT

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

DELTA = 1e-5
EVENT = TwiceSampledGaussianDpEvent(
    example_sampling_rate=0.25, coordinate_sampling_rate=0.5,
    noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=0.5)


def _epsilon(steps, event=EVENT):
    return TwiceSamplingRdpAccountant().compose(event, steps).get_epsilon(
        DELTA)


def test_accounting_imports_and_runs_with_tensorflow_blocked(tmp_path):
    code = f'''
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('tensorflow', 'tensorflow_privacy', 'keras',
                                  'tf_keras'):
            raise ImportError('blocked for the test: ' + name)
sys.meta_path.insert(0, Block())
import tf_twice.accounting
from tf_twice.accounting import budget
b = budget.PrivacyBudget(tf_twice.accounting.TwiceSampledGaussianDpEvent(
    example_sampling_rate=0.01, coordinate_sampling_rate=0.5,
    noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=None), 1e-5,
    target_epsilon=3.0,
    state_path={str(tmp_path / 'ledger.json')!r})
b.reserve_ahead(1)
b.charge(1)
b.write()
print(b.remaining_steps() > 0, budget.PrivacyBudget(
    b.event, 1e-5, state_path=b.state_path).steps)
'''
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ['True', '1']


def test_epsilon_after_is_the_accountants_epsilon():
    budget = PrivacyBudget(EVENT, DELTA)
    budget.charge(3)
    for extra in (0, 1, 7, 1000):
        assert budget.epsilon_after(extra) == pytest.approx(
            _epsilon(3 + extra), rel=1e-12)
    assert budget.epsilon == budget.epsilon_after(0)
    assert budget.get_epsilon_and_optimal_order() == pytest.approx(
        TwiceSamplingRdpAccountant().compose(
            EVENT, 3).get_epsilon_and_optimal_order(DELTA))


def test_remaining_steps_is_the_largest_count_within_the_target():
    target = (_epsilon(20) + _epsilon(21)) / 2
    budget = PrivacyBudget(EVENT, DELTA, target_epsilon=target)
    assert budget.remaining_steps() == 20
    assert budget.remaining_steps(limit=5) == 5
    assert budget.remaining_steps(limit=0) == 0
    budget.charge(19)
    assert budget.remaining_steps() == 1 and budget.can_take(1)
    budget.charge(5)  # Charged past the target: none remain.
    assert budget.remaining_steps() == 0 and not budget.can_take(1)


def test_epsilon_depends_on_the_step_counts_not_on_how_they_were_charged(
        tmp_path):
    # A run whose noise was calibrated to hit its target to the last bit
    # must be allowed every planned step, charged one at a time as `fit`
    # does; summing step by step once drifted above the target.
    steps = 560
    target = accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, example_sampling_rate=0.25,
        coordinate_sampling_rate=0.5, noise_multiplier=1.0,
        l2_norm_clip=1.0, linf_norm_clip=0.5)
    path = str(tmp_path / 'ledger.json')
    one_by_one = PrivacyBudget(EVENT, DELTA, target_epsilon=target,
                               state_path=path)
    for _ in range(steps - 1):
        one_by_one.charge(1)
    assert one_by_one.epsilon_after(1) == target
    assert one_by_one.can_take(1)
    one_by_one.charge(1)
    assert one_by_one.epsilon == target
    assert PrivacyBudget(EVENT, DELTA, state_path=path).epsilon == target
    assert one_by_one.accountant.get_epsilon(DELTA) == target
    with pytest.raises(ValueError, match='count'):
        one_by_one.compose(EVENT, -1)  # Would lower epsilon.
    assert one_by_one.epsilon == target


def test_an_event_with_float32_fields_is_charged_its_float64_curve(tmp_path):
    # dp_accounting may compute a float32 event's RDP in float32 (lower); the
    # ledger charges every event of one key the curve of the key's values,
    # whether the event came in memory or from the state file.
    def gaussian(kind):
        return dp_accounting.PoissonSampledDpEvent(
            kind(0.004), dp_accounting.GaussianDpEvent(kind(0.6)))

    def as_float64(value):  # The float32 value, exactly, as a float.
        return float(np.float32(value))
    exact = _epsilon(1000, gaussian(as_float64))
    path = str(tmp_path / 'ledger.json')
    live = PrivacyBudget(gaussian(as_float64), DELTA, state_path=path)
    live.charge(1000)
    resumed = PrivacyBudget(gaussian(np.float32), DELTA, state_path=path)
    fresh = PrivacyBudget(gaussian(np.float32), DELTA)
    fresh.charge(1000)
    assert live.epsilon == resumed.epsilon == fresh.epsilon == exact
    assert fresh.accountant.get_epsilon(DELTA) == exact


@pytest.mark.parametrize('target_steps, max_steps, expected', [
    (None, None, 10), (4, None, 4), (None, 6, 6), (None, 1, 1)])
def test_write_ahead_is_capped_by_the_budget(tmp_path, target_steps,
                                             max_steps, expected):
    path = str(tmp_path / 'ledger.json')
    target = (None if target_steps is None else
              (_epsilon(target_steps) + _epsilon(target_steps + 1)) / 2)
    budget = PrivacyBudget(EVENT, DELTA, target_epsilon=target,
                           max_steps=max_steps, state_path=path,
                           save_every_steps=10)
    budget.reserve_ahead(1)
    with open(path) as f:
        state = json.load(f)
    assert state['steps'] == state['reserved_steps'] == expected
    if target is not None:  # A crash now leaves a file within the target.
        assert state['epsilon'] <= target
    budget.charge(1)  # Covered by the reservation: no write.
    with open(path) as f:
        assert json.load(f)['steps'] == expected
    budget.write()
    with open(path) as f:
        assert json.load(f)['steps'] == 1


def test_state_round_trip_keeps_segments_of_every_event():
    other = dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.1))
    budget = PrivacyBudget(EVENT, DELTA)
    budget.charge(2)
    budget.compose(other, 3)
    budget.charge(1)
    state = json.loads(json.dumps(budget.get_state()))
    assert [s['count'] for s in state['segments']] == [2, 3, 1]
    assert budget_lib.event_from_json(state['segments'][1]['event']) == other
    copy = PrivacyBudget.from_state(state)
    assert copy.steps == 6 and copy.event == EVENT
    assert copy.epsilon == budget.epsilon


def test_state_path_that_cannot_be_written_is_refused(tmp_path,
                                                      monkeypatch):
    with pytest.raises(ValueError, match='state_path.*does not exist'):
        PrivacyBudget(EVENT, DELTA, state_path=str(tmp_path / 'no' / 'l'))
    with pytest.raises(ValueError, match='state_path.*is a directory'):
        PrivacyBudget(EVENT, DELTA, state_path=tmp_path)
    assert os.listdir(tmp_path) == []
    # A path under a regular file.
    (tmp_path / 'notes.txt').write_text('')
    with pytest.raises(ValueError, match='notes.txt.* is a file, not a '
                       'directory'):
        PrivacyBudget(EVENT, DELTA,
                      state_path=str(tmp_path / 'notes.txt' / 'l.json'))
    state = PrivacyBudget(EVENT, DELTA).get_state()
    with pytest.raises(ValueError, match='does not exist'):
        PrivacyBudget.from_state(state, event=EVENT,
                                 state_path=str(tmp_path / 'no' / 'l'))
    # A read-only filesystem (root ignores permission bits, so it is
    # emulated where the writability probe creates its file).
    real_file = ledger_state.tempfile.NamedTemporaryFile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, 'Read-only file system')

    monkeypatch.setattr(ledger_state.tempfile, 'NamedTemporaryFile',
                        read_only)
    with pytest.raises(ValueError, match='state_path=.*not writable '
                       '\\(Read-only file system\\)'):
        PrivacyBudget(EVENT, DELTA, state_path=str(tmp_path / 'l.json'))
    assert os.listdir(tmp_path) == ['notes.txt']  # Nothing created.
    monkeypatch.setattr(ledger_state.tempfile, 'NamedTemporaryFile',
                        real_file)
    PrivacyBudget(EVENT, DELTA, state_path=str(tmp_path / 'l.json'))
    assert os.listdir(tmp_path) == ['notes.txt']  # The probe left nothing.


def test_atomic_write_survives_crash_mid_write(tmp_path, monkeypatch):
    path = str(tmp_path / 'ledger.json')
    budget = PrivacyBudget(EVENT, DELTA)
    budget.charge(2)
    budget.save(path)
    before = open(path).read()
    budget.charge(1)  # In memory; the next write fails half-way.
    real_dump = json.dump

    def dump_then_crash(obj, f, **kwargs):
        f.write(json.dumps(obj)[:20])
        raise OSError('disk gone mid-write')

    monkeypatch.setattr(budget_lib.json, 'dump', dump_then_crash)
    with pytest.raises(OSError, match='mid-write'):
        budget.save(path)
    monkeypatch.setattr(budget_lib.json, 'dump', real_dump)
    assert open(path).read() == before
    assert os.listdir(tmp_path) == ['ledger.json']  # No temp file left.
    assert PrivacyBudget(EVENT, DELTA, state_path=path).steps == 2


def _write_state(path, edit):
    """A state file of 4 steps, edited by `edit(state)`."""
    budget = PrivacyBudget(EVENT, DELTA)
    budget.charge(4)
    state = budget.get_state()
    edit(state)
    with open(path, 'w') as f:
        json.dump(state, f)
    return path


def test_bad_state_files_are_refused(tmp_path):
    path = tmp_path / 'ledger.json'
    path.write_text('{"format": "tf_twice.PrivacyLedger", "vers')
    with pytest.raises(ValueError, match='Cannot read'):
        PrivacyBudget(EVENT, DELTA, state_path=str(path))
    state = PrivacyBudget(EVENT, DELTA).get_state()
    for key, value, match in [('format', 'x', 'format'),
                              ('version', 99, 'version')]:
        path.write_text(json.dumps(dict(state, **{key: value})))
        with pytest.raises(ValueError, match=match):
            PrivacyBudget(EVENT, DELTA, state_path=str(path))
    evil = dict(state, segments=[{'event': {
        'module_name': 'os', 'class_name': 'system', 'arguments': {}},
        'count': 1}])
    path.write_text(json.dumps(evil))
    with pytest.raises(ValueError, match='only'):
        PrivacyBudget(EVENT, DELTA, state_path=str(path))


def test_a_state_file_edited_by_hand_is_refused(tmp_path):
    def to_no_op(state):  # Its events made free, the digest left.
        state['segments'][0]['event'] = budget_lib.event_to_json(
            dp_accounting.NoOpDpEvent())

    path = _write_state(str(tmp_path / 'ledger.json'), to_no_op)
    with pytest.raises(ValueError, match='history_digest does not match'):
        PrivacyBudget(EVENT, DELTA, state_path=path)


def test_a_version_1_state_file_is_read_and_rewritten_as_2(tmp_path):
    def to_version_1(state):
        state['version'] = 1
        del state['history_digest']

    path = _write_state(str(tmp_path / 'ledger.json'), to_version_1)
    budget = PrivacyBudget(EVENT, DELTA, state_path=path)
    assert budget.steps == 4
    budget.charge(1)
    with open(path) as f:
        state = json.load(f)
    assert state['version'] == 2 and state['steps'] == 5
    assert int(state['history_digest'], 16) == ledger_state.history_digest(
        budget.history())


@pytest.mark.parametrize('orders', [[0.5], [1.0], [float('nan')], [-2.0]])
def test_a_state_file_with_invalid_orders_is_refused(tmp_path, orders):
    # Closed: an RDP order <= 1 would convert to a meaningless (small) eps.
    path = _write_state(str(tmp_path / 'ledger.json'),
                        lambda state: state.update(orders=orders))
    with pytest.raises(ValueError, match='orders'):
        PrivacyBudget(EVENT, DELTA, state_path=path)


def test_other_dp_accounting_events_and_custom_orders():
    event = dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.1))
    budget = PrivacyBudget(event, DELTA, orders=[2, 4, 8, 16, 32])
    budget.charge(100)
    accountant = dp_accounting.rdp.RdpAccountant([2, 4, 8, 16, 32])
    accountant.compose(event, 100)
    assert budget.epsilon == pytest.approx(accountant.get_epsilon(DELTA))
    restored = PrivacyBudget.from_state(budget.get_state())
    assert list(restored.orders) == [2, 4, 8, 16, 32]


def test_remaining_steps_respects_max_steps_and_the_target():
    budget = PrivacyBudget(EVENT, DELTA, max_steps=10)
    budget.charge(4)
    assert budget.remaining_steps() == 6
    assert budget.remaining_steps(limit=2) == 2
    assert budget.can_take(6) and not budget.can_take(7)
    # The tighter of the two limits wins.
    target = (_epsilon(3) + _epsilon(4)) / 2
    assert PrivacyBudget(EVENT, DELTA, max_steps=10,
                         target_epsilon=target).remaining_steps() == 3
    assert PrivacyBudget(EVENT, DELTA, max_steps=2,
                         target_epsilon=target).remaining_steps() == 2
    assert PrivacyBudget(EVENT, DELTA).remaining_steps() is None
    over = PrivacyBudget(EVENT, DELTA, max_steps=3)
    over.charge(5)  # Charged past the plan (steps that ran anyway).
    assert over.remaining_steps() == 0 and not over.can_take(1)


def test_max_steps_counts_resumed_steps(tmp_path):
    path = str(tmp_path / 'ledger.json')
    first = PrivacyBudget(EVENT, DELTA, state_path=path)
    first.charge(4)
    first.write()
    resumed = PrivacyBudget(EVENT, DELTA, state_path=path, max_steps=7)
    assert resumed.steps == 4 and resumed.remaining_steps() == 3
    assert resumed.can_take(3) and not resumed.can_take(4)
