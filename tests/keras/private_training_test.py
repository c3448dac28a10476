"""Tests of make_private: model, Poisson data and ledger from one config."""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models

from tf_twice import sampling
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.hybrid import learning
from tf_twice.keras import DPModel, PrivacyLedger, make_private
from tf_twice.keras import basis_refresh
from tf_twice.keras import guards

N, BATCH = 64, 16  # q1 = 1/4: 4 steps per epoch.
DELTA = 1e-5
TARGET = 3.0
X, Y = tiny_models.data(N, seed=11)


def _config(**changes):
    fields = dict(num_examples=N, expected_batch_size=BATCH, l2_norm_clip=1.0,
                  linf_norm_clip=0.3, coordinate_sampling_rate=0.5)
    fields.update(changes)
    return TwiceSamplingConfig.single(**fields)


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _wire(config=None, **kwargs):
    args = dict(delta=DELTA, target_epsilon=TARGET, verbose=0)
    if 'epochs' not in kwargs and 'steps' not in kwargs:
        args['epochs'] = 2
    args.update(kwargs)
    return make_private(tiny_models.mlp(), config or _config(), X, Y, **args)


def test_noise_is_calibrated_to_the_target_over_the_planned_steps():
    training = _wire(epochs=2)
    assert training.steps == 8 and training.epochs == 2
    config = training.model.config
    assert config.is_calibrated
    # The planned steps spend the target, tightly: a little less noise
    # would exceed it.
    assert 0.99 * TARGET <= config.epsilon(8, DELTA) <= TARGET
    z = config.noise_multipliers[0]
    assert config.with_noise_multipliers((0.98 * z,)).epsilon(
        8, DELTA) > TARGET
    # More planned steps need more noise for the same target.
    longer = _wire(steps=40).model.config.noise_multipliers[0]
    assert longer > z
    # Everything else is the given config's.
    assert config.with_noise_multipliers((None,)) == _config()


def test_the_parts_are_wired_from_the_one_config():
    training = _wire(steps=6)
    model, data, ledger, steps, epochs = training
    assert isinstance(model, DPModel)
    assert (steps, epochs) == (6, 2)  # 4 steps per epoch.
    assert ledger.event == model.dp_event() == model.config.dp_event()
    assert (ledger.delta, ledger.target_epsilon, ledger.max_steps) == (
        DELTA, TARGET, 6)
    # The data are Poisson samples at the config's q1 from its n examples.
    info = guards.check_poisson_input(
        data, example_sampling_rate=model.config.example_sampling_rate)
    assert info.num_examples == N
    assert info.example_sampling_rate == BATCH / N
    # Unpadded: the model cuts each batch itself, computing no padding rows.
    assert sampling.get_poisson_sampling_info(data).physical_batch_size is None
    for xb, _, weights in data.take(4):
        assert np.all(weights.numpy() == 1.0) and len(weights) == len(xb)


def test_fit_stops_exactly_after_the_planned_steps():
    training = _wire(steps=6)
    model = training.model
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    # training.epochs iterations of data hold 8 steps; the plan is 6.
    model.fit(training.data, epochs=training.epochs,
              callbacks=[training.ledger], verbose=0)
    assert training.ledger.steps == 6 == int(model.optimizer.iterations)
    assert training.ledger.stopped_at_max_steps
    assert training.ledger.epsilon <= TARGET


def test_a_given_noise_must_fit_the_target():
    noisy = _config(noise_multiplier=5.0)
    training = _wire(noisy, steps=8)
    assert training.model.config == noisy  # Not recalibrated.
    with pytest.raises(ValueError, match='above target_epsilon'):
        _wire(_config(noise_multiplier=0.5), steps=8)
    # Without a target there is nothing to fit: the ledger counts.
    untargeted = _wire(noisy, target_epsilon=None, steps=8)
    assert untargeted.ledger.target_epsilon is None
    assert untargeted.ledger.max_steps == 8


