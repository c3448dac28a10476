"""Tests of the ledger's TF-free state (tf_twice.accounting.budget).

The Keras callback over it is tested in ledger_test.
"""

import json
import os
import subprocess
import sys

import dp_accounting
import pytest

from tf_twice.accounting import budget as budget_lib
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


def test_state_path_that_cannot_be_written_is_refused(tmp_path):
    # A read-only filesystem: in ledger_test.
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
