"""`StepLedger`, the TF-free half of `PrivacyLedger`: the rule applied to a
budget through readings, watches, custom loops and stops.

The weights here are a name and a record that steps extend, as a DPModel's
train step does (`privacy_record_test` checks that it does); the Keras
ledger's tests check that its hooks read the record where these readings do.
"""

import logging

import dp_accounting
import pytest

from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import ledger_state
from tf_twice.accounting import step_ledger
from tf_twice.accounting import step_record as sr

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

EVENT = dp_accounting.PoissonSampledDpEvent(
    0.01, dp_accounting.GaussianDpEvent(2.0))
OTHER = dp_accounting.PoissonSampledDpEvent(
    0.01, dp_accounting.GaussianDpEvent(3.0))
WORDS = sr.event_words(ledger_state.event_key(EVENT))
OTHER_WORDS = sr.event_words(ledger_state.event_key(OTHER))


class _Weights:
    """A model's weights and their record."""
    name = 'weights'

    def __init__(self, record=sr.EMPTY):
        self.record = record

    def run(self, count, words=WORDS):
        self.record = sr.extend(self.record, words, count)


class _Ledger(step_ledger.StepLedger):

    def __init__(self, model, *, verbose=0, **kwargs):
        self._setup(budget_lib.PrivacyBudget(EVENT, 1e-5, **kwargs),
                    verbose=verbose)
        self.model = model

    def _model_record(self):
        return self.model, getattr(self.model, 'record', None)


def test_every_step_is_charged_once_whichever_reading_sees_it():
    weights = _Weights()
    ledger = _Ledger(weights)
    weights.run(3)
    assert ledger.steps == 3
    assert ledger.steps == 3  # A second reading charges nothing.
    weights.run(2)
    assert ledger.get_state()['steps'] == 5
    assert ledger.epsilon == pytest.approx(
        budget_lib.PrivacyBudget(EVENT, 1e-5).epsilon_after(5))


def test_steps_after_a_watched_rollback_are_charged_beside_those_undone():
    weights = _Weights()
    ledger = _Ledger(weights)
    weights.run(5)
    ledger._sync(watch=True)
    weights.record = sr.extend(sr.EMPTY, WORDS, 3)  # Reloaded.
    ledger._sync(watch=True)  # As before an execution of fit.
    assert ledger.steps == 5
    weights.run(2)  # The same record as before the rollback.
    assert ledger.steps == 7


def test_a_new_ledger_charges_what_its_history_lacks():
    weights = _Weights()
    weights.run(4)
    state = _Ledger(_Weights(sr.extend(sr.EMPTY, WORDS, 3))).get_state()
    ledger = _Ledger(weights)
    ledger._setup(budget_lib.PrivacyBudget.from_state(state), verbose=0)
    assert ledger.steps == 4


@pytest.mark.parametrize('words', [sr.event_words(ledger_state.event_key(
    OTHER)), sr.UNCHECKED_INPUT, sr.NON_PRIVATE])
def test_steps_it_cannot_account_are_refused_or_logged(words, caplog):
    weights = _Weights()
    ledger = _Ledger(weights, verbose=1)
    weights.run(2)
    assert ledger.steps == 2
    weights.run(1, words)
    with pytest.raises(ValueError, match='cannot account'):
        ledger._sync()
    with caplog.at_level(logging.WARNING, 'tf_twice.keras.ledger'):
        assert ledger.steps == 2  # A reading logs instead.
    assert 'does not bound them' in caplog.text


def test_unchecked_steps_are_charged_only_while_a_fit_watches_them():
    weights = _Weights()
    ledger = _Ledger(weights)
    ledger.watch_unchecked_input(True)
    ledger._sync(watch=True)  # As before an execution of fit.
    weights.run(2, sr.UNCHECKED_INPUT)
    assert ledger.steps == 2
    ledger.watch_unchecked_input(False)
    with pytest.raises(ValueError, match='cannot account'):
        _Ledger(weights)._sync()


def test_record_steps_charges_what_no_reading_charged():
    weights = _Weights()
    ledger = _Ledger(weights)
    ledger.reserve_steps(2)
    weights.run(2)
    assert ledger.steps == 2  # Read mid-loop.
    ledger.record_steps(2)
    assert ledger.steps == 2
    ledger.reserve_steps(1)
    weights.run(1)
    ledger.record_steps(1)
    assert ledger.steps == 3
    plain = _Ledger(None)  # No record: the count is charged.
    plain.reserve_steps(3)
    plain.record_steps(3)
    assert plain.steps == 3


