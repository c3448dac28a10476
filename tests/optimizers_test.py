"""Tests of the twice-sampling Keras optimizers.

The classes derive from tensorflow-privacy's on Keras 2 where it is
installed, and from Keras's own elsewhere (native); both run the same
mechanism, so most tests run on every stack. Only
``make_twice_sampling_optimizer_class`` needs tensorflow-privacy; elsewhere
it raises an ImportError naming the fix.
"""

import importlib
import json

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import reference
from tests import tiny_models
from tf_twice import _keras
from tf_twice import optimizers
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.mechanism import randomness

NUM_FEATURES, NUM_CLASSES = tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES
BATCH = 6


def _data(batch=BATCH, seed=0):
    return tiny_models.data(batch, seed)


_mlp = tiny_models.mlp


_linear = tiny_models.linear


def _tf_privacy_vectorized():
    """tf_privacy's vectorized optimizers, imported the way tf_twice imports
    them (on TensorFlow >= 2.16 its package __init__ must be skipped)."""
    optimizers.TwiceSamplingDPKerasSGDOptimizer  # pylint: disable=pointless-statement
    return importlib.import_module(
        'tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized')


def _vector_loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)


def _config(**kwargs):
    return tiny_models.dp_config(**kwargs)


def _private(model, optimizer, physical_batch_size=4):
    private = DPModel(model, physical_batch_size=physical_batch_size)
    private.compile(optimizer=optimizer, loss=_vector_loss())
    return private


_FIXED_KEY = randomness.draw_step_key(tf.random.Generator.from_state(
    tiny_models.FIXED_KEY_STATE['state'],
    tiny_models.FIXED_KEY_STATE['algorithm']))


def _one_step(model, optimizer, x, y, sample_weight=None, fix_key=False):
    """One step of ``model`` wrapped by DPModel and compiled with the
    DP ``optimizer`` (the optimizer path); returns the new weights. With
    ``fix_key`` the step uses ``_FIXED_KEY``."""
    private = _private(model, optimizer)
    if fix_key:
        tiny_models.fix_next_step_key(private)
    tiny_models.one_step(private, x, y, sample_weight)
    return [v.numpy() for v in model.trainable_variables]


@markers.needs_tf_privacy_optimizers
def test_matches_tf_privacy_vectorized_without_noise():
    tfp_vectorized = _tf_privacy_vectorized()
    x, y = _data()
    model = _mlp()
    model.compile(optimizer=tfp_vectorized.VectorizedDPKerasSGDOptimizer(
        l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.5),
        loss=_vector_loss())
    model.train_on_batch(x, y)
    theirs = [v.numpy() for v in model.trainable_variables]
    ours = _one_step(
        _mlp(), optimizers.TwiceSamplingDPKerasSGDOptimizer(
            TwiceSamplingConfig.single(
                num_examples=BATCH, expected_batch_size=BATCH,
                l2_norm_clip=0.3, noise_multiplier=0.0, non_private=True),
            learning_rate=0.5), x, y)
    initial = [v.numpy() for v in _mlp().trainable_variables]
    for a, b, w0 in zip(theirs, ours, initial):
        assert not np.allclose(a, w0)  # the step did something
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_whole_step_matches_numpy_reference():
    x, y = _data(seed=1)
    c2, c_inf, z, exp_batch, q2, lr = 0.8, 0.2, 0.7, 5.0, 0.5, 0.3
    model = _linear()
    w0, b0 = [v.numpy() for v in model.trainable_variables]
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        TwiceSamplingConfig.single(
            num_examples=100, expected_batch_size=exp_batch,
            l2_norm_clip=c2, linf_norm_clip=c_inf, noise_multiplier=z,
            coordinate_sampling_rate=q2),
        seed=42, learning_rate=lr)
    key = _FIXED_KEY
    shapes = [w0.shape, b0.shape]
    masks = [m.numpy() for m in randomness.coordinate_masks(
        key, shapes, q2, BATCH)]
    noise = [e.numpy() for e in randomness.standard_normal_noise(
        key, shapes, [tf.float32] * 2)]
    w1, b1 = _one_step(model, opt, x, y, fix_key=True)
    w_ref, b_ref = reference.softmax_regression_step(
        w0, b0, x, y, np.ones(BATCH), masks, noise, c2=c2, c_inf=c_inf, z=z,
        expected_batch_size=exp_batch, q2=q2, lr=lr)
    np.testing.assert_allclose(w1, w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b1, b_ref, rtol=1e-5, atol=1e-6)


