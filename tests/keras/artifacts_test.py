"""No model artifact lets anyone predict a step's noise.

Every artifact kind a Keras user writes (TF checkpoint, ``.weights.h5``,
``.h5``, ``.keras``, SavedModel, ``get_config``, an optimizer checkpoint) is
searched for the step-key stream's state; restores of one checkpoint must
draw independent noise, a seeded model restored from any artifact must not
replay the seed's noise, and only the explicit secret run-state file
reproduces a seeded stream. Every checkpoint restores the record of the DP
steps the weights hold (`tf_twice.keras.privacy_record`).

Keras 3 writes no TF-format or plain ``.h5`` weights (those kinds are Keras
2's); its SavedModel is ``Model.export``; ``tf.train.Checkpoint`` and the
Keras formats are tested on both.
"""

import copy
import io
import json
import os
import pickle
import stat
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models

from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import privacy_record

CONFIG = TwiceSamplingConfig.single(
    num_examples=100, expected_batch_size=4.0, l2_norm_clip=0.5,
    noise_multiplier=1.0, linf_norm_clip=0.2, coordinate_sampling_rate=0.5)
SEED = 1234
# Noise vectors of d = 8 * 100 + 3 = 803 coordinates: two independent ones
# have correlation about N(0, 1/d), so the tests' bound |r| < 0.5 is 14
# standard deviations away (no false alarm), while replayed noise gives 1.
_WIDTH = 100


def _mlp():
    return tiny_models.mlp(width=_WIDTH)


_EMPTY = (np.zeros((0, tiny_models.NUM_FEATURES), np.float32),
          np.zeros((0,), np.int64))


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dp_model(seed=None, path='model', momentum=0.0):
    # Momentum would carry earlier noise into the measured update.
    if path == 'model':
        dp = DPModel(_mlp(), CONFIG, physical_batch_size=4,
                     seed=seed)
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    else:
        dp = DPModel(_mlp(), physical_batch_size=4)
        dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            CONFIG, learning_rate=1.0, momentum=momentum, seed=seed),
                   loss=_loss())
    dp(_EMPTY[0])  # Built, so that weights files load into it.
    return dp


def _noise_of_next_step(dp):
    """The next step's released noise: an empty logical batch's update
    (of the wrapped model's weights; the record's digest is no noise)."""
    before = dp.inner_model.get_weights()
    tiny_models.one_step(dp, *_EMPTY)
    return np.concatenate([(a - b).ravel() for a, b in zip(
        dp.inner_model.get_weights(), before)])


def _key_words(dp):
    return dp.aggregator.keys.get_state()['state']


def _artifact_bytes(path):
    paths = [path] if os.path.isfile(path) else [
        os.path.join(root, name) for root, _, names in os.walk(path)
        for name in names]
    return b''.join(open(p, 'rb').read() for p in paths)


def _save(dp, kind, directory):
    """Writes artifact ``kind`` of ``dp`` under ``directory``; its path."""
    if kind == 'tf_checkpoint':
        path = os.path.join(directory, 'ckpt')
        dp.save_weights(path)
        return directory
    if kind == 'weights_h5':
        path = os.path.join(directory, 'model.weights.h5')
        dp.save_weights(path)
    elif kind == 'h5':
        # Keras writes no whole-model .h5 of a subclassed model (it refuses
        # with NotImplementedError); .h5 weights are what can be written.
        path = os.path.join(directory, 'model.h5')
        dp.save_weights(path)
    elif kind == 'keras':
        path = os.path.join(directory, 'model.keras')
        dp.save(path)
    elif kind == 'saved_model':
        path = os.path.join(directory, 'saved_model')
        if markers.KERAS_MAJOR == 2:
            dp.save(path, save_format='tf')
        else:
            dp.export(path, input_signature=[tf.TensorSpec(
                [None, tiny_models.NUM_FEATURES], tf.float32)])
    elif kind == 'optimizer_checkpoint':
        path = os.path.join(directory, 'opt')
        tf.train.Checkpoint(optimizer=dp.optimizer, model=dp).write(path)
        return directory
    return path


