"""The ledger read, saved and charged from several threads at once.

A monitor thread reading the ledger (its steps or epsilon) while `fit` runs
races with the steps: every step must be charged exactly once (neither
lost nor counted twice), and a save from another thread must not leave
the file behind the steps. Custom-loop records from several threads:
tests/accounting/step_ledger_test.py.
"""

import json
import threading

import tensorflow as tf

from tests import tiny_models
from tf_twice import _files
from tf_twice import sampling
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger

DELTA = 1e-5
N = 64
X, Y = tiny_models.data(N, seed=11)


def _dp_model():
    config = TwiceSamplingConfig.single(
        num_examples=N, expected_batch_size=16.0, l2_norm_clip=1.0,
        linf_norm_clip=0.5, coordinate_sampling_rate=0.5,
        noise_multiplier=1.0)
    dp = DPModel(tiny_models.linear(), config, physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True))
    return dp


def test_monitors_reading_the_ledger_during_training_charge_every_step_once():
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    ledger.set_model(dp)  # Charges the model's steps at every reading.
    assert ledger.steps == 0
    data = sampling.poisson_batches(X, Y, physical_batch_size=8,
                                    expected_batch_size=16.0, steps=40,
                                    seed=1)
    done = threading.Event()

    def monitor():  # E.g. a progress display of the privacy spent.
        while not done.is_set():
            _ = ledger.steps

    # Two monitors: readings race with the steps and with each other.
    threads = [threading.Thread(target=monitor) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        dp.fit(data, verbose=0)  # Charged by the ledger's readings.
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert int(dp.steps_taken) == int(dp.optimizer.iterations) == 40
    assert ledger.steps == 40


def test_a_save_from_another_thread_never_leaves_the_file_behind_the_steps(
        tmp_path, monkeypatch):
    """`ledger.save()` on a monitor thread whose write is slow (fsync
    releases the GIL): without a lock its stale file replaced the
    write-ahead one while fit's steps went on, and a crash would lose them.
    With the lock, training waits for the write (here: until the monitor
    stops waiting, 2 s), and the file covers every step that ran."""
    dp = _dp_model()
    path = str(tmp_path / 'state.json')
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     save_every_steps=10, verbose=0)
    real_write = _files.atomic_write_json
    in_write, go = threading.Event(), threading.Event()

    def slow_write(p, obj):  # The monitor's write is slow (fsync).
        if threading.current_thread().name == 'monitor':
            in_write.set()
            go.wait(timeout=2)
        real_write(p, obj)

    monkeypatch.setattr(_files, 'atomic_write_json', slow_write)
    monitor = threading.Thread(target=ledger.save, name='monitor')
    seen = []

    class Coordinator(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                monitor.start()
                in_write.wait()
            if batch == 6:
                go.set()
                monitor.join()
                with open(path) as f:
                    seen.append((json.load(f)['steps'],
                                 int(dp.steps_taken)))

    dp.fit(sampling.poisson_batches(X, Y, physical_batch_size=8,
                                    expected_batch_size=16.0, steps=9,
                                    seed=1),
           callbacks=[ledger, Coordinator()], verbose=0)
    on_disk, ran = seen[0]
    assert on_disk >= ran, (on_disk, ran)  # Unlocked: 2 on disk, 7 ran.