def test_sample_weight_zero_rows_are_padding():
    x, y = _data()
    kwargs = dict(config=_config(l2_norm_clip=0.5, linf_norm_clip=0.1,
                                 noise_multiplier=1.0,
                                 coordinate_sampling_rate=0.5,
                                 expected_batch_size=4),
                  seed=3, learning_rate=0.2)
    got = _one_step(_mlp(), optimizers.TwiceSamplingDPKerasSGDOptimizer(
        **kwargs), x, y, sample_weight=np.array([1, 1, 1, 1, 0, 0]))
    want = _one_step(_mlp(), optimizers.TwiceSamplingDPKerasSGDOptimizer(
        **kwargs), x[:4], y[:4])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_minimize_on_a_batched_loss_is_refused():
    # A loss from one batched forward pass has no isolated per-example
    # gradients (0 * NaN = NaN in its backward pass): refused, naming the
    # fix. The isolation of the optimizer path is tested in isolation_test.
    x, y = _data()
    model = _mlp()
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=6))
    with tf.GradientTape(persistent=True) as tape:
        loss = _vector_loss()(y, model(x))
    variables = model.trainable_variables
    with pytest.raises(ValueError, match=r'DPModel\(model\)'):
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    if hasattr(opt, 'minimize'):  # Keras 3's optimizers have none.
        with pytest.raises(ValueError, match=r'DPModel\(model\)'):
            opt.minimize(loss, variables, tape=tape)


@markers.needs_gradient_accumulation
def test_gradient_accumulation_applies_the_mean_of_released_steps():
    # Every step is its own DP release; the weights move every k-th step by
    # the mean of the k released gradients (tf_privacy's semantics).
    x, y = _data(batch=8, seed=2)
    mechanism = dict(l2_norm_clip=0.4, linf_norm_clip=0.1,
                     noise_multiplier=0.0)
    model = _mlp()
    private = _private(model, optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=4, **mechanism),
        gradient_accumulation_steps=2, learning_rate=0.3))
    initial = [v.numpy() for v in model.trainable_variables]
    tiny_models.one_step(private, x[:4], y[:4])
    for a, b in zip(initial, model.trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())
    tiny_models.one_step(private, x[4:], y[4:])
    accumulated = [v.numpy() for v in model.trainable_variables]
    # Noiseless: the mean of two steps normalised by 4 each equals one step
    # over all 8 examples normalised by 8.
    one_batch = _one_step(_mlp(), optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=8, **mechanism), learning_rate=0.3), x, y)
    for a, b in zip(accumulated, one_batch):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The accumulators were reset: the next step starts from zero.
    tiny_models.one_step(private, x[:4], y[:4])
    for a, b in zip(accumulated, model.trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


@markers.needs_gradient_accumulation
def test_gradient_accumulation_noise_std():
    # With zero gradients, two accumulation steps release two independent
    # noise draws of std z c2 / (B_exp q2); the update is their mean.
    z, c2, exp_batch, q2, lr = 2.0, 0.5, 10.0, 0.5, 1.0
    model = tf.keras.Sequential([tf.keras.layers.Dense(
        400, input_shape=(50,), kernel_initializer='zeros')])
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(l2_norm_clip=c2, noise_multiplier=z,
                expected_batch_size=exp_batch, coordinate_sampling_rate=q2),
        gradient_accumulation_steps=2, seed=0, learning_rate=lr)
    private = DPModel(model, physical_batch_size=4)
    private.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError())
    x = np.zeros((4, 50), np.float32)
    tiny_models.one_step(private, x, np.zeros((4, 400), np.float32))
    tiny_models.one_step(private, x, np.zeros((4, 400), np.float32))
    values = model.trainable_variables[0].numpy().reshape(-1)
    sigma = lr * z * c2 / (exp_batch * q2) / np.sqrt(2)
    assert abs(values.std() / sigma - 1) < 5 / np.sqrt(2 * values.size)


