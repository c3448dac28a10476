"""Tests of the per-example (fast) training path, DPModel."""

import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests.paths import ROOT
from tests import reference
from tests import tiny_models

from tf_twice import models
from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel, PrivacyLedger
from tf_twice.keras import default_physical_batch_size
from tf_twice.keras import guards
from tf_twice.keras import vectorized_backprop
from tf_twice.mechanism import randomness

NUM_FEATURES, NUM_CLASSES = tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES


def _data(batch, seed=0):
    return tiny_models.data(batch, seed)


_mlp = tiny_models.mlp


_linear = tiny_models.linear


def _loss(**kwargs):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         **kwargs)


NUM_EXAMPLES = 24  # expected_batch_size 6 -> q1 = 0.25


def _config(**changes):
    fields = dict(num_examples=NUM_EXAMPLES, expected_batch_size=6.0,
                  l2_norm_clip=0.6, linf_norm_clip=0.15, noise_multiplier=1.0,
                  coordinate_sampling_rate=0.5)
    fields.update(changes)
    return TwiceSamplingConfig.single(**fields)


CONFIG = _config()
SEED = 17


def _private(model, lr=0.3, metrics=None, config=CONFIG, seed=SEED,
             physical_batch_size=4):
    dp = DPModel(model, config, physical_batch_size=physical_batch_size,
                 seed=seed)
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


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('physical_batch_size', [8, 3])
def test_dp_optimizer_runs_the_same_step_as_the_models_mechanism(
        physical_batch_size):
    x, y = _data(8)
    via_optimizer = DPModel(_mlp(), physical_batch_size=physical_batch_size)
    via_optimizer.compile(
        optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            CONFIG, seed=SEED, learning_rate=0.3),
        loss=_loss())
    tiny_models.one_step(via_optimizer, x, y)
    dp = _private(_mlp(), physical_batch_size=physical_batch_size)
    tiny_models.one_step(dp, x, y)
    assert not np.allclose(_weights(dp)[0], _weights(_mlp())[0])
    _assert_all_close(_weights(dp), _weights(via_optimizer))
    assert via_optimizer.config == dp.config == CONFIG
    assert via_optimizer.dp_event() == dp.dp_event() == CONFIG.dp_event()


@pytest.mark.parametrize('dp_optimizer', [
    False, pytest.param(True, marks=markers.needs_tf_privacy_optimizers)])
def test_mixed_float16_applies_the_update_unscaled(dp_optimizer):
    # Under 'mixed_float16' Keras wraps the optimizer in a LossScaleOptimizer,
    # which divides what it is given by its loss scale (2**15 at first); the
    # DP update comes from an unscaled loss and must reach the optimizer the
    # wrapper holds as it is, and a DP optimizer's mechanism must be found.
    x, y = _data(8)

    def step(policy):
        with tiny_models.dtype_policy(policy):
            if dp_optimizer:
                dp = DPModel(_mlp(), physical_batch_size=4)
                dp.compile(
                    optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
                        CONFIG, seed=SEED, learning_rate=0.3),
                    loss=_loss())
            else:
                dp = _private(_mlp())
            tiny_models.one_step(dp, x, y)
            return dp

    mixed, full = step('mixed_float16'), step('float32')
    assert isinstance(mixed.optimizer,
                      tf.keras.mixed_precision.LossScaleOptimizer)
    assert int(mixed.optimizer.iterations) == 1
    initial = _weights(_mlp())
    # float16 per-example gradients, the same seeded masks and noise.
    _assert_all_close([m - i for m, i in zip(_weights(mixed), initial)],
                      [f - i for f, i in zip(_weights(full), initial)],
                      rtol=0.05, atol=2e-3)


