"""Image datasets from local files, as numpy arrays (no download, no TF).

Loaders:

* `load_idx(path)`: one file in the idx format of (Fashion-)MNIST, gzipped
  or raw; returns an array of the file's dtype and shape.
* `load_fashion_mnist(path=None)`: Fashion-MNIST from the directory that
  Debian's `dataset-fashion-mnist` package installs
  (`/usr/share/datasets/fashion-mnist`), or `path`, or the directory in the
  environment variable `TF_TWICE_FASHION_MNIST_DIR`; returns
  `((x_train, y_train), (x_test, y_test))`: uint8 images [N, 28, 28] with
  values 0-255 and int32 labels 0-9 (60,000 training and 10,000 test
  examples).
* `load_npz(path)`: any image dataset saved with `numpy.savez` as arrays
  `x_train`, `y_train`, `x_test`, `y_test` (the names of Keras' `mnist.npz`;
  `train_images`, `train_labels`, `test_images`, `test_labels` are accepted
  too); returns `((x_train, y_train), (x_test, y_test))` with the images as
  stored and int32 labels.

Preprocessing must not depend on the private data: scale by constants (e.g.
uint8 / 255) or by statistics of public data. A per-dataset mean and
standard deviation computed on the private training set is itself a release
of that set which no accountant charges; the differential-privacy guarantee
of the training run does not cover it.
"""

from __future__ import annotations

import gzip
import os
from typing import Dict, Mapping, Sequence, Tuple

import numpy as np

__all__ = [
    'DEFAULT_FASHION_MNIST_DIR',
    'FASHION_MNIST_DIR_ENV',
    'FASHION_MNIST_FILES',
    'load_fashion_mnist',
    'load_idx',
    'load_npz',
]

Split = Tuple[np.ndarray, np.ndarray]

DEFAULT_FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_DIR_ENV = 'TF_TWICE_FASHION_MNIST_DIR'
# Base names of the four files; each may also be stored with a .gz suffix.
FASHION_MNIST_FILES = {
    'x_train': 'train-images-idx3-ubyte',
    'y_train': 'train-labels-idx1-ubyte',
    'x_test': 't10k-images-idx3-ubyte',
    'y_test': 't10k-labels-idx1-ubyte',
}
FASHION_MNIST_CLASSES = 10
_FASHION_MNIST_IMAGE_SHAPE = (28, 28)

# idx type codes (third byte of the magic number) and their big-endian dtypes.
_IDX_DTYPES = {
    0x08: np.dtype('>u1'),
    0x09: np.dtype('>i1'),
    0x0B: np.dtype('>i2'),
    0x0C: np.dtype('>i4'),
    0x0D: np.dtype('>f4'),
    0x0E: np.dtype('>f8'),
}
_GZIP_MAGIC = b'\x1f\x8b'

# Accepted array names in an .npz, the first of each tuple preferred.
_NPZ_KEYS = {
    'x_train': ('x_train', 'train_images'),
    'y_train': ('y_train', 'train_labels'),
    'x_test': ('x_test', 'test_images'),
    'y_test': ('y_test', 'test_labels'),
}


def _read_bytes(path: str) -> bytes:
    with open(path, 'rb') as f:
        head = f.read(2)
    # Decide by content, not by name: a renamed file still loads.
    opener = gzip.open if head == _GZIP_MAGIC else open
    try:
        with opener(path, 'rb') as f:
            return f.read()
    except (OSError, EOFError) as e:  # A corrupt or truncated gzip stream.
        raise ValueError(f'{path}: cannot be read as gzip: {e}') from e


