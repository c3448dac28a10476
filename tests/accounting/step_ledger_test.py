"""`StepLedger`, the TF-free half of `PrivacyLedger`: the rule applied to a
budget through readings, watches, custom loops and stops.

The weights here are a name and a record that steps extend, as a DPModel's
train step does (tests/keras/ledger_state_attack_test.py checks that every
route that trains writes it); the Keras ledger's tests check that its hooks
read the record where these readings do. The scenarios of the Keras
ledger's end-to-end tests are here, as records, below the rule's own tests.
"""

import json
import logging
import threading

import dp_accounting
import pytest

from tf_twice.accounting import TwiceSamplingRdpAccountant
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
    """A ledger of `event` (or continuing `budget`) on `model`, built as
    `PrivacyLedger`'s constructor builds it."""

    def __init__(self, model, *, verbose=0, event=EVENT, budget=None,
                 **kwargs):
        if budget is None:
            budget = budget_lib.PrivacyBudget(event, 1e-5, **kwargs)
        self._setup(budget, verbose=verbose)
        self.model = model
        self._log_resumed()

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


# --- the scenarios of the Keras ledger's tests, as records -----------------
#
# Each is a sequence of steps on the weights (`_Weights.run`: a train step of
# any route, which keras tests check writes the record), weights restored
# (a checkpoint, another run's weights), readings, a fit's watch (before an
# execution: `_sync(watch=True)`), custom-loop calls and state files, with
# the charge or refusal the ledger must give.

NOOP = dp_accounting.NoOpDpEvent()


def _words(event):
    return sr.event_words(ledger_state.event_key(event))


def _state_file(path, segments):
    """Writes a state file whose history is `segments` of (event, count)."""
    budget = budget_lib.PrivacyBudget(segments[0][0], 1e-5)
    for event, count in segments:
        budget.compose(event, count)
    budget.save(path)
    return path


def _continued(ledger, event, weights):
    """A ledger of `event` continuing `ledger`'s history (`from_state`)."""
    return _Ledger(weights, budget=budget_lib.PrivacyBudget.from_state(
        ledger.get_state(), event=event))


def _fit(ledger, weights, count, words=WORDS):
    """`count` steps of a fit under `ledger`: watched, then read."""
    ledger._sync(watch=True)
    weights.run(count, words)
    ledger._sync()


def _loop(ledger, weights, count):
    """A custom loop's `count` steps: reserve, step, record."""
    for _ in range(count):
        ledger.reserve_steps(1)
        weights.run(1)
        ledger.record_steps(1)


@pytest.mark.parametrize('runs, charged', [
    # A fit without a ledger, or a custom loop, before the first fit under
    # one: the weights released after it depend on all 5 steps.
    ([('unseen', 3), ('watched', 2)], 5),
    # A custom loop's steps between two fits under the ledger.
    ([('watched', 2), ('unseen', 3), ('watched', 2)], 7),
])
def test_steps_no_ledger_watched_are_charged_by_the_next_one(runs, charged):
    weights = _Weights()
    ledger = None
    for how, count in runs:
        if how == 'unseen':
            weights.run(count)
        else:
            ledger = ledger or _Ledger(weights)
            _fit(ledger, weights, count)
    assert ledger.steps == charged


def test_a_second_ledger_on_the_same_state_file_charges_no_step_twice(
        tmp_path):
    path = str(tmp_path / 'ledger.json')
    weights = _Weights()
    first = _Ledger(weights, state_path=path, save_every_steps=1)
    _fit(first, weights, 3)
    first.save()
    second = _Ledger(weights, state_path=path, save_every_steps=1)
    assert second.steps == 3  # The file holds the weights' 3 steps.
    _fit(second, weights, 2)
    second.save()
    assert second.steps == 5
    assert _Ledger(None, state_path=path).steps == 5


@pytest.mark.parametrize('custom_loop', [False, True])
def test_a_new_ledger_charges_the_steps_another_charged(custom_loop):
    # A recompile's fresh optimizer counts from 0, an audit leaves the
    # weights as they were: the record still names the first ledger's
    # steps, which a new ledger charges, in a fit or a custom loop; the
    # first, still holding the model, charges the second's steps too.
    weights = _Weights()
    first = _Ledger(weights)
    _fit(first, weights, 3)
    second = _Ledger(weights)
    if custom_loop:
        _loop(second, weights, 2)
    else:
        _fit(second, weights, 2)
    assert second.steps == first.steps == 3 + 2


