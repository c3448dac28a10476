"""Attacks on the stated guarantee, one group per way in; each test fails
if its defence is removed.

1. Artifacts and the ledger's state file: the file holds no step key or
   seed, and a file whose segments were cut or edited is refused rather
   than read as fewer steps.
2. Extreme records: a record with NaN, inf, 1e38 or 300 features or targets
   changes the released update (noise included) by at most its own clipped
   contribution, under every dtype policy; a weight above 1 never reaches an
   update; a class_weight lookup must not abort the step of a record with
   a label outside it.
3. Resume: a state file older than the checkpoint it is resumed with is
   refused (its epsilon would miss the steps in the weights); a step whose
   ``on_train_batch_end`` an exception cut off is charged before the
   ledger is read or saved.
4. Distribution (in ``distribution_test``, whose processes set up the
   devices): under MirroredStrategy the optimizer acts on the summed noisy
   update only, so optimizer clipping gives the single-device update; a
   dataset distributed by the caller is refused.
5. Callback order and custom loops: a callback before the ledger sees
   every step it can observe charged, in memory and in the file; a custom
   loop reserves its steps in the file before they run; steps of a fit
   without a ledger on input that is not Poisson-sampled are not vouched
   for by a later ledger.
6. (with ``tests/accounting/validation_audit_test.py``) a config block
   dimension that is not the model's is refused.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger

DELTA = 1e-5
N = 64
B_EXP, Q2, C2, C_INF, LR = 16.0, 0.5, 1.0, 0.5, 1.0
X, Y = tiny_models.data(N, seed=11)
SEED = 987654321


def _config(**changes):
    values = dict(num_examples=N, expected_batch_size=B_EXP, l2_norm_clip=C2,
                  linf_norm_clip=C_INF, coordinate_sampling_rate=Q2,
                  noise_multiplier=1.0)
    values.update(changes)
    return TwiceSamplingConfig.single(**values)


def _dp_model(config=None, seed=None, loss=None, inner=None):
    dp = DPModel(inner or tiny_models.linear(), config or _config(),
                 physical_batch_size=8, seed=seed)
    dp.compile(optimizer=tf.keras.optimizers.SGD(LR), loss=loss or (
        tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    return dp


def _data(steps, seed):
    return sampling.poisson_batches(X, Y, physical_batch_size=8,
                                    expected_batch_size=B_EXP, steps=steps,
                                    seed=seed)


def _iterations(dp):
    return int(dp.optimizer.iterations.numpy())


def _steps_on_disk(path):
    with open(path) as f:
        return json.load(f)['steps']


# --- 1. artifacts and the ledger's state file -------------------------------


def test_ledger_state_holds_no_step_key_or_seed(tmp_path):
    path = str(tmp_path / 'ledger.json')
    dp = _dp_model(seed=SEED)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     verbose=0)
    dp.fit(_data(2, 1), callbacks=[ledger], verbose=0)
    key_word = dp.aggregator.keys.get_state()['state'][-1]
    text = open(path).read() + json.dumps(ledger.get_state())
    for secret in (key_word, SEED):
        assert str(secret) not in text
    assert 'seed' not in text and 'state' not in json.loads(
        open(path).read())['segments'][0]


_CUTS = {
    'segments removed': lambda s: s.pop('segments'),
    'segments emptied': lambda s: s.update(segments=[]),
    'segment count cut': lambda s: s['segments'][0].update(count=1),
    'steps edited': lambda s: s.update(steps=s['steps'] + 1),
    'segment not an object': lambda s: s.update(segments=['x']),
}


@pytest.mark.parametrize('cut', sorted(_CUTS))
def test_cut_or_edited_ledger_state_is_refused(tmp_path, cut):
    # Read as it stands, each would restart the privacy spent from fewer
    # steps than the ledger charged (0 for the first two).
    path = str(tmp_path / 'ledger.json')
    event = _config().dp_event()
    ledger = PrivacyLedger(event, DELTA, state_path=path, verbose=0)
    ledger.record_steps(40)
    state = json.load(open(path))
    assert state['steps'] == 40
    _CUTS[cut](state)
    with open(path, 'w') as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match='segment|steps='):
        PrivacyLedger(event, DELTA, state_path=path, verbose=0)


# --- 2. extreme records -----------------------------------------------------


def _update(dp, initial, x, y, w):
    """One step from ``initial`` with the same key (masks AND noise)."""
    dp.set_weights(initial)
    dp.aggregator.keys.set_state(tiny_models.FIXED_KEY_STATE)
    tiny_models.one_step(dp, x, y, w)
    return np.concatenate([
        (np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
        for a, b in zip(dp.get_weights(), initial)])


# Each run's weights round to the variables' dtype once, by at most half a
# unit in the last place: 2**-11 (float16) or 2**-8 (bfloat16) relative.
_HALF_ULP = {'float16': 2.0**-11, 'bfloat16': 2.0**-8}


@pytest.mark.parametrize('policy', [
    'float32', 'mixed_float16', 'mixed_bfloat16', 'float16', 'bfloat16'])
@pytest.mark.parametrize('where', ['feature', 'target'])
def test_extreme_record_moves_the_noisy_update_by_at_most_its_clip(
        where, policy):
    # Noise on (z = 1, the calibrated kind), masks and the l-infinity clip:
    # the record's own clipped contribution is all it can change; it can
    # neither poison the update (non-finite) nor touch the noise. Under
    # every dtype policy: 16-bit gradients are clipped and summed over a
    # chunk in float32, chunks are added in float64, and only the applied
    # update is rounded to 16-bit variables.
    with tiny_models.dtype_policy(policy):
        dp = _dp_model(loss=tf.keras.losses.MeanSquaredError(
            reduction=tf.keras.losses.Reduction.NONE),
            inner=tiny_models.mlp())
    x, labels = tiny_models.data(6, seed=2)
    y = np.eye(tiny_models.NUM_CLASSES, dtype=np.float32)[labels]
    initial = dp.get_weights()
    bad = 5  # The last row: the other rows keep their masks.
    padded = np.ones(len(x), np.float32)
    padded[bad] = 0.0
    reference = _update(dp, initial, x, y, padded)
    scale = LR / (B_EXP * Q2)
    # Rounding of the two runs' weights, per coordinate.
    weights = np.concatenate([np.abs(np.asarray(w, np.float64)).ravel()
                              for w in initial])
    rounding = 2 * _HALF_ULP.get(policy, 0.0) * (
        weights + np.abs(reference) + scale * C_INF)
    for value in (np.nan, np.inf, -np.inf, 1e38, -1e38, 300.0):
        bx, by = x.copy(), y.copy()
        (bx if where == 'feature' else by)[bad] = value
        got = _update(dp, initial, bx, by, np.ones(len(x), np.float32))
        assert np.all(np.isfinite(got)), value
        own = got - reference
        assert (np.linalg.norm(own) <= scale * C2 * (1 + 1e-4)
                + np.linalg.norm(rounding)), value
        assert np.all(np.abs(own) <= scale * C_INF * (1 + 1e-4)
                      + rounding), value


@pytest.mark.parametrize('weight', [1.5, np.nan, -0.5])
def test_a_weight_outside_the_unit_interval_never_reaches_an_update(weight):
    # A weight of 1.5 would scale the record's clipped gradient past c2.
    dp = _dp_model()
    x, y = tiny_models.data(4, seed=3)
    initial = dp.get_weights()
    w = np.array([1.0, 1.0, 1.0, weight], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match='sample_weight'):
        tiny_models.one_step(dp, x, y, w)
    for a, b in zip(dp.get_weights(), initial):  # Nothing was applied.
        np.testing.assert_array_equal(a, b)


def test_class_weight_with_a_label_outside_it_does_not_abort_a_step():
    # Keras 2 would gather the missing label's weight out of range and abort
    # the step that sampled record 0, revealing it was sampled; DPModel
    # applies class_weight itself, with weight 0 for that label.
    y = Y.copy()
    y[0] = 7  # Outside the 3 classes and outside class_weight.
    dp = _dp_model(config=_config(expected_batch_size=float(N)))
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    data = sampling.poisson_batches(X, y, physical_batch_size=8,
                                    expected_batch_size=float(N), steps=2,
                                    seed=1)  # q1 = 1: record 0 is sampled.
    dp.fit(data, callbacks=[ledger], verbose=0,
           class_weight={0: 1.0, 1: 0.5, 2: 1.0})
    assert _iterations(dp) == ledger.steps == 2


# --- 3. resume --------------------------------------------------------------


def test_stale_ledger_state_beside_a_newer_checkpoint_is_charged(tmp_path):
    path = str(tmp_path / 'ledger.json')
    checkpoint = str(tmp_path / 'ckpt.weights.h5')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     save_every_steps=1, verbose=0)
    dp.fit(_data(2, 1), callbacks=[ledger], verbose=0)
    stale = open(path).read()
    dp.fit(_data(4, 2), callbacks=[ledger], verbose=0)
    dp.save_weights(checkpoint)
    # A new process: the checkpoint of step 6, the ledger file of step 2.
    with open(path, 'w') as f:
        f.write(stale)
    resumed = _dp_model()
    resumed.load_weights(checkpoint)
    ledger = PrivacyLedger.for_model(resumed, delta=DELTA, state_path=path,
                                     save_every_steps=1, verbose=0)
    # The weights' record names 6 steps of the event: 4 more are charged.
    assert ledger.steps == 6
    resumed.fit(_data(1, 3), callbacks=[ledger], verbose=0)
    assert ledger.steps == _iterations(resumed) == 7


class _FailAt(tf.keras.callbacks.Callback):

    def __init__(self, at):
        super().__init__()
        self._at = at

    def on_train_batch_end(self, batch, logs=None):
        if _iterations(self.model) == self._at:
            raise OSError('disk full')


def test_step_cut_off_by_an_exception_is_charged_before_any_read(tmp_path):
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(OSError, match='disk full'):
        dp.fit(_data(5, 1), callbacks=[_FailAt(3), ledger], verbose=0)
    assert _iterations(dp) == 3
    # Read, saved or copied before any further hook: the 3rd step is in.
    assert ledger.steps == 3
    assert ledger.epsilon == pytest.approx(
        _config().epsilon(3, DELTA), rel=1e-9)
    copy = str(tmp_path / 'copy.json')
    ledger.save(copy)
    assert _steps_on_disk(copy) == 3
    assert PrivacyLedger.from_state(ledger.get_state()).steps == 3


# --- 5. callback order, custom loops ----------------------------------------


class _Observer(tf.keras.callbacks.Callback):
    """Before the ledger: what the ledger charges when a step's weights are
    first observable."""

    def __init__(self, ledger, path):
        super().__init__()
        self._ledger, self._path = ledger, path
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((_iterations(self.model), self._ledger.steps,
                          _steps_on_disk(self._path)))


@pytest.mark.parametrize('steps_per_execution', [1, 2])
def test_a_callback_before_the_ledger_sees_every_step_charged(
        tmp_path, steps_per_execution):
    path = str(tmp_path / 'ledger.json')
    dp = DPModel(tiny_models.linear(), _config(), physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(LR),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True),
               steps_per_execution=steps_per_execution)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     save_every_steps=1, verbose=0)
    observer = _Observer(ledger, path)
    dp.fit(_data(4, 1), callbacks=[observer, ledger], verbose=0)
    assert len(observer.seen) == 4 // steps_per_execution
    for ran, charged, on_disk in observer.seen:
        assert charged == ran and on_disk >= ran, observer.seen


def test_custom_loop_reserves_each_step_in_the_file_before_it_runs(tmp_path):
    # record_steps alone charges a step after it ran: a crash between the
    # two loses it from the file. reserve_steps writes ahead.
    path = str(tmp_path / 'ledger.json')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     save_every_steps=1, max_steps=3,
                                     verbose=0)
    ledger.set_model(dp)  # Its drawn steps and record_steps: charged once.
    step = tf.function(dp.train_step)
    batch = (X[:8], Y[:8])  # One shape: traced once.
    for _ in range(3):
        ledger.reserve_steps(1)
        step(batch)  # A crash here leaves a file that covers this step.
        assert _steps_on_disk(path) >= _iterations(dp)
        ledger.record_steps(1)
    assert ledger.steps == _steps_on_disk(path) == _iterations(dp) == 3
    with pytest.raises(ValueError, match='exceed'):
        ledger.reserve_steps(1)  # Past max_steps: refused before it runs.
    assert _steps_on_disk(path) == 3


def test_steps_on_shuffled_batches_are_not_vouched_for_by_a_later_ledger():
    dp = _dp_model()
    dp.fit(X, Y, batch_size=16, epochs=1, verbose=0)  # Fixed-size batches.
    assert _iterations(dp) == N // 16
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='Poisson'):
        dp.fit(_data(1, 1), callbacks=[ledger], verbose=0)


# --- 6. a config that does not describe the model ---------------------------


def test_a_block_dimension_that_is_not_the_models_is_refused():
    # linf clip 0.25 of l2 clip 1: the worst case spreads over d0 = 16
    # coordinates, the linear model has 15. Claiming 1 coordinate would
    # report about a fifth of the epsilon.
    config = TwiceSamplingConfig(
        num_examples=N, expected_batch_size=B_EXP, coordinate_sampling_rate=Q2,
        blocks=(Block(l2_norm_clip=1.0, linf_norm_clip=0.25,
                      noise_multiplier=1.0, dimension=1),))
    claimed = PrivacyLedger(config.dp_event(), DELTA, verbose=0)
    claimed.record_steps(20)
    true = PrivacyLedger(TwiceSampledGaussianDpEvent(
        B_EXP / N, Q2, 1.0, 1.0, 0.25, block_dimensions=15), DELTA,
        verbose=0)
    true.record_steps(20)
    assert claimed.epsilon < true.epsilon / 4  # What it would print.
    dp = _dp_model(config=config)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='dimension=1.*15 coordinates'):
        dp.fit(_data(1, 1), callbacks=[ledger], verbose=0)
    # Without a ledger the first step refuses too, before it runs.
    with pytest.raises(ValueError, match='dimension=1.*15 coordinates'):
        dp.fit(_data(1, 1), verbose=0)
    assert _iterations(dp) == 0 and int(dp.steps_taken) == 0
    # The model's own dimension is accepted.
    right = _dp_model(config=_config(linf_norm_clip=0.25).with_dimensions(
        [15]))
    ledger = PrivacyLedger.for_model(right, delta=DELTA, verbose=0)
    right.fit(_data(1, 1), callbacks=[ledger], verbose=0)
    assert ledger.steps == 1
