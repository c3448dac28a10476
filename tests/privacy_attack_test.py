"""Attacks on the privacy path: ways the stated (epsilon, delta) could
silently stop holding, each refused or accounted.

Every test here failed before the change it pins down:

* callbacks that act on the noise-free ``nonprivate_*`` training logs
  (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint's ``save_best_only``)
  would make the schedule or the released checkpoint a noise-free
  function of the private data: refused when a ledger is attached;
* ``make_private`` resumed from a ledger state file with a fixed
  ``data_seed`` starts sampling after the steps already charged, so no
  Poisson batch of the earlier run is drawn again;
* the training script's ``run.json`` holds no seed;
* ``preprocess_fn`` of ``poisson_batches`` runs on each example alone, so
  a preprocessing step that uses batch statistics cannot mix examples.

Steps a DP model ran before any ledger saw it (a ``fit`` without the
ledger, a custom loop), charged by the first ledger that sees it, and
audit trials, charged by none: tests/keras/ledger_state_attack_test.py
(the record every route writes), tests/auditing_test.py and
tests/accounting/step_ledger_test.py.
"""

import dataclasses
import json

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from examples.training import plan as plan_lib
from examples.training import resume
from examples.training import settings
from tests import tiny_models
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.config import Block
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger
from tf_twice.keras import make_private

DELTA = 1e-5
N = 64
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=[N, tiny_models.NUM_FEATURES]).astype(np.float32)
Y = _RNG.integers(0, tiny_models.NUM_CLASSES, N)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _config(**changes):
    values = dict(num_examples=N, expected_batch_size=16.0, l2_norm_clip=1.0,
                  linf_norm_clip=0.5, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.0)
    values.update(changes)
    return TwiceSamplingConfig.single(**values)


def _dp_model(**changes):
    dp = DPModel(tiny_models.linear(), _config(**changes),
                 physical_batch_size=8)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    return dp


def _data(steps=3, seed=1):
    return sampling.poisson_batches(X, Y, physical_batch_size=8,
                                    expected_batch_size=16.0, steps=steps,
                                    seed=seed)


# --- (2) callbacks on noise-free training logs ---------------------------------


@pytest.mark.parametrize('callback', [
    lambda: tf.keras.callbacks.EarlyStopping(monitor='nonprivate_loss'),
    lambda: tf.keras.callbacks.ReduceLROnPlateau(
        monitor='nonprivate_accuracy'),
    lambda: tf.keras.callbacks.ModelCheckpoint(
        '/tmp/unused.weights.h5', save_weights_only=True,
        monitor='nonprivate_loss', save_best_only=True),
])
def test_callbacks_that_act_on_nonprivate_logs_are_refused(callback):
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='nonprivate_'):
        dp.fit(_data(), callbacks=[ledger, callback()], verbose=0)
    assert int(dp.optimizer.iterations) == 0


def test_callbacks_on_other_logs_are_accepted():
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(), callbacks=[
        ledger, tf.keras.callbacks.EarlyStopping(monitor='epsilon',
                                                 mode='max')],
        verbose=0)
    assert ledger.steps == 3


# --- (3) resumed sampling ----------------------------------------------------


def test_make_private_resumed_with_a_data_seed_does_not_replay_batches(
        tmp_path):
    path = str(tmp_path / 'ledger.json')

    def run():
        return make_private(tiny_models.linear(), _config(), X, Y,
                            delta=DELTA, steps=8, data_seed=11,
                            state_path=path, verbose=0)

    first = run()
    first.model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    # An iterator made to look at the data (not trained on), then 3 steps.
    next(iter(first.data))
    first.model.fit(first.data.take(3), callbacks=[first.ledger], verbose=0)
    charged = first.ledger.steps
    assert charged >= 3

    second = run()  # A new process would do the same.
    before = sampling.get_poisson_sampling_info(first.data)
    after = sampling.get_poisson_sampling_info(second.data)
    # Step indices of each run's first 4 iterations (epochs).
    per_epoch = before.steps

    def drawn(info):
        return {(info.seed, info.start_step + i)
                for i in range(4 * per_epoch)}

    assert not drawn(before) & drawn(after)
    # Another seed, so also the batches differ.
    first_batch = sampling.sample_logical_batch_indices(
        N, example_sampling_rate=16.0 / N, seed=after.seed,
        step=after.start_step)
    replayed = [sampling.sample_logical_batch_indices(
        N, example_sampling_rate=16.0 / N, seed=before.seed, step=s)
                for s in range(4 * per_epoch)]
    assert not any(np.array_equal(first_batch, r) for r in replayed)