# The weights a checkpoint restored (their record, as (words, count)
# segments), a state file beside them (None: a new ledger without one), the
# ledger's event, and what it charges them (None: refused).
_E, _O = WORDS, OTHER_WORDS


@pytest.mark.parametrize('weights, state, event, charged', [
    # A new ledger, a fresh optimizer: the record names their 3 steps.
    pytest.param([(_E, 3)], None, EVENT, 3,
                 id='restored_checkpoint_new_ledger'),
    # The checkpoint's state file, which ran ahead of it (steps after the
    # checkpoint, lost in a crash).
    pytest.param([(_E, 3)], [(EVENT, 5)], EVENT, 5, id='its_file_ahead_of_it'),
    # A stale copy of the state file: the steps it lacks are charged.
    pytest.param([(_E, 5)], [(EVENT, 2)], EVENT, 5, id='stale_file'),
    # Another run's file of the same events: its first 3 steps are the
    # weights' 3, and its epsilon bounds theirs.
    pytest.param([(_E, 3)], [(EVENT, 10)], EVENT, 10,
                 id='other_runs_file_same_event'),
    # Another run's file of another event: the weights' steps on top.
    pytest.param([(_E, 3)], [(OTHER, 10)], EVENT, 13,
                 id='other_runs_file_other_event'),
    # The same, under the other run's event: the weights' steps are
    # another mechanism's.
    pytest.param([(_E, 3)], [(OTHER, 10)], OTHER, None,
                 id='other_runs_file_and_event'),
    # A ledger replaced by one continuing its history under a new event:
    # either file resumes the checkpoint (the first lacks the 2 new steps).
    pytest.param([(_O, 3), (_E, 2)], [(OTHER, 3)], EVENT, 5,
                 id='replaced_ledgers_file'),
    pytest.param([(_O, 3), (_E, 2)], [(OTHER, 3), (EVENT, 2)], EVENT, 5,
                 id='its_replacements_file'),
    # Steps of a fit without the ledger, after the file's last write.
    pytest.param([(_E, 9)], [(EVENT, 5)], EVENT, 9,
                 id='fit_without_the_ledger'),
    # ... on input not checked to be Poisson-sampled: refused.
    pytest.param([(_E, 9), (sr.UNCHECKED_INPUT, 1)], [(EVENT, 5)], EVENT, None,
                 id='unchecked_input'),
    # A checkpoint saved (ModelCheckpoint listed before the ledger) after a
    # step the ledger had not charged yet: it holds that step.
    pytest.param([(_E, 1)], None, EVENT, 1,
                 id='saved_before_the_ledgers_hook'),
    # A public starting point wrapped in a new DPModel: an empty record.
    pytest.param([], None, EVENT, 0, id='public_starting_point'),
])
def test_restored_weights_are_charged_what_the_state_file_lacks(
        tmp_path, weights, state, event, charged):
    path = None
    if state is not None:
        path = _state_file(str(tmp_path / 'ledger.json'), state)
    on_file = 0 if state is None else sum(count for _, count in state)
    model = _Weights(sr.record_of(weights))
    ledger = _Ledger(model, event=event, state_path=path)
    if charged is None:
        with pytest.raises(ValueError, match='cannot account'):
            ledger._sync(watch=True)  # A fit is refused before any step.
        assert ledger.budget.steps == on_file
        return
    assert ledger.steps == charged  # A reading charges them.
    _fit(ledger, model, 1, _words(event))  # Training goes on.
    assert ledger.steps == charged + 1
    if path is not None:
        ledger.save()
        assert _Ledger(None, event=event, state_path=path).steps == (
            charged + 1)


