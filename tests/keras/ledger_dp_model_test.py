"""PrivacyLedger and tf_twice DP models, end to end: for_model, the checks
at the start of fit, and the plumbing by which steps are charged from the
weights' record (tf_twice.keras.privacy_record): the train function a
ledger watches or blocks, interrupted fits, rollbacks, reduced precision,
custom loops, the DP optimizer path and its recompiles.

Which records a ledger charges or refuses, in every scenario these fits
reach: tests/accounting/step_ledger_test.py and step_record_test.py."""

import logging
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models
from tests.keras.ledger_setup import accountant_epsilon as _accountant_epsilon
from tests.keras.ledger_setup import data as _data
from tests.keras.ledger_setup import DELTA, EVENT, Q1, X, Y
from tests.keras.ledger_setup import model as _model
from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import step_record
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import privacy_record
from tf_twice.keras.ledger import PrivacyLedger


# --- for_model and the checks at the start of fit ---------------------------

# EVENT's step on the 64 examples of X (q1 = 16 / 64).
CONFIG = TwiceSamplingConfig.single(
    num_examples=64, expected_batch_size=16, l2_norm_clip=1.0,
    linf_norm_clip=0.5, noise_multiplier=1.0, coordinate_sampling_rate=0.5)


def _config(**changes):
    fields = dict(num_examples=64, expected_batch_size=16, l2_norm_clip=1.0,
                  linf_norm_clip=0.5, noise_multiplier=1.0,
                  coordinate_sampling_rate=0.5)
    fields.update(changes)
    return TwiceSamplingConfig.single(**fields)


def _dp_optimizer_model(config=CONFIG, **optimizer_kwargs):
    """The optimizer path: a DPModel without a config, compiled with a
    tf_twice DP optimizer, which carries the mechanism."""
    model = DPModel(_model(), physical_batch_size=8)
    model.compile(
        optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            config, learning_rate=0.1, seed=0, **optimizer_kwargs),
        loss=tf.keras.losses.MeanSquaredError())
    return model


def _steps_under(dp, config, *, steps, seed=2):
    """Recompiles `dp` with a new DP optimizer of `config` and runs
    `steps` of its steps outside any ledger (a custom loop); returns the
    optimizer."""
    dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        config, learning_rate=0.1), loss=tf.keras.losses.MeanSquaredError())
    if steps:
        step = tf.function(dp.train_step)
        for batch in _data(steps=steps, seed=seed):
            step(batch)
    return dp.optimizer


def _a_then_steps_under(config, *, fit_steps, steps):
    """A DP-optimizer model (optimizer A) after `fit_steps` steps under
    its ledger, then `steps` of a new DP optimizer of `config` outside any
    ledger (`_steps_under`); returns the model, the ledger and A."""
    dp = _dp_optimizer_model()
    optimizer_a = dp.optimizer
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(steps=fit_steps), callbacks=[ledger], verbose=0)
    _steps_under(dp, config, steps=steps)
    return dp, ledger, optimizer_a


def _plain_model_with_dp_optimizer():
    model = _model()
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        CONFIG, learning_rate=0.1), loss=tf.keras.losses.MeanSquaredError(
            reduction='none'))
    return model


def _dp_model(**changes):
    dp = DPModel(_model(), _config(**changes), physical_batch_size=8, seed=0)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse')
    return dp