@markers.needs_gradient_accumulation
def test_get_config_round_trip():
    config = TwiceSamplingConfig.single(
        num_examples=60_000, expected_batch_size=256, l2_norm_clip=1.5,
        linf_norm_clip=0.2, noise_multiplier=1.1,
        coordinate_sampling_rate=0.5)
    opt = optimizers.TwiceSamplingDPKerasAdamOptimizer(
        config, gradient_accumulation_steps=3, seed=7, learning_rate=0.01,
        beta_1=0.8)
    saved = opt.get_config()
    assert saved['config'] == config.to_dict()
    assert saved['gradient_accumulation_steps'] == 3
    json.dumps(saved)  # The config is stored as a plain dict.
    clone = optimizers.TwiceSamplingDPKerasAdamOptimizer.from_config(saved)
    assert type(clone) is type(opt)
    assert clone.config == config and clone.get_config() == saved
    assert clone.aggregator.dp_event() == config.dp_event()
    assert clone.gradient_accumulation_steps == 3
    assert clone.get_config()['beta_1'] == pytest.approx(0.8)
    # No seed or random state in the config (it would give away the noise),
    # and none of tf_privacy's parallel mechanism arguments.
    for name in ('seed', 'num_microbatches', 'l2_norm_clip',
                 'noise_multiplier'):
        assert name not in saved
    legacy = markers.KERAS_MAJOR == 2 and markers.HAS_TF_PRIVACY
    restored = tf.keras.optimizers.deserialize(
        tf.keras.optimizers.serialize(opt),
        **(dict(use_legacy_optimizer=True) if legacy else {}))
    assert type(restored).__name__ == 'TwiceSamplingDPKerasAdamOptimizer'
    assert restored.config == config


@markers.needs_tf_privacy_optimizers
def test_subclasses_tf_privacy_classes():
    tfp_vectorized = _tf_privacy_vectorized()
    assert issubclass(optimizers.TwiceSamplingDPKerasSGDOptimizer,
                      tfp_vectorized.VectorizedDPKerasSGDOptimizer)
    assert issubclass(optimizers.TwiceSamplingDPKerasAdagradOptimizer,
                      tf.keras.optimizers.legacy.Adagrad)
    rms = optimizers.make_twice_sampling_optimizer_class(
        tf.keras.optimizers.legacy.RMSprop)
    assert rms.__name__ == 'TwiceSamplingDPKerasRMSpropOptimizer'
    with pytest.raises(ValueError, match='cls'):
        optimizers.make_twice_sampling_optimizer_class(dict)


@pytest.mark.parametrize('kwargs, name', [
    (dict(gradient_accumulation_steps=0), 'gradient_accumulation_steps'),
    (dict(gradient_accumulation_steps=1.5), 'gradient_accumulation_steps'),
    (dict(num_microbatches=3), 'num_microbatches'),
    (dict(seed=-1), 'seed'),
    (dict(config={'l2_norm_clip': 1.0}), 'TwiceSamplingConfig'),
    (dict(config=_config(expected_batch_size=4, noise_multiplier=None)),
     'calibrate'),
])
def test_invalid_arguments(kwargs, name):
    full = dict(config=_config(expected_batch_size=4))
    full.update(kwargs)
    with pytest.raises(ValueError, match=name):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(**full)


def test_apply_without_dp_gradients_is_refused():
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=4))
    var = tf.Variable([1.0])
    with pytest.raises(ValueError, match='not clipped'):
        opt.apply_gradients([(tf.constant([1.0]), var)])