def _load(dp, kind, saved):
    """Restores artifact ``kind`` written by ``_save`` into ``dp``."""
    if kind == 'tf_checkpoint':
        dp.load_weights(os.path.join(saved, 'ckpt'))
    elif kind == 'optimizer_checkpoint':
        tf.train.Checkpoint(optimizer=dp.optimizer, model=dp).read(
            os.path.join(saved, 'opt')).assert_existing_objects_matched()
    else:
        dp.load_weights(saved)


def _record(dp, steps):
    """`dp`'s record, which holds `steps` steps."""
    record = privacy_record.read(dp)
    assert record.steps == steps and record.digest != (0, 0)
    return record


def _optimizer_variables(optimizer):
    """A method on Keras 2, a property on Keras 3."""
    variables = optimizer.variables
    return variables() if callable(variables) else variables


# Every artifact kind the stack writes (Keras 3 writes no TensorFlow-format
# weights and no .h5 weights of another name).
ARTIFACTS = [kind for kind in ['tf_checkpoint', 'weights_h5', 'h5', 'keras',
                               'saved_model', 'optimizer_checkpoint']
             if markers.KERAS_MAJOR == 2 or kind not in ('tf_checkpoint',
                                                          'h5')]
PATHS = ['model', pytest.param('optimizer',
                               marks=markers.needs_tf_privacy_optimizers)]


def _two_poisson_steps(x, y):
    return sampling.poisson_batches(x, y, physical_batch_size=4,
                                    expected_batch_size=4.0, steps=2, seed=0)


def _saved_model_after_fit(dp, x, y, tmp_path):
    """Two Poisson steps of ``dp``, then its Keras 2 SavedModel; its path."""
    dp.fit(_two_poisson_steps(x, y), epochs=1, verbose=0)
    path = str(tmp_path / 'saved_model')
    dp.save(path, save_format='tf')
    return path


class _BatchSum(tf.keras.layers.Layer):
    """Identity that adds a metric of its input (Keras 2's ``add_metric``;
    Keras 3 refuses it)."""

    def call(self, inputs):
        if markers.KERAS_MAJOR == 2:
            self.add_metric(tf.reduce_sum(inputs), name='input_sum',
                            aggregation='mean')
        return inputs


def _saved_variables(path):
    """Every variable of the artifact(s) at ``path``: {file/name: array}."""
    saved = {}

    def add_h5(tag, group):
        group.visititems(lambda name, item: saved.__setitem__(
            f'{tag}/{name}', np.asarray(item[()]))
            if isinstance(item, h5py.Dataset) else None)

    paths = [path] if os.path.isfile(path) else [
        os.path.join(root, name) for root, _, names in os.walk(path)
        for name in names]
    for p in paths:
        if p.endswith('.h5'):
            with h5py.File(p, 'r') as f:
                add_h5(p, f)
        elif p.endswith('.keras'):
            with zipfile.ZipFile(p) as z, h5py.File(
                    io.BytesIO(z.read('model.weights.h5')), 'r') as f:
                add_h5(p, f)
        elif p.endswith('.index'):
            reader = tf.train.load_checkpoint(p[:-len('.index')])
            for name in reader.get_variable_to_shape_map():
                saved[f'{p}/{name}'] = np.asarray(reader.get_tensor(name))
    return saved


def _trained_with_metrics(callbacks=(), path='model', seed=None):
    """A DPModel (the mechanism in the model or, path='optimizer', in its
    DP optimizer) with a compiled metric (and on Keras 2 a layer's), fit
    for two steps."""
    x, y = tiny_models.data(12)
    inner = tf.keras.Sequential(
        [tf.keras.Input((tiny_models.NUM_FEATURES,)), _BatchSum()]
        + _mlp().layers)
    if path == 'model':
        dp = DPModel(inner, CONFIG, physical_batch_size=4, seed=seed)
        optimizer = tf.keras.optimizers.SGD(1.0)
    else:
        dp = DPModel(inner, physical_batch_size=4)
        optimizer = optimizers.TwiceSamplingDPKerasSGDOptimizer(
            CONFIG, learning_rate=1.0, seed=seed)
    dp.compile(optimizer=optimizer, loss=_loss(), metrics=['accuracy'])
    dp.fit(_two_poisson_steps(x, y), epochs=1, verbose=0,
           callbacks=list(callbacks))
    return dp


