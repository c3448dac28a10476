"""The record's arithmetic and the rule by which a ledger charges it.

TF-free: the scenarios of the ledger's end-to-end tests (resume, stale and
foreign state files, rollbacks, other mechanisms, unchecked input, weights
set by arithmetic) as histories of words;
tests/keras/ledger_state_attack_test.py checks that the train step writes
the same arithmetic.
"""

import pytest

from tf_twice.accounting import step_record as sr

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

E = sr.event_words('{"event": "E"}')  # The ledger's event.
F = sr.event_words('{"event": "F"}')  # Another mechanism.


def _steps(*segments):
    """The record of (words, count) segments, step by step."""
    record = sr.EMPTY
    for words, count in segments:
        for _ in range(count):
            record = sr.Record(record.steps + 1, tuple(
                (d * a + w) % sr.MODULUS for d, a, w in zip(
                    record.digest, sr.MULTIPLIERS, words)))
    return record


def test_event_words_are_not_reserved_and_differ():
    assert E != F
    for words in (E, F):
        assert all(3 <= w < sr.MODULUS for w in words)
    assert sr.UNCHECKED_INPUT != sr.NON_PRIVATE


def test_the_closed_form_is_the_step_by_step_update():
    history = [(E, 3), (F, 5), (E, 1), (sr.UNCHECKED_INPUT, 2)]
    assert sr.record_of(history) == _steps(*history)
    assert sr.extend(sr.EMPTY, E, 0) == sr.EMPTY
    assert sr.record_of([(E, 100_000)]) == sr.extend(
        sr.extend(sr.EMPTY, E, 60_000), E, 40_000)


def test_order_and_events_change_the_digest():
    assert sr.record_of([(E, 2), (F, 1)]) != sr.record_of([(F, 1), (E, 2)])
    assert sr.record_of([(E, 3)]).digest != sr.record_of([(F, 3)]).digest


@pytest.mark.parametrize('history, accepted, record, charge', [
    # Steps the ledger watched run: charged.
    ([(E, 5)], (E, 5), [(E, 8)], 3),
    # A resumed ledger (its file ahead of the checkpoint): a prefix.
    ([(E, 10)], None, [(E, 6)], 0),
    # A new ledger, or a stale copy of the file: the rest is charged.
    ([], None, [(E, 3)], 3),
    ([(E, 2)], None, [(E, 5)], 3),
    # A history of two mechanisms, the weights continue under the second.
    ([(F, 3), (E, 2)], None, [(F, 3), (E, 4)], 2),
    # Weights rolled back inside a segment of the ledger's event, then
    # trained on unseen: charged as new steps.
    ([(F, 3), (E, 10)], None, [(F, 3), (E, 12)], 2),
    # A rollback to the end of another mechanism's segment, then this
    # event: branched at a boundary.
    ([(F, 3), (E, 10)], (F, 3), [(F, 3), (E, 1)], 1),
    # Another run's file of other events: the weights' steps are charged
    # on top (its first j = 0 steps).
    ([(F, 10)], None, [(E, 3)], 3),
    # A second ledger on the state file of the first: its history holds
    # every step of the weights.
    ([(E, 3)], None, [(E, 3)], 0),
    # Another run's weights of this event loaded under a ledger that
    # watched 2 steps: 8 steps of its event extend them (it cannot tell
    # that they ran on other weights).
    ([(E, 2)], (E, 2), [(E, 10)], 8),
    # Back to the first mechanism after another's steps were charged.
    ([(E, 2), (F, 3)], None, [(E, 2), (F, 3), (E, 1)], 1),
])
def test_accepted_records_charge_the_steps_not_yet_charged(
        history, accepted, record, charge):
    last = None if accepted is None else _steps(accepted)
    assert sr.steps_to_charge(history, last, _steps(*record), E) == charge


@pytest.mark.parametrize('history, accepted, record', [
    # Steps of another mechanism, watched or not.
    ([(E, 5)], (E, 5), [(E, 5), (F, 1)]),
    ([(E, 5)], None, [(E, 5), (F, 1)]),
    # Steps on unchecked input, and non-private steps.
    ([(E, 5)], (E, 5), [(E, 5), (sr.UNCHECKED_INPUT, 1)]),
    ([], None, [(sr.UNCHECKED_INPUT, 2), (E, 3)]),
    ([(E, 5)], None, [(E, 2), (sr.NON_PRIVATE, 1), (E, 2)]),
    # Another run's weights of another mechanism.
    ([(E, 10)], (E, 2), [(F, 10)]),
    # A branch inside another mechanism's segment, then this event.
    ([(F, 10)], None, [(F, 4), (E, 2)]),
    # A ledger that charged more steps than ran (steps recorded by hand, a
    # reservation a crash left): its count has room for the weights' steps
    # of another mechanism, or non-private ones, but its history does not.
    ([(E, 3)], None, [(F, 2)]),
    ([(E, 3)], None, [(sr.NON_PRIVATE, 2)]),
    # Another run's file of this event beside weights of another one.
    ([(E, 10)], None, [(F, 3)]),
])
def test_records_the_history_does_not_cover_are_refused(history, accepted,
                                                        record):
    last = None if accepted is None else _steps(accepted)
    assert sr.steps_to_charge(history, last, _steps(*record), E) is None


@pytest.mark.parametrize('record', [
    sr.Record(-1, (0, 0)),
    sr.Record(3, (sr.MODULUS, 0)),
    sr.Record(0, (5, 7)),  # A digest without steps: weights * 0.1.
    sr.Record(3, tuple(d // 10 for d in sr.record_of([(E, 30)]).digest)),
    # set_weights([w * 0.1 for w in get_weights()]): the record, int64,
    # scaled and truncated with the others.
    sr.Record(0, tuple(d // 10 for d in sr.record_of([(E, 3)]).digest)),
])
def test_records_no_step_writes_are_refused(record):
    assert sr.steps_to_charge([(E, 30)], None, record, E) is None


def test_after_a_charge_the_history_covers_the_record():
    # The ledger's invariant: once charged, the same record charges 0. The
    # weights start at step 2 of a 4-step history (a resume); the 7 steps
    # that ran on them after it are new ones, charged on top.
    history, last = [(E, 4)], None
    for record in (_steps((E, 2)), _steps((E, 7)), _steps((E, 9))):
        charge = sr.steps_to_charge(history, last, record, E)
        history.append((E, charge))
        last = record
        assert sr.steps_to_charge(history, last, record, E) == 0
    assert sum(count for _, count in history) == 4 + 7