def _edit_file(path, edit, recompute_digest):
    with open(path) as f:
        state = json.load(f)
    edit(state)
    if recompute_digest:  # As a deliberate forger would.
        segments = ledger_state.parse_segments(
            dict(state, version=1))  # Version 1 skips the digest check.
        state['history_digest'] = ledger_state.word_to_hex(
            ledger_state.history_digest(
                [(ledger_state.event_key(e), c) for e, c in segments]))
    with open(path, 'w') as f:
        json.dump(state, f)


def test_a_forged_state_file_beside_its_checkpoint_charges_its_steps(
        tmp_path):
    # The digest recomputed, the events made no-ops: the file reads as
    # written, but the weights' record names 3 steps of the event, which
    # the ledger then charges on top.
    path = _state_file(str(tmp_path / 'ledger.json'), [(EVENT, 3)])

    def to_no_op(state):
        state['segments'][0]['event'] = budget_lib.event_to_json(NOOP)

    _edit_file(path, to_no_op, recompute_digest=True)
    forged = _Ledger(None, state_path=path)
    assert forged.steps == 3 and forged.epsilon == 0.0  # Read as written.
    weights = _Weights(sr.extend(sr.EMPTY, WORDS, 3))
    ledger = _Ledger(weights, state_path=path)
    _fit(ledger, weights, 1)
    assert ledger.steps == 3 + 3 + 1
    assert ledger.epsilon == pytest.approx(
        budget_lib.PrivacyBudget(EVENT, 1e-5).epsilon_after(4), rel=1e-9)


@pytest.mark.parametrize('stale', [False, True])
def test_loop_steps_on_restored_weights_do_not_fill_the_gap(tmp_path,
                                                            stale):
    # Steps run on restored weights (3 steps) before the ledger's first
    # check are not the weights' old steps: the record counts both.
    path = None
    if stale:  # A copy of the file from before the third step.
        path = _state_file(str(tmp_path / 'stale.json'), [(EVENT, 2)])
    weights = _Weights(sr.extend(sr.EMPTY, WORDS, 3))
    ledger = _Ledger(weights, state_path=path)
    weights.run(3)
    ledger.record_steps(3)
    assert ledger.steps == 6


@pytest.mark.parametrize('words, charged', [(WORDS, 10 + 1),
                                            (OTHER_WORDS, None)])
def test_weights_reloaded_during_a_custom_loop(words, charged):
    # Another run's weights (10 steps) loaded under this ledger: their
    # steps are charged if they are its event's (they extend the 2 it
    # watched by 8 of its event, which ran on other weights: it cannot
    # tell), refused if another mechanism's.
    weights = _Weights()
    ledger = _Ledger(weights)
    _loop(ledger, weights, 2)
    weights.record = sr.extend(sr.EMPTY, words, 10)
    if charged is None:
        with pytest.raises(ValueError, match='cannot account'):
            _loop(ledger, weights, 1)
        assert ledger.budget.steps == 2
    else:
        _loop(ledger, weights, 1)
        assert ledger.steps == charged


@pytest.mark.parametrize('words, read', [
    (OTHER_WORDS, None), (sr.NON_PRIVATE, None),
    (OTHER_WORDS, 'epsilon'), (OTHER_WORDS, 'state')])
def test_uncharged_steps_of_another_mechanism_are_refused_under_an_over_count(
        words, read):
    # A ledger that charged more steps than ran (recorded without a step; a
    # write-ahead reservation a crash left, or a resumed file, do the same)
    # has room for another mechanism's steps in every count: the record
    # still refuses them, at a fit's start and in a custom loop, also after
    # a ledger of that mechanism was built just to read its epsilon or its
    # state on the same weights.
    weights = _Weights()
    ledger = _Ledger(weights)
    ledger.record_steps(3)
    weights.run(2, words)
    if read is not None:
        reader = _Ledger(weights, event=OTHER)
        assert (reader.epsilon > 0 if read == 'epsilon' else
                reader.get_state()['steps'] == 2)
    assert ledger.steps == 3  # A reading leaves them uncharged.
    refusal = r'hold 2 DP steps.*cannot account'
    with pytest.raises(ValueError, match=refusal):
        ledger._sync(watch=True)  # The start of a fit.
    with pytest.raises(ValueError, match=refusal):
        ledger.record_steps(2)
    assert ledger.steps == 3


