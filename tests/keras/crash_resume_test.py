"""Crash and resume: a killed DP run neither forgets privacy nor replays noise.

A tiny `DPModel` trains on Poisson logical batches with a `PrivacyLedger`
(write-ahead state file) and a mid-epoch checkpoint callback; a callback
raises in the middle of an epoch (the simulated crash, before the ledger and
the checkpoint see the end of that step). A fresh process is mimicked by
building a new model and ledger from the same paths, restoring and training
on. Checked:

(a) the ledger file charges at least every step that ran, and resuming
    continues from it (privacy spent is not reset);
(b) the last checkpoint exists, loads, and holds the weights and optimizer
    step of the step it was written after (and no random state); the
    checkpoints are Keras-format ``.weights.h5`` files, which Keras 2 and
    Keras 3 both write and read, optimizer state included;
(c) the resumed ledger's epsilon is the accountant's for every step charged;
(d) the resumed run draws none of the mask/noise keys of the crashed run,
    although the model is seeded with the same seed (a seeded stream is
    positioned by the model's state at its first step).
"""

import os
from typing import List

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tf_twice import sampling
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger

NUM_EXAMPLES, EXPECTED_BATCH = 64, 16.0
STEPS_PER_EPOCH = 8
CRASH_AT = 7  # The 7th step runs, then the crash.
SAVE_FREQ = 2  # Checkpoints after steps 2, 4, 6: the last one is step 6.
LAST_CHECKPOINT = CRASH_AT - CRASH_AT % SAVE_FREQ
SAVE_EVERY = 4  # Ledger write-ahead: a crash over-charges < 4 + 1 steps.
DELTA = 1e-5
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=[NUM_EXAMPLES, 4]).astype(np.float32)
Y = _RNG.integers(0, 3, NUM_EXAMPLES)


def _dp_model() -> DPModel:
    inner = tf.keras.Sequential([tf.keras.layers.Dense(
        3, input_shape=(4,),
        kernel_initializer=tf.keras.initializers.GlorotUniform(seed=0))])
    config = TwiceSamplingConfig.single(
        num_examples=NUM_EXAMPLES, expected_batch_size=EXPECTED_BATCH,
        l2_norm_clip=1.0, linf_norm_clip=0.5, noise_multiplier=1.0,
        coordinate_sampling_rate=0.5)
    dp = DPModel(inner, config, physical_batch_size=8, seed=3)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True))
    return dp


def _data(seed: int) -> tf.data.Dataset:
    # A resumed run uses a new sampling seed (see tf_twice.sampling).
    return sampling.poisson_batches(
        X, Y, physical_batch_size=8, expected_batch_size=EXPECTED_BATCH,
        steps=STEPS_PER_EPOCH, seed=seed)


def _state(dp: DPModel) -> tuple:
    return tuple(dp.aggregator.keys.get_state()['state'])