@pytest.mark.parametrize('dp', [False, True])
def test_an_exhausted_budget_runs_no_step_and_restores_the_train_function(
        dp):
    # Before the first step the ledger swaps the train function for one
    # that runs none (Keras ignores stop_training then), over the one that
    # watches a DP model's record. Keras 3 builds compiled metrics at the
    # first step: a fit that runs no step must still end cleanly, and the
    # next one, without the ledger, train.
    if dp:
        model = _dp_model()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse',
                      metrics=['mae'])
        ledger = PrivacyLedger.for_model(model, delta=DELTA, max_steps=0)
    else:  # A target the steps recorded so far exhausted.
        model = _model()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse',
                      metrics=['mae'])
        target = (_accountant_epsilon((EVENT, 3))
                  + _accountant_epsilon((EVENT, 4))) / 2
        ledger = PrivacyLedger(EVENT, DELTA, target_epsilon=target)
        ledger.record_steps(3)
    initial = model.get_weights()
    model.fit(_data(), epochs=2, callbacks=[ledger], verbose=0)
    assert ledger.steps == (0 if dp else 3)
    assert int(model.optimizer.iterations) == 0
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    assert 'get_metrics_result' not in vars(model)  # Restored.
    assert model.train_function.__name__ not in ('blocked_train_function',
                                                 'watched_train_function')
    history = model.fit(_data(steps=2), epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 2
    assert any('mae' in key for key in history.history)


def test_for_model_builds_the_models_event(tmp_path):
    path = str(tmp_path / 'ledger.json')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(
        dp, delta=DELTA, target_epsilon=50.0, max_steps=9,
        state_path=path, save_every_steps=3, orders=[2, 4, 8], verbose=0)
    assert ledger.event == EVENT == dp.dp_event()
    assert (ledger.delta, ledger.target_epsilon, ledger.max_steps,
            ledger.state_path) == (DELTA, 50.0, 9, path)
    np.testing.assert_array_equal(ledger.orders, [2, 4, 8])


@markers.needs_tf_privacy_optimizers
def test_for_model_builds_the_dp_optimizers_event():
    optimizer_model = _dp_optimizer_model()
    assert PrivacyLedger.for_model(optimizer_model,
                                   delta=DELTA).event == EVENT


@pytest.mark.parametrize('make, kwargs, match', [
    (lambda: _model(), {}, 'DPModel'),  # A plain SGD optimizer.
    pytest.param(lambda: _dp_optimizer_model(num_microbatches=4), {},
                 'num_microbatches',
                 marks=markers.needs_tf_privacy_optimizers),
    pytest.param(_plain_model_with_dp_optimizer, {}, 'DPModel',
                 marks=markers.needs_tf_privacy_optimizers),
    (lambda: DPModel(_model()), {}, 'no DP mechanism'),
    (lambda: _dp_model(noise_multiplier=0.0, non_private=True), {},
     'non_private'),
    (lambda: _dp_model(num_examples=15), {}, 'num_examples = 15'),
    (_dp_model, dict(delta=2.0), 'delta'),
    (_dp_model, dict(max_steps=-3), 'max_steps'),
    (_dp_model, dict(state_path='/no/such/dir/ledger.json'), 'state_path'),
])
def test_for_model_refusals(make, kwargs, match):
    args = dict(delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PrivacyLedger.for_model(make(), **args)


@markers.needs_tf_privacy_optimizers
def test_optimizer_path_is_accounted_and_checked():
    model = _dp_optimizer_model()
    ledger = PrivacyLedger.for_model(model, delta=DELTA)
    model.fit(_data(steps=2), epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 2 == int(model.optimizer.iterations)
    other = _dp_optimizer_model(_config(noise_multiplier=0.8))
    with pytest.raises(ValueError, match='noise_multiplier=1.0.*0.8'):
        other.fit(_data(steps=2), callbacks=[PrivacyLedger(EVENT, DELTA)],
                  verbose=0)
    assert int(other.optimizer.iterations) == 0
    # Shuffled fixed-size batches and a wrong n are refused on this path too.
    x, y = X, Y
    with pytest.raises(ValueError, match='not Poisson sampling'):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64)
                  .batch(8), callbacks=[PrivacyLedger(EVENT, DELTA)],
                  verbose=0)
    twice = (np.concatenate([x, x]), np.concatenate([y, y]))
    other_q1 = sampling.poisson_batches(
        *twice, physical_batch_size=8, expected_batch_size=16, steps=2)
    with pytest.raises(ValueError, match='example_sampling_rate 0.125'):
        model.fit(other_q1, callbacks=[PrivacyLedger(EVENT, DELTA)],
                  verbose=0)
    other_n = sampling.poisson_batches(
        *twice, physical_batch_size=8, example_sampling_rate=Q1, steps=2)
    with pytest.raises(ValueError, match='num_examples=64'):
        model.fit(other_n, callbacks=[PrivacyLedger(EVENT, DELTA)],
                  verbose=0)
    assert int(model.optimizer.iterations) == 2


class _FailingCallback(tf.keras.callbacks.Callback):
    """Raises in on_train_batch_end of step ``at`` (a full disk, say)."""

    def __init__(self, at):
        super().__init__()
        self._at = at

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self._at:
            raise OSError('disk full')


def test_an_interrupted_fit_charges_its_steps_and_leaves_no_ledger_behind(
        tmp_path):
    # The failing callback runs before the ledger: step 3 ran, but the
    # ledger's on_train_batch_end never saw it. The train function it
    # watches charged it, and the state file, written ahead, never holds
    # fewer steps than ran. Keras calls no on_train_end then: DPModel.fit
    # releases the train function itself, so a later fit without the
    # ledger runs without it (here on unchecked input, which that ledger
    # would have refused).
    path = str(tmp_path / 'ledger.json')
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA,
                                     state_path=path, save_every_steps=1,
                                     verbose=0)
    with pytest.raises(OSError, match='disk full'):
        dp.fit(_data(steps=5), callbacks=[_FailingCallback(3), ledger],
               verbose=0)
    assert int(dp.steps_taken) == 3 == ledger.budget.steps  # No reading.
    assert 3 <= PrivacyLedger(EVENT, DELTA, state_path=path).steps <= 4
    assert dp.train_function.__name__ != 'watched_train_function'
    unchecked = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).take(1)
    with pytest.warns(UserWarning, match='not Poisson-sampled'):
        dp.fit(unchecked, verbose=0)
    assert ledger.budget.steps == 3 and int(dp.steps_taken) == 4