def test_a_ledger_continuing_the_history_under_another_event_charges_it():
    # Steps under A's ledger, then B's steps outside it: A's ledger cannot
    # charge B's (a fit under it is refused); one continuing its history
    # under B's event charges them and composes both.
    weights = _Weights()
    ledger = _Ledger(weights)
    _fit(ledger, weights, 2)
    weights.run(3, OTHER_WORDS)
    with pytest.raises(ValueError, match='cannot account'):
        ledger._sync(watch=True)
    both = _continued(ledger, OTHER, weights)
    _fit(both, weights, 1, OTHER_WORDS)
    assert both.steps == 2 + 3 + 1 and ledger.steps == 2
    assert [s['count'] for s in both.get_state()['segments']] == [2, 4]


def test_a_history_continued_through_states_goes_back_to_a_mechanism():
    # A's custom loop, then B's steps charged by a ledger continuing A's
    # history that binds the weights without training, then A again with a
    # ledger continuing that one: B's steps are accounted in its history,
    # and A's own ledger may not go on (its epsilon leaves them out; it
    # once checked the weights at its first record only).
    weights = _Weights()
    ledger_a = _Ledger(weights)
    _loop(ledger_a, weights, 2)
    weights.run(3, OTHER_WORDS)
    ledger_ab = _continued(ledger_a, OTHER, weights)
    ledger_ab._sync(watch=True)  # bind_model
    assert ledger_ab.steps == 2 + 3
    with pytest.raises(ValueError, match='hold 5 DP steps.*cannot account'):
        ledger_a.reserve_steps(1)
    assert ledger_a.steps == 2
    ledger_aba = _continued(ledger_ab, EVENT, weights)
    _fit(ledger_aba, weights, 1)
    assert ledger_aba.steps == 2 + 3 + 1
    assert [s['count'] for s in
            ledger_aba.get_state()['segments']] == [2, 3, 1]


def test_a_resume_under_another_event_composes_both_and_says_so(tmp_path,
                                                                caplog):
    path = str(tmp_path / 'ledger.json')
    _Ledger(None, state_path=path).record_steps(5)
    with caplog.at_level(logging.WARNING, logger='tf_twice.keras.ledger'):
        _Ledger(None, state_path=path, verbose=1)  # The same mechanism.
        assert 'another mechanism' not in caplog.text
        second = _Ledger(None, event=OTHER, state_path=path, verbose=1)
        assert 'ran another mechanism' in caplog.text  # Said, at verbose=1.
    assert second.epsilon == pytest.approx(
        TwiceSamplingRdpAccountant().compose(EVENT, 5).get_epsilon(1e-5))
    second.record_steps(3)  # A plain model's steps (no record).
    expected = TwiceSamplingRdpAccountant().compose(EVENT, 5).compose(
        OTHER, 3).get_epsilon(1e-5)
    assert second.steps == 8
    assert second.epsilon == pytest.approx(expected, rel=1e-12)
    third = _Ledger(None, state_path=path)
    assert third.epsilon == pytest.approx(expected, rel=1e-12)
    with open(path) as f:
        segments = json.load(f)['segments']
    assert [s['count'] for s in segments] == [5, 3]
    assert budget_lib.event_from_json(segments[1]['event']) == OTHER


def test_concurrent_record_steps_charge_every_step():
    """Thread A is switched out inside `record_steps`; thread B records a
    step meanwhile. Unlocked, A took B's step for its own. With the lock, B
    waits for A (A stops waiting for B after 1 s): both steps count."""
    ledger = _Ledger(None)  # A model without a record (a plain model).
    real_sync = ledger._sync
    other_done = threading.Event()
    others = []

    def sync(**kwargs):  # Thread A is switched out after reading `before`.
        if threading.current_thread().name == 'A' and not others:
            others.append(threading.Thread(
                target=lambda: (ledger.record_steps(1), other_done.set()),
                name='B'))
            others[0].start()
            other_done.wait(timeout=1)
        real_sync(**kwargs)

    ledger._sync = sync
    first = threading.Thread(target=lambda: ledger.record_steps(1), name='A')
    first.start()
    first.join()
    others[0].join()
    assert ledger.budget.steps == 2  # Unlocked: 1.