def test_float16_variables_train_on_float32_sums():
    # Under the 'float16' policy the variables and per-example gradients
    # are float16; each chunk is clipped and summed in float32
    # (precision.accumulation_dtype), the chunks' sums are added and noised
    # in float64 (precision.BATCH_SUM_DTYPE), and the update is rounded to
    # float16 only when applied.
    x, y = _data(8)
    with tiny_models.dtype_policy('float16'):
        dp = _private(_mlp())
        initial = _weights(dp)
        tiny_models.one_step(dp, x, y)
    assert all(tf.as_dtype(v.dtype) == tf.float16
               for v in dp.trainable_variables)
    moved = [np.abs(w - i).max() for w, i in zip(_weights(dp), initial)]
    assert all(np.isfinite(m) and m > 0 for m in moved)


@markers.needs_tf_privacy_optimizers
def test_plain_model_with_dp_optimizer_is_refused_before_any_step():
    model = _mlp()
    initial = _weights(model)
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        CONFIG, learning_rate=0.3), loss=_loss(reduction='none'))
    with pytest.raises(ValueError, match=r'DPModel\(model\)'):
        model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)
    _assert_all_close(_weights(model), initial, rtol=0, atol=0)
    with pytest.raises(ValueError, match='must be a tf_twice.keras.DPModel'):
        PrivacyLedger.for_model(model, delta=DELTA)


def test_train_on_batch_is_refused():
    dp = _private(_mlp())
    with pytest.raises(ValueError, match='record_steps'):
        dp.train_on_batch(*_data(4))


def test_no_gradient_reaches_the_weights_through_the_dp_models_outputs():
    # Training through the DPModel's outputs (an outer model's fit, a
    # GradientTape loop) would update its weights without DP and without a
    # step the ledger sees: no gradient gets there, so Keras refuses.
    x, y = _data(8)
    dp = _private(_mlp())
    np.testing.assert_array_equal(dp(x).numpy(), dp.inner_model(x).numpy())
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(_loss()(y, dp(x, training=True)))
    assert all(g is None for g in tape.gradient(loss,
                                                dp.trainable_variables))
    before = _weights(dp)
    outer = tf.keras.Sequential([dp])
    outer.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    with pytest.raises(ValueError, match='(?i)no gradients'):
        outer.fit(x, y, epochs=1, verbose=0)
    # With a layer of its own, the outer model trains only that layer.
    mixed = tf.keras.Sequential([dp, tf.keras.layers.Dense(3)])
    mixed.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # Keras: no gradient for dp's.
        mixed.fit(x, y, epochs=1, verbose=0)
    _assert_all_close(_weights(dp), before, rtol=0, atol=0)
    assert int(dp.steps_taken) == 0
    # Nor may a DPModel wrap one: its steps would be noise alone.
    with pytest.raises(ValueError, match='inner_model'):
        DPModel(dp, CONFIG)


class _AddsLossAndWritesState(tf.keras.layers.Layer):
    """Adds an input-dependent loss and, in training mode, writes the
    batch mean into a state variable."""

    def build(self, input_shape):
        self.scale = self.add_weight(name='scale', shape=(), trainable=True,
                                     initializer='ones')
        self.mean = self.add_weight(name='mean', shape=(), trainable=False,
                                    initializer='zeros')

    def call(self, inputs, training=None):
        outputs = self.scale * inputs
        self.add_loss(tf.reduce_mean(tf.square(outputs)))
        if training:
            self.mean.assign(tf.reduce_mean(inputs))
        return outputs