class _FreezeFirstLayer(tf.keras.callbacks.Callback):
    """Sets the wrapped model's first layer untrainable after step ``at``
    (a fine-tuning schedule)."""

    def __init__(self, at):
        super().__init__()
        self._at = at

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self._at:
            self.model.inner_model.layers[0].trainable = False


def test_steps_after_a_layer_is_frozen_during_fit_are_charged(tmp_path):
    # The traced step keeps training the variables it was traced with, so
    # its steps are still the config's event: they must be charged and
    # stopped at max_steps, although the trainable variables no longer
    # match the config's block dimension.
    inner = tf.keras.Sequential([
        tf.keras.layers.Dense(3, input_shape=(4,)), tf.keras.layers.Dense(3)])
    config = TwiceSamplingConfig(
        num_examples=64, expected_batch_size=16,
        coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=1.0, linf_norm_clip=0.5,
                      noise_multiplier=1.0, dimension=inner.count_params()),))
    dp = DPModel(inner, config, physical_batch_size=8, seed=0)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse')
    path = str(tmp_path / 'ledger.json')
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, max_steps=4,
                                     state_path=path, save_every_steps=1,
                                     verbose=0)
    dp.fit(_data(steps=3), epochs=2, verbose=0,
           callbacks=[_FreezeFirstLayer(1), ledger])
    assert int(dp.steps_taken) == ledger.steps == 4
    assert PrivacyLedger(dp.dp_event(), DELTA, state_path=path).steps == 4
    # More steps are refused before any runs: the event no longer describes
    # the trainable variables.
    ledger2_path = str(tmp_path / 'more.json')
    more = PrivacyLedger(dp.dp_event(), DELTA, state_path=ledger2_path)
    more.record_steps(4)
    with pytest.raises(ValueError, match='dimension=27.*12 coordinates'):
        dp.fit(_data(steps=2, seed=2), callbacks=[more], verbose=0)
    assert int(dp.steps_taken) == 4


