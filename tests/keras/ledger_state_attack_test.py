"""Attacks on the ledger's state file, resume and audit exemption.

The state file's history digest refuses a file edited by hand; the binding
a DPModel's weights keep (`tf_twice.keras.ledger_binding`) refuses a ledger
whose first steps are not those the weights were trained with: a new
ledger, a stale copy, another run's file of other events, a file edited
with its digest recomputed. The other tests guard
avenues that are closed too.
"""

import json

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models
from tests.keras.artifacts_test import _load, _save
from tests.keras.privacy_audit_test import DELTA, X, Y, _config, _data
from tests.keras.privacy_audit_test import _dp_model
from tests.keras.privacy_audit_test import _iterations
from tests.keras.privacy_audit_test import _steps_on_disk
from tf_twice import auditing
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import ledger_state
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger

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
    (the binding is the only trace of the steps then)."""
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


def _refused_on_resume(checkpoint, state, match):
    """A new process resumes `checkpoint` with the file `state`: refused
    before any step. The optimizer is fresh (step count 0), so that only
    the weights' own count and binding can tell."""
    resumed = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    ledger = PrivacyLedger.for_model(resumed, delta=DELTA, state_path=state,
                                     verbose=0)
    with pytest.raises(ValueError, match=match):
        resumed.fit(_data(1, 4), callbacks=[ledger], verbose=0)
    assert ledger.steps == _steps_on_disk(state)


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


def test_a_state_file_edited_by_hand_is_refused(tmp_path):
    path = str(tmp_path / 'ledger.json')
    event = _config().dp_event()
    PrivacyLedger(event, DELTA, state_path=path, verbose=0).record_steps(100)
    _edit_file(path, _to_no_op, recompute_digest=False)
    with pytest.raises(ValueError, match='history_digest does not match'):
        PrivacyLedger(event, DELTA, state_path=path, verbose=0)


def test_a_forged_state_file_beside_its_checkpoint_is_refused(tmp_path):
    # The digest recomputed: only the weights' binding can tell.
    state, checkpoint = _trained(tmp_path, 3)
    _edit_file(state, _to_no_op, recompute_digest=True)
    forged = PrivacyLedger.for_model(_dp_model(), delta=DELTA,
                                     state_path=state, verbose=0)
    assert forged.steps == 3 and forged.epsilon == 0.0  # Read as written.
    dp = _restored('weights_h5', checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    with pytest.raises(ValueError, match='not the steps'):
        dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert _iterations(dp) == 3  # No step ran.


def test_another_runs_state_file_beside_a_checkpoint_is_refused(tmp_path):
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
    assert _iterations(dp) == 3
    dp.save_weights(checkpoint)
    # Resume B's checkpoint with A's state file: A's 10 steps cover the
    # optimizer's 3, so only the binding's history tells them apart.
    resumed = _dp_model(config=weak)
    resumed.load_weights(checkpoint)
    assert _iterations(resumed) == 3
    ledger = PrivacyLedger.for_model(resumed, delta=DELTA,
                                     state_path=other, verbose=0)
    assert ledger.epsilon < weak.epsilon(3, DELTA)
    with pytest.raises(ValueError, match='not the steps'):
        resumed.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert _iterations(resumed) == 3


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
def test_a_new_ledger_on_a_restored_checkpoint_is_refused(tmp_path, kind):
    # A new process, a fresh optimizer and a fresh ledger: epsilon 0 for
    # weights that hold 3 steps, unless the binding is restored.
    _, checkpoint = _trained(tmp_path, 3, kind)
    dp = _restored(kind, checkpoint, fresh_optimizer=True)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match=r'trained with 3 DP steps.*only 0'):
        dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 0
    # Charging them (they ran under this event) is the one way on.
    ledger.record_steps(3)
    dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 4


@pytest.mark.parametrize('kind', CHECKPOINTS)
def test_a_checkpoint_resumes_with_its_state_file(tmp_path, kind):
    # The file runs ahead of the checkpoint (steps after it, lost in a
    # crash): still the same run and history, so accepted.
    state, checkpoint = _trained(tmp_path, 3, kind)
    PrivacyLedger.for_model(_dp_model(), delta=DELTA, state_path=state,
                            verbose=0).record_steps(2)
    dp = _restored(kind, checkpoint)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(2, 2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 7 and _iterations(dp) == 5
    steps, digest = dp.ledger_binding.numpy()
    assert steps == 7 and digest == ledger.budget.history_digest()
    assert int(dp.steps_taken.numpy()) == 5  # 3 + 2: the checkpoint's.


def test_a_stale_copy_of_the_state_file_is_refused(tmp_path):
    state, _ = _trained(tmp_path, 2)
    stale = str(tmp_path / 'stale.json')
    with open(state) as f, open(stale, 'w') as g:
        g.write(f.read())
    # The run goes on to 5 steps and is checkpointed.
    dp = _dp_model()
    dp(X[:1])
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(3, 3), callbacks=[ledger], verbose=0)
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    _refused_on_resume(checkpoint, stale,
                       r'trained with 5 DP steps.*only 2.*stale')


def test_a_custom_loop_on_a_restored_checkpoint_is_refused(tmp_path):
    _, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    # for_model gives the ledger its model: no set_model in a custom loop.
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='trained with 3 DP steps'):
        ledger.reserve_steps(1)