def test_nothing_reaches_the_weights_through_the_losses_its_layers_add():
    # An activity regularizer or add_loss is a second, data-dependent output
    # of the wrapped model's forward pass: through it an outer fit or a tape
    # over model.losses took a non-private step (found by an audit), and a
    # training-mode call wrote batch statistics into the state.
    x, y = _data(8)
    tf.keras.utils.set_random_seed(0)
    inner = tf.keras.Sequential([
        tf.keras.Input((NUM_FEATURES,)),
        tf.keras.layers.Dense(
            5, activity_regularizer=tf.keras.regularizers.L2(10.0)),
        _AddsLossAndWritesState(),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(NUM_CLASSES)])
    dp = _private(inner)
    state = [v.numpy() for v in dp.weights]
    # Inference mode, whatever the caller asks: no dropout, no state write.
    np.testing.assert_array_equal(dp(x, training=True).numpy(),
                                  inner(x, training=False).numpy())
    with tf.GradientTape() as tape:
        outputs = dp(x, training=True)
        added = tf.add_n(dp.losses)
    assert len(dp.losses) == 2 and float(added) > 0
    assert all(g is None for g in tape.gradient(
        [added, outputs], dp.trainable_variables))
    # Nor when the gradient is built from a traced graph: a tape around a
    # tf.function records one call, whose graph is then differentiated.
    def added_losses(a):
        dp(a)
        return tf.add_n(dp.losses)

    for name, forward in (('outputs', tf.function(lambda a: dp(a))),
                          ('losses', tf.function(added_losses))):
        with tf.GradientTape() as tape:
            traced = forward(x)
        assert all(g is None for g in tape.gradient(
            traced, dp.trainable_variables)), name
    inputs = tf.keras.Input((NUM_FEATURES,))
    outer = tf.keras.Model(inputs, tf.keras.layers.Dense(NUM_CLASSES)(
        dp(inputs)))
    outer.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # Keras: no gradient for dp's.
        outer.fit(x, y, epochs=2, verbose=0)
    _assert_all_close([v.numpy() for v in dp.weights], state, rtol=0,
                      atol=0)
    assert int(dp.steps_taken) == 0