@markers.needs_tf_privacy_optimizers
def test_steps_of_a_replaced_dp_optimizer_of_another_mechanism_are_not_its():
    # Fit under optimizer A's ledger, recompile with B (less noise), run B's
    # steps outside any fit the ledger watches, recompile back to A: the
    # weights' record names B's steps, so they are not charged as A's (they
    # were once: epsilon under-reported), and A's ledger refuses more
    # steps. A ledger continuing A's history under B's event, bound to the
    # weights without training, charges them; one continuing that one under
    # A charges A's next step, which the recompile back traced with A's
    # words.
    dp, ledger, optimizer_a = _a_then_steps_under(
        _config(noise_multiplier=0.3), fit_steps=2, steps=3)
    ledger_ab = PrivacyLedger.from_state(ledger.get_state(),
                                         event=dp.dp_event(), verbose=0)
    dp.compile(optimizer=optimizer_a, loss=tf.keras.losses.MeanSquaredError())
    assert ledger.steps == 2
    with pytest.raises(ValueError, match='cannot account'):
        dp.fit(_data(steps=1, seed=3), callbacks=[ledger], verbose=0)
    assert int(dp.steps_taken) == 5
    ledger_ab.bind_model(dp)
    assert ledger_ab.steps == 2 + 3
    ledger_aba = PrivacyLedger.from_state(ledger_ab.get_state(),
                                          event=dp.dp_event(), verbose=0)
    dp.fit(_data(steps=1, seed=4), callbacks=[ledger_aba], verbose=0)
    assert ledger_aba.steps == 2 + 3 + 1 and ledger.steps == 2
    assert [segment['count'] for segment in
            ledger_aba.get_state()['segments']] == [2, 3, 1]


def _install_optimizer(dp, optimizer, route):
    """Makes `optimizer` the one `dp`'s next steps run with: a recompile,
    an assignment without one, or a recompile after one that failed in
    Keras once it had set the optimizer (a typo in an argument)."""
    loss = tf.keras.losses.MeanSquaredError()
    if route == 'assigned':
        dp.optimizer = optimizer
        return
    if route == 'after_a_failed_compile':
        with pytest.raises(TypeError):
            dp.compile(optimizer=optimizer, loss=loss,
                       steps_per_execution='2')
    dp.compile(optimizer=optimizer, loss=loss)


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('other, route', [
    ('less_noise', 'recompiled'), ('non_private', 'recompiled'),
    ('less_noise', 'assigned'), ('less_noise', 'after_a_failed_compile')])
def test_uncharged_steps_of_another_mechanism_are_refused_under_an_over_count(
        other, route):
    # A ledger that charged more steps than ran (here recorded without a
    # step; a write-ahead reservation a crash left, or a resumed file, do
    # the same) has room for B's steps in every count: the record must
    # still refuse it, in a fit and in a custom loop, however B was
    # installed and replaced (B's steps were once missed when no
    # successful recompile replaced it); a reading while B is installed
    # leaves them uncharged. (The same after a ledger of B read B's epsilon
    # or state: step_ledger_test.)
    dp = _dp_optimizer_model()
    optimizer_a = dp.optimizer
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    ledger.set_model(dp)
    ledger.record_steps(3)
    config_b = (_config(non_private=True) if other == 'non_private'
                else _config(noise_multiplier=0.3))
    _install_optimizer(dp, optimizers.TwiceSamplingDPKerasSGDOptimizer(
        config_b, learning_rate=0.1), route)
    step = tf.function(dp.train_step)
    for batch in _data(steps=2, seed=2):
        step(batch)
    assert ledger.steps == 3
    _install_optimizer(dp, optimizer_a, route)
    refusal = r'hold 2 DP steps.*cannot account'
    with pytest.raises(ValueError, match=refusal):
        dp.fit(_data(steps=1, seed=3), callbacks=[ledger], verbose=0)
    with pytest.raises(ValueError, match=refusal):
        ledger.record_steps(2)
    assert ledger.steps == 3
    assert int(dp.optimizer.iterations) == 0  # A ran no step.