def test_optimizer_with_a_basis_runs_the_hybrid_step():
    # Softmax regression: the optimizer's update equals the shared hybrid
    # step on the same per-example gradients and key.
    from tf_twice.hybrid import learning
    from tf_twice.mechanism import hybrid
    model = _linear()
    x, y = _data()
    w, b = [v.numpy() for v in model.trainable_variables]
    grads = reference.softmax_regression_gradients(w, b, x, y)
    basis = learning.learn_basis([g.astype(np.float32) for g in grads],
                                 [2], groups=2)
    config = TwiceSamplingConfig(
        num_examples=100, expected_batch_size=BATCH,
        coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=0.3, noise_multiplier=1.0),
                Block(l2_norm_clip=0.2, noise_multiplier=2.0,
                      linf_norm_clip=0.05)))
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        config, basis=basis, seed=3, learning_rate=0.5)
    assert opt.basis is basis and opt.config.num_blocks == 2
    assert opt.config == config.with_dimensions(basis.block_dimensions)
    key = _FIXED_KEY
    update = hybrid.noisy_update(
        hybrid.block_sums([g.astype(np.float32) for g in grads], config,
                          basis=basis, key=key), config, basis=basis,
        key=key)
    got = _one_step(model, opt, x, y, fix_key=True)
    for g, u, v0 in zip(got, update, (w, b)):
        np.testing.assert_allclose(g, v0 - 0.5 * u.numpy(), rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(ValueError, match='built with basis'):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(
            _config(expected_batch_size=4)).set_basis(basis)


def _pretend(monkeypatch, keras_version, has_tf_privacy):
    """Makes tf_twice.optimizers see another stack (through tf_twice._keras,
    where it asks), with nothing built."""
    for name in optimizers.__all__:
        monkeypatch.delitem(optimizers.__dict__, name, raising=False)
    # Classes built for a pretended stack must not replace the real ones in
    # Keras's registry, whose loaders would then rebuild a saved optimizer
    # from the wrong base in every later test of the process.
    monkeypatch.setattr(tf.keras.utils, 'register_keras_serializable',
                        lambda **_: lambda cls: cls)
    monkeypatch.setattr(_keras, 'KERAS_VERSION', keras_version)
    monkeypatch.setattr(_keras, 'KERAS_MAJOR', int(keras_version[0]))
    monkeypatch.setattr(_keras, 'has_tf_privacy', lambda: has_tf_privacy)


_KERAS_2_FIX = 'TF_USE_LEGACY_KERAS=1'
_EXTRA_FIX = 'pip install "tf_twice[tf-privacy]"'


@pytest.mark.parametrize('keras_version, has_tf_privacy, fixes, not_fixes', [
    ('3.15.1', True, [_KERAS_2_FIX, 'Keras 3.15.1'], [_EXTRA_FIX]),
    ('2.15.0', False, [_EXTRA_FIX, 'Python < 3.12'], [_KERAS_2_FIX]),
    ('3.15.1', False, [_KERAS_2_FIX, _EXTRA_FIX], []),
])
@pytest.mark.parametrize('name', ['make_twice_sampling_optimizer_class'])
def test_unusable_stack_raises_an_import_error_naming_the_fix(
        monkeypatch, name, keras_version, has_tf_privacy, fixes, not_fixes):
    _pretend(monkeypatch, keras_version, has_tf_privacy)
    with pytest.raises(ImportError) as raised:
        getattr(optimizers, name)
    message = str(raised.value)
    assert f'tf_twice.optimizers.{name}' in message
    for fix in fixes + ['tf_twice.keras.DPModel(model, config)',
                        'tf_twice.keras.make_private']:
        assert fix in message
    for fix in not_fixes:
        assert fix not in message
    # `from ... import` goes through the same path.
    with pytest.raises(ImportError, match='tf_twice.keras.DPModel'):
        exec(f'from tf_twice.optimizers import {name}', {})  # pylint: disable=exec-used
    # Introspection does not run into the error, nor list the names.
    assert name not in dir(optimizers)


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match='NoSuchOptimizer'):
        getattr(optimizers, 'NoSuchOptimizer')
    assert not hasattr(optimizers, 'NoSuchOptimizer')


def test_classes_exist_on_every_stack():
    # Unpatched: derived from tensorflow-privacy's where this stack has it
    # (Keras 2), else Keras's own; the factory only with tensorflow-privacy.
    cls = optimizers.TwiceSamplingDPKerasSGDOptimizer
    assert 'TwiceSamplingDPKerasSGDOptimizer' in dir(optimizers)
    if markers.KERAS_MAJOR == 2 and markers.HAS_TF_PRIVACY:
        assert issubclass(cls, tf.keras.optimizers.legacy.SGD)
    else:
        assert issubclass(cls, tf.keras.optimizers.SGD)
        with pytest.raises(ImportError) as raised:
            optimizers.make_twice_sampling_optimizer_class
        message = str(raised.value)
        if markers.KERAS_MAJOR != 2:
            assert _KERAS_2_FIX in message
        if not markers.HAS_TF_PRIVACY:
            assert _EXTRA_FIX in message


@pytest.mark.parametrize('keras_version, has_tf_privacy', [
    ('3.15.1', True), ('2.15.0', False), ('3.15.1', False)])
