"""Checks of examples/train.py through its importable functions.

Every mode trains for a handful of steps on scikit-learn's digits (shipped
with scikit-learn, nothing is downloaded); the tensorflow-datasets path runs
on `tfds.testing.mock_data`, Fashion-MNIST on tiny idx files written here
and the npz path on a tiny .npz. Private modes must report the ledger's
epsilon and the privacy statement's epsilon for the same steps, and they
must agree. One test runs the script as a command and checks that its
console is free of TensorFlow's known start-up noise.
"""

import gzip
import importlib.util
import json
import logging
import math
import os
import pathlib
import struct
import subprocess
import sys

from absl import flags
import numpy as np
import pytest

from tf_twice import datasets
from tf_twice.accounting import TwiceSamplingRdpAccountant

pytest.importorskip('sklearn.datasets')

_SCRIPT = (pathlib.Path(__file__).resolve().parents[1] / 'examples' /
           'train.py')
_MODULE = 'tf_twice_examples_train'


def _load():
    """Imports examples/train.py (a script, not a package) as a module."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.spec_from_file_location(_MODULE, _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    spec.loader.exec_module(module)
    return module


train_lib = _load()

# Small and fast: a few steps of expected batch 32 in chunks of 32.
FAST = dict(steps=3, batch_size=32, physical_batch_size=32, seed=0,
            verbose=0)


@pytest.fixture(scope='module')
def digits():
    return train_lib.load_data('digits')


def _check_private(results, steps):
    assert results['steps'] == steps
    assert results['total_steps'] == steps
    assert results['optimizer_steps'] == steps
    assert math.isfinite(results['epsilon']) and results['epsilon'] > 0
    # The ledger (steps that ran) and the statement (the setting) agree.
    assert results['statement_epsilon'] == pytest.approx(
        results['epsilon'], rel=1e-9)
    assert 'Epsilon with twice sampling' in results['statement']


def test_digits_split_is_fixed_and_scaled(digits):
    again = train_lib.load_data('digits', public_examples=100)
    assert digits.x_train.shape[1:] == (8, 8, 1)
    assert len(digits.x_test) == train_lib.DIGITS_TEST_EXAMPLES
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    # The public split comes out of the training data, disjoint from it.
    assert len(again.x_public) == 100
    assert len(again.x_train) == len(digits.x_train) - 100
    train_rows = {row.tobytes() for row in again.x_train}
    assert sum(row.tobytes() in train_rows for row in again.x_public) <= 5


@pytest.mark.parametrize('mode', ['dpsgd', 'twice'])
def test_private_modes_train_and_account(digits, mode):
    results = train_lib.train(dict(FAST, mode=mode, target_epsilon=8.0),
                              data=digits)
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 3)
    assert results['epsilon'] <= 8.0
    assert results['delta'] == 1e-5  # n = 1437: 1/n -> 1e-4, capped.
    assert results['expected_batch_size'] == 32
    if mode == 'dpsgd':
        assert results['coordinate_sampling_rate'] == 1.0
        assert results['linf_norm_clip'] is None
    else:
        assert results['coordinate_sampling_rate'] == 0.5
        assert results['linf_norm_clip'] == pytest.approx(0.1)


def test_planned_steps_meet_the_target_epsilon(digits):
    """The noise is calibrated for the planned steps: epsilon ~ target."""
    results = train_lib.train(dict(FAST, mode='twice', target_epsilon=2.0,
                                   noise_multiplier=None), data=digits)
    assert 0.99 * 2.0 <= results['epsilon'] <= 2.0


def test_nonprivate_mode_makes_no_claim(digits):
    results = train_lib.train(dict(FAST, mode='nonprivate'), data=digits)
    assert results['steps'] == 3
    assert 0.0 <= results['test_accuracy'] <= 1.0
    assert results['epsilon'] is None and results['statement'] is None


def test_tfds_dataset_with_mock_data():
    tfds = pytest.importorskip('tensorflow_datasets')
    with tfds.testing.mock_data(num_examples=48):
        data = train_lib.load_data('mnist', public_examples=8)
        results = train_lib.train(
            dict(FAST, mode='twice', dataset='mnist', steps=2, batch_size=8,
                 physical_batch_size=8, noise_multiplier=1.0),
            data=data)
    assert data.x_train.shape == (40, 28, 28, 1)
    assert data.x_train.dtype == np.uint8  # Scaled to [0, 1] when used.
    assert data.num_classes == 10
    assert len(data.x_public) == 8
    assert results['num_examples'] == 40
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 2)


@pytest.mark.parametrize('overrides, flag', [
    (dict(target_epsilon=2.0, noise_multiplier=1.0), '--target_epsilon'),
    (dict(target_epsilon=0.0), '--target_epsilon'),
    (dict(noise_multiplier=-1.0), '--noise_multiplier'),
    (dict(coordinate_sampling_rate=1.5), '--coordinate_sampling_rate'),
    (dict(coordinate_sampling_rate=0.0), '--coordinate_sampling_rate'),
    (dict(mode='dpsgd', coordinate_sampling_rate=0.5),
     '--coordinate_sampling_rate'),
    (dict(dataset='imagenet'), '--dataset'),
    (dict(mode='sparse'), '--mode'),
    (dict(batch_size=64, example_sampling_rate=0.1), '--batch_size'),
    (dict(example_sampling_rate=1.5), '--example_sampling_rate'),
    (dict(epochs=2, steps=5), '--epochs'),
    (dict(linf_norm_clip=0.1, d0=100), '--linf_norm_clip'),
    (dict(mode='dpsgd', d0=100), '--d0'),
    (dict(d0=0.5), '--d0'),
    (dict(delta=1.0), '--delta'),
    (dict(mode='nonprivate', target_epsilon=1.0), '--target_epsilon'),
    (dict(mode='hybrid', ranks='4,0'), '--ranks'),
    (dict(physical_batch_size=0), '--physical_batch_size'),
    (dict(dataset='npz'), '--data_path'),
    (dict(dataset='digits', data_path='data.npz'), '--data_path'),
    (dict(model='resnet50'), '--model'),
])
def test_bad_flags_are_refused_by_name(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        train_lib.check_config(dict(FAST, **overrides))


def test_batch_larger_than_the_dataset_is_refused(digits):
    with pytest.raises(ValueError, match='--batch_size'):
        train_lib.build_run(dict(FAST, batch_size=5000), data=digits)


def test_unknown_dataset_is_refused_by_load_data():
    with pytest.raises(ValueError, match='--dataset'):
        train_lib.load_data('imagenet')


def test_command_line_flags_fill_the_config():
    flag_values = flags.FlagValues()
    train_lib.define_flags(flag_values)
    flag_values(['train.py', '--mode=dpsgd', '--steps=7', '--ranks=4,8',
                 '--noise_multiplier=1.5'])
    config = train_lib.check_config(flag_values)
    assert config.mode == 'dpsgd' and config.steps == 7
    assert config.ranks == (4, 8) and config.noise_multiplier == 1.5
    assert config.dataset == 'digits' and config.target_epsilon is None
    names = {f.name for f in
             train_lib.dataclasses.fields(train_lib.TrainConfig)}
    assert names <= set(flag_values)


def test_resuming_continues_the_ledger(digits, tmp_path):
    checkpoint_dir = str(tmp_path / 'run')
    config = dict(FAST, mode='twice', noise_multiplier=1.0,
                  checkpoint_dir=checkpoint_dir)
    first = train_lib.train(dict(config, steps=2), data=digits)
    assert first['total_steps'] == 2
    ledger_file = os.path.join(checkpoint_dir, train_lib.LEDGER_FILENAME)
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 2

    # Same run, longer plan: restores the checkpoint and runs the rest.
    second = train_lib.train(dict(config, steps=5), data=digits)
    assert second['resumed_steps'] == 2
    assert second['steps'] == 3
    assert second['total_steps'] == 5
    assert second['optimizer_steps'] == 5  # Optimizer state restored.
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 5
    event = train_lib.build_run(dict(config, steps=5),
                                data=digits).model.dp_event()
    expected = TwiceSamplingRdpAccountant().compose(event, 5).get_epsilon(
        second['delta'])
    assert second['epsilon'] == pytest.approx(expected, rel=1e-9)
    assert second['statement_epsilon'] == pytest.approx(expected, rel=1e-9)

    # Nothing left of the plan: no step runs, nothing is reset.
    third = train_lib.train(dict(config, steps=5), data=digits)
    assert third['steps'] == 0 and third['total_steps'] == 5
    assert third['epsilon'] == pytest.approx(expected, rel=1e-9)


def test_checkpoint_is_keras_weights_with_no_temporary_left(digits,
                                                           tmp_path):
    checkpoint_dir = tmp_path / 'run'
    config = dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                  checkpoint_dir=str(checkpoint_dir))
    train_lib.train(dict(config, steps=2), data=digits)
    assert sorted(os.listdir(checkpoint_dir)) == sorted([
        train_lib.CHECKPOINT_NAME, train_lib.LEDGER_FILENAME,
        train_lib.RUN_FILENAME])
    assert train_lib.CHECKPOINT_NAME.endswith('.weights.h5')


class _CrashingSave:
    """A model whose save_weights writes part of the file, then dies."""

    def save_weights(self, path):
        with open(path, 'wb') as f:
            f.write(b'half a checkpoint')
        raise OSError('killed mid-save')


def test_a_crash_mid_save_keeps_the_last_checkpoint(tmp_path):
    path = str(tmp_path / train_lib.CHECKPOINT_NAME)
    with open(path, 'wb') as f:
        f.write(b'the last checkpoint')
    checkpoint = train_lib._EpochCheckpoint(path)  # pylint: disable=protected-access
    checkpoint.set_model(_CrashingSave())
    with pytest.raises(OSError, match='killed mid-save'):
        checkpoint.on_epoch_end(0)
    with open(path, 'rb') as f:
        assert f.read() == b'the last checkpoint'


def test_a_tensorflow_format_checkpoint_is_refused_not_ignored(digits,
                                                               tmp_path):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    checkpoint_dir = tmp_path / 'run'
    tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(checkpoint_dir / 'ckpt'))
    with pytest.raises(ValueError, match='TensorFlow-format checkpoint'):
        train_lib.build_run(dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                                 checkpoint_dir=str(checkpoint_dir)),
                            data=digits)


def test_nonprivate_resume_restores_the_optimizer(digits, tmp_path):
    config = dict(FAST, mode='nonprivate',
                  checkpoint_dir=str(tmp_path / 'run'))
    train_lib.train(dict(config, steps=2, optimizer='adam'), data=digits)
    second = train_lib.train(dict(config, steps=3, optimizer='adam'),
                             data=digits)
    assert second['resumed_steps'] == 2 and second['steps'] == 1
    assert second['optimizer_steps'] == 3


def test_resume_refuses_another_mode(digits, tmp_path):
    checkpoint_dir = str(tmp_path / 'run')
    train_lib.train(dict(FAST, mode='nonprivate', steps=1,
                         checkpoint_dir=checkpoint_dir), data=digits)
    with pytest.raises(ValueError, match='--mode'):
        train_lib.build_run(dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                                 checkpoint_dir=checkpoint_dir), data=digits)


HYBRID = dict(FAST, mode='hybrid', public_examples=50, ranks='4',
              basis_refresh_steps=2, target_epsilon=8.0)


def test_hybrid_mode_learns_a_public_basis_and_accounts_blocks(digits):
    data = train_lib.load_data('digits', public_examples=50)
    results = train_lib.train(HYBRID, data=data)
    assert results['num_public_examples'] == 50
    assert results['num_examples'] == len(digits.x_train) - 50
    assert results['ranks'] == [4]
    # One principal block, then the residual: per-block clips and noise.
    assert len(results['noise_multiplier']) == 2
    clips = results['l2_norm_clip']
    assert len(clips) == 2
    assert sum(c**2 for c in clips) == pytest.approx(1.0)  # The budget.
    # Principal block: no l-infinity clip (principal_d0 = 1); residual:
    # c2 / sqrt(d0) with the default d0.
    assert results['linf_norm_clip'][0] == pytest.approx(clips[0])
    assert results['linf_norm_clip'][1] == pytest.approx(
        clips[1] / math.sqrt(train_lib.DEFAULT_D0))
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 3)
    assert results['epsilon'] <= 8.0


def test_hybrid_resume_keeps_the_blocks(tmp_path):
    data = train_lib.load_data('digits', public_examples=50)
    config = dict(HYBRID, target_epsilon=None, noise_multiplier=1.0,
                  checkpoint_dir=str(tmp_path / 'run'))
    first = train_lib.train(dict(config, steps=2), data=data)
    second = train_lib.train(dict(config, steps=4), data=data)
    assert second['resumed_steps'] == 2 and second['total_steps'] == 4
    assert second['optimizer_steps'] == 4
    assert second['l2_norm_clip'] == first['l2_norm_clip']
    assert second['statement_epsilon'] == pytest.approx(
        second['epsilon'], rel=1e-9)


def test_data_given_must_match_the_public_split(digits):
    with pytest.raises(ValueError, match='--public_examples'):
        train_lib.build_run(dict(FAST, public_examples=10), data=digits)
    with pytest.raises(ValueError, match='--mode=hybrid'):
        train_lib.build_run(dict(HYBRID, public_examples=None), data=digits)


def test_accuracy_study_table():
    study = _load_study()
    configs = study.row_configs(batch_size=128, coordinate_sampling_rate=0.5,
                                d0=100, ranks=[16], basis_refresh_steps=20)
    assert configs['dpsgd q=q1*q2']['batch_size'] == 64
    assert configs['twice']['coordinate_sampling_rate'] == 0.5
    with pytest.raises(ValueError, match='--rows'):
        study.row_configs(batch_size=128, coordinate_sampling_rate=0.5,
                          d0=100, ranks=[16], basis_refresh_steps=20,
                          rows=['sparse'])
    run = dict(expected_batch_size=128.0, coordinate_sampling_rate=0.5,
               noise_multiplier=[4.0, 1.5], epsilon=3.99, total_steps=400)
    table = study.markdown_table({'hybrid': [
        dict(run, test_accuracy=a) for a in (0.8, 0.9, 0.85)]})
    assert '| hybrid | 128 | 0.5 | 4, 1.5 | 3.990 | 400 | 85.0 % ' \
        '| 80.0 - 90.0 % | 3 |' in table


def _load_study():
    path = _SCRIPT.parent / 'accuracy_study.py'
    spec = importlib.util.spec_from_file_location('tf_twice_study', path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def test_accuracy_study_keeps_runs_and_plots(tmp_path):
    study = _load_study()
    configs = study.row_configs(batch_size=64, coordinate_sampling_rate=0.5,
                                d0=100, ranks=[4], basis_refresh_steps=5,
                                rows=['dpsgd q=q1', 'twice'])
    calls = []

    def fake_train(config, data):
        # Accuracy encodes the run, so that the tables can be checked.
        calls.append(config)
        accuracy = 0.5 + 0.1 * config['target_epsilon'] / 8 + (
            0.01 * config['seed'])
        return dict(test_accuracy=accuracy, epsilon=config['target_epsilon'],
                    train_seconds=1.0, delta=1e-5, statement='not kept',
                    expected_batch_size=config['batch_size'],
                    coordinate_sampling_rate=config.get(
                        'coordinate_sampling_rate', 1.0),
                    noise_multiplier=[1.0], total_steps=config['steps'])

    settings = dict(steps=7, rows=configs)
    path = str(tmp_path / 'runs.json')
    kwargs = dict(seeds=[0, 1], common=dict(steps=7), public_examples=0,
                  data=object(), train_fn=fake_train, log=lambda _: None)
    first = study.run_study(configs, target_epsilons=[1.0],
                            store=study.RunStore(path, settings), **kwargs)
    assert len(calls) == 4
    assert {c['target_epsilon'] for c in calls} == {1.0}
    # A second part of the study reruns nothing it already has.
    both = study.run_study(configs, target_epsilons=[1.0, 8.0],
                           store=study.RunStore(path, settings), **kwargs)
    assert len(calls) == 8
    assert {c['target_epsilon'] for c in calls[4:]} == {8.0}
    assert both[1.0] == first[1.0]
    assert [r['test_accuracy'] for r in both[8.0]['twice']] == [0.6, 0.61]
    assert 'statement' not in both[8.0]['twice'][0]
    table = study.markdown_table(both[8.0])
    assert '| twice | 64 | 0.5 | 1 | 8.000 | 7 | 60.5 % | 60.0 - 61.0 % ' \
        '| 2 |' in table
    with pytest.raises(ValueError, match='--results_json'):
        study.RunStore(path, dict(settings, steps=8))
    png = tmp_path / 'plot' / 'accuracy.png'
    study.plot_accuracy(both, str(png),
                        published=study.PUBLISHED['fashion_mnist'])
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_steps_that_end_mid_epoch(digits):
    # 1437 / 200 -> 7 steps per epoch: 9 steps stop two into the second.
    results = train_lib.train(dict(FAST, mode='dpsgd', batch_size=200,
                                   steps=9, noise_multiplier=1.0),
                              data=digits)
    _check_private(results, 9)


# --- local datasets: Fashion-MNIST idx files and npz ---------------------


def _write_idx_gz(path, array: np.ndarray) -> None:
    """uint8 `array` in the idx format (magic 0x0000 0x08 rank, dims)."""
    header = bytes([0, 0, 0x08, array.ndim])
    header += struct.pack(f'>{array.ndim}I', *array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _tiny_fashion_mnist(directory, num_train=40, num_test=10):
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
        y_train=np.arange(num_train) % 10,
        x_test=rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
        y_test=np.arange(num_test) % 10)
    os.makedirs(directory, exist_ok=True)
    for key, base in datasets.FASHION_MNIST_FILES.items():
        _write_idx_gz(os.path.join(directory, base + '.gz'), arrays[key])
    return str(directory)


def test_fashion_mnist_trains_on_local_idx_files(tmp_path):
    data_dir = _tiny_fashion_mnist(tmp_path / 'fmnist')
    results = train_lib.train(dict(
        FAST, mode='twice', dataset='fashion_mnist', data_dir=data_dir,
        model='tanh_cnn', steps=2, batch_size=8, physical_batch_size=8,
        public_examples=4, noise_multiplier=1.0))
    assert results['num_examples'] == 36
    assert results['num_public_examples'] == 4
    assert results['num_test_examples'] == 10
    assert results['model'] == 'tanh_cnn'
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 2)


def test_fashion_mnist_data_is_uint8_with_a_channel_axis(tmp_path):
    data = train_lib.load_data(
        'fashion_mnist', data_dir=_tiny_fashion_mnist(tmp_path))
    assert data.x_train.shape == (40, 28, 28, 1)
    assert data.x_train.dtype == np.uint8  # Scaled by 1/255 where used.
    assert data.num_classes == 10
    unit = train_lib.to_unit_float(data.x_train)
    np.testing.assert_allclose(unit, data.x_train / 255.0, rtol=1e-6)


def test_missing_fashion_mnist_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        train_lib.load_data('fashion_mnist', data_dir=str(tmp_path))
    assert str(tmp_path) in str(raised.value)
    assert 'apt-get install dataset-fashion-mnist' in str(raised.value)


def test_npz_dataset_trains(tmp_path):
    rng = np.random.default_rng(1)
    path = str(tmp_path / 'images.npz')
    np.savez(path, x_train=rng.integers(0, 256, (30, 12, 12), np.int64),
             y_train=np.arange(30) % 3,
             x_test=rng.integers(0, 256, (6, 12, 12), np.int64),
             y_test=np.arange(6) % 3)
    data = train_lib.load_data('npz', data_path=path)
    assert data.x_train.shape == (30, 12, 12, 1)
    assert data.x_train.dtype == np.uint8 and data.num_classes == 3
    results = train_lib.train(dict(
        FAST, mode='dpsgd', dataset='npz', data_path=path, steps=2,
        batch_size=8, physical_batch_size=8, noise_multiplier=1.0))
    assert results['num_examples'] == 30
    _check_private(results, 2)


def test_npz_images_must_be_0_to_255_or_float(tmp_path):
    path = str(tmp_path / 'bad.npz')
    np.savez(path, x_train=np.full((2, 4, 4, 1), 256), y_train=[0, 1],
             x_test=np.zeros((1, 4, 4, 1)), y_test=[0])
    with pytest.raises(ValueError, match='0-255'):
        train_lib.load_data('npz', data_path=path)
    np.savez(path, x_train=np.zeros((2, 4), np.uint8), y_train=[0, 1],
             x_test=np.zeros((1, 4), np.uint8), y_test=[0])
    with pytest.raises(ValueError, match=r'\[N, height, width\]'):
        train_lib.load_data('npz', data_path=path)


def test_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path):
    pytest.importorskip('tensorflow_datasets')
    with pytest.raises(train_lib.DataUnavailableError) as raised:
        train_lib.load_data('cifar10', data_dir=str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path) in message  # Where it looked.
    assert 'never downloads' in message
    assert "tfds.builder('cifar10', data_dir='DIR').download_and_prepare()" \
        in message
    assert 'downloads/manual' in message
    assert '--dataset=npz --data_path=FILE' in message
    assert not (tmp_path / 'downloads').exists()  # No download started.


def test_data_flags_fill_the_config():
    flag_values = flags.FlagValues()
    train_lib.define_flags(flag_values)
    flag_values(['train.py', '--dataset=npz', '--data_path=/d/x.npz',
                 '--model=tanh_cnn'])
    config = train_lib.check_config(flag_values)
    assert (config.dataset, config.data_path) == ('npz', '/d/x.npz')
    assert config.model == 'tanh_cnn'


def _record(logger_name: str, message: str) -> logging.LogRecord:
    return logging.getLogger(logger_name).makeRecord(
        logger_name, logging.WARNING, __file__, 1, message, None, None)


def test_known_noise_is_dropped_and_other_warnings_are_kept():
    train_lib.quiet_known_noise()
    train_lib.quiet_known_noise()  # Idempotent: one filter.
    tf_logger = logging.getLogger('tensorflow')
    drops = [f for f in tf_logger.filters
             if type(f).__name__ == '_DropKnownNoise']
    assert len(drops) == 1
    noise = _record('tensorflow', 'Conv2DBackpropFilter uses a while_loop. '
                    'Fix that!')
    slow = _record('tensorflow', 'Callback method `on_train_batch_end` is '
                   'slow compared to the batch time (batch time: 0.01s)')
    other = _record('tensorflow', 'Gradients do not exist for variables')
    assert not tf_logger.filter(noise) and not tf_logger.filter(slow)
    assert tf_logger.filter(other)
    # tf_twice's own warnings go through other loggers: never filtered.
    ledger = logging.getLogger('tf_twice.keras.ledger')
    assert ledger.filter(_record('tf_twice.keras.ledger', 'PrivacyLedger: '
                                 'Fix that! uses a while_loop. Fix that!'))


def test_command_line_run_on_fashion_mnist_is_quiet(tmp_path):
    """The script end to end: flags, data, training, statement; no noise."""
    data_dir = _tiny_fashion_mnist(tmp_path / 'fmnist', num_train=20,
                                   num_test=4)
    env = {k: v for k, v in os.environ.items()
           if k != 'TF_CPP_MIN_LOG_LEVEL'}
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), '--dataset=fashion_mnist',
         f'--data_dir={data_dir}', '--model=tanh_cnn', '--steps=2',
         '--batch_size=4', '--physical_batch_size=4',
         '--noise_multiplier=1.0', '--verbose=0', '--seed=0'],
        capture_output=True, text=True, env=env, timeout=300)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console
    assert 'Twice-sampled DP-SGD performed over 20 examples' in console
    assert 'Test accuracy:' in console and 'Privacy ledger:' in console
    for noise in ('Fix that!', 'Unable to register', 'cpu_feature_guard',
                  'TensorRT', 'SetPriority'):
        assert noise not in console