def test_steps_past_the_limits_are_not_reserved():
    weights = _Weights()
    ledger = _Ledger(weights, max_steps=2)
    ledger.reserve_steps(2)
    weights.run(2)
    ledger.record_steps(2)
    with pytest.raises(ValueError, match='exceed the ledger'):
        ledger.reserve_steps(1)
    assert ledger.steps == 2


def test_a_stop_says_whether_the_plan_ended_or_the_target_was_reached():
    planned = _Ledger(_Weights(), max_steps=3, target_epsilon=100.0)
    planned._note_stop(4)
    assert planned.stopped_at_max_steps and not planned.stopped_by_budget
    capped = _Ledger(_Weights(), target_epsilon=0.01)
    capped._note_stop(1)
    assert capped.stopped_by_budget and not capped.stopped_at_max_steps


def _resumed(history_ledger_event, steps, weights):
    """A _Ledger of EVENT on `weights` whose history starts with `steps`
    steps of `history_ledger_event`."""
    first = _Ledger(None)
    first._budget = budget_lib.PrivacyBudget(history_ledger_event, 1e-5)
    first._budget.charge(steps)
    ledger = _Ledger(weights)
    ledger._setup(budget_lib.PrivacyBudget.from_state(
        first.get_state(), event=EVENT), verbose=0)
    return ledger


def test_record_steps_charges_steps_the_record_shows_but_no_reading_charged():
    # Weights replaced mid-loop by a checkpoint the history covers: the
    # record advanced 3 steps, none charged; the loop's 1 step still is.
    weights = _Weights()
    ledger = _resumed(OTHER, 3, weights)
    ledger.reserve_steps(1)
    weights.record = sr.extend(sr.EMPTY, OTHER_WORDS, 3)  # covered
    ledger.record_steps(1)
    assert ledger.steps == 4


def test_steps_seen_before_reserve_do_not_count_towards_the_loops():
    weights = _Weights()
    ledger = _Ledger(weights)
    weights.run(2)  # Ran unseen before the loop: charged at reserve.
    ledger.reserve_steps(1)
    assert ledger.budget.steps == 2
    ledger.record_steps(1)  # The record shows none of the loop's step.
    assert ledger.steps == 3


def test_reserve_steps_watches_a_rolled_back_record():
    weights = _Weights()
    ledger = _Ledger(weights)
    ledger.reserve_steps(5)
    weights.run(5)
    ledger.record_steps(5)
    weights.record = sr.extend(sr.EMPTY, WORDS, 3)  # Reloaded.
    ledger.reserve_steps(1)
    weights.run(1)
    assert ledger.steps == 6  # A reading mid-loop sees the step.


def test_unchecked_steps_are_refused_once_the_watch_ends():
    weights = _Weights()
    ledger = _Ledger(weights)
    ledger.watch_unchecked_input(True)
    ledger._sync(watch=True)
    weights.run(1, sr.UNCHECKED_INPUT)
    assert ledger.steps == 1
    ledger.watch_unchecked_input(False)
    weights.run(1, sr.UNCHECKED_INPUT)
    with pytest.raises(ValueError, match='cannot account'):
        ledger._sync()


def test_unchecked_steps_of_other_weights_are_refused():
    weights, other = _Weights(), _Weights()
    ledger = _Ledger(weights)
    ledger.watch_unchecked_input(True)
    ledger._sync(watch=True)  # Watching `weights`, not `other`.
    other.run(1, sr.UNCHECKED_INPUT)
    ledger.model = other
    with pytest.raises(ValueError, match='cannot account'):
        ledger._sync()


def test_a_target_stop_at_exactly_max_steps_is_the_targets():
    ledger = _Ledger(_Weights(), max_steps=3, target_epsilon=0.01)
    ledger._note_stop(3)  # steps + k == max_steps: the target stops it.
    assert ledger.stopped_by_budget and not ledger.stopped_at_max_steps


def test_messages_go_to_the_keras_ledgers_logger(caplog):
    weights = _Weights()
    ledger = _Ledger(weights, verbose=1)
    weights.run(1, sr.UNCHECKED_INPUT)
    with caplog.at_level(logging.WARNING):
        assert ledger.steps == 0  # Refused: logged, not charged.
    assert [r.name for r in caplog.records] == ['tf_twice.keras.ledger']
