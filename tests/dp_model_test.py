"""Tests of the per-example (fast) training path, DPModel."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models

from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import DPModel, PrivacyLedger, make_private
from tf_twice.keras import guards
from tf_twice.mechanism import aggregation as agg

NUM_FEATURES, NUM_CLASSES = tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES


def _data(batch, seed=0):
    return tiny_models.data(batch, seed)


_mlp = tiny_models.mlp


_linear = tiny_models.linear


def _loss(**kwargs):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         **kwargs)


def _private(model, lr=0.3, metrics=None, **dp_kwargs):
    dp = make_private(model, **dp_kwargs)
    dp.compile(optimizer=tf.keras.optimizers.SGD(lr), loss=_loss(),
               metrics=metrics)
    return dp


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


def _assert_all_close(a_list, b_list, **kwargs):
    kwargs = {'rtol': 1e-5, 'atol': 1e-6, **kwargs}
    for a, b in zip(a_list, b_list):
        np.testing.assert_allclose(a, b, **kwargs)


_next_key = tiny_models.fix_next_step_key


DP = dict(l2_norm_clip=0.6, linf_norm_clip=0.15, noise_multiplier=1.0,
          coordinate_sampling_rate=0.5, expected_batch_size=6.0, seed=17)


@pytest.mark.parametrize('physical_batch_size', [8, 3])
def test_dp_optimizer_runs_the_same_step_as_the_models_mechanism(
        physical_batch_size):
    x, y = _data(8)
    via_optimizer = make_private(_mlp(),
                                 physical_batch_size=physical_batch_size)
    via_optimizer.compile(
        optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            learning_rate=0.3, **DP),
        loss=_loss())
    tiny_models.one_step(via_optimizer, x, y)
    dp = _private(_mlp(), physical_batch_size=physical_batch_size, **DP)
    tiny_models.one_step(dp, x, y)
    assert not np.allclose(_weights(dp)[0], _weights(_mlp())[0])
    _assert_all_close(_weights(dp), _weights(via_optimizer))
    assert via_optimizer.dp_event(24) == dp.dp_event(24)


def test_plain_model_with_dp_optimizer_is_refused_before_any_step():
    model = _mlp()
    initial = _weights(model)
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        learning_rate=0.3, **DP),
        loss=_loss(reduction=tf.keras.losses.Reduction.NONE))
    with pytest.raises(ValueError, match='make_private'):
        model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)
    _assert_all_close(_weights(model), initial, rtol=0, atol=0)
    with pytest.raises(ValueError, match='make_private'):
        PrivacyLedger.for_model(model, num_examples=24, delta=DELTA)


def test_train_on_batch_is_refused():
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    with pytest.raises(ValueError, match='record_steps'):
        dp.train_on_batch(*_data(4))


def _numpy_step(w, b, x, y, weights, masks, noise, c2, c_inf, z, exp_batch,
                q2, lr):
    """The whole DP-SGD step for softmax regression, in numpy."""
    logits = x @ w + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    delta = p - np.eye(NUM_CLASSES)[y]
    grads = [x[:, :, None] * delta[:, None, :], delta]
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1)
    flat = flat * np.minimum(1.0, c2 / np.linalg.norm(flat, axis=1))[:, None]
    flat = np.clip(flat, -c_inf, c_inf)
    m = np.concatenate([k.reshape(len(x), -1) for k in masks], axis=1)
    total = (weights[:, None] * m * flat).sum(0)
    total += z * c2 * np.concatenate([e.reshape(-1) for e in noise])
    update = total / (exp_batch * q2)
    return w - lr * update[:w.size].reshape(w.shape), b - lr * update[w.size:]


def test_whole_step_matches_numpy_reference():
    x, y = _data(7, seed=3)
    weights = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
    dp = _private(_linear(), physical_batch_size=3, **DP)
    w0, b0 = _weights(dp)
    key = _next_key(dp)
    shapes = [w0.shape, b0.shape]
    masks = [m.numpy() for m in agg.coordinate_masks(key, shapes, 0.5, 7)]
    noise = [e.numpy() for e in agg.standard_normal_noise(
        key, shapes, [tf.float32] * 2)]
    tiny_models.one_step(dp, x, y, sample_weight=weights)
    want = _numpy_step(w0, b0, x, y, weights, masks, noise, 0.6, 0.15, 1.0,
                       6.0, 0.5, 0.3)
    _assert_all_close(_weights(dp), want)


def test_microbatching_does_not_change_the_update():
    x, y = _data(10, seed=4)
    results = []
    for physical in (3, 16):  # 4 chunks (2 rows padding) vs 1 chunk
        dp = _private(_mlp(), physical_batch_size=physical, **DP)
        tiny_models.one_step(dp, x, y)
        results.append(_weights(dp))
    for other in results[1:]:
        _assert_all_close(results[0], other)


def test_empty_logical_batch_is_a_pure_noise_step():
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    initial = _weights(dp)
    key = _next_key(dp)
    noise = agg.standard_normal_noise(
        key, [w.shape for w in initial], [tf.float32] * len(initial))
    empty = (np.zeros((0, NUM_FEATURES), np.float32), np.zeros((0,), np.int64))
    logs = tiny_models.one_step(dp, *empty)
    scale = 0.3 * 1.0 * 0.6 / (6.0 * 0.5)  # lr * z * c2 / (B_exp * q2)
    want = [w - scale * e.numpy() for w, e in zip(initial, noise)]
    _assert_all_close(_weights(dp), want)
    assert logs['nonprivate_loss'] == 0.0


def test_no_retracing_for_new_batch_sizes():
    traces = []

    class CountingDPModel(DPModel):

        def train_step(self, data):
            traces.append(1)  # runs once per trace, not per step
            return super().train_step(data)

    x, y = _data(9)
    sizes = [5, 3, 0, 9, 4]
    dataset = tf.data.Dataset.from_generator(
        lambda: ((x[:s], y[:s]) for s in sizes),
        output_signature=(tf.TensorSpec([None, NUM_FEATURES], tf.float32),
                          tf.TensorSpec([None], tf.int64)))
    dp = CountingDPModel(_mlp(), physical_batch_size=4, **DP)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    history = dp.fit(dataset, epochs=2, verbose=0)
    # tf.function traces twice when its first trace creates variables (the
    # optimizer's); the count must not grow with the number of batch sizes.
    first = len(traces)
    assert first <= 2
    assert np.all(np.isfinite(history.history['nonprivate_loss']))
    sizes[:] = [1, 7, 2, 0, 8, 6]
    dp.fit(dataset, epochs=1, verbose=0)
    assert len(traces) == first


def test_metrics_are_over_real_examples():
    x, y = _data(6, seed=5)
    weights = np.array([1, 0, 1, 1, 0, 1], np.float32)
    model = _mlp()
    logits = model(x).numpy()
    per_example = _loss(reduction=tf.keras.losses.Reduction.NONE)(
        y, logits).numpy()
    real = weights == 1
    want_loss = per_example[real].mean()
    want_acc = (logits.argmax(1) == y)[real].mean()
    dp = _private(model, physical_batch_size=4, metrics=['accuracy'], **DP)
    logs = tiny_models.one_step(dp, x, y, sample_weight=weights)
    np.testing.assert_allclose(logs['nonprivate_loss'], want_loss, rtol=1e-5)
    np.testing.assert_allclose(logs['nonprivate_accuracy'], want_acc, rtol=1e-6)
    assert set(logs) == {'nonprivate_loss', 'nonprivate_accuracy'}
    evaluated = dp.evaluate(x, y, verbose=0, return_dict=True)
    assert set(evaluated) == {'loss', 'accuracy'}


def test_non_finite_example_is_dropped():
    x, y = _data(6, seed=6)
    poisoned = x.copy()
    poisoned[3, 0] = np.inf
    dp_kwargs = dict(DP, noise_multiplier=0.0)
    dp = _private(_mlp(), physical_batch_size=4, **dp_kwargs)
    tiny_models.one_step(dp, poisoned, y)
    # The same batch with example 3 given weight 0 has the same masks.
    ref = _private(_mlp(), physical_batch_size=4, **dp_kwargs)
    tiny_models.one_step(ref, x, y, sample_weight=np.array([1, 1, 1, 0, 1, 1]))
    assert all(np.all(np.isfinite(w)) for w in _weights(dp))
    _assert_all_close(_weights(dp), _weights(ref))


def test_weights_above_one_are_refused():
    x, y = _data(4)
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    with pytest.raises(tf.errors.InvalidArgumentError, match='in \\[0, 1\\]'):
        tiny_models.one_step(dp, x, y, sample_weight=np.array([1, 2, 1, 1]))


def test_batch_norm_is_refused():
    inner = tf.keras.Sequential([
        tf.keras.layers.Dense(3, input_shape=(NUM_FEATURES,)),
        tf.keras.layers.BatchNormalization()])
    outer = tf.keras.Sequential([inner, tf.keras.layers.Dense(2)])
    # The check itself is tested in guards_test; here: the model path runs it.
    with pytest.raises(ValueError, match='GroupNormalization'):
        make_private(outer, physical_batch_size=4, **DP)


def test_mechanism_is_given_exactly_once():
    dp = make_private(_mlp(), physical_batch_size=4, **DP)
    with pytest.raises(ValueError, match='already has its DP mechanism'):
        dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4),
            loss=_loss())
    bare = make_private(_mlp(), physical_batch_size=4)
    with pytest.raises(ValueError, match='no DP mechanism'):
        bare.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    with pytest.raises(ValueError, match='expected_batch_size'):
        make_private(_mlp(), physical_batch_size=4, l2_norm_clip=1.0,
                     noise_multiplier=1.0)


@pytest.mark.parametrize('kwargs, name', [
    (dict(physical_batch_size=0), 'physical_batch_size'),
    (dict(physical_batch_size=2.5), 'physical_batch_size'),
    (dict(coordinate_sampling_rate=2.0), 'coordinate_sampling_rate'),
    (dict(linf_norm_clip=0.0), 'linf_norm_clip'),
])
def test_invalid_arguments(kwargs, name):
    full = dict(DP, physical_batch_size=4)
    full.update(kwargs)
    with pytest.raises(ValueError, match=name):
        make_private(_mlp(), **full)


def test_config_round_trip_and_weights():
    dp = make_private(_mlp(), physical_batch_size=4, **DP)
    assert len(dp.weights) == len(dp.inner_model.weights)
    config = dp.get_config()
    clone = DPModel.from_config(config)
    assert clone.get_config()['physical_batch_size'] == 4
    for key in ('l2_norm_clip', 'linf_norm_clip', 'noise_multiplier',
                'coordinate_sampling_rate', 'expected_batch_size'):
        assert clone.get_config()[key] == config[key]
    assert 'seed' not in config


# --- accounting: dp_event and the fit guards --------------------------------

NUM_EXAMPLES = 24  # expected_batch_size 6 -> q1 = 0.25
DELTA = 1e-5


def _event(**changes):
    fields = dict(example_sampling_rate=0.25, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.0, l2_norm_clip=0.6, linf_norm_clip=0.15)
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def _poisson(num_examples=NUM_EXAMPLES, q1=0.25, steps=3, seed=1):
    x, y = _data(num_examples, seed=7)
    return sampling.poisson_batches(x, y, physical_batch_size=4,
                                    example_sampling_rate=q1, steps=steps,
                                    seed=seed)


def test_dp_event_is_the_models_step():
    dp = make_private(_mlp(), physical_batch_size=4, **DP)
    assert dp.dp_event(NUM_EXAMPLES) == _event()
    assert dp.dp_event(6).example_sampling_rate == 1.0
    with pytest.raises(ValueError, match='num_examples'):
        dp.dp_event(5)  # q1 = 6 / 5 > 1


def test_fit_with_ledger_on_poisson_batches_is_accounted():
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    ledger = PrivacyLedger.for_model(dp, num_examples=NUM_EXAMPLES,
                                     delta=DELTA, verbose=0)
    assert ledger.event == _event()
    with warnings.catch_warnings():
        warnings.simplefilter('error', guards.NonPoissonInputWarning)
        dp.fit(_poisson(), epochs=2, callbacks=[ledger], verbose=0)
    assert ledger.steps == 6 == int(dp.optimizer.iterations)


@pytest.mark.parametrize('make', [
    lambda: _data(NUM_EXAMPLES),  # Arrays that fit batches itself.
    lambda: (tf.data.Dataset.from_tensor_slices(_data(NUM_EXAMPLES))
             .shuffle(NUM_EXAMPLES).batch(6)),
])
def test_fit_with_ledger_refuses_non_poisson_input(make):
    data = make()
    args = data if isinstance(data, tuple) else (data,)
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    initial = _weights(dp)
    ledger = PrivacyLedger(_event(), DELTA)
    with pytest.raises(ValueError, match='not Poisson sampling'):
        dp.fit(*args, epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 0
    _assert_all_close(_weights(dp), initial, rtol=0, atol=0)
    # The explicit opt-in trains, loudly, and still counts the steps.
    with pytest.warns(guards.NonPoissonInputWarning,
                      match='EPSILON DOES NOT HOLD'):
        dp.fit(*args, epochs=1, callbacks=[ledger], verbose=0,
               allow_non_poisson_input=True)
    assert ledger.steps == int(dp.optimizer.iterations) > 0


@pytest.mark.parametrize('event, data, match', [
    (_event(noise_multiplier=1.1), None, 'noise_multiplier=1.1'),
    (_event(l2_norm_clip=1.0), None, 'l2_norm_clip=1.0'),
    (_event(linf_norm_clip=None), None, 'linf_norm_clip=None'),
    (_event(coordinate_sampling_rate=1.0), None, 'coordinate_sampling_rate'),
    # The dataset samples at another rate than the event.
    (_event(), lambda: _poisson(q1=0.5), 'must be equal'),
    # Same q1, but q1 * n = 8 != expected_batch_size 6.
    (_event(), lambda: _poisson(num_examples=32), 'example_sampling_rate'),
])
def test_fit_with_mismatched_ledger_is_refused(event, data, match):
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    ledger = PrivacyLedger(event, DELTA)
    data = _poisson() if data is None else data()
    with pytest.raises(ValueError, match=match):
        dp.fit(data, epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 0 and int(dp.optimizer.iterations) == 0


def test_ledger_in_a_callback_list_is_found():
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    callbacks = tf.keras.callbacks.CallbackList(
        [PrivacyLedger(_event(noise_multiplier=2.0), DELTA)], model=dp)
    with pytest.raises(ValueError, match='noise_multiplier'):
        dp.fit(_poisson(), callbacks=callbacks, verbose=0)


def test_fit_without_ledger_trains_on_arrays():
    dp = _private(_mlp(), physical_batch_size=4, **DP)
    with warnings.catch_warnings():
        warnings.simplefilter('error', guards.NonPoissonInputWarning)
        dp.fit(*_data(12), batch_size=6, epochs=1, verbose=0)
    assert int(dp.optimizer.iterations) == 2
    with pytest.raises(ValueError, match='allow_non_poisson_input'):
        dp.fit(*_data(12), verbose=0, allow_non_poisson_input='yes')


def test_dp_model_without_basis_has_no_basis_state():
    dp = make_private(_mlp(), physical_batch_size=4, **DP)
    assert dp.basis is None and dp.dp_params.num_blocks == 1
    assert dp.dp_event(NUM_EXAMPLES).block_dimensions is None
    with pytest.raises(ValueError, match='no basis is given'):
        make_private(_mlp(), physical_batch_size=4,
                     **dict(DP, l2_norm_clip=(0.5, 0.1),
                            noise_multiplier=(1.0, 1.0), linf_norm_clip=None))


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