def test_tf1_graph_mode_is_refused():
    # There Keras 2 trained an outer model with tf.gradients over the
    # wrapped layers' symbolic losses, which reached the weights.
    code = ('import tensorflow as tf\n'
            'tf.compat.v1.disable_eager_execution()\n'
            'from tests import tiny_models\n'
            'from tf_twice.keras import DPModel\n'
            'try:\n'
            '    DPModel(tiny_models.mlp(), tiny_models.dp_config(\n'
            '        expected_batch_size=4.0))\n'
            'except ValueError as error:\n'
            '    print("refused:", error)\n')
    out = subprocess.run([sys.executable, '-c', code], check=True,
                         capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert 'refused:' in out and 'disable_eager_execution' in out, out


def test_per_example_gradients_are_computed_for_the_real_rows_only(
        monkeypatch):
    # A batch of 11 in chunks of 4 is 4 + 4 + 3 rows, not 12 with padding
    # to a multiple of 4.
    from tf_twice.keras import per_example
    rows = tf.Variable(0, dtype=tf.int32)
    original = per_example.gradients

    def counting(model, loss, x, y, **kwargs):
        rows.assign_add(tf.shape(y)[0])
        return original(model, loss, x, y, **kwargs)

    monkeypatch.setattr(per_example, 'gradients', counting)
    dp = _private(_mlp(), physical_batch_size=4)
    dp.fit(tf.data.Dataset.from_tensors(_data(11)), verbose=0)
    assert int(rows.numpy()) == 11
    # Chunks of 32 pad the last one to a multiple of 4: 32 + 12 rows.
    rows.assign(0)
    dp = _private(_mlp(), physical_batch_size=32)
    dp.fit(tf.data.Dataset.from_tensors(_data(43)), verbose=0)
    assert int(rows.numpy()) == 44
    # Full chunks are never padded, also when the unit does not divide
    # them: chunks of 17 (unit 2) take 40 rows as 17 + 17 + 6.
    rows.assign(0)
    dp = _private(_mlp(), physical_batch_size=17)
    dp.fit(tf.data.Dataset.from_tensors(_data(40)), verbose=0)
    assert int(rows.numpy()) == 40


@pytest.mark.parametrize('physical_batch_size', [3, 24])
def test_whole_step_matches_numpy_reference(physical_batch_size):
    # 3: chunks of 3, 3 and 1 row; 24: one chunk of 7 rows padded to 9.
    x, y = _data(7, seed=3)
    weights = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
    dp = _private(_linear(), physical_batch_size=physical_batch_size)
    w0, b0 = _weights(dp)
    key = _next_key(dp)
    shapes = [w0.shape, b0.shape]
    masks = [m.numpy() for m in randomness.coordinate_masks(
        key, shapes, 0.5, 7)]
    noise = [e.numpy() for e in randomness.standard_normal_noise(
        key, shapes, [tf.float32] * 2)]
    tiny_models.one_step(dp, x, y, sample_weight=weights)
    want = reference.softmax_regression_step(
        w0, b0, x, y, weights, masks, noise, c2=0.6, c_inf=0.15, z=1.0,
        expected_batch_size=6.0, q2=0.5, lr=0.3)
    _assert_all_close(_weights(dp), want)


def test_microbatching_does_not_change_the_update():
    x, y = _data(10, seed=4)
    results = []
    for physical in (3, 16):  # 4 chunks vs 1 chunk (padded to 12 rows)
        dp = _private(_mlp(), physical_batch_size=physical)
        tiny_models.one_step(dp, x, y)
        results.append(_weights(dp))
    for other in results[1:]:
        _assert_all_close(results[0], other)


def test_empty_logical_batch_is_a_pure_noise_step():
    dp = _private(_mlp())
    initial = _weights(dp)
    key = _next_key(dp)
    noise = randomness.standard_normal_noise(
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
    dp = CountingDPModel(_mlp(), CONFIG, physical_batch_size=4, seed=SEED)
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
    per_example = _loss(reduction='none')(
        y, logits).numpy()
    real = weights == 1
    want_loss = per_example[real].mean()
    want_acc = (logits.argmax(1) == y)[real].mean()
    dp = _private(model, metrics=['accuracy'])
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
    silent = _config(noise_multiplier=0.0, non_private=True)
    dp = _private(_mlp(), config=silent)
    tiny_models.one_step(dp, poisoned, y)
    # The same batch with example 3 given weight 0 has the same masks.
    ref = _private(_mlp(), config=silent)
    tiny_models.one_step(ref, x, y, sample_weight=np.array([1, 1, 1, 0, 1, 1]))
    assert all(np.all(np.isfinite(w)) for w in _weights(dp))
    _assert_all_close(_weights(dp), _weights(ref))


def test_weights_above_one_are_refused():
    # From a dataset: in the graph, naming sample_weight and the range.
    x, y = _data(4)
    dp = _private(_mlp())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r'sample_weight must be finite and in \[0, 1\]'):
        tiny_models.one_step(dp, x, y, sample_weight=np.array([1, 2, 1, 1]))


@pytest.mark.parametrize('weights, shown', [
    ([1.0, 2.0, 1.0, 1.0], '2.0 at index 1'),
    ([1.0, 1.0, -0.5, 1.0], '-0.5 at index 2'),
    ([1.0, 1.0, 1.0, np.nan], 'nan at index 3'),
    ([np.inf, 1.0, 1.0, 1.0], 'inf at index 0'),
])
@pytest.mark.parametrize('as_keyword', [True, False])
def test_fit_refuses_array_weights_outside_0_1_before_training(
        weights, shown, as_keyword):
    x, y = _data(4)
    dp = _private(_mlp())
    before = _weights(dp)
    weights = np.array(weights, np.float32)
    # sample_weight is fit's 11th argument (after validation_split,
    # validation_data, shuffle, class_weight) on Keras 2 and 3.
    with pytest.raises(ValueError, match=r'sample_weight must be finite and '
                       r'in \[0, 1\].*' + re.escape(shown)):
        if as_keyword:
            dp.fit(x, y, batch_size=4, verbose=0, sample_weight=weights)
        else:
            dp.fit(x, y, 4, 1, 0, None, 0.0, None, False, None, weights)
    assert int(dp.optimizer.iterations) == 0
    _assert_all_close(_weights(dp), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r'class_weight\[1\] must be finite'):
        dp.fit(x, y, batch_size=4, verbose=0, class_weight={0: 1.0, 1: 3.0})


def test_batch_norm_is_refused():
    inner = tf.keras.Sequential([
        tf.keras.layers.Dense(3, input_shape=(NUM_FEATURES,)),
        tf.keras.layers.BatchNormalization()])
    outer = tf.keras.Sequential([inner, tf.keras.layers.Dense(2)])
    # The check itself is tested in guards_test; here: the model path runs it.
    with pytest.raises(ValueError, match='GroupNormalization'):
        DPModel(outer, CONFIG, physical_batch_size=4)


@markers.needs_tf_privacy_optimizers
def test_a_config_and_a_dp_optimizer_are_refused_together():
    dp = DPModel(_mlp(), CONFIG, physical_batch_size=4)
    with pytest.raises(ValueError, match='already has its DP mechanism'):
        dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            CONFIG), loss=_loss())