def test_a_public_starting_point_is_wrapped_anew(tmp_path):
    # The documented way to start a new account from trained weights whose
    # privacy is accounted elsewhere: a new DPModel, unbound.
    _, checkpoint = _trained(tmp_path, 3)
    restored = _restored('weights_h5', checkpoint)
    dp = DPModel(restored.inner_model, _config(), physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    assert not np.any(dp.ledger_binding.numpy())
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
    # are not the weights' old steps: the weights count their own.
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
    with pytest.raises(ValueError, match=r'hold 6 DP steps'):
        ledger.record_steps(3)


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
    with pytest.raises(ValueError, match=r'hold 1 DP steps.*only 0'):
        restored.fit(_data(1, 2), callbacks=[fresh], verbose=0)


def test_steps_of_a_fit_without_the_ledger_are_refused_on_resume(tmp_path):
    state, _ = _trained(tmp_path, 3)
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=state,
                                     verbose=0)
    dp.fit(_data(2, 2), callbacks=[ledger], verbose=0)
    dp.fit(_data(4, 3), verbose=0)  # The ledger forgotten.
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    _refused_on_resume(checkpoint, state, r'hold 6 DP steps.*only 5')


def test_weights_reloaded_during_a_custom_loop_are_refused(tmp_path):
    _, other = _trained(tmp_path, 10)
    dp = _dp_model()
    dp(X[:1])
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    _loop(ledger, dp, 2, 2)
    dp.load_weights(other)  # Another run's weights, under this ledger.
    with pytest.raises(ValueError, match=r'trained with 10 DP steps.*only 3'):
        _loop(ledger, dp, 1, 3)


@markers.needs_tf_privacy_optimizers
def test_a_replaced_ledger_read_later_does_not_rebind_the_weights(
        tmp_path):
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
    bound = dp.ledger_binding.numpy().copy()
    # The weak steps are not the first ledger's event: not charged as its
    # strong ones, nor do they rebind the weights to its history.
    assert first.steps == 3
    np.testing.assert_array_equal(dp.ledger_binding.numpy(), bound)
    # Nor may a custom loop go on under the first ledger.
    with pytest.raises(ValueError, match='runs'):
        first.reserve_steps(1)
    checkpoint = _save(dp, 'weights_h5', str(tmp_path))
    for path, accepted in [(second_path, True), (first_path, False)]:
        resumed = DPModel(tiny_models.linear(), physical_batch_size=8)
        resumed(X[:1])
        resumed.load_weights(checkpoint)
        resumed.compile(optimizer=optimizer(WEAK), loss=_loss())
        ledger = PrivacyLedger.for_model(resumed, delta=DELTA,
                                         state_path=path, verbose=0)
        if accepted:
            resumed.fit(_data(1, 3), callbacks=[ledger], verbose=0)
            assert ledger.steps == 6
        else:
            with pytest.raises(ValueError, match=r'trained with 5 DP.*only 3'):
                resumed.fit(_data(1, 3), callbacks=[ledger], verbose=0)


def test_weights_set_by_arithmetic_are_refused(tmp_path):
    _, checkpoint = _trained(tmp_path, 3)
    dp = _restored('weights_h5', checkpoint, fresh_optimizer=True)
    dp.set_weights([w * 0.1 for w in dp.get_weights()])  # Counts to 0.
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='not values a ledger wrote'):
        dp.fit(_data(1, 2), callbacks=[ledger], verbose=0)


def test_a_version_1_state_file_is_read_and_rewritten_as_2(tmp_path):
    path = str(tmp_path / 'ledger.json')
    event = _config().dp_event()
    PrivacyLedger(event, DELTA, state_path=path, verbose=0).record_steps(4)
    with open(path) as f:
        state = json.load(f)
    state['version'] = 1
    del state['history_digest']
    with open(path, 'w') as f:
        json.dump(state, f)
    ledger = PrivacyLedger(event, DELTA, state_path=path, verbose=0)
    assert ledger.steps == 4
    ledger.record_steps(1)
    with open(path) as f:
        state = json.load(f)
    assert state['version'] == 2 and state['steps'] == 5
    assert int(state['history_digest'], 16) == ledger.budget.history_digest()


@pytest.mark.parametrize('orders', [[0.5], [1.0], [float('nan')], [-2.0]])
def test_a_state_file_with_invalid_orders_is_refused(tmp_path, orders):
    # Closed: an RDP order <= 1 would convert to a meaningless (small) eps.
    path = str(tmp_path / 'ledger.json')
    event = _config().dp_event()
    PrivacyLedger(event, DELTA, state_path=path, verbose=0).record_steps(40)
    state = json.load(open(path))
    state['orders'] = orders
    with open(path, 'w') as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match='orders'):
        PrivacyLedger(event, DELTA, state_path=path, verbose=0)


def test_an_audit_does_not_exempt_steps_another_ledger_charged():
    # Closed: exempt_draws subtracts only the audit's own trials, so a fresh
    # in-process ledger still sees the steps a first ledger charged.
    dp = _dp_model()
    first = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(3, 1), callbacks=[first], verbose=0)
    assert first.steps == 3
    auditing.audit_one_step(dp, (X[0], Y[0]), num_trials=4, delta=DELTA)
    assert dp.aggregator.keys.exempt_draws > 0
    dp.optimizer.iterations.assign(0)  # A recompile with a fresh optimizer.
    second = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='run 3 DP steps'):
        dp.fit(_data(1, 2), callbacks=[second], verbose=0)
    assert first.steps == 3
