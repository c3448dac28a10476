"""`step_control`: the steps a model drew keys for, counted exactly once.

A monitor thread reading the ledger (its steps or epsilon) while `fit` runs
makes `DrawnStepCounter.new_steps` race with the steps: a step that
finishes while the streams are read must be charged at the next reading,
never marked counted and lost (an under-count of epsilon), and two readings
at once must not both count it (an over-count).
"""

import threading
import types

import tensorflow as tf

from tests import tiny_models
from tf_twice import sampling
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger
from tf_twice.keras import step_control

DELTA = 1e-5
N = 64
X, Y = tiny_models.data(N, seed=11)


class _StreamWithAConcurrentStep:
    """A step-key stream on which one step finishes (as if on another
    thread) right after the ``at``-th read of ``draws``."""

    def __init__(self, at):
        self._value, self._reads, self._at = 0, 0, at
        self.accounted_draws = 0
        self.unverified_from = None

    @property
    def draws(self):
        value = self._value
        self._reads += 1
        if self._reads == self._at:
            self._value += 1  # The step's key is drawn after this read.
        return value


def test_a_step_finishing_during_a_reading_is_charged_later():
    charged = {}
    for at in range(1, 7):  # The step finishes after each read in turn.
        stream = _StreamWithAConcurrentStep(at)
        model = types.SimpleNamespace(key_streams=[stream])
        counter = step_control.DrawnStepCounter()
        charged[at] = sum(counter.new_steps(model) for _ in range(8))
        assert stream.draws == 1
    # The one step that ran, whenever it finished (the bug: 0 for one).
    assert charged == {at: 1 for at in range(1, 7)}, charged


def test_monitors_reading_the_ledger_during_training_charge_every_step_once():
    config = TwiceSamplingConfig.single(
        num_examples=N, expected_batch_size=16.0, l2_norm_clip=1.0,
        linf_norm_clip=0.5, coordinate_sampling_rate=0.5,
        noise_multiplier=1.0)
    dp = DPModel(tiny_models.linear(), config, physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True))
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
    assert dp.aggregator.keys.draws == int(dp.optimizer.iterations) == 40
    assert ledger.steps == 40
