"""Checks of the training script's datasets (examples/training/data.py).

Digits ship with scikit-learn; the tensorflow-datasets path runs on
`tfds.testing.mock_data`, Fashion-MNIST on tiny idx files written here and
the npz path on a tiny .npz. Nothing is downloaded.
"""

from absl import flags
import numpy as np
import pytest

pytest.importorskip('sklearn.datasets')

# pylint: disable=g-import-not-at-top,wrong-import-position
from examples import train as train_script
from examples.training import data as data_lib
from examples.training import runner
from examples.training import settings
from tests.examples.train_helpers import FAST
from tests.examples.train_helpers import check_private
from tests.examples.train_helpers import tiny_fashion_mnist
# pylint: enable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='module')
def digits():
    return data_lib.load_data('digits')


def test_digits_split_is_fixed_and_scaled(digits):
    again = data_lib.load_data('digits', public_examples=100)
    assert digits.x_train.shape[1:] == (8, 8, 1)
    assert len(digits.x_test) == data_lib.DIGITS_TEST_EXAMPLES
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    # The public split comes out of the training data, disjoint from it.
    assert len(again.x_public) == 100
    assert len(again.x_train) == len(digits.x_train) - 100
    train_rows = {row.tobytes() for row in again.x_train}
    assert sum(row.tobytes() in train_rows for row in again.x_public) <= 5


def test_tfds_dataset_with_mock_data():
    tfds = pytest.importorskip('tensorflow_datasets')
    with tfds.testing.mock_data(num_examples=48):
        data = data_lib.load_data('mnist', public_examples=8)
        results = runner.train(
            dict(FAST, mode='twice', dataset='mnist', steps=2, batch_size=8,
                 physical_batch_size=8, noise_multiplier=1.0),
            data=data)
    assert data.x_train.shape == (40, 28, 28, 1)
    assert data.x_train.dtype == np.uint8  # Scaled to [0, 1] when used.
    assert data.num_classes == 10
    assert len(data.x_public) == 8
    assert results['num_examples'] == 40
    assert 0.0 <= results['test_accuracy'] <= 1.0
    check_private(results, 2)


def test_unknown_dataset_is_refused_by_load_data():
    with pytest.raises(ValueError, match='--dataset'):
        data_lib.load_data('imagenet')


def test_fashion_mnist_trains_on_local_idx_files(tmp_path):
    data_dir = tiny_fashion_mnist(tmp_path / 'fmnist')
    results = runner.train(dict(
        FAST, mode='twice', dataset='fashion_mnist', data_dir=data_dir,
        model='tanh_cnn', steps=2, batch_size=8, physical_batch_size=8,
        public_examples=4, noise_multiplier=1.0))
    assert results['num_examples'] == 36
    assert results['num_public_examples'] == 4
    assert results['num_test_examples'] == 10
    assert results['model'] == 'tanh_cnn'
    assert 0.0 <= results['test_accuracy'] <= 1.0
    check_private(results, 2)


def test_fashion_mnist_data_is_uint8_with_a_channel_axis(tmp_path):
    data = data_lib.load_data(
        'fashion_mnist', data_dir=tiny_fashion_mnist(tmp_path))
    assert data.x_train.shape == (40, 28, 28, 1)
    assert data.x_train.dtype == np.uint8  # Scaled by 1/255 where used.
    assert data.num_classes == 10
    unit = data_lib.to_unit_float(data.x_train)
    np.testing.assert_allclose(unit, data.x_train / 255.0, rtol=1e-6)


def test_missing_fashion_mnist_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        data_lib.load_data('fashion_mnist', data_dir=str(tmp_path))
    assert str(tmp_path) in str(raised.value)
    assert 'apt-get install dataset-fashion-mnist' in str(raised.value)


def test_npz_dataset_trains(tmp_path):
    rng = np.random.default_rng(1)
    path = str(tmp_path / 'images.npz')
    np.savez(path, x_train=rng.integers(0, 256, (30, 12, 12), np.int64),
             y_train=np.arange(30) % 3,
             x_test=rng.integers(0, 256, (6, 12, 12), np.int64),
             y_test=np.arange(6) % 3)
    data = data_lib.load_data('npz', data_path=path)
    assert data.x_train.shape == (30, 12, 12, 1)
    assert data.x_train.dtype == np.uint8 and data.num_classes == 3
    results = runner.train(dict(
        FAST, mode='dpsgd', dataset='npz', data_path=path, steps=2,
        batch_size=8, physical_batch_size=8, noise_multiplier=1.0))
    assert results['num_examples'] == 30
    check_private(results, 2)


def test_npz_images_must_be_0_to_255_or_float(tmp_path):
    path = str(tmp_path / 'bad.npz')
    np.savez(path, x_train=np.full((2, 4, 4, 1), 256), y_train=[0, 1],
             x_test=np.zeros((1, 4, 4, 1)), y_test=[0])
    with pytest.raises(ValueError, match='0-255'):
        data_lib.load_data('npz', data_path=path)
    np.savez(path, x_train=np.zeros((2, 4), np.uint8), y_train=[0, 1],
             x_test=np.zeros((1, 4), np.uint8), y_test=[0])
    with pytest.raises(ValueError, match=r'\[N, height, width\]'):
        data_lib.load_data('npz', data_path=path)


def test_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path):
    pytest.importorskip('tensorflow_datasets')
    with pytest.raises(data_lib.DataUnavailableError) as raised:
        data_lib.load_data('cifar10', data_dir=str(tmp_path))
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
    train_script.define_flags(flag_values)
    flag_values(['train.py', '--dataset=npz', '--data_path=/d/x.npz',
                 '--model=tanh_cnn'])
    config = settings.check_config(flag_values)
    assert (config.dataset, config.data_path) == ('npz', '/d/x.npz')
    assert config.model == 'tanh_cnn'
