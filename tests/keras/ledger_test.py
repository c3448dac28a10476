"""Tests of the PrivacyLedger callback (tf_twice.keras.ledger) on a plain
Keras model, which keeps no record of its steps: the ledger charges each
execution's steps before it runs.

What needs a fit is tested here: the hooks that charge, write ahead, log
and stop. The arithmetic and the state file are tested without TensorFlow
(tests/accounting: budget_test, budget_attack_test, step_ledger_test).
"""

import glob
import json

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tests.keras.ledger_setup import accountant_epsilon as _accountant_epsilon
from tests.keras.ledger_setup import data as _data
from tests.keras.ledger_setup import DELTA, EVENT, OTHER_EVENT
from tests.keras.ledger_setup import model as _model
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import budget as budget_lib
from tf_twice.keras.ledger import PrivacyLedger


def _target_between(k):
    """A target with epsilon(k steps) <= target < epsilon(k + 1 steps)."""
    low = _accountant_epsilon((EVENT, k))
    high = _accountant_epsilon((EVENT, k + 1))
    assert low < high
    return (low + high) / 2


class _StepWatcher(tf.keras.callbacks.Callback):
    """Listed after the ledger: records, before each execution runs, the
    steps the optimizer took, the steps the ledger had charged and those
    its state file charged."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        with open(self.ledger.state_path) as f:
            on_file = json.load(f)['steps']
        self.seen.append((int(self.model.optimizer.iterations),
                          self.ledger.steps, on_file))


def _logged_epsilons(log_dir):
    values = {}
    for name in glob.glob(str(log_dir / 'events.out.tfevents.*')):
        for record in tf.compat.v1.train.summary_iterator(name):
            for v in record.summary.value:
                if v.tag == 'epoch_epsilon':
                    values[record.step] = float(tf.make_ndarray(v.tensor))
    return values


def test_a_plain_models_steps_are_charged_and_written_before_they_run(
        tmp_path):
    # Each execution of steps_per_execution steps is charged, in memory and
    # in the state file, before it runs: a crash (an exception in any
    # callback) finds every step that ran charged. The epoch's epsilon goes
    # to the logs and to log_dir.
    k = 2
    model = _model(steps_per_execution=k)
    ledger = PrivacyLedger(EVENT, DELTA, state_path=str(tmp_path / 'l.json'),
                           save_every_steps=1, log_dir=str(tmp_path))
    watcher = _StepWatcher(ledger)
    history = model.fit(_data(steps=4), epochs=2, verbose=0,
                        callbacks=[ledger, watcher])
    assert [(ran, charged) for ran, charged, _ in watcher.seen] == [
        (i, i + k) for i in range(0, 8, k)]
    assert all(on_file >= charged for _, charged, on_file in watcher.seen)
    assert ledger.steps == 8 == int(model.optimizer.iterations)
    assert ledger.epsilon == pytest.approx(
        _accountant_epsilon((EVENT, 8)), rel=1e-12)
    epoch_epsilons = [_accountant_epsilon((EVENT, 4)),
                      _accountant_epsilon((EVENT, 8))]
    assert history.history['epsilon'] == pytest.approx(epoch_epsilons,
                                                       rel=1e-12)
    assert _logged_epsilons(tmp_path) == pytest.approx(
        dict(enumerate(epoch_epsilons)), rel=1e-6)
    assert ledger.accountant.get_epsilon(DELTA) == ledger.epsilon
    assert ledger.dp_event == dp_accounting.SelfComposedDpEvent(EVENT, 8)
    assert not ledger.stopped_by_budget


def test_stops_before_an_execution_would_exceed_the_target():
    # The 7th step would stay within the target, but the execution of 3
    # that holds it would not: training stops after 6 steps, and the
    # weights are those of exactly the first 6 logical batches.
    target = _target_between(7)
    model = _model(steps_per_execution=3)
    initial = model.get_weights()
    ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=target)
    model.fit(_data(steps=30), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.stopped_by_budget and not ledger.stopped_at_max_steps
    assert ledger.steps == 6 == int(model.optimizer.iterations)
    assert ledger.epsilon_after(1) <= target < ledger.epsilon_after(3)
    assert _accountant_epsilon((EVENT, ledger.steps)) <= target

    reference = _model()
    reference.set_weights(initial)
    for x, y, w in list(_data(steps=6).as_numpy_iterator()):
        reference.train_on_batch(x, y, sample_weight=w)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_fits_state_file_resumes_and_max_steps_counts_its_steps(tmp_path):
    path = str(tmp_path / 'privacy_ledger.json')
    model = _model()
    model.fit(_data(), epochs=1, callbacks=[PrivacyLedger(
        EVENT, DELTA, state_path=path, verbose=0)], verbose=0)
    with open(path) as f:
        state = json.load(f)
    # Exact once the fit ended (it was written 10 steps ahead).
    assert state['steps'] == 5 and state['reserved_steps'] == 0
    assert state['segments'] == [{'event': budget_lib.event_to_json(EVENT),
                                  'count': 5}]
    assert state['delta'] == DELTA

    resumed = PrivacyLedger(EVENT, DELTA, state_path=path, max_steps=7,
                            verbose=0)
    assert resumed.steps == 5
    model.fit(_data(seed=2), epochs=5, callbacks=[resumed], verbose=0)
    assert resumed.stopped_at_max_steps and not resumed.stopped_by_budget
    assert resumed.steps == 7 == int(model.optimizer.iterations)
    assert resumed.epsilon == pytest.approx(_accountant_epsilon((EVENT, 7)),
                                            rel=1e-12)
    assert PrivacyLedger(EVENT, DELTA, state_path=path).steps == 7
    # A later fit runs no step at all.
    model.fit(_data(), epochs=1, callbacks=[resumed], verbose=0)
    assert resumed.steps == 7 == int(model.optimizer.iterations)


def test_get_state_from_state_round_trip(tmp_path):
    ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=50.0)
    ledger.record_steps(4)
    state = json.loads(json.dumps(ledger.get_state()))
    copy = PrivacyLedger.from_state(state)
    assert copy.steps == 4 and copy.event == EVENT
    assert copy.delta == DELTA and copy.target_epsilon == 50.0
    assert copy.epsilon == ledger.epsilon
    np.testing.assert_array_equal(copy.orders, ledger.orders)
    other = PrivacyLedger.from_state(state, event=OTHER_EVENT, delta=1e-6)
    other.record_steps(2)
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(EVENT, 4).compose(OTHER_EVENT, 2)
    assert other.epsilon == pytest.approx(accountant.get_epsilon(1e-6))
    path = str(tmp_path / 'ledger.json')
    ledger.save(path)
    with pytest.raises(ValueError, match='already holds a ledger'):
        PrivacyLedger.from_state(state, state_path=path)
    empty = PrivacyLedger(EVENT, DELTA).get_state()
    with pytest.raises(ValueError, match='event is required'):
        PrivacyLedger.from_state(empty)


@pytest.mark.parametrize('kwargs, match', [
    (dict(delta=0.0), 'delta'),
    (dict(delta=1.0), 'delta'),
    (dict(delta='x'), 'delta'),
    (dict(target_epsilon=-1.0), 'target_epsilon'),
    (dict(target_epsilon=float('inf')), 'target_epsilon'),
    (dict(save_every_steps=0), 'save_every_steps'),
    (dict(save_every_steps=1.5), 'save_every_steps'),
    (dict(event='gaussian'), 'DpEvent'),
    (dict(event=dp_accounting.PoissonSampledDpEvent(0.1, EVENT)),
     'PoissonSampledDpEvent'),
    (dict(state_path=3), 'state_path'),
    (dict(max_steps=-1), 'max_steps'),
    (dict(max_steps=1.5), 'max_steps'),
    (dict(max_steps=True), 'max_steps'),
])
def test_bad_arguments(kwargs, match):
    args = dict(event=EVENT, delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PrivacyLedger(args.pop('event'), args.pop('delta'), **args)
    ledger = PrivacyLedger(EVENT, DELTA)
    with pytest.raises(ValueError, match='count'):
        ledger.record_steps(0)
    with pytest.raises(ValueError, match='extra_steps'):
        ledger.epsilon_after(-1)
