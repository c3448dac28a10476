"""Attacks on the ledger's state file, resume and audits, end to end.

The state file's history digest refuses a file edited by hand. The record
a DPModel's weights keep (`tf_twice.keras.privacy_record`) makes a ledger
charge every step they hold that its history lacks (a new ledger, a stale
copy, another run's file, a forged one) and refuse steps it cannot account
(another mechanism's, unchecked input, values no step wrote). The rule
itself is tested without TensorFlow in tests/accounting/step_record_test.py.
"""

import json

import dp_accounting
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models
from tests.keras.artifacts_test import _load, _save
from tests.keras.privacy_audit_test import DELTA, X, Y, _config, _data
from tests.keras.privacy_audit_test import _dp_model
from tests.keras.privacy_audit_test import _iterations
from tf_twice import auditing
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import ledger_state
from tf_twice.accounting import step_record
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger
from tf_twice.keras import privacy_record

WEAK, STRONG = 0.3, 5.0  # Noise multipliers.
# Every kind of checkpoint that restores a DPModel's weights (artifacts_test
# writes and reads them; 'keras' is reloaded whole by `_restored`).
CHECKPOINTS = [pytest.param('tf_checkpoint', marks=markers.needs_keras_2),
               'weights_h5', 'optimizer_checkpoint', 'keras']


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _trained(tmp_path, steps, kind='weights_h5', noise=1.0):
    """A run of `steps` steps under a ledger with a state file, saved; the
    state file's path and the checkpoint's."""
    state = str(tmp_path / 'ledger.json')
    dp = _dp_model(config=_config(noise_multiplier=noise))
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(steps, 1), callbacks=[ledger], verbose=0)
    assert ledger.steps == steps
    return state, _save(dp, kind, str(tmp_path))


def _restored(kind, checkpoint, noise=1.0, fresh_optimizer=False):
    """A new model given the checkpoint (as a new process would); with
    `fresh_optimizer`, recompiled so that the optimizer's step count is 0
    (the record is the only trace of the steps then)."""
    if kind == 'keras':
        dp = tf.keras.models.load_model(checkpoint)
    else:
        dp = _dp_model(config=_config(noise_multiplier=noise))
        dp(X[:1])
        _load(dp, kind, checkpoint)
    if fresh_optimizer:
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
        assert _iterations(dp) == 0
    return dp


def _resumed(checkpoint, state):
    """A new process resumes `checkpoint` with the file `state`, its
    optimizer fresh: the weights' record is the only trace of their steps.
    Trains one step and returns the ledger."""
    resumed = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    ledger = PrivacyLedger.for_model(resumed, delta=DELTA, state_path=state,
                                     verbose=0)
    resumed.fit(_data(1, 4), callbacks=[ledger], verbose=0)
    return ledger


def _refused(dp, ledger, match='cannot account'):
    """A fit of `dp` under `ledger` is refused before any step."""
    before = _iterations(dp)
    with pytest.raises(ValueError, match=match):
        dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert _iterations(dp) == before


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


def _to_no_op(state):
    state['segments'][0]['event'] = budget_lib.event_to_json(
        dp_accounting.NoOpDpEvent())


def test_a_forged_state_file_beside_its_checkpoint_charges_its_steps(
        tmp_path):
    # The digest recomputed, the events made no-ops: the file reads as
    # written, but the weights' record names 3 steps of the model's event,
    # which the ledger then charges on top.
    state, checkpoint = _trained(tmp_path, 3)
    _edit_file(state, _to_no_op, recompute_digest=True)
    forged = PrivacyLedger.for_model(_dp_model(), delta=DELTA,
                                     state_path=state, verbose=0)
    assert forged.steps == 3 and forged.epsilon == 0.0  # Read as written.
    dp = _restored('weights_h5', checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 3 + 3 + 1
    assert ledger.epsilon == pytest.approx(_config().epsilon(4, DELTA),
                                           rel=1e-9)


def test_another_runs_state_file_beside_a_checkpoint(tmp_path):
    other = str(tmp_path / 'other.json')
    checkpoint = str(tmp_path / 'ckpt.weights.h5')
    # Run A: 10 steps at strong noise; only its state file survives.
    PrivacyLedger(_config(noise_multiplier=STRONG).dp_event(), DELTA,
                  state_path=other, verbose=0).record_steps(10)
    # Run B: 3 steps at weak noise; its checkpoint is released/resumed.
    weak = _config(noise_multiplier=WEAK)
    dp = _dp_model(config=weak)
    ledger_b = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(3, 1), callbacks=[ledger_b], verbose=0)
    dp.save_weights(checkpoint)
    # Resumed under weak noise with A's file: A's 10 steps are not the
    # weights' 3, so those are charged on top of them.
    resumed = _dp_model(config=weak)
    resumed.load_weights(checkpoint)
    ledger = PrivacyLedger.for_model(resumed, delta=DELTA,
                                     state_path=other, verbose=0)
    assert ledger.epsilon >= weak.epsilon(3, DELTA)
    resumed.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 10 + 3 + 1
    # Resumed under A's strong noise: the weights' weak steps are another
    # mechanism's, which a ledger of the strong event cannot account.
    strong = _dp_model(config=_config(noise_multiplier=STRONG))
    strong.load_weights(checkpoint)
    _refused(strong, PrivacyLedger.for_model(strong, delta=DELTA,
                                             state_path=other, verbose=0))