class _Recorder(tf.keras.callbacks.Callback):
    """After each step: the key stream's state (which identifies the key
    the step drew) and the weights."""

    def __init__(self):
        super().__init__()
        self.states_after: List[tuple] = []
        self.weights_after: List[List[np.ndarray]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.states_after.append(_state(self.model))
        self.weights_after.append(self.model.inner_model.get_weights())


class _Crash(tf.keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == CRASH_AT:
            raise RuntimeError('simulated crash')


def _accountant_epsilon(event, steps: int) -> float:
    return TwiceSamplingRdpAccountant().compose(event, steps).get_epsilon(
        DELTA)


def _crashed_run(ledger_path: str, checkpoint: tf.keras.callbacks.Callback):
    dp = _dp_model()
    recorder = _Recorder()
    ledger = PrivacyLedger.for_model(
        dp, delta=DELTA, state_path=ledger_path,
        save_every_steps=SAVE_EVERY, verbose=0)
    # The crash comes before the ledger and the checkpoint see its step.
    with pytest.raises(RuntimeError, match='simulated crash'):
        dp.fit(_data(seed=1), epochs=2, verbose=0,
               callbacks=[recorder, _Crash(), ledger, checkpoint])
    assert int(dp.optimizer.iterations) == CRASH_AT
    return dp, recorder


def _check_resumed_ledger(dp: DPModel, ledger_path: str) -> PrivacyLedger:
    """(a): the file charges every step that ran; resuming keeps it."""
    resumed = PrivacyLedger.for_model(
        dp, delta=DELTA, state_path=ledger_path,
        save_every_steps=SAVE_EVERY, verbose=0)
    assert CRASH_AT <= resumed.steps <= CRASH_AT + SAVE_EVERY
    assert resumed.epsilon == pytest.approx(
        _accountant_epsilon(resumed.event, resumed.steps), rel=1e-12)
    return resumed


def _check_no_replay(new_states: List[tuple], recorder: _Recorder) -> None:
    """(d): no resumed step uses a key of any step of the crashed run."""
    used = set(recorder.states_after)
    assert new_states and not used.intersection(new_states)


def _assert_weights_equal(a, b) -> None:
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_resume_from_model_checkpoint(tmp_path):
    ledger_path = str(tmp_path / 'privacy_ledger.json')
    weights_path = str(tmp_path / 'checkpoints' / 'model.weights.h5')
    checkpoint = tf.keras.callbacks.ModelCheckpoint(
        weights_path, save_weights_only=True, save_freq=SAVE_FREQ)
    _, recorder = _crashed_run(ledger_path, checkpoint)

    # A new process: same paths, a model built from scratch.
    dp = _dp_model()  # Same seed, same initial weights.
    resumed = _check_resumed_ledger(dp, ledger_path)
    charged = resumed.steps

    # (b) The last checkpoint is the one after step LAST_CHECKPOINT.
    assert os.listdir(tmp_path / 'checkpoints') == ['model.weights.h5']
    dp.load_weights(weights_path)
    _assert_weights_equal(dp.inner_model.get_weights(),
                          recorder.weights_after[LAST_CHECKPOINT - 1])
    assert int(dp.optimizer.iterations) == LAST_CHECKPOINT

    # (c) Training on charges the new steps on top of the old ones.
    new_recorder = _Recorder()
    dp.fit(_data(seed=2), epochs=1, verbose=0,
           callbacks=[new_recorder, resumed])
    assert resumed.steps == charged + STEPS_PER_EPOCH
    assert int(dp.optimizer.iterations) == LAST_CHECKPOINT + STEPS_PER_EPOCH
    assert resumed.epsilon == pytest.approx(
        _accountant_epsilon(resumed.event, charged + STEPS_PER_EPOCH),
        rel=1e-12)
    again = PrivacyLedger(resumed.event, DELTA, state_path=ledger_path)
    assert again.steps == resumed.steps
    _check_no_replay(new_recorder.states_after, recorder)


@pytest.mark.parametrize('ledger_first', [False, True])
def test_resume_with_backup_and_restore(tmp_path, ledger_first):
    # Any callback order charges exactly the steps that ran, also when the
    # ledger's on_train_begin runs before BackupAndRestore restores.
    ledger_path = str(tmp_path / 'privacy_ledger.json')
    backup_dir = str(tmp_path / 'backup')
    backup = tf.keras.callbacks.BackupAndRestore(backup_dir,
                                                 save_freq=SAVE_FREQ)
    _, recorder = _crashed_run(ledger_path, backup)
    assert os.listdir(backup_dir)  # (b) The backup is kept.

    dp = _dp_model()
    resumed = _check_resumed_ledger(dp, ledger_path)
    charged = resumed.steps

    class _AfterRestore(tf.keras.callbacks.Callback):
        """Captures the state BackupAndRestore restored (runs after it)."""

        def on_train_begin(self, logs=None):
            self.iterations = int(self.model.optimizer.iterations)
            self.weights = self.model.inner_model.get_weights()

    after_restore = _AfterRestore()
    new_recorder = _Recorder()
    callbacks = [
        tf.keras.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ),
        after_restore, new_recorder]
    callbacks = [resumed] + callbacks if ledger_first else callbacks + [
        resumed]
    dp.fit(_data(seed=2), epochs=2, verbose=0, callbacks=callbacks)

    # (b) The backup after step LAST_CHECKPOINT was restored.
    assert after_restore.iterations == LAST_CHECKPOINT
    _assert_weights_equal(after_restore.weights,
                          recorder.weights_after[LAST_CHECKPOINT - 1])
    # Keras 2 resumes mid-epoch (the rest of epoch 1, then epoch 2); Keras
    # 3 restores the epoch and runs it again from its first step.
    ran = int(dp.optimizer.iterations) - LAST_CHECKPOINT
    done_in_epoch_1 = LAST_CHECKPOINT if markers.KERAS_MAJOR == 2 else 0
    assert ran == len(new_recorder.states_after) == (
        2 * STEPS_PER_EPOCH - done_in_epoch_1)
    # (c)
    assert resumed.steps == charged + ran
    assert resumed.epsilon == pytest.approx(
        _accountant_epsilon(resumed.event, charged + ran), rel=1e-12)
    _check_no_replay(new_recorder.states_after, recorder)


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