def _metric_values(dp):
    return [variable.numpy() for metric in dp._training_metrics()
            for variable in metric.variables]


def _assert_no_metric_state(saved, loss_total):
    assert saved
    for name, value in saved.items():
        # Keras 2 names them metrics/... (h5) and keras_api/metrics/...
        # (SavedModel); any other variable must not hold the loss sum.
        assert 'metric' not in name.lower() or not np.any(value), name
        assert loss_total not in value.ravel(), name


@pytest.mark.parametrize('path', PATHS)
def test_no_artifact_holds_the_key_stream_or_the_training_metrics(
        tmp_path, path):
    dp = _trained_with_metrics(path=path, seed=SEED)
    key_word = _key_words(dp)[-1]  # Philox state: [counter, counter, key].
    # fit's loss and metrics are the private batches' without noise (the
    # loss tracker holds the exact sum of the sampled examples' losses).
    running = _metric_values(dp)
    loss_total = running[0]
    assert loss_total > 0 and len(running) >= 4
    # Nor may a config say how the stream was seeded (Keras initializers
    # have a seed entry of their own, None here).
    for config in (dp.get_config(), dp.optimizer.get_config()):
        assert 'seed' not in config
        assert str(SEED) not in json.dumps(config, default=str)
    for kind in ARTIFACTS:  # One trained model writes each kind in turn.
        directory = tmp_path / kind
        directory.mkdir()
        saved = _save(dp, kind, str(directory))
        data = _artifact_bytes(saved)
        assert data, kind
        # The secret key word and the seed, in either byte order, appear
        # nowhere in the files (the counter words are small step counts).
        for value in (key_word, SEED):
            for order in ('<', '>'):
                packed = np.array([value], np.int64).astype(order + 'i8')
                assert packed.tobytes() not in data, (kind, value)
        assert b'dp_generator' not in data and b'_keys' not in data, kind
        # Keras 2 wrote the metrics' state into .weights.h5, .keras and
        # SavedModel files. Saving writes them empty and keeps fit's
        # running values.
        _assert_no_metric_state(_saved_variables(saved), loss_total)
        for got, want in zip(_metric_values(dp), running):
            np.testing.assert_array_equal(got, want, err_msg=kind)


def test_no_checkpoint_callback_holds_the_training_metrics(tmp_path):
    # Checkpoints after every step, in each format the stack writes.
    keras_2 = markers.KERAS_MAJOR == 2
    files = ['cb.weights.h5', 'cb.keras'] + (
        ['tf/ckpt', 'saved_model'] if keras_2 else [])
    callbacks = [tf.keras.callbacks.ModelCheckpoint(
        str(tmp_path / name), save_freq=1,
        save_weights_only=name in ('cb.weights.h5', 'tf/ckpt'))
                 for name in files]
    callbacks.append(tf.keras.callbacks.BackupAndRestore(
        str(tmp_path / 'backup'), delete_checkpoint=False))
    dp = _trained_with_metrics(callbacks)
    saved = _saved_variables(str(tmp_path))
    assert all(any(name.startswith(str(tmp_path / f)) for name in saved)
               for f in files + ['backup'])
    _assert_no_metric_state(saved, _metric_values(dp)[0])