def test_another_runs_state_file_of_the_same_events_is_accepted(tmp_path):
    # Sound: its first 3 steps are the weights' 3, and its epsilon (10
    # steps) bounds theirs. The rule is the history, not the run.
    other = str(tmp_path / 'other.json')
    PrivacyLedger(_config().dp_event(), DELTA, state_path=other,
                  verbose=0).record_steps(10)
    _, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=other,
                                     verbose=0)
    dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 11


@pytest.mark.parametrize('kind', CHECKPOINTS)
def test_a_new_ledger_charges_the_steps_a_restored_checkpoint_holds(
        tmp_path, kind):
    # A new process, a fresh optimizer and a fresh ledger: the weights'
    # record restored with them names their 3 steps.
    _, checkpoint = _trained(tmp_path, 3, kind)
    dp = _restored(kind, checkpoint, fresh_optimizer=True)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    assert ledger.steps == 3  # A reading charges them.
    dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 4


def test_a_checkpoint_resumes_with_its_state_file(tmp_path, kind='keras'):
    # The file runs ahead of the checkpoint (steps after it, lost in a
    # crash): still the same run and history, so accepted. (Every
    # checkpoint kind restores the record: the test above.)
    state, checkpoint = _trained(tmp_path, 3, kind)
    PrivacyLedger.for_model(_dp_model(), delta=DELTA, state_path=state,
                            verbose=0).record_steps(2)
    dp = _restored(kind, checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(2, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 7 and _iterations(dp) == 5
    # 3 + 2 of the model's event: the checkpoint's and this run's.
    words = step_record.event_words(ledger.budget.event_key)
    assert privacy_record.read(dp) == step_record.extend(
        step_record.EMPTY, words, 5)


def test_a_stale_copy_of_the_state_file_is_charged_the_missing_steps(
        tmp_path):
    state, checkpoint = _trained(tmp_path, 2)
    stale = str(tmp_path / 'stale.json')
    with open(state) as f, open(stale, 'w') as g:
        g.write(f.read())
    # The run goes on to 5 steps and is checkpointed.
    dp = _restored('weights_h5', checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(3, 3), callbacks=[ledger], verbose=0)
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    assert _resumed(checkpoint, stale).steps == 2 + 3 + 1


def test_a_custom_loop_on_a_restored_checkpoint_charges_its_steps(
        tmp_path):
    _, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    # for_model gives the ledger its model: no set_model in a custom loop.
    ledger = PrivacyLedger(_config().dp_event(), DELTA, verbose=0)
    ledger.set_model(dp)
    ledger.reserve_steps(1)
    assert ledger.budget.steps == 3


def test_a_public_starting_point_is_wrapped_anew(tmp_path):
    # The documented way to start a new account from trained weights whose
    # privacy is accounted elsewhere: a new DPModel, unbound.
    _, checkpoint = _trained(tmp_path, 3)
    restored = _restored('weights_h5', checkpoint)
    dp = DPModel(restored.inner_model, _config(), physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    assert privacy_record.read(dp) == step_record.EMPTY
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 1


def _loop(ledger, dp, steps, seed):
    for batch in _data(steps, seed):
        ledger.reserve_steps(1)
        dp.train_step(batch)
        ledger.record_steps(1)


@pytest.mark.parametrize('stale', [False, True])
def test_loop_steps_on_restored_weights_do_not_fill_the_gap(tmp_path,
                                                            stale):
    # Steps run on the restored weights before the ledger's first check
    # are not the weights' old steps: the record counts both.
    state, checkpoint = _trained(tmp_path, 3)
    path = None
    if stale:  # A copy of the file from before the third step.
        path = str(tmp_path / 'stale.json')
        PrivacyLedger(_config().dp_event(), DELTA, state_path=path,
                      verbose=0).record_steps(2)
    dp = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     verbose=0)
    for batch in _data(3, 2):
        dp.train_step(batch)
    ledger.record_steps(3)
    assert ledger.steps == 6


def test_a_checkpoint_saved_before_the_ledgers_hook_holds_its_steps(
        tmp_path):
    # ModelCheckpoint listed before the ledger saves the weights of a step
    # the ledger has not charged (nor bound) yet.
    checkpoint = str(tmp_path / 'first.weights.h5')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)

    class SaveFirst(tf.keras.callbacks.Callback):

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.model.save_weights(checkpoint)

    dp.fit(_data(2, 1), callbacks=[SaveFirst(), ledger], verbose=0)
    restored = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    assert int(restored.steps_taken.numpy()) == 1
    fresh = PrivacyLedger.for_model(restored, delta=DELTA, verbose=0)
    restored.fit(_data(1, 2), callbacks=[fresh], verbose=0)
    assert fresh.steps == 2


def test_steps_of_a_fit_without_the_ledger_on_resume(tmp_path):
    # On Poisson batches of the config they are its steps: charged on
    # resume. On other input the record marks them: refused.
    state, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(2, 2), callbacks=[ledger], verbose=0)
    dp.fit(_data(4, 3), verbose=0)  # The ledger forgotten.
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    assert _resumed(checkpoint, state).steps == 5 + 4 + 1
    with pytest.warns(UserWarning, match='not Poisson-sampled'):
        dp.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).take(1),
               verbose=0)
    words = step_record.event_words(ledger.budget.event_key)
    assert privacy_record.read(dp) == step_record.extend(step_record.extend(
        step_record.EMPTY, words, 9), step_record.UNCHECKED_INPUT, 1)
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    resumed = _restored('weights_h5', checkpoint)
    _refused(resumed, PrivacyLedger.for_model(resumed, delta=DELTA,
                                              state_path=state, verbose=0))