# --- (4) the training script's run file ------------------------------------------

def test_training_script_run_file_holds_no_seed(tmp_path):
    secret = 987654321
    config = settings.check_config(dict(
        mode='hybrid', seed=secret, public_examples=50, ranks='4',
        noise_multiplier=1.0, steps=3))
    plan = plan_lib.resolve_plan(config, 1000)
    one_block = plan.mechanism
    plan = dataclasses.replace(plan, ranks=(4,), mechanism=TwiceSamplingConfig(
        num_examples=one_block.num_examples,
        expected_batch_size=one_block.expected_batch_size,
        coordinate_sampling_rate=one_block.coordinate_sampling_rate,
        blocks=(Block(l2_norm_clip=0.6, linf_norm_clip=0.6,
                      noise_multiplier=1.0, dimension=4),
                Block(l2_norm_clip=0.8, linf_norm_clip=0.08,
                      noise_multiplier=1.0, dimension=100))))
    resume.write_run_file(config, plan, str(tmp_path),
                          hybrid=plan_lib.hybrid_blocks_record(config, plan))
    text = (tmp_path / resume.RUN_FILENAME).read_text()
    assert str(secret) not in text
    assert 'seed' not in json.loads(text).get('hybrid', {}).get(
        'settings', {})


# --- (5) preprocessing that mixes examples -----------------------------------------


def test_preprocess_fn_cannot_mix_the_examples_of_a_batch():
    # Centring by the batch mean would make every example's input depend
    # on the others (one record shifts every other record's gradient).
    x = np.arange(8, dtype=np.float32)[:, None] * np.ones([1, 3], np.float32)

    def centre(xb, yb):
        return xb - tf.reduce_mean(xb, axis=0, keepdims=True), yb

    ds = sampling.poisson_batches(x, np.arange(8), physical_batch_size=8,
                                  example_sampling_rate=1.0, steps=1, seed=0,
                                  preprocess_fn=centre)
    xb, _, _ = next(ds.as_numpy_iterator())
    # Applied to each example alone, the batch of one is its own mean.
    np.testing.assert_array_equal(xb, np.zeros_like(xb))


# --- (7) the ledger's numbers against dp_accounting ----------------------------


def test_ledger_epsilon_at_q2_one_is_dp_accountings_subsampled_gaussian():
    # q2 = 1: exactly dp_accounting's Poisson-subsampled Gaussian at integer
    # orders; at fractional orders the ledger uses the next integer order,
    # an upper bound.
    q1, z, steps = 0.01, 1.1, 1000
    event = TwiceSampledGaussianDpEvent(
        example_sampling_rate=q1, coordinate_sampling_rate=1.0,
        noise_multiplier=z, l2_norm_clip=1.0, linf_norm_clip=None)
    reference_event = dp_accounting.PoissonSampledDpEvent(
        q1, dp_accounting.GaussianDpEvent(z))
    for orders, exact in ((list(range(2, 65)), True), (None, False)):
        ledger = PrivacyLedger(event, DELTA, orders=orders, verbose=0)
        ledger.record_steps(steps)
        reference = dp_accounting.rdp.RdpAccountant(ledger.orders)
        reference.compose(reference_event, steps)
        if exact:
            assert ledger.epsilon == pytest.approx(
                reference.get_epsilon(DELTA), rel=1e-9)
        else:
            assert ledger.epsilon >= reference.get_epsilon(DELTA)
        assert TwiceSamplingRdpAccountant(ledger.orders).compose(
            event, steps).get_epsilon(DELTA) == pytest.approx(
                ledger.epsilon, rel=1e-12)