@markers.needs_keras_2
def test_a_saved_model_is_written_right_after_fit(tmp_path):
    # Keras 2's SavedModel traces `call` with the specs of the model's first
    # call; DPModel's training never calls it, so before the fix a model
    # trained and never called refused `save(..., save_format='tf')`.
    x, y = tiny_models.data(12)
    dp = DPModel(_mlp(), CONFIG, physical_batch_size=4)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    path = _saved_model_after_fit(dp, x, y, tmp_path)
    # Compiled too: the SavedModel names the loss metric's class, which
    # loading must find.
    restored = tf.keras.models.load_model(path)
    for rows in (1, 7):  # Any batch size, whatever the trained ones were.
        np.testing.assert_allclose(restored(x[:rows]).numpy(),
                                   dp(x[:rows]).numpy(), rtol=1e-5, atol=1e-6)


@markers.needs_keras_3
@pytest.mark.parametrize('trained', [True, False])
def test_an_export_needs_no_input_signature(tmp_path, trained):
    # Keras 3 exports a subclassed model with the input shapes of its first
    # call; a DPModel builds itself and its fit calls only the wrapped
    # model, so before the fix export() refused ("never called") unless
    # given an input_signature. Now: the trained batches' specs, else the
    # wrapped model's inputs.
    x, y = tiny_models.data(12)
    dp = DPModel(_mlp(), CONFIG, physical_batch_size=4)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    if trained:
        dp.fit(_two_poisson_steps(x, y), epochs=1, verbose=0)
    path = str(tmp_path / 'exported')
    dp.export(path)
    served = tf.saved_model.load(path)
    for rows in (1, 7):  # Any batch size, whatever the trained ones were.
        np.testing.assert_allclose(served.serve(x[:rows]).numpy(),
                                   dp(x[:rows]).numpy(), rtol=1e-5, atol=1e-6)


@markers.needs_keras_2
@pytest.mark.parametrize('path', [
    'model', pytest.param('optimizer',
                          marks=markers.needs_tf_privacy_optimizers)])
def test_a_saved_model_reloads_as_a_dp_model(tmp_path, path):
    # Keras 2 revives a SavedModel from its class's config where that
    # works, else as a generic model whose fit trains without DP and
    # without a word; DPModel's config did not deserialize there.
    x, y = tiny_models.data(12)
    dp = _dp_model(path=path)
    saved = _saved_model_after_fit(dp, x, y, tmp_path)
    restored = tf.keras.models.load_model(saved)
    assert isinstance(restored, DPModel)
    assert restored.config == dp.config
    assert int(restored.steps_taken) == int(dp.steps_taken) == 2
    # It trains as a DPModel: its steps are counted.
    restored.fit(_two_poisson_steps(x, y), epochs=1, verbose=0)
    assert int(restored.steps_taken) == 4


@markers.needs_tf_privacy_optimizers
def test_an_optimizer_path_model_loads_in_a_new_process(tmp_path):
    # The optimizer classes were built on first access, so a new process
    # that imported tf_twice.keras found none: 'Unknown optimizer' (a
    # SavedModel) or 'Could not locate class' (.keras). One process loads
    # both files (a TensorFlow import costs seconds).
    x, y = tiny_models.data(12)
    saved_model = _saved_model_after_fit(_dp_model(path='optimizer'), x, y,
                                         tmp_path)
    dp = _dp_model(path='optimizer')
    dp.fit(_two_poisson_steps(x, y), epochs=1, verbose=0)
    keras_file = str(tmp_path / 'model.keras')
    dp.save(keras_file)
    code = ('import sys, tensorflow as tf, tf_twice.keras\n'
            'for path in sys.argv[1:]:\n'
            '    model = tf.keras.models.load_model(path)\n'
            '    print(type(model).__name__, type(model.optimizer).__name__,\n'
            '          int(model.steps_taken), model.config.num_examples)\n')
    out = subprocess.run([sys.executable, '-c', code, saved_model,
                          keras_file], check=True, capture_output=True,
                         text=True).stdout
    expected = ['DPModel', 'TwiceSamplingDPKerasSGDOptimizer', '2',
                str(CONFIG.num_examples)]
    assert [line.split() for line in out.splitlines()] == [expected] * 2, out


