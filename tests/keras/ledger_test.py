"""Tests of the PrivacyLedger callback (tf_twice.keras.ledger)."""

import glob
import json
import logging

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


def test_epsilon_equals_accountant_and_lands_in_history():
    model = _model()
    ledger = PrivacyLedger(EVENT, DELTA)
    history = model.fit(_data(), epochs=2, callbacks=[ledger], verbose=0)
    assert ledger.steps == 10 == int(model.optimizer.iterations)
    assert ledger.epsilon == pytest.approx(
        _accountant_epsilon((EVENT, 10)), rel=1e-12)
    assert history.history['epsilon'] == pytest.approx(
        [_accountant_epsilon((EVENT, 5)), _accountant_epsilon((EVENT, 10))],
        rel=1e-12)
    assert ledger.accountant.get_epsilon(DELTA) == ledger.epsilon
    assert ledger.dp_event == dp_accounting.SelfComposedDpEvent(EVENT, 10)
    assert not ledger.stopped_by_budget


def test_stops_before_exceeding_target_and_weights_match_k_steps():
    target = _target_between(7)
    model = _model()
    initial = model.get_weights()
    ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=target)
    model.fit(_data(), epochs=5, callbacks=[ledger], verbose=0)
    assert ledger.stopped_by_budget
    assert ledger.steps == 7 == int(model.optimizer.iterations)
    assert ledger.epsilon <= target < ledger.epsilon_after(1)
    assert _accountant_epsilon((EVENT, ledger.steps)) <= target
    assert ledger.remaining_steps() == 0

    # The same model trained on exactly the first 7 logical batches.
    reference = _model()
    reference.set_weights(initial)
    for x, y, w in list(_data(steps=7).as_numpy_iterator()):
        reference.train_on_batch(x, y, sample_weight=w)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_exhausted_budget_runs_no_step_and_restores_train_function():
    target = _target_between(3)
    ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=target)
    ledger.record_steps(3)
    model = _model()
    initial = model.get_weights()
    model.fit(_data(), epochs=2, callbacks=[ledger], verbose=0)
    assert int(model.optimizer.iterations) == 0 and ledger.steps == 3
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    # The blocked train function was only for that fit.
    model.fit(_data(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 5


class _StepWatcher(tf.keras.callbacks.Callback):
    """Listed after the ledger: records, before each execution runs, the
    steps the optimizer took and the steps the ledger had charged."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append((int(self.model.optimizer.iterations),
                          self.ledger.steps))


@pytest.mark.parametrize('steps_per_execution', [1, 2])
def test_a_plain_models_steps_are_charged_before_they_run(
        steps_per_execution):
    model = _model(steps_per_execution=steps_per_execution)
    ledger = PrivacyLedger(EVENT, DELTA)
    watcher = _StepWatcher(ledger)
    model.fit(_data(steps=4), callbacks=[ledger, watcher], verbose=0)
    k = steps_per_execution
    assert watcher.seen == [(i, i + k) for i in range(0, 4, k)]
    assert ledger.steps == 4 == int(model.optimizer.iterations)


def test_steps_per_execution_stops_at_a_multiple():
    target = _target_between(7)
    model = _model(steps_per_execution=3)
    ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=target)
    model.fit(_data(steps=30), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 6 == int(model.optimizer.iterations)
    assert ledger.epsilon <= target


def test_save_and_resume_keeps_privacy_spent(tmp_path):
    (tmp_path / 'ckpt').mkdir()  # A missing directory is refused.
    path = str(tmp_path / 'ckpt' / 'privacy_ledger.json')
    model = _model()
    model.fit(_data(), epochs=1, callbacks=[PrivacyLedger(
        EVENT, DELTA, state_path=path, verbose=0)], verbose=0)
    with open(path) as f:
        state = json.load(f)
    assert state['steps'] == 5 and state['reserved_steps'] == 0
    assert state['segments'] == [{'event': budget_lib.event_to_json(EVENT),
                                  'count': 5}]
    assert state['delta'] == DELTA

    resumed = PrivacyLedger(EVENT, DELTA, state_path=path, verbose=0)
    assert resumed.steps == 5
    assert resumed.epsilon == pytest.approx(_accountant_epsilon((EVENT, 5)))
    model.fit(_data(seed=2), epochs=1, callbacks=[resumed], verbose=0)
    assert resumed.steps == 10
    assert resumed.epsilon == pytest.approx(_accountant_epsilon((EVENT, 10)),
                                            rel=1e-12)
    assert PrivacyLedger(EVENT, DELTA, state_path=path).steps == 10


def test_resume_with_other_event_composes_both(tmp_path, caplog):
    path = str(tmp_path / 'ledger.json')
    first = PrivacyLedger(EVENT, DELTA, state_path=path)
    first.record_steps(5)
    with caplog.at_level(logging.WARNING, logger='tf_twice.keras.ledger'):
        PrivacyLedger(EVENT, DELTA, state_path=path)  # The same mechanism.
        assert 'another mechanism' not in caplog.text
        second = PrivacyLedger(OTHER_EVENT, DELTA, state_path=path)
        assert 'ran another mechanism' in caplog.text  # Said, at verbose=1.
    assert second.epsilon == pytest.approx(_accountant_epsilon((EVENT, 5)))
    _model().fit(_data(steps=3), epochs=1, callbacks=[second], verbose=0)
    expected = _accountant_epsilon((EVENT, 5), (OTHER_EVENT, 3))
    assert second.steps == 8
    assert second.epsilon == pytest.approx(expected, rel=1e-12)
    third = PrivacyLedger(EVENT, DELTA, state_path=path)
    assert third.epsilon == pytest.approx(expected, rel=1e-12)
    segments = json.load(open(path))['segments']
    assert [s['count'] for s in segments] == [5, 3]
    assert budget_lib.event_from_json(segments[1]['event']) == OTHER_EVENT


class _Crash(tf.keras.callbacks.Callback):

    def __init__(self, after_steps):
        super().__init__()
        self.after_steps = after_steps

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.after_steps:
            raise RuntimeError('simulated crash')


@pytest.mark.parametrize('save_every_steps', [1, 4])
def test_crash_never_loses_steps(tmp_path, save_every_steps):
    path = str(tmp_path / 'ledger.json')
    model = _model()
    ledger = PrivacyLedger(EVENT, DELTA, state_path=path,
                           save_every_steps=save_every_steps)
    # The crash comes before the ledger sees the end of step 3.
    with pytest.raises(RuntimeError, match='simulated crash'):
        model.fit(_data(), epochs=1, callbacks=[_Crash(3), ledger], verbose=0)
    taken = int(model.optimizer.iterations)
    # Step 3 was charged before it ran, also in memory.
    assert taken == 3 and ledger.steps == 3
    reloaded = PrivacyLedger(EVENT, DELTA, state_path=path)
    assert taken <= reloaded.steps <= taken + save_every_steps
    assert reloaded.epsilon >= _accountant_epsilon((EVENT, taken))


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


def test_log_dir_writes_epsilon_scalar(tmp_path):
    ledger = PrivacyLedger(EVENT, DELTA, log_dir=str(tmp_path))
    _model().fit(_data(steps=2), epochs=2, callbacks=[ledger], verbose=0)
    values = {}
    for name in glob.glob(str(tmp_path / 'events.out.tfevents.*')):
        for record in tf.compat.v1.train.summary_iterator(name):
            for v in record.summary.value:
                if v.tag == 'epoch_epsilon':
                    values[record.step] = float(
                        tf.make_ndarray(v.tensor))
    assert values == pytest.approx({
        0: _accountant_epsilon((EVENT, 2)),
        1: _accountant_epsilon((EVENT, 4))}, rel=1e-6)


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


# --- max_steps: the plan's end ---------------------------------------------


def test_max_steps_stops_fit_exactly_there():
    model = _model()
    ledger = PrivacyLedger(EVENT, DELTA, max_steps=7, verbose=0)
    assert ledger.max_steps == 7 and ledger.remaining_steps() == 7
    model.fit(_data(), epochs=5, callbacks=[ledger], verbose=0)
    assert ledger.stopped_at_max_steps and not ledger.stopped_by_budget
    assert ledger.steps == 7 == int(model.optimizer.iterations)
    assert ledger.remaining_steps() == 0 and not ledger.can_take(1)
    # A later fit runs no step at all.
    model.fit(_data(), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 7 == int(model.optimizer.iterations)
    assert ledger.stopped_at_max_steps


def test_max_steps_zero_runs_no_step():
    model = _model()
    initial = model.get_weights()
    ledger = PrivacyLedger(EVENT, DELTA, max_steps=0, verbose=0)
    model.fit(_data(), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 0 == int(model.optimizer.iterations)
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)


def test_max_steps_with_steps_per_execution_stops_at_a_multiple():
    model = _model(steps_per_execution=3)
    ledger = PrivacyLedger(EVENT, DELTA, max_steps=7, verbose=0)
    model.fit(_data(steps=30), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 6 == int(model.optimizer.iterations)
    assert ledger.stopped_at_max_steps


def test_max_steps_counts_resumed_steps(tmp_path):
    path = str(tmp_path / 'ledger.json')
    model = _model()
    model.fit(_data(steps=4), epochs=1, callbacks=[PrivacyLedger(
        EVENT, DELTA, state_path=path, verbose=0)], verbose=0)
    resumed = PrivacyLedger(EVENT, DELTA, state_path=path, max_steps=7,
                            verbose=0)
    assert resumed.steps == 4 and resumed.remaining_steps() == 3
    model.fit(_data(), epochs=5, callbacks=[resumed], verbose=0)
    assert resumed.steps == 7 and resumed.stopped_at_max_steps
    assert int(model.optimizer.iterations) == 4 + 3
    assert PrivacyLedger(EVENT, DELTA, state_path=path).steps == 7