def test_ledger_epsilon_at_d0_one_is_a_gaussian_subsampled_at_q1_q2():
    # With c_inf = c2 (d0 = 1) an example's worst case is one coordinate,
    # kept with probability q2: the dominating pair is exactly a Gaussian
    # Poisson-subsampled at q1 * q2 (an independent computation).
    q1, q2, z, steps = 0.05, 0.5, 1.2, 500
    event = TwiceSampledGaussianDpEvent(
        example_sampling_rate=q1, coordinate_sampling_rate=q2,
        noise_multiplier=z, l2_norm_clip=1.0, linf_norm_clip=1.0)
    ledger = PrivacyLedger(event, DELTA, orders=list(range(2, 65)),
                           verbose=0)
    ledger.record_steps(steps)
    reference = dp_accounting.rdp.RdpAccountant(ledger.orders)
    reference.compose(dp_accounting.PoissonSampledDpEvent(
        q1 * q2, dp_accounting.GaussianDpEvent(z)), steps)
    assert ledger.epsilon == pytest.approx(reference.get_epsilon(DELTA),
                                           rel=1e-9)


# --- (1) a stale secret run state -------------------------------------------------


def _seeded_linear():
    dp = DPModel(tiny_models.linear(), _config(), physical_batch_size=8,
                 seed=3)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    return dp


def test_random_state_of_another_step_is_refused(tmp_path):
    # The state saved after step 1, loaded into the checkpoint of step 2:
    # step 3 would reuse step 2's key, i.e. the noise already released in
    # the checkpoint (two releases with one noise reveal their difference).
    secret = str(tmp_path / 'random_state.json')
    weights = str(tmp_path / 'model.weights.h5')
    x, y = tiny_models.data(4)
    dp = _seeded_linear()
    tiny_models.one_step(dp, x, y)
    dp.save_random_state(secret)
    tiny_models.one_step(dp, x, y)
    dp.save_weights(weights)

    resumed = _seeded_linear()
    resumed(x)
    resumed.load_weights(weights)
    assert int(resumed.optimizer.iterations) == 2
    with pytest.raises(ValueError, match='step'):
        resumed.load_random_state(secret)


def _one_step_and_its_random_state(tmp_path):
    """A seeded model after one step, the file of its random state, and
    the step's batch."""
    secret = str(tmp_path / 'random_state.json')
    x, y = tiny_models.data(4)
    dp = _seeded_linear()
    tiny_models.one_step(dp, x, y)
    dp.save_random_state(secret)
    return dp, secret, (x, y)


def test_random_state_of_other_weights_at_the_same_step_count_is_refused(
        tmp_path):
    # The state saved after step 1 must not load into weights that also
    # hold one step but are others (its next keys would be those the
    # saved run goes on with). A recompile with a fresh optimizer restarts
    # the optimizer's count, not the DP steps the stream is placed by: the
    # state of step 1 is refused after step 3 by its step.
    dp, secret, (x, y) = _one_step_and_its_random_state(tmp_path)
    dp.load_random_state(secret)  # The same weights: accepted.
    saved = dp.inner_model.get_weights()
    dp.inner_model.set_weights([w + 0.5 for w in saved])
    assert int(dp.steps_taken) == 1
    with pytest.raises(ValueError, match='with other weights'):
        dp.load_random_state(secret)
    dp.inner_model.set_weights(saved)
    tiny_models.one_step(dp, x, y)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    tiny_models.one_step(dp, x, y)
    assert int(dp.optimizer.iterations) == 1 and int(dp.steps_taken) == 3
    with pytest.raises(ValueError, match='saved at step 1, but this model '
                       'is at step 3'):
        dp.load_random_state(secret)


@pytest.mark.parametrize('missing', ['step', 'weights'])
def test_random_state_without_its_step_or_weights_is_refused(tmp_path,
                                                             missing):
    # A file of an earlier version records neither the step nor the weights
    # digest: it cannot be matched with the model, so it must not load (it
    # might continue the keys of a step already in released weights).
    dp, secret, _ = _one_step_and_its_random_state(tmp_path)
    with open(secret) as f:
        state = json.load(f)
    del state[missing]
    with open(secret, 'w') as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match='without a record of the step'):
        dp.load_random_state(secret)


def test_random_state_needs_the_weights_it_is_checked_against(tmp_path):
    # A model not built yet (e.g. a TF-format checkpoint waiting to be
    # restored) has no weights to match the file with: refused, naming the
    # fix, rather than loaded unchecked.
    dp = DPModel(tf.keras.Sequential([tf.keras.layers.Dense(1)]), _config(),
                 physical_batch_size=8, seed=3)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    with pytest.raises(ValueError, match='not built.*call the model'):
        dp.save_random_state(str(tmp_path / 'random_state.json'))