@markers.needs_tf_privacy_optimizers
def test_steps_of_a_cached_train_function_of_another_mechanism_stop_the_fit():
    # An optimizer assigned without a recompile: Keras's cached train
    # function still runs A's step, which the record names, while the model
    # reports B's event. A ledger of B must not count those steps as none
    # (it did once: 20 steps of A ran, the ledger charged none of them).
    dp = _dp_optimizer_model()
    ledger_a = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_data(steps=3), callbacks=[ledger_a], verbose=0)
    dp.optimizer = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(noise_multiplier=0.5), learning_rate=0.1)
    ledger_b = PrivacyLedger.from_state(ledger_a.get_state(),
                                        event=dp.dp_event(), verbose=0)
    with pytest.raises(ValueError, match='cannot account'):
        dp.fit(_data(steps=5, seed=2), callbacks=[ledger_b], verbose=0)
    assert dp.stop_training  # Refused in the fit: training stops.
    assert int(dp.steps_taken) == 4
    assert ledger_b.steps == 3
    assert ledger_a.steps == 3 + 1  # A's ledger charges A's step.


@markers.needs_tf_privacy_optimizers
def test_steps_of_replaced_dp_optimizers_of_the_same_mechanism_are_charged():
    # An interrupted fit, then a recompile with another DP optimizer of the
    # same config (other step keys): the step the ledger did not see is
    # still charged. Then one the ledger never saw, compiled, used in a
    # custom loop and replaced, and a recompile back to the first: their
    # steps are the event's, charged, never refused.
    dp = _dp_optimizer_model()
    first = dp.optimizer
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    with pytest.raises(OSError, match='disk full'):
        dp.fit(_data(steps=5), callbacks=[_FailingCallback(3), ledger],
               verbose=0)
    dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        CONFIG, learning_rate=0.05),
        loss=tf.keras.losses.MeanSquaredError())
    dp.fit(_data(steps=2, seed=2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 3 + 2
    _steps_under(dp, CONFIG, steps=3, seed=3)
    dp.compile(optimizer=first, loss=tf.keras.losses.MeanSquaredError())
    dp.fit(_data(steps=2, seed=4), callbacks=[ledger], verbose=0)
    assert ledger.steps == int(dp.steps_taken) == 3 + 2 + 3 + 2


@pytest.mark.parametrize('policy', ['mixed_float16', 'float16'])
def test_reduced_precision_steps_are_charged(tmp_path, policy):
    # Under 'mixed_float16' Keras wraps the optimizer in a
    # LossScaleOptimizer, which DPModel's update bypasses; under 'float16'
    # the variables are 16-bit. Either way the record, int64, holds every
    # step that ran (those of a fit without the ledger too), and an
    # interrupted fit and a resumed ledger charge them.
    path = str(tmp_path / 'ledger.json')
    with tiny_models.dtype_policy(policy):
        dp = _dp_model()
        ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                         save_every_steps=1, verbose=0)
        with pytest.raises(OSError, match='disk full'):
            dp.fit(_data(steps=5), callbacks=[_FailingCallback(3), ledger],
                   verbose=0)
        assert PrivacyLedger(EVENT, DELTA, state_path=path).steps >= 3
        dp.fit(_data(steps=2, seed=3), verbose=0)
        resumed = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                          save_every_steps=1, verbose=0)
        dp.fit(_data(steps=2, seed=4), callbacks=[resumed], verbose=0)
    ran = 3 + 2 + 2
    assert int(dp.steps_taken) == ran
    words = step_record.event_words(resumed.budget.event_key)
    assert privacy_record.read(dp) == step_record.extend(step_record.EMPTY,
                                                         words, ran)
    # The crash may leave one write-ahead step charged that never ran
    # (save_every_steps=1): never fewer than ran, at most one more.
    assert ran <= resumed.steps <= ran + 1
    assert PrivacyLedger(EVENT, DELTA, state_path=path).steps == resumed.steps


