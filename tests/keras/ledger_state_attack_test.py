"""The record a DPModel's weights keep (`tf_twice.keras.privacy_record`),
end to end: every route that trains writes it, every checkpoint restores
it, and a ledger charges from it.

The rule a ledger applies to a record (charge the steps its history lacks,
refuse those it cannot account: another mechanism's, unchecked input,
values no step wrote) and the attacks on the state file and on resume
(stale, foreign, forged or replaced files, weights reloaded or scaled) are
tested without TensorFlow: tests/accounting/step_record_test.py,
step_ledger_test.py, budget_test.py. Here, what only a fit shows: that the
train step writes what that arithmetic computes, and that a checkpoint
carries it to a new process (every checkpoint kind restores it:
artifacts_test).
"""

import pytest
import tensorflow as tf

from tests.keras.artifacts_test import _save
from tests.keras.privacy_audit_test import DELTA, X, Y, _config, _data
from tests.keras.privacy_audit_test import _dp_model
from tests.keras.privacy_audit_test import _iterations
from tf_twice.accounting import step_record
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger
from tf_twice.keras import privacy_record


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _refused(dp, ledger, match='cannot account'):
    """A fit of `dp` under `ledger` is refused before any step."""
    before = _iterations(dp)
    with pytest.raises(ValueError, match=match):
        dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert _iterations(dp) == before


def _after(record, words, count):
    return step_record.extend(record, words, count)


def test_every_route_that_trains_writes_the_record_a_ledger_charges():
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    words = step_record.event_words(ledger.budget.event_key)
    dp.fit(_data(2, 1), callbacks=[ledger], verbose=0)  # Under the ledger.
    dp.fit(_data(2, 2), verbose=0)  # The ledger forgotten.
    # A custom loop, eager (a compiled one writes it too: the test of
    # logical_batches in ledger_dp_model_test).
    for batch in _data(1, 3):
        dp.train_step(batch)
    # The record the host's arithmetic computes for 5 steps of the event,
    # which the ledger that watched 2 and a new one both charge.
    checked = _after(step_record.EMPTY, words, 5)
    assert privacy_record.read(dp) == checked
    assert ledger.steps == 5
    assert PrivacyLedger.for_model(dp, delta=DELTA, verbose=0).steps == 5

    # A fit opted in to input not checked to be Poisson-sampled: its ledger
    # charges its steps (its epsilon does not hold for them, as the fit
    # warns); the record marks them, so no later ledger accepts them.
    shuffled = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).take(2)
    with pytest.warns(UserWarning, match='DOES NOT HOLD'):
        dp.fit(shuffled, callbacks=[ledger], verbose=0,
               allow_non_poisson_input=True)
    assert ledger.steps == 7
    opted_in = _after(checked, step_record.UNCHECKED_INPUT, 2)
    assert privacy_record.read(dp) == opted_in
    _refused(dp, PrivacyLedger.for_model(dp, delta=DELTA, verbose=0))
    # A fit opted in but refused before any step (a class weight outside
    # [0, 1]) must not leave its ledger accepting unchecked steps, such as
    # those of a later fit without it.
    with pytest.raises(ValueError, match='class_weight'):
        dp.fit(shuffled, callbacks=[ledger], verbose=0,
               allow_non_poisson_input=True, class_weight={0: 2.0})
    with pytest.warns(UserWarning, match='not Poisson-sampled'):
        dp.fit(shuffled.take(1), verbose=0)
    assert privacy_record.read(dp) == _after(
        opted_in, step_record.UNCHECKED_INPUT, 1)
    assert ledger.steps == 7  # Refused: logged, not charged.
    with pytest.raises(ValueError, match='cannot account'):
        ledger.reserve_steps(1)  # A custom loop's check reads it too.
    assert int(dp.steps_taken) == 8


def test_a_restored_checkpoint_holds_its_steps_for_every_ledger(tmp_path):
    # A run of 3 steps under a ledger with a state file, saved whole; the
    # file then runs ahead of the checkpoint (2 steps after it, lost in a
    # crash).
    state = str(tmp_path / 'ledger.json')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(3, 1), callbacks=[ledger], verbose=0)
    checkpoint = _save(dp, 'keras', str(tmp_path))
    PrivacyLedger.for_model(_dp_model(), delta=DELTA, state_path=state,
                            verbose=0).record_steps(2)
    # A new process, a fresh optimizer: the record restored with the
    # weights is the only trace of their steps. A new ledger charges them;
    # the run's file already holds them.
    restored = tf.keras.models.load_model(checkpoint)
    restored.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    assert _iterations(restored) == 0
    assert PrivacyLedger.for_model(restored, delta=DELTA,
                                   verbose=0).steps == 3
    resumed = PrivacyLedger.for_model(restored, delta=DELTA,
                                      state_path=state, verbose=0)
    restored.fit(_data(2, 2), callbacks=[resumed], verbose=0)
    assert resumed.steps == 3 + 2 + 2
    words = step_record.event_words(resumed.budget.event_key)
    assert privacy_record.read(restored) == _after(step_record.EMPTY, words,
                                                   5)
    # The documented way to start a new account from weights whose privacy
    # is accounted elsewhere: the wrapped model in a new DPModel, whose
    # record is its own, empty.
    anew = DPModel(restored.inner_model, _config(), physical_batch_size=8)
    anew.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    assert privacy_record.read(anew) == step_record.EMPTY
    assert PrivacyLedger.for_model(anew, delta=DELTA, verbose=0).steps == 0
    # Weights set by arithmetic (the record with them): no step wrote
    # that record, so no ledger accounts it.
    restored.set_weights([w * 0.1 for w in restored.get_weights()])
    with pytest.raises(ValueError, match='cannot account'):
        PrivacyLedger.for_model(restored, delta=DELTA,
                                verbose=0).bind_model(restored)