def load_idx(path: str) -> np.ndarray:
    """Reads one idx file (gzip or raw) into a native-endian numpy array.

    The idx format: two zero bytes, a type code (0x08 uint8, 0x09 int8,
    0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), the number of
    dimensions, one big-endian uint32 per dimension, then the data,
    big-endian, in C order.

    Raises:
      FileNotFoundError: if `path` does not exist.
      ValueError: naming the file, when the magic number, the type code or
        the dimensions do not match the data.
    """
    data = _read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(
            f'{path}: not an idx file (its magic number must start with two '
            f'zero bytes; got {data[:4].hex() or "an empty file"}).')
    type_code, rank = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(
            f'{path}: unknown idx type code 0x{type_code:02x} (known: '
            f'{", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)}).')
    if rank < 1:
        raise ValueError(f'{path}: an idx file needs >= 1 dimension; the '
                         'header says 0.')
    header_size = 4 + 4 * rank
    if len(data) < header_size:
        raise ValueError(f'{path}: truncated header ({len(data)} bytes for '
                         f'{rank} dimensions).')
    shape = tuple(int(d) for d in
                  np.frombuffer(data, '>u4', count=rank, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_size
    if actual != expected:
        raise ValueError(
            f'{path}: the header says shape {shape} of {dtype.name} '
            f'({expected} bytes of data) but the file holds {actual} bytes '
            '(truncated or not an idx file).')
    array = np.frombuffer(data, dtype, offset=header_size).reshape(shape)
    return array.astype(dtype.newbyteorder('='))


def _fashion_mnist_dir(path: str | None) -> str:
    if path is not None:
        return os.fspath(path)
    return os.environ.get(FASHION_MNIST_DIR_ENV) or DEFAULT_FASHION_MNIST_DIR


def _find_idx_file(directory: str, base: str) -> str | None:
    for name in (base + '.gz', base):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    return None


def _check_split(images: np.ndarray, labels: np.ndarray, image_path: str,
                 label_path: str) -> Split:
    if images.dtype != np.uint8 or images.shape[1:] != (
            _FASHION_MNIST_IMAGE_SHAPE):
        raise ValueError(
            f'{image_path}: expected uint8 images of shape [N, 28, 28]; got '
            f'{images.dtype.name} {images.shape}.')
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f'{label_path}: expected uint8 labels of shape [N]; '
                         f'got {labels.dtype.name} {labels.shape}.')
    if len(labels) != len(images):
        raise ValueError(f'{label_path} holds {len(labels)} labels but '
                         f'{image_path} holds {len(images)} images.')
    if len(labels) and labels.max() >= FASHION_MNIST_CLASSES:
        raise ValueError(f'{label_path}: labels must be 0-9; found '
                         f'{int(labels.max())}.')
    return images, labels.astype(np.int32)


def load_fashion_mnist(path: str | None = None) -> Tuple[Split, Split]:
    """Fashion-MNIST from local idx files.

    Args:
      path: the directory of the four idx files (`train-images-idx3-ubyte`,
        `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
        `t10k-labels-idx1-ubyte`, each gzipped with `.gz` or raw). Default:
        the environment variable `TF_TWICE_FASHION_MNIST_DIR` if set, else
        `/usr/share/datasets/fashion-mnist` (Debian's
        `dataset-fashion-mnist` package).

    Returns:
      `((x_train, y_train), (x_test, y_test))`: uint8 images [N, 28, 28]
      (0-255, not scaled) and int32 labels in 0-9.

    Raises:
      FileNotFoundError: naming the directory searched, the missing files
        and how to get them.
      ValueError: naming the file that is not a valid idx file of
        Fashion-MNIST's shape.
    """
    directory = _fashion_mnist_dir(path)
    found = {key: _find_idx_file(directory, base)
             for key, base in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[k] + '[.gz]' for k, v in found.items()
               if v is None]
    if missing:
        raise FileNotFoundError(
            f'Fashion-MNIST not found in {directory!r}: missing '
            f'{", ".join(missing)}. Install it with `apt-get install '
            'dataset-fashion-mnist` (files in '
            f'{DEFAULT_FASHION_MNIST_DIR}), or pass the directory that holds '
            f'the idx files (the `path` argument, --data_dir, or the '
            f'{FASHION_MNIST_DIR_ENV} environment variable).')
    arrays = {key: load_idx(file) for key, file in found.items()}
    train = _check_split(arrays['x_train'], arrays['y_train'],
                         found['x_train'], found['y_train'])
    test = _check_split(arrays['x_test'], arrays['y_test'], found['x_test'],
                        found['y_test'])
    return train, test


def _pick(arrays: Mapping[str, np.ndarray], names: Sequence[str]):
    for name in names:
        if name in arrays:
            return arrays[name]
    return None


def _labels(labels: np.ndarray, name: str, path: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]  # Keras' CIFAR-10 stores labels as [N, 1].
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f'{path}: {name} must hold integer class labels of '
                         f'shape [N]; got {labels.dtype.name} {labels.shape}.')
    if len(labels) and labels.min() < 0:
        raise ValueError(f'{path}: {name} holds negative labels.')
    return labels.astype(np.int32)


def load_npz(path: str) -> Tuple[Split, Split]:
    """A numpy image dataset saved with `numpy.savez` (or savez_compressed).

    The file must hold x_train, y_train, x_test and y_test (or train_images,
    train_labels, test_images, test_labels). Labels are integer class
    indices of shape [N] (or [N, 1]). Pickled objects are refused (loading a
    pickle can run code).

    Returns:
      `((x_train, y_train), (x_test, y_test))`: the images as stored and
      int32 labels.

    Raises:
      FileNotFoundError: if `path` does not exist.
      ValueError: naming the file and the missing arrays, or the array whose
        shape or dtype is wrong.
    """
    try:
        loaded = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f'npz dataset not found: {path!r}.') from None
    except (ValueError, OSError) as e:
        raise ValueError(f'{path}: cannot be read as an .npz archive: {e}'
                         ) from e
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # A .npy file.
        raise ValueError(f'{path}: not an .npz archive (numpy.savez writes '
                         'one).')
    with loaded as npz:
        try:
            arrays: Dict[str, np.ndarray] = {k: npz[k] for k in npz.files}
        except ValueError as e:  # Object arrays need a pickle.
            raise ValueError(f'{path}: holds pickled objects, which are not '
                             f'loaded: {e}') from e
    picked = {key: _pick(arrays, names) for key, names in _NPZ_KEYS.items()}
    missing = [' or '.join(_NPZ_KEYS[k]) for k, v in picked.items()
               if v is None]
    if missing:
        raise ValueError(
            f'{path}: missing arrays {"; ".join(missing)} (it holds '
            f'{sorted(arrays) or "none"}). Save the dataset with '
            'numpy.savez(path, x_train=..., y_train=..., x_test=..., '
            'y_test=...).')
    splits = []
    for x_key, y_key in (('x_train', 'y_train'), ('x_test', 'y_test')):
        images = picked[x_key]
        labels = _labels(picked[y_key], y_key, path)
        if images.ndim < 2 or len(images) != len(labels):
            raise ValueError(
                f'{path}: {x_key} of shape {images.shape} must hold one '
                f'image per label of {y_key} ({len(labels)} labels).')
        splits.append((images, labels))
    if splits[0][0].shape[1:] != splits[1][0].shape[1:]:
        raise ValueError(
            f'{path}: training and test images differ in shape: '
            f'{splits[0][0].shape[1:]} and {splits[1][0].shape[1:]}.')
    return splits[0], splits[1]