@pytest.mark.parametrize('config, kwargs, match', [
    (_config(num_examples=100), {}, 'num_examples is 100 but x and y hold '
     '64'),
    (None, dict(target_epsilon=None), 'target_epsilon is required'),
    (None, dict(epochs=2, steps=8), 'exactly one of epochs'),
    (None, dict(epochs=None), 'exactly one of epochs'),
    (None, dict(epochs=None, steps=0), 'steps must be'),
    (None, dict(delta=0.0), 'delta'),
    (None, dict(target_epsilon=-1.0), 'target_epsilon'),
    (_config(noise_multiplier=0.0, non_private=True), {}, 'non_private'),
    ({'num_examples': N}, {}, 'TwiceSamplingConfig'),
])
def test_inconsistent_settings_are_refused(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _wire(config, **kwargs)


def test_hybrid_config_gets_the_basis_dimensions():
    grads = basis_refresh.public_per_example_gradients(
        tiny_models.mlp(), _loss(), *tiny_models.data(32, seed=1))
    basis = learning.learn_basis(grads, [3, 5], groups=2)
    config = TwiceSamplingConfig(
        num_examples=N, expected_batch_size=BATCH,
        coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=0.5), Block(l2_norm_clip=0.3),
                Block(l2_norm_clip=0.2, linf_norm_clip=0.05)))
    training = _wire(config, basis=basis, steps=8)
    model = training.model
    assert model.basis is basis
    assert model.config.dimensions == basis.block_dimensions
    assert model.dp_event().block_dimensions == basis.block_dimensions
    # One noise multiplier for all blocks, meeting the target.
    noise = model.config.noise_multipliers
    assert len(set(noise)) == 1
    assert 0.99 * TARGET <= model.config.epsilon(8, DELTA) <= TARGET
    assert training.ledger.event == model.dp_event()
    with pytest.raises(ValueError, match='the basis has 3 blocks'):
        _wire(_config(), basis=basis, steps=8)


def test_data_seed_fixes_the_batches_and_state_path_reaches_the_ledger(
        tmp_path):
    path = str(tmp_path / 'ledger.json')
    first = _wire(steps=4, data_seed=3, state_path=path)
    second = _wire(steps=4, data_seed=3)
    for a, b in zip(first.data, second.data):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert first.ledger.state_path == path
    with pytest.raises(ValueError, match='does not exist'):
        _wire(steps=4, state_path=str(tmp_path / 'missing' / 'l.json'))
    # The ledger is an ordinary one: it reloads from its file.
    first.ledger.record_steps(2)
    first.ledger.save()
    assert PrivacyLedger(first.ledger.event, DELTA,
                         state_path=path).steps == 2


def test_epochs_plan_rounds_up_to_whole_steps():
    training = _wire(epochs=1.3)
    assert training.steps == math.ceil(1.3 * 4) == 6
    assert training.epochs == 2


def test_fit_without_the_ledger_in_callbacks_still_stops_at_the_plan():
    # A forgotten callbacks=[ledger] must not overrun the budget: the
    # model's attached ledger accounts every fit and stops it at the plan.
    training = _wire(steps=6)
    model = training.model
    assert model.attached_ledger is training.ledger
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(training.data, epochs=5, verbose=0)  # 20 steps offered.
    assert training.ledger.steps == 6 == int(model.optimizer.iterations)
    assert training.ledger.epsilon <= TARGET
    # A second fit runs no step past the plan.
    model.fit(training.data, epochs=1, verbose=0)
    assert training.ledger.steps == 6 == int(model.optimizer.iterations)


def test_another_ledger_than_the_attached_one_is_refused():
    training = _wire(steps=6)
    model = training.model
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    other = PrivacyLedger.for_model(model, delta=DELTA, verbose=0)
    with pytest.raises(ValueError, match='attached'):
        model.fit(training.data, epochs=1, callbacks=[other], verbose=0)
    assert int(model.optimizer.iterations) == 0
    with pytest.raises(ValueError, match='PrivacyLedger'):
        model.attach_ledger(object())


def test_the_plans_normal_end_is_logged_as_information(caplog):
    training = _wire(steps=2, verbose=1)
    training.model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                           loss=_loss())
    with caplog.at_level(logging.INFO, logger='tf_twice.keras.ledger'):
        training.model.fit(training.data, epochs=training.epochs, verbose=0)
    ends = [r for r in caplog.records if 'planned 2 steps' in r.getMessage()]
    assert ends and all(r.levelno == logging.INFO for r in ends)