def test_mechanism_is_given_exactly_once():
    bare = DPModel(_mlp(), physical_batch_size=4)
    with pytest.raises(ValueError,
                       match=r'no DP mechanism.*DPModel\(model, config\)'):
        bare.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss())
    # The mechanism is a whole, calibrated config; nothing else stands in.
    with pytest.raises(ValueError, match='seed need a config'):
        DPModel(_mlp(), seed=1)
    with pytest.raises(ValueError, match='TwiceSamplingConfig'):
        DPModel(_mlp(), {'l2_norm_clip': 1.0, 'noise_multiplier': 1.0})
    with pytest.raises(ValueError, match='calibrate'):
        DPModel(_mlp(), _config(noise_multiplier=None))


@pytest.mark.parametrize('build, name', [
    (lambda: DPModel(_mlp(), CONFIG, physical_batch_size=0),
     'physical_batch_size'),
    (lambda: DPModel(_mlp(), CONFIG, physical_batch_size=2.5),
     'physical_batch_size'),
    (lambda: DPModel(_mlp(), CONFIG, seed=-1), 'seed'),
    (lambda: _config(coordinate_sampling_rate=2.0),
     'coordinate_sampling_rate'),
    (lambda: _config(linf_norm_clip=0.0), 'linf_norm_clip'),
])
def test_invalid_arguments(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_config_round_trip_and_weights():
    dp = DPModel(_mlp(), CONFIG, physical_batch_size=4, seed=SEED)
    # + privacy_record, its own weight.
    assert len(dp.weights) == len(dp.inner_model.weights) + 1
    config = dp.get_config()
    assert config['config'] == CONFIG.to_dict()
    json.dumps({k: v for k, v in config.items() if k != 'model'})
    clone = DPModel.from_config(config)
    assert clone.get_config() == config
    assert clone.physical_batch_size == 4
    assert clone.config == CONFIG and clone.dp_event() == dp.dp_event()
    # No seed or random state in the config (it would give away the noise).
    assert 'seed' not in config
    # Without a config the mechanism comes from the optimizer at compile.
    bare = DPModel(_mlp(), physical_batch_size=4).get_config()
    assert 'config' not in bare
    assert DPModel.from_config(bare).config is None


def _dense(width, inputs=None):
    # d = (inputs + 1) * width, written out per example: on two positions
    # per example the kernel's gradient is no outer product (see below).
    layer = (tf.keras.layers.Dense(width) if inputs is None else
             tf.keras.layers.Dense(width, input_shape=(2, inputs)))
    return tf.keras.Sequential([layer])


@pytest.mark.parametrize('make_model, expected_batch_size, want', [
    # d = 43, Dense layers: far more rows than 512 fit the cache.
    (_mlp, None, 512),
    (_mlp, 100.0, 128),  # No larger than the batch, rounded up to 2**k.
    (_mlp, 6.0, 8),
    (_mlp, 1.0, 8),  # Never below 8.
    # d = 90,300: [64, d] float32 fit in 32 MiB, [128, d] do not.
    (lambda: _dense(300, 300), None, 64),
    (lambda: _dense(300, 300), 1000.0, 64),
    # d = 292,140: [16, d] fit in 32 MiB, but [64, d] fit in 128 MiB, and
    # chunks of 64 are faster (ResNet22).
    (lambda: _dense(540, 540), None, 64),
    (lambda: _dense(540, 540), 20.0, 32),
    # d = 1,001,000: [8, d] fit in 32 MiB, [32, d] in 128 MiB.
    (lambda: _dense(1000, 1000), None, 32),
    # d = 4.2M: not even 8 rows fit, 8 is the floor.
    (lambda: _dense(2048, 2048), None, 8),
    (lambda: _dense(3), None, 64),  # Not built: d unknown.
    (lambda: _dense(3), 20.0, 32),
])
def test_default_physical_batch_size(monkeypatch, make_model,
                                     expected_batch_size, want):
    # The rule for CPUs, also where the tests see a GPU.
    monkeypatch.setattr(vectorized_backprop, 'gpu_visible', lambda: False)
    _check_default_physical_batch_size(make_model, expected_batch_size, want)


@pytest.mark.parametrize('make_model, expected_batch_size, want', [
    # d = 90,300 and 1,001,000: [256, d] float32 fit in 1 GiB.
    (lambda: _dense(300, 300), None, 256),
    (lambda: _dense(1000, 1000), None, 256),
    (lambda: _dense(1000, 1000), 100.0, 128),
    # d = 4,196,352: [32, d] fit in 1 GiB, [64, d] do not.
    (lambda: _dense(2048, 2048), None, 32),
    (lambda: _dense(3), None, 64),  # Not built: d unknown.
])
def test_default_physical_batch_size_where_a_gpu_is_visible(
        monkeypatch, make_model, expected_batch_size, want):
    monkeypatch.setattr(vectorized_backprop, 'gpu_visible', lambda: True)
    _check_default_physical_batch_size(make_model, expected_batch_size, want)


@pytest.mark.parametrize('gpu, want', [(False, 512), (True, 256)])
def test_default_physical_batch_size_of_dense_layers(monkeypatch, gpu, want):
    # Their kernels' gradients stay factors: 2 * 2048 + 2048 floats per
    # example, not d = 4.2M (8 rows above), so 512 rows fit in 32 MiB; on a
    # CPU such a model's chunk may reach 512 rows, elsewhere 256.
    monkeypatch.setattr(vectorized_backprop, 'gpu_visible', lambda: gpu)
    _check_default_physical_batch_size(
        lambda: tf.keras.Sequential([tf.keras.Input((2048,)),
                                     tf.keras.layers.Dense(2048)]), None, want)
    # The ScatterNet linear model (GroupNorm - Dense): on a CPU its
    # d = 39,700 would give 128 rows.
    _check_default_physical_batch_size(models.linear, None, want)
    # Never more than the expected batch rounded up to a power of two.
    _check_default_physical_batch_size(models.linear, 100.0, 128)
    # Hybrid clipping writes each example's gradient out: 256 at most.
    model = models.linear()
    assert default_physical_batch_size(model, hybrid=True) == 256


def _check_default_physical_batch_size(make_model, expected_batch_size, want):
    config = (None if expected_batch_size is None else
              _config(num_examples=1000,
                      expected_batch_size=expected_batch_size))
    size = default_physical_batch_size(make_model(), config)
    assert size == want
    assert isinstance(size, int) and 8 <= size <= 512
    assert size & (size - 1) == 0  # A power of two.
    if expected_batch_size is not None:
        assert size <= max(8, 2 * expected_batch_size)


def test_dp_model_defaults_its_physical_batch_size(monkeypatch):
    monkeypatch.setattr(vectorized_backprop, 'gpu_visible', lambda: False)
    model = _mlp()
    assert DPModel(model, CONFIG).physical_batch_size == (
        default_physical_batch_size(model, CONFIG)) == 8
    assert DPModel(_mlp()).physical_batch_size == 512


# --- accounting: dp_event and the fit guards --------------------------------

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
    assert DPModel(_mlp(), CONFIG).dp_event() == _event()
    whole = DPModel(_mlp(), _config(num_examples=6))
    assert whole.dp_event().example_sampling_rate == 1.0
    silent = DPModel(_mlp(), _config(noise_multiplier=0.0, non_private=True))
    with pytest.raises(ValueError, match='non_private'):
        silent.dp_event()
    with pytest.raises(ValueError, match='no DP mechanism'):
        DPModel(_mlp()).dp_event()


def test_fit_with_ledger_on_poisson_batches_is_accounted():
    dp = _private(_mlp())
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    assert ledger.event == _event() == dp.dp_event()
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
    dp = _private(_mlp())
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
    (_event(coordinate_sampling_rate=1.0), None,
     'coordinate_sampling_rate=1.0'),
    (_event(example_sampling_rate=0.5), None, 'example_sampling_rate=0.5'),
    (_event(block_dimensions=43), None, 'block_dimensions=43'),
    # The dataset samples at another rate than the model's config.
    (_event(), lambda: _poisson(q1=0.5), 'must be equal'),
    # Same q1, but from 32 examples, not the config's 24.
    (_event(), lambda: _poisson(num_examples=32), 'num_examples=24'),
    # Even with a ledger built for that n (another q1).
    (_event(example_sampling_rate=6 / 32), lambda: _poisson(num_examples=32),
     'example_sampling_rate=0.1875'),
])
def test_fit_with_mismatched_ledger_is_refused(event, data, match):
    dp = _private(_mlp())
    ledger = PrivacyLedger(event, DELTA)
    data = _poisson() if data is None else data()
    with pytest.raises(ValueError, match=match):
        dp.fit(data, epochs=1, callbacks=[ledger], verbose=0)
    assert ledger.steps == 0 and int(dp.optimizer.iterations) == 0