class _Unregistered(tf.keras.Model):
    """A wrapped model class that Keras's loaders do not know."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = tf.keras.layers.Dense(tiny_models.NUM_CLASSES)

    def call(self, inputs):
        return self.dense(inputs)

    def get_config(self):
        return {'name': self.name}


@markers.needs_keras_2
def test_a_saved_model_that_cannot_come_back_as_a_dp_model_does_not_load(
        tmp_path):
    # Keras 2 revived a SavedModel it could not rebuild from its config
    # (tf_twice not imported, a wrapped class it does not know) as a
    # generic model whose fit trained without DP. Now loading fails.
    x, y = tiny_models.data(12)
    dp = DPModel(_Unregistered(), CONFIG, physical_batch_size=4)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
    saved = _saved_model_after_fit(dp, x, y, tmp_path)
    with pytest.raises(ValueError, match='_Unregistered'):
        tf.keras.models.load_model(saved)
    restored = tf.keras.models.load_model(
        saved, custom_objects={'_Unregistered': _Unregistered})
    assert isinstance(restored, DPModel)
    assert int(restored.steps_taken) == 2
    # Still a serving export.
    served = tf.saved_model.load(saved).signatures['serving_default']
    outputs = served(tf.constant(x[:3]))
    np.testing.assert_allclose(next(iter(outputs.values())).numpy(),
                               dp(x[:3]).numpy(), rtol=1e-5, atol=1e-6)
    # And a process that has not imported tf_twice gets an error too.
    code = ('import sys, tensorflow as tf\n'
            'try:\n'
            '    tf.keras.models.load_model(sys.argv[1])\n'
            'except ValueError as error:\n'
            '    print("refused:", error)\n'
            'else:\n'
            '    print("loaded")\n'
            'print("tf_twice" in sys.modules)\n')
    out = subprocess.run([sys.executable, '-c', code, saved], check=True,
                         capture_output=True, text=True).stdout
    assert 'refused:' in out and 'tf_twice>DPModel' in out, out
    assert out.strip().endswith('False'), out


@markers.needs_keras_2
@pytest.mark.parametrize('kind', ['weights_h5', 'keras'])
def test_files_with_keras_own_loss_mean_load_both_ways(tmp_path, kind):
    # Before tf_twice's own Mean, DPModel's loss metric was Keras's, whose
    # saved entry Keras 2 names after the class: files of either load into
    # the other.
    def with_keras_mean(dp):
        object.__setattr__(dp, '_example_loss_tracker',
                           tf.keras.metrics.Mean(name='loss'))
        return dp

    for direction, (writer, reader) in enumerate((
            (with_keras_mean(_dp_model()), _dp_model()),
            (_dp_model(), with_keras_mean(_dp_model())))):
        tiny_models.one_step(writer, *tiny_models.data(4))
        directory = tmp_path / str(direction)
        directory.mkdir()
        _load(reader, kind, _save(writer, kind, str(directory)))
        for got, want in zip(reader.get_weights(), writer.get_weights()):
            np.testing.assert_array_equal(got, want)


def test_two_restores_of_one_checkpoint_draw_independent_noise(tmp_path):
    dp = _dp_model()
    tiny_models.one_step(dp, *tiny_models.data(4))
    dp.save_weights(str(tmp_path / 'model.weights.h5'))
    original = _noise_of_next_step(dp)
    draws = []
    for _ in range(2):
        restored = _dp_model()
        restored.load_weights(str(tmp_path / 'model.weights.h5'))
        draws.append(_noise_of_next_step(restored))
    for a, b in [(draws[0], draws[1]), (draws[0], original),
                 (draws[1], original)]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.5


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('kind', [
    pytest.param('tf_checkpoint', marks=markers.needs_keras_2),
    'weights_h5', 'optimizer_checkpoint'])
def test_seeded_resume_does_not_replay_noise(tmp_path, kind, path):
    dp = _dp_model(seed=SEED, path=path)
    first = _noise_of_next_step(dp)  # The seed's first key.
    second = _noise_of_next_step(dp)
    saved = _save(dp, kind, str(tmp_path))
    # Two runs forked from one checkpoint with the same seed: neither
    # replays a released step, nor do they share noise with each other
    # (their difference would be noise-free).
    forks = []
    for _ in range(2):
        resumed = _dp_model(seed=SEED, path=path)
        _load(resumed, kind, saved)
        assert int(resumed.optimizer.iterations) == 2  # Really restored.
        # With the record of the steps the weights hold, which a ledger
        # charges (ledger_state_attack_test).
        assert privacy_record.read(resumed) == _record(dp, steps=2)
        forks.append(_noise_of_next_step(resumed))
    for a, b in [(forks[0], first), (forks[0], second), (forks[1], first),
                 (forks[1], second), (forks[0], forks[1])]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.5


@pytest.mark.parametrize('path', PATHS)
def test_forks_that_load_before_compile_share_no_noise(tmp_path, path):
    # The natural fork: wrap, load the checkpoint, compile, train. The seed
    # follows the state the model was wrapped with, not the loaded one.
    dp = _dp_model(seed=SEED, path=path)
    released = _noise_of_next_step(dp)
    weights = str(tmp_path / 'model.weights.h5')
    dp.save_weights(weights)
    forks = []
    for _ in range(2):
        if path == 'model':
            fork = DPModel(_mlp(), CONFIG, physical_batch_size=4,
                           seed=SEED)
            fork(_EMPTY[0])
            fork.load_weights(weights)
            fork.compile(optimizer=tf.keras.optimizers.SGD(1.0),
                         loss=_loss())
        else:
            fork = DPModel(_mlp(), physical_batch_size=4)
            fork(_EMPTY[0])
            fork.load_weights(weights)
            fork.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
                CONFIG, learning_rate=1.0, seed=SEED), loss=_loss())
        forks.append(_noise_of_next_step(fork))
    for a, b in [(forks[0], forks[1]), (forks[0], released)]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.5


# BackupAndRestore and ModelCheckpoint resumes of a seeded run: see
# crash_resume_test.


def _restore(route, dp, tmp_path):
    """A fresh model with the same seed, given ``dp``'s weights by ``route``;
    returns it and how to run its next step."""
    def by_fit(model):
        return _noise_of_next_step(model)

    if route == 'load_model_of_inner':
        path = str(tmp_path / 'inner.keras')
        dp.inner_model.save(path)
        resumed = DPModel(tf.keras.models.load_model(path), CONFIG,
                          physical_batch_size=4, seed=SEED)
        resumed.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=_loss())
        return resumed, by_fit
    resumed = _dp_model(seed=SEED)
    if route == 'inner_load_weights':
        path = str(tmp_path / 'inner.weights.h5')
        dp.inner_model.save_weights(path)
        resumed.inner_model.load_weights(path)
    else:
        resumed.set_weights(dp.get_weights())
    if route == 'custom_loop':
        step = tf.function(resumed.train_step)

        def by_train_step(model):
            before = model.inner_model.get_weights()
            step(_EMPTY)
            return np.concatenate([(a - b).ravel() for a, b in zip(
                model.inner_model.get_weights(), before)])
        return resumed, by_train_step
    if route == 'keras_fit':
        def by_keras_fit(model):
            before = model.inner_model.get_weights()
            tf.keras.Model.fit(model, tf.data.Dataset.from_tensors(_EMPTY),
                               verbose=0)
            return np.concatenate([(a - b).ravel() for a, b in zip(
                model.inner_model.get_weights(), before)])
        return resumed, by_keras_fit
    return resumed, by_fit


@pytest.mark.parametrize('route', ['set_weights', 'inner_load_weights',
                                   'load_model_of_inner', 'custom_loop',
                                   'keras_fit'])
def test_seeded_stream_never_replays_on_weights_from_elsewhere(tmp_path,
                                                                route):
    # The same seed on weights that came from a run of that seed, by any
    # route, must not repeat that run's noise: the stream is positioned by
    # the seed and the model's state at its first step.
    dp = _dp_model(seed=SEED)
    released = [_noise_of_next_step(dp) for _ in range(2)]
    resumed, run_step = _restore(route, dp, tmp_path)
    noise = run_step(resumed)
    for earlier in released:
        assert abs(np.corrcoef(noise, earlier)[0, 1]) < 0.5, route
    if route == 'set_weights':  # Whatever the route: checked once.
        # The same seed on the same initial model reproduces the run.
        again = _dp_model(seed=SEED)
        np.testing.assert_array_equal(_noise_of_next_step(again),
                                      released[0])


@markers.needs_tf_privacy_optimizers
def test_copies_of_a_dp_optimizer_draw_independent_noise():
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(CONFIG, learning_rate=1.0)
    noises = []
    for copy_ in (opt, copy.deepcopy(opt)):
        dp = DPModel(_mlp(), physical_batch_size=4)
        dp.compile(optimizer=copy_, loss=_loss())
        noises.append(_noise_of_next_step(dp))
    assert abs(np.corrcoef(noises[0], noises[1])[0, 1]) < 0.5
    with pytest.raises(TypeError, match='secret'):
        pickle.dumps(opt.aggregator.keys)


@pytest.mark.parametrize('path', PATHS)
def test_keras_file_reloads_compiled_without_replaying(tmp_path, path):
    dp = _dp_model(seed=SEED, path=path, momentum=0.5)
    tiny_models.one_step(dp, *tiny_models.data(4))
    path = str(tmp_path / 'model.keras')
    dp.save(path)
    loads = [tf.keras.models.load_model(path) for _ in range(2)]
    for loaded in loads:
        assert isinstance(loaded, DPModel)
        assert int(loaded.optimizer.iterations) == 1
        assert privacy_record.read(loaded) == _record(dp, steps=1)
        assert loaded.config == dp.config == CONFIG
        assert type(loaded.optimizer) is type(dp.optimizer)
        for a, b in zip(loaded.get_weights(), dp.get_weights()):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(_optimizer_variables(loaded.optimizer),
                        _optimizer_variables(dp.optimizer)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    for loaded in loads:  # Measure the noise alone, not the momentum.
        for slot in _optimizer_variables(loaded.optimizer):
            if len(slot.shape):  # Slots; not the step count, not the rate.
                slot.assign(tf.zeros_like(slot))
    noises = [_noise_of_next_step(m) for m in loads]
    assert abs(np.corrcoef(noises[0], noises[1])[0, 1]) < 0.5


def test_secret_run_state_file_resumes_a_seeded_stream_exactly(tmp_path):
    dp = _dp_model(seed=SEED)
    tiny_models.one_step(dp, *tiny_models.data(4))
    dp.save_weights(str(tmp_path / 'model.weights.h5'))
    secret = str(tmp_path / 'secret' / 'random_state.json')
    os.makedirs(os.path.dirname(secret))
    dp.save_random_state(secret)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    want = _noise_of_next_step(dp)
    resumed = _dp_model(seed=SEED)
    resumed.load_weights(str(tmp_path / 'model.weights.h5'))
    resumed.load_random_state(secret)
    np.testing.assert_array_equal(_noise_of_next_step(resumed), want)
    with pytest.raises(ValueError, match='SecretRandomState'):
        resumed.aggregator.keys.set_state({'format': 'other'})


def test_op_determinism_asks_for_a_secret_seed_instead_of_failing_in_tf():
    # TensorFlow refuses OS-entropy generators under op determinism; the
    # model must say which argument to give, and a seeded model must train.
    from tensorflow.python.framework import config as tf_config
    tf.config.experimental.enable_op_determinism()
    try:
        with pytest.raises(ValueError, match=r'op determinism.*seed='):
            DPModel(_mlp(), CONFIG, physical_batch_size=4)
        seeded = _dp_model(seed=SEED)
        assert np.all(np.isfinite(_noise_of_next_step(seeded)))
    finally:
        tf_config.disable_op_determinism()


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
