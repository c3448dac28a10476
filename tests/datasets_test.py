"""Tests of the local dataset loaders (tf_twice.datasets).

Fashion-MNIST is exercised on tiny idx files written here (the Debian
package need not be installed); the layout and header are the real ones.
"""

import gzip
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tf_twice import datasets

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

_TYPE_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B,
               np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """The idx encoding of `array`: magic, big-endian dims, big-endian data."""
    code = _TYPE_CODES[array.dtype.type]
    header = bytes([0, 0, code, array.ndim])
    header += struct.pack(f'>{array.ndim}I', *array.shape)
    return header + array.astype(array.dtype.newbyteorder('>')).tobytes()


def write_idx(path, array: np.ndarray, compress: bool = True) -> str:
    data = idx_bytes(array)
    with (gzip.open if compress else open)(path, 'wb') as f:
        f.write(data)
    return str(path)


def write_fashion_mnist(directory, num_train: int = 12, num_test: int = 6,
                        seed: int = 0, compress: bool = True):
    """Tiny Fashion-MNIST-shaped idx files; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        'x_train': rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
        'y_train': (np.arange(num_train) % 10).astype(np.uint8),
        'x_test': rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
        'y_test': (np.arange(num_test) % 10).astype(np.uint8),
    }
    os.makedirs(directory, exist_ok=True)
    for key, base in datasets.FASHION_MNIST_FILES.items():
        name = base + ('.gz' if compress else '')
        write_idx(os.path.join(directory, name), arrays[key], compress)
    return arrays


@pytest.mark.parametrize('dtype', list(_TYPE_CODES))
@pytest.mark.parametrize('compress', [True, False])
def test_load_idx_round_trips_every_type(tmp_path, dtype, compress):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    if dtype == np.uint8:
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4) + 200
    path = write_idx(tmp_path / 'a.idx', array, compress)
    loaded = datasets.load_idx(path)
    assert loaded.dtype == np.dtype(dtype)  # Native byte order.
    assert loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, array)


def test_load_idx_one_dimension(tmp_path):
    labels = np.array([3, 1, 4, 1, 5], np.uint8)
    path = write_idx(tmp_path / 'labels-idx1-ubyte.gz', labels)
    np.testing.assert_array_equal(datasets.load_idx(path), labels)


@pytest.mark.parametrize('data, message', [
    (b'', 'magic number'),
    (b'\x01\x00\x08\x01' + struct.pack('>I', 1) + b'\x00', 'magic number'),
    (b'\x00\x00\x07\x01' + struct.pack('>I', 1) + b'\x00', 'type code 0x07'),
    (b'\x00\x00\x08\x00', '>= 1 dimension'),
    (b'\x00\x00\x08\x02' + struct.pack('>I', 2), 'truncated header'),
    (b'\x00\x00\x08\x01' + struct.pack('>I', 3) + b'\x00\x01',
     'holds 2 bytes'),
    (b'\x00\x00\x0c\x01' + struct.pack('>I', 1) + b'\x00' * 5,
     'holds 5 bytes'),
])
def test_load_idx_refuses_bad_files_naming_them(tmp_path, data, message):
    path = tmp_path / 'bad-idx'
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message) as raised:
        datasets.load_idx(str(path))
    assert str(path) in str(raised.value)


def test_load_idx_refuses_a_truncated_gzip_naming_it(tmp_path):
    whole = gzip.compress(idx_bytes(np.zeros((4, 28, 28), np.uint8)))
    path = tmp_path / 'cut.gz'
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match='gzip') as raised:
        datasets.load_idx(str(path))
    assert str(path) in str(raised.value)


@pytest.mark.parametrize('compress', [True, False])
def test_load_fashion_mnist_from_a_directory(tmp_path, compress):
    written = write_fashion_mnist(tmp_path, compress=compress)
    (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist(
        str(tmp_path))
    assert x_train.shape == (12, 28, 28) and x_train.dtype == np.uint8
    assert x_test.shape == (6, 28, 28)
    assert y_train.dtype == np.int32 and y_test.dtype == np.int32
    np.testing.assert_array_equal(x_train, written['x_train'])
    np.testing.assert_array_equal(y_train, written['y_train'])
    np.testing.assert_array_equal(x_test, written['x_test'])
    np.testing.assert_array_equal(y_test, written['y_test'])


def test_fashion_mnist_directory_from_the_environment(tmp_path, monkeypatch):
    written = write_fashion_mnist(tmp_path / 'env', num_train=3, num_test=2)
    monkeypatch.setenv(datasets.FASHION_MNIST_DIR_ENV, str(tmp_path / 'env'))
    (x_train, _), _ = datasets.load_fashion_mnist()
    np.testing.assert_array_equal(x_train, written['x_train'])
    # An explicit directory wins over the environment.
    other = write_fashion_mnist(tmp_path / 'arg', num_train=4, seed=1)
    (x_train, _), _ = datasets.load_fashion_mnist(str(tmp_path / 'arg'))
    np.testing.assert_array_equal(x_train, other['x_train'])


def test_missing_fashion_mnist_names_directory_files_and_fix(tmp_path,
                                                              monkeypatch):
    write_fashion_mnist(tmp_path)
    os.remove(tmp_path / 't10k-labels-idx1-ubyte.gz')
    with pytest.raises(FileNotFoundError) as raised:
        datasets.load_fashion_mnist(str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path) in message
    assert 't10k-labels-idx1-ubyte' in message
    assert 'train-images-idx3-ubyte' not in message  # Present.
    assert 'apt-get install dataset-fashion-mnist' in message
    assert datasets.FASHION_MNIST_DIR_ENV in message
    # The default directory, when nothing is given, is the Debian one.
    monkeypatch.delenv(datasets.FASHION_MNIST_DIR_ENV, raising=False)
    monkeypatch.setattr(datasets, 'DEFAULT_FASHION_MNIST_DIR',
                        str(tmp_path / 'none'))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / 'none')):
        datasets.load_fashion_mnist()


def test_fashion_mnist_with_wrong_shapes_names_the_file(tmp_path):
    write_fashion_mnist(tmp_path)
    write_idx(tmp_path / 'train-images-idx3-ubyte.gz',
              np.zeros((12, 28, 27), np.uint8))
    with pytest.raises(ValueError, match=r'\[N, 28, 28\]') as raised:
        datasets.load_fashion_mnist(str(tmp_path))
    assert 'train-images-idx3-ubyte.gz' in str(raised.value)
    write_fashion_mnist(tmp_path)
    write_idx(tmp_path / 't10k-labels-idx1-ubyte.gz',
              np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match='5 labels but'):
        datasets.load_fashion_mnist(str(tmp_path))
    write_idx(tmp_path / 't10k-labels-idx1-ubyte.gz',
              np.full(6, 10, np.uint8))
    with pytest.raises(ValueError, match='labels must be 0-9'):
        datasets.load_fashion_mnist(str(tmp_path))


def _npz(tmp_path, **arrays) -> str:
    path = str(tmp_path / 'data.npz')
    np.savez(path, **arrays)
    return path


def test_load_npz(tmp_path):
    rng = np.random.default_rng(0)
    x, x_test = rng.random((5, 4, 4, 3)), rng.random((2, 4, 4, 3))
    path = _npz(tmp_path, x_train=x, y_train=np.arange(5),
                x_test=x_test, y_test=np.array([[1], [0]]))
    (x_train, y_train), (x_t, y_t) = datasets.load_npz(path)
    np.testing.assert_array_equal(x_train, x)
    np.testing.assert_array_equal(x_t, x_test)
    assert y_train.dtype == np.int32 and y_train.tolist() == [0, 1, 2, 3, 4]
    assert y_t.tolist() == [1, 0]  # [N, 1] labels are flattened.


def test_load_npz_accepts_the_tutorial_names(tmp_path):
    path = _npz(tmp_path, train_images=np.zeros((3, 2, 2), np.uint8),
                train_labels=np.array([0, 1, 2]),
                test_images=np.ones((1, 2, 2), np.uint8),
                test_labels=np.array([2]))
    (x_train, _), (x_test, y_test) = datasets.load_npz(path)
    assert x_train.shape == (3, 2, 2) and x_test.max() == 1
    assert y_test.tolist() == [2]


def test_load_npz_names_the_missing_keys(tmp_path):
    path = _npz(tmp_path, x_train=np.zeros((3, 2, 2)),
                y_train=np.arange(3), images=np.zeros((1, 2, 2)))
    with pytest.raises(ValueError) as raised:
        datasets.load_npz(path)
    message = str(raised.value)
    assert path in message
    assert 'x_test or test_images' in message
    assert 'y_test or test_labels' in message
    assert 'y_train' not in message.split('(it holds')[0]
    assert "'images'" in message  # What the file does hold.


@pytest.mark.parametrize('arrays, message', [
    (dict(y_train=np.arange(3.0)), 'integer class labels'),
    (dict(y_train=np.array([0, -1, 2])), 'negative'),
    (dict(y_train=np.arange(2)), 'one image per label'),
    (dict(x_test=np.zeros((1, 3, 2))), 'differ in shape'),
])
def test_load_npz_refuses_bad_arrays(tmp_path, arrays, message):
    good = dict(x_train=np.zeros((3, 2, 2)), y_train=np.arange(3),
                x_test=np.zeros((1, 2, 2)), y_test=np.arange(1))
    path = _npz(tmp_path, **dict(good, **arrays))
    with pytest.raises(ValueError, match=message) as raised:
        datasets.load_npz(path)
    assert path in str(raised.value)


def test_load_npz_refuses_pickles_and_other_files(tmp_path):
    objects = np.empty(3, dtype=object)
    path = _npz(tmp_path, x_train=objects, y_train=np.arange(3),
                x_test=objects, y_test=np.arange(3))
    with pytest.raises(ValueError, match='pickled'):
        datasets.load_npz(path)
    npy = str(tmp_path / 'a.npy')
    np.save(npy, np.zeros(3))
    with pytest.raises(ValueError, match='not an .npz'):
        datasets.load_npz(npy)
    text = tmp_path / 'a.txt'
    text.write_text('hello')
    with pytest.raises(ValueError, match=str(text)):
        datasets.load_npz(str(text))
    with pytest.raises(FileNotFoundError, match='missing.npz'):
        datasets.load_npz(str(tmp_path / 'missing.npz'))


def test_importing_the_loaders_does_not_import_tensorflow():
    code = ('import sys, tf_twice.datasets; '
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == 'False'