def test_ledger_in_a_callback_list_is_found():
    dp = _private(_mlp())
    callbacks = tf.keras.callbacks.CallbackList(
        [PrivacyLedger(_event(noise_multiplier=2.0), DELTA)], model=dp)
    with pytest.raises(ValueError, match='noise_multiplier'):
        dp.fit(_poisson(), callbacks=callbacks, verbose=0)


def test_fit_without_ledger_trains_on_arrays_loudly():
    dp = _private(_mlp())
    # No epsilon holds for fixed-size batches: said, not refused (nothing
    # is accounted without a ledger, and no later ledger takes the weights).
    with pytest.warns(guards.NonPoissonInputWarning,
                      match='without a PrivacyLedger on input .ndarray.'):
        dp.fit(*_data(12), batch_size=6, epochs=1, verbose=0)
    assert int(dp.optimizer.iterations) == 2
    with warnings.catch_warnings():
        warnings.simplefilter('error', guards.NonPoissonInputWarning)
        dp.fit(_poisson(), epochs=1, verbose=0)  # Poisson input: silent.
        # A non-private baseline claims no epsilon.
        baseline = _private(_mlp(), config=_config(noise_multiplier=0.0,
                                                   non_private=True))
        baseline.fit(*_data(12), batch_size=6, epochs=1, verbose=0)
    with pytest.raises(ValueError, match='allow_non_poisson_input'):
        dp.fit(*_data(12), verbose=0, allow_non_poisson_input='yes')


def test_dp_model_without_basis_has_no_basis_state():
    dp = DPModel(_mlp(), CONFIG, physical_batch_size=4)
    assert dp.basis is None and dp.config.num_blocks == 1
    assert dp.dp_event().block_dimensions is None
    two_blocks = TwiceSamplingConfig(
        num_examples=NUM_EXAMPLES, expected_batch_size=6.0,
        blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0),
                Block(l2_norm_clip=0.1, noise_multiplier=1.0)))
    with pytest.raises(ValueError, match='no basis is given'):
        DPModel(_mlp(), two_blocks, physical_batch_size=4)


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