def test_custom_loops_charge_their_steps_and_are_told_if_input_is_unchecked(
        caplog):
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, max_steps=3)
    caplog.set_level(logging.WARNING)
    step = tf.function(dp.train_step)
    for batch in ledger.logical_batches(_data(steps=5)):
        step(batch)
        assert ledger.epsilon > 0  # A progress display: charges nothing.
    # Stopped before the step max_steps would exceed; the input was
    # checked, so the loop is not told otherwise. The compiled step wrote
    # the record.
    assert ledger.steps == int(dp.steps_taken) == 3
    words = step_record.event_words(ledger.budget.event_key)
    assert privacy_record.read(dp) == step_record.extend(step_record.EMPTY,
                                                         words, 3)
    assert not [r for r in caplog.records if 'custom loop' in r.getMessage()]
    shuffled = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(64).batch(16)
    with pytest.raises(ValueError, match='not recognised as'):
        next(iter(PrivacyLedger.for_model(dp, delta=DELTA).logical_batches(
            shuffled)))
    other_rate = sampling.poisson_batches(X, Y, physical_batch_size=8,
                                          example_sampling_rate=0.5, steps=1)
    with pytest.raises(ValueError, match='example_sampling_rate'):
        next(iter(ledger.logical_batches(other_rate)))
    with pytest.raises(ValueError, match='for_model'):
        next(iter(PrivacyLedger(EVENT, DELTA).logical_batches(_data())))
    # A loop of its own: the ledger cannot see what it feeds train_step
    # (fit checks its input is Poisson-sampled), and says so, once.
    loop = PrivacyLedger.for_model(dp, delta=DELTA)
    for batch in _data(steps=2, seed=2):
        loop.reserve_steps(1)
        dp.train_step(batch)
        loop.record_steps(1)
    told = [r for r in caplog.records if 'custom loop' in r.getMessage()]
    assert len(told) == 1
    assert 'poisson_batches' in told[0].getMessage()
    assert loop.steps == 3 + 2  # The weights' earlier steps too.


def test_logical_batches_refuse_a_model_on_several_replicas(monkeypatch):
    # strategy.run(train_step, args=(batch,)) gives each replica the whole
    # logical batch: every example summed once per replica, against noise
    # for one (a ledger reported 4.43 where 14.5 is sound).
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    monkeypatch.setattr(type(dp), 'distribute_strategy', property(
        lambda self: types.SimpleNamespace(num_replicas_in_sync=2)))
    with pytest.raises(ValueError, match='2 replicas.*fit'):
        next(iter(ledger.logical_batches(_data())))
    assert ledger.steps == 0


def test_ledger_alone_checks_a_dp_model():
    # Keras's own fit, without DPModel.fit's checks: the ledger still refuses.
    dp = _dp_model(linf_norm_clip=0.25)
    ledger = PrivacyLedger(EVENT, DELTA)
    with pytest.raises(ValueError, match='linf_norm_clip=0.5'):
        tf.keras.Model.fit(dp, _data(steps=2), callbacks=[ledger], verbose=0)
    assert ledger.steps == 0 and int(dp.optimizer.iterations) == 0


def test_batch_norm_model_is_refused_before_any_step(tmp_path):
    path = str(tmp_path / 'ledger.json')
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(3, input_shape=(4,)),
        tf.keras.layers.BatchNormalization(name='bn')])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse')
    ledger = PrivacyLedger(EVENT, DELTA, state_path=path)
    with pytest.raises(ValueError, match='bn.*GroupNormalization'):
        model.fit(_data(steps=2), callbacks=[ledger], verbose=0)
    assert int(model.optimizer.iterations) == 0 and ledger.steps == 0
    assert not os.path.exists(path)