def test_without_tf_privacy_the_classes_are_native(
        monkeypatch, keras_version, has_tf_privacy):
    _pretend(monkeypatch, keras_version, has_tf_privacy)
    for name in ('TwiceSamplingDPKerasSGDOptimizer',
                 'TwiceSamplingDPKerasAdamOptimizer',
                 'TwiceSamplingDPKerasAdagradOptimizer'):
        cls = getattr(optimizers, name)
        base = name[len('TwiceSamplingDPKeras'):-len('Optimizer')]
        assert issubclass(cls, getattr(tf.keras.optimizers, base))
        assert name in dir(optimizers)


def test_a_plain_model_compiled_with_it_is_refused_before_any_step():
    # Keras hands a plain model's optimizer a batched loss: refused at
    # fit's first trace, with the recipe that works, weights untouched.
    x, y = _data(batch=12)
    model = _mlp()
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=4), learning_rate=0.5),
        loss=_vector_loss())
    with pytest.raises(ValueError, match='make_private') as raised:
        model.fit(x, y, batch_size=4, verbose=0)
    assert 'poisson_batches' in str(raised.value)
    for a, b in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))


@markers.needs_keras_3
def test_a_seeded_run_resumed_mid_accumulation_draws_fresh_noise(tmp_path):
    # Keras 3 counts an accumulating optimizer's iterations in updates:
    # after one of two accumulated steps it reads 0, as at the start. The
    # stream's position is the DP steps the weights hold, so a run restored
    # from that point draws new masks and noise, not the released step's.
    x, y = _data(batch=8, seed=4)

    def build():
        opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
            _config(expected_batch_size=8, noise_multiplier=1.0,
                    coordinate_sampling_rate=0.5),
            gradient_accumulation_steps=2, seed=1234, learning_rate=0.1)
        return _private(_mlp(), opt), opt

    def released(opt):
        return np.concatenate([a.numpy().ravel()
                               for a in opt._accumulated_gradients])

    first, opt = build()
    tiny_models.one_step(first, x, y)
    assert int(opt.iterations) == 0 and int(first.steps_taken) == 1
    path = str(tmp_path / 'mid.weights.h5')
    first.save_weights(path)
    resumed, opt2 = build()
    resumed.load_weights(path)
    # The restored run's step is an update step: with the accumulator
    # emptied, the weights move by lr * (its release) / 2.
    for accumulator in opt2._accumulated_gradients:
        accumulator.assign(tf.zeros_like(accumulator))
    weights = lambda: np.concatenate(
        [v.numpy().ravel() for v in resumed.inner_model.trainable_variables])
    before = weights()
    tiny_models.one_step(resumed, x, y)
    release = 2 * (before - weights()) / 0.1
    assert np.abs(release).max() > 0.1  # The step did run.
    assert not np.allclose(release, released(opt), atol=1e-3)
    # The same seed from the start does replay (one seed, one run).
    fresh, opt3 = build()
    tiny_models.one_step(fresh, x, y)
    np.testing.assert_array_equal(released(opt3), released(opt))


def test_keras_3s_apply_and_a_loss_scale_wrapper_do_not_bypass_it():
    # Once a DPModel compiled it, the optimizer still applies nothing but
    # that model's private updates.
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        _config(expected_batch_size=4), learning_rate=0.5)
    _private(_mlp(), opt)
    var = tf.Variable([1.0])
    grads = [tf.constant([1.0])]
    if hasattr(opt, 'apply'):
        with pytest.raises(ValueError, match='not clipped'):
            opt.apply(grads, [var])
    wrapped = tf.keras.mixed_precision.LossScaleOptimizer(opt)
    with pytest.raises(ValueError, match='not clipped'):
        wrapped.apply_gradients(zip(grads, [var]))
    assert var.numpy() == 1.0


def test_the_mechanism_can_be_given_as_tf_privacys_keyword_arguments():
    mechanism = dict(l2_norm_clip=1.5, noise_multiplier=1.1,
                     num_examples=1000, expected_batch_size=50,
                     coordinate_sampling_rate=0.5, linf_norm_clip=0.2)
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        learning_rate=0.1, **mechanism)
    assert opt.config == TwiceSamplingConfig.single(**mechanism)
    with pytest.raises(ValueError, match='not both'):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(
            _config(expected_batch_size=4), noise_multiplier=1.0)
    with pytest.raises(ValueError, match='num_examples'):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0)