def test_weights_reloaded_during_a_custom_loop(tmp_path):
    # Another run's weights loaded under this ledger: their steps are
    # charged if they are its event's, refused if another mechanism's.
    for noise, refused in [(1.0, False), (STRONG, True)]:
        run = tmp_path / str(noise)
        run.mkdir()
        _, other = _trained(run, 10, noise=noise)
        dp = _dp_model()
        dp(X[:1])
        ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
        _loop(ledger, dp, 2, 2)
        dp.load_weights(other)
        if refused:
            with pytest.raises(ValueError, match='cannot account'):
                _loop(ledger, dp, 1, 3)
            assert ledger.budget.steps == 2
        else:
            # The weights' 10 steps extend the 2 it watched by 8 of its
            # event (which ran on other weights: it cannot tell).
            _loop(ledger, dp, 1, 3)
            assert ledger.steps == 10 + 1


@markers.needs_tf_privacy_optimizers
def test_a_replaced_ledger_cannot_go_on_but_its_file_resumes(tmp_path):
    from tf_twice import optimizers  # pylint: disable=g-import-not-at-top

    def optimizer(noise):
        return optimizers.TwiceSamplingDPKerasSGDOptimizer(
            _config(noise_multiplier=noise), learning_rate=1.0)

    first_path = str(tmp_path / 'phase1.json')
    second_path = str(tmp_path / 'phase2.json')
    dp = DPModel(tiny_models.linear(), physical_batch_size=8)
    dp.compile(optimizer=optimizer(STRONG), loss=_loss())
    first = PrivacyLedger.for_model(dp, delta=DELTA, state_path=first_path,
                                    verbose=0)
    dp.fit(_data(3, 1), callbacks=[first], verbose=0)
    dp.compile(optimizer=optimizer(WEAK), loss=_loss())  # A new event.
    second = PrivacyLedger.from_state(first.get_state(), event=dp.dp_event(),
                                      state_path=second_path, verbose=0)
    dp.fit(_data(2, 2), callbacks=[second], verbose=0)
    # The weak steps are not the first ledger's event: a reading leaves
    # them uncharged (and says so), a custom loop may not go on under it.
    assert first.steps == 3
    with pytest.raises(ValueError):
        first.reserve_steps(1)
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    for path in (second_path, first_path):
        resumed = DPModel(tiny_models.linear(), physical_batch_size=8)
        resumed(X[:1])
        resumed.load_weights(checkpoint)
        resumed.compile(optimizer=optimizer(WEAK), loss=_loss())
        ledger = PrivacyLedger.for_model(resumed, delta=DELTA,
                                         state_path=path, verbose=0)
        # The first file lacks the 2 weak steps: charged after its 3.
        resumed.fit(_data(1, 3), callbacks=[ledger], verbose=0)
        assert ledger.steps == 6


def test_weights_set_by_arithmetic_are_refused(tmp_path):
    _, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    dp.set_weights([w * 0.1 for w in dp.get_weights()])  # Record too.
    _refused(dp, PrivacyLedger.for_model(dp, delta=DELTA, verbose=0))


def test_an_audit_leaves_the_record_as_it_was():
    # The audit restores the weights and their record: no trial is charged,
    # and a fresh ledger still sees the 3 steps a first ledger charged.
    dp = _dp_model()
    first = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(3, 1), callbacks=[first], verbose=0)
    before = privacy_record.read(dp)
    auditing.audit_one_step(dp, (X[0], Y[0]), num_trials=4, delta=DELTA)
    assert privacy_record.read(dp) == before and first.steps == 3
    dp.optimizer.iterations.assign(0)  # A recompile with a fresh optimizer.
    second = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(1, 2), callbacks=[second], verbose=0)
    # Each ledger that reads the model accounts its weights: both charge
    # the step the second one watched.
    assert second.steps == 4 and first.steps == 4