def test_for_model_with_a_basis_accounts_every_block(tmp_path):
    from tf_twice.hybrid import learning
    from tf_twice.keras import basis_refresh
    grads = basis_refresh.public_per_example_gradients(
        _model(), tf.keras.losses.MeanSquaredError(), X[:16], Y[:16])
    basis = learning.learn_basis(grads, [2, 3])
    config = TwiceSamplingConfig(
        num_examples=64, expected_batch_size=16.0,
        coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0),
                Block(l2_norm_clip=0.5, noise_multiplier=1.0),
                Block(l2_norm_clip=0.7, noise_multiplier=2.0)))
    dp = DPModel(_model(), config, physical_batch_size=8, seed=0,
                 basis=basis)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse')
    path = str(tmp_path / 'ledger.json')
    ledger = PrivacyLedger.for_model(dp, delta=DELTA,
                                     state_path=path, verbose=0)
    event = TwiceSampledGaussianDpEvent(
        example_sampling_rate=Q1, coordinate_sampling_rate=0.5,
        noise_multiplier=(1.0, 1.0, 2.0), l2_norm_clip=(0.5, 0.5, 0.7),
        linf_norm_clip=(None, None, None), block_dimensions=(2, 3, 15))
    assert ledger.event == event
    dp.fit(_data(steps=2), callbacks=[ledger], verbose=0)
    resumed = PrivacyLedger(event, DELTA, state_path=path, verbose=0)
    assert resumed.steps == 2
    assert resumed.epsilon == pytest.approx(_accountant_epsilon((event, 2)),
                                            rel=1e-12)


class _RollBack(tf.keras.callbacks.Callback):
    """Undoes every other step (a "keep the step if a public check passes"
    schedule), before the ledger's own hook runs when listed first."""

    def __init__(self, path):
        super().__init__()
        self._path, self.ran = path, 0

    def on_train_begin(self, logs=None):
        self.model.save_weights(self._path)

    def on_train_batch_end(self, batch, logs=None):
        self.ran += 1
        if self.ran % 2:
            self.model.load_weights(self._path)  # The step is undone.
        else:
            self.model.save_weights(self._path)


def test_steps_undone_by_a_callback_are_charged(tmp_path):
    # The released weights depend on every undone step (whether it was
    # kept is a function of its noisy update): each one is charged, in any
    # callback order (the record is read right after each execution), by a
    # ledger before the rollback and one after it.
    dp = _dp_model()
    dp(X[:1])
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    other = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    undo = _RollBack(str(tmp_path / 'kept.weights.h5'))
    dp.fit(_data(steps=6), verbose=0, callbacks=[ledger, undo, other])
    assert undo.ran == 6 and int(dp.steps_taken) == 3
    assert ledger.steps == other.steps == 6  # Two ledgers watch alike.


def test_a_step_whose_hooks_an_exception_cut_off_is_charged_on_restore(
        tmp_path):
    # The exception comes before the ledger's hook; the retried fit's
    # BackupAndRestore rolls the weights back before the ledger reads them.
    dp = _dp_model()
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    backup = str(tmp_path / 'backup')
    with pytest.raises(OSError, match='disk full'):
        dp.fit(_data(steps=4), epochs=2, verbose=0, callbacks=[
            tf.keras.callbacks.BackupAndRestore(backup),
            _FailingCallback(6), ledger])
    assert int(dp.steps_taken) == ledger.steps == 6  # Before the failure.
    dp.fit(_data(steps=4, seed=2), epochs=2, verbose=0, callbacks=[
        tf.keras.callbacks.BackupAndRestore(backup), ledger])
    # Epoch 2 again from the backup of step 4: 4 more steps on the branch.
    assert int(dp.steps_taken) == 8 and ledger.steps == 6 + 4
