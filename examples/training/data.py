"""The training script's data: the datasets, their fixed splits, scaling.

`load_data` returns a `Data`: the private training split, a held-out public
split (`--public_examples` training examples, a fixed random subset), a
validation split carved from the private one (`--validation_examples`, for
tuning without looking at the test set) and the test split. With
`--features=scattering` every image is replaced by its ScatterNet
coefficients (`tf_twice.features`: a fixed transform applied to each image
on its own, computed once and cached on disk). Integer images stay uint8 and are scaled to [0, 1] by the
constant 255 where they are used (`to_unit_float`): preprocessing must not
depend on the private data. Nothing is downloaded; a dataset that is not on
this machine raises an error that says how to get it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import datasets

from examples.training import settings

# Held-out test images of the digits split, and the seed of every fixed
# split (independent of --seed, so runs with different seeds see the same
# data).
DIGITS_TEST_EXAMPLES = 360
SPLIT_SEED = 0


@dataclasses.dataclass
class Data:
    """Splits of one dataset; images are float32 in [0, 1] or uint8."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    x_validation: Optional[np.ndarray] = None
    y_validation: Optional[np.ndarray] = None

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(int(s) for s in self.x_train.shape[1:])


def _tfds_arrays(dataset: tf.data.Dataset) -> Tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for x, y in dataset.batch(4096).as_numpy_iterator():
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ValueError('the dataset split is empty.')
    return np.concatenate(xs), np.concatenate(ys).astype(np.int32)


def _load_digits() -> Tuple[Tuple[np.ndarray, np.ndarray],
                            Tuple[np.ndarray, np.ndarray], int]:
    # pylint: disable-next=g-import-not-at-top
    from sklearn import datasets as sklearn_datasets
    digits = sklearn_datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    test, train = order[:DIGITS_TEST_EXAMPLES], order[DIGITS_TEST_EXAMPLES:]
    return (x[train], y[train]), (x[test], y[test]), 10


def _image_batch(x: np.ndarray, source: str) -> np.ndarray:
    """[N, H, W] or [N, H, W, C] images; a missing channel axis is added.

    Integer images must hold 0-255 and are kept as uint8 (`to_unit_float`
    divides by the constant 255 where they are used); float images are used
    as stored, so they must already be scaled by data-independent constants.
    """
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise ValueError(f'{source}: images must have shape [N, height, '
                         f'width] or [N, height, width, channels]; got '
                         f'{x.shape}.')
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f'{source}: integer images must hold values '
                             '0-255 (they are divided by 255).')
        return x.astype(np.uint8)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f'{source}: images must be integer (0-255) or '
                         f'float; got {x.dtype.name}.')
    return x.astype(np.float32)


def _load_fashion_mnist(data_dir: Optional[str]):
    (x, y), (x_test, y_test) = datasets.load_fashion_mnist(data_dir)
    return ((x[..., None], y), (x_test[..., None], y_test),
            datasets.FASHION_MNIST_CLASSES)


def _load_npz(path: str):
    (x, y), (x_test, y_test) = datasets.load_npz(path)
    x, x_test = _image_batch(x, path), _image_batch(x_test, path)
    # Classes: the largest label + 1. It sets the model's output size and
    # is taken as part of the task's definition, not as private data.
    num_classes = max(2, int(max(y.max(initial=0), y_test.max(initial=0))) + 1)
    return (x, y), (x_test, y_test), num_classes


class DataUnavailableError(ValueError):
    """The dataset is not on this machine; the message says how to get it."""


def _tfds_offline_help(name: str) -> str:
    return (
        f'This script never downloads: prepare {name} beforehand and pass '
        'its directory with --data_dir=DIR. Either run\n'
        '  python -c "import tensorflow_datasets as tfds; '
        f"tfds.builder('{name}', data_dir='DIR').download_and_prepare()\"\n"
        'on a machine with network access and copy DIR here, or copy the '
        'source files listed in tensorflow_datasets/url_checksums/'
        f'{name}.txt (same names and checksums) into DIR/downloads/manual/ '
        'and run the same command here (tensorflow-datasets then reads them '
        'instead of downloading; tensorflow-datasets 4.9.9 needs the '
        'importlib_resources package to prepare). Or save the dataset as an '
        '.npz with arrays x_train, y_train, x_test, y_test and run with '
        '--dataset=npz --data_path=FILE.')


def _load_tfds(name: str, data_dir: Optional[str]):
    try:
        # pylint: disable-next=g-import-not-at-top
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataUnavailableError(
            f'--dataset={name} needs tensorflow-datasets, which does not '
            f'import: {e}.\n{_tfds_offline_help(name)}') from e
    try:
        # download=False: without network a download only ends in a
        # connection error after retries; a missing copy fails at once.
        (train, test), info = tfds.load(name, split=['train', 'test'],
                                        as_supervised=True, with_info=True,
                                        data_dir=data_dir, download=False)
    except (AssertionError, OSError, ImportError) as e:
        raise DataUnavailableError(
            f'--dataset={name}: no prepared copy was found ({e})\n'
            f'{_tfds_offline_help(name)}') from e
    num_classes = int(info.features['label'].num_classes)
    return _tfds_arrays(train), _tfds_arrays(test), num_classes


def _scattering(x: np.ndarray, name: str) -> np.ndarray:
    """ScatterNet features of images [N, H, W, C] (uint8 or [0, 1])."""
    try:
        # pylint: disable-next=g-import-not-at-top
        from tf_twice import features
        return features.cached_scattering(x, name=name)
    except ImportError as e:
        raise DataUnavailableError(f'--features=scattering: {e}') from e


def load_data(dataset: str = 'digits', *, public_examples: int = 0,
              data_dir: Optional[str] = None,
              data_path: Optional[str] = None, features: str = 'none',
              validation_examples: int = 0) -> Data:
    """Loads `dataset` and holds out `public_examples` training examples.

    Args:
      dataset: one of settings.DATASETS. 'digits' comes with scikit-learn
        (float32 in [0, 1]). 'fashion_mnist' reads the idx files of Debian's
        `dataset-fashion-mnist` package (or `data_dir`) with
        `tf_twice.datasets`; 'npz' reads `data_path`
        (`tf_twice.datasets.load_npz`); the others are read with
        tensorflow-datasets (`as_supervised=True`) from a copy prepared
        beforehand. Integer images are kept as uint8 and scaled to [0, 1] by
        the constant 255 (`to_unit_float`) where they are used; a missing
        channel axis is added.
      public_examples: training examples moved to the public split (a
        fixed random subset); they are not part of `x_train`.
      data_dir: the Fashion-MNIST directory, or the tensorflow-datasets data
        directory.
      data_path: the .npz file of `dataset='npz'`.
      features: 'none' (the images) or 'scattering' (their ScatterNet
        coefficients, float32 [N, H/4, W/4, 81 C], from the training and
        test images before any split, cached on disk by
        `tf_twice.features.cached_scattering`).
      validation_examples: private training examples moved to the
        validation split (a fixed random subset, the same for every seed);
        they are not part of `x_train`.

    Raises:
      ValueError: an unknown dataset, `public_examples` out of range, or
        data that cannot be read.
      DataUnavailableError: (a ValueError) a tensorflow-datasets dataset
        that is not prepared here; the message says how to prepare it.
      FileNotFoundError: Fashion-MNIST or the .npz file is missing; the
        message says how to get it.
    """
    settings.check_choice('dataset', dataset, settings.DATASETS)
    settings.check_choice('features', features, settings.FEATURES)
    public_examples = settings.check_integer('public_examples',
                                             public_examples, 0)
    validation_examples = settings.check_integer(
        'validation_examples', validation_examples, 0)
    if dataset == 'digits':
        (x, y), (x_test, y_test), num_classes = _load_digits()
    elif dataset == 'fashion_mnist':
        (x, y), (x_test, y_test), num_classes = _load_fashion_mnist(data_dir)
    elif dataset == 'npz':
        if data_path is None:
            raise settings.flag_error(
                'data_path', 'an .npz file for --dataset=npz', data_path)
        (x, y), (x_test, y_test), num_classes = _load_npz(data_path)
    else:
        (x, y), (x_test, y_test), num_classes = _load_tfds(dataset, data_dir)
    if public_examples + validation_examples >= len(x):
        raise settings.flag_error(
            'public_examples', f'smaller than the {len(x)} training examples '
            f'less --validation_examples={validation_examples}',
            public_examples)
    if features == 'scattering':
        x = _scattering(x, f'{dataset}-train')
        x_test = _scattering(x_test, f'{dataset}-test')
    order = np.random.default_rng(SPLIT_SEED + 1).permutation(len(x))
    public, private = order[:public_examples], order[public_examples:]
    # The validation split comes from the private examples with its own
    # fixed order, so the public split is the same with or without it.
    private = np.random.default_rng(SPLIT_SEED + 2).permutation(private)
    validation = np.sort(private[:validation_examples])
    private = np.sort(private[validation_examples:])
    return Data(x_train=x[private], y_train=y[private], x_public=x[public],
                y_public=y[public], x_test=x_test, y_test=y_test,
                num_classes=num_classes, x_validation=x[validation],
                y_validation=y[validation])


# Not converted by autograph: the branches are Python-level dtype checks.
@tf.autograph.experimental.do_not_convert
def to_unit_float(x):
    """uint8 images to float32 in [0, 1]; float images unchanged."""
    if isinstance(x, np.ndarray):
        if np.issubdtype(x.dtype, np.integer):
            return x.astype(np.float32) / 255.0
        return x.astype(np.float32)
    if x.dtype.is_integer:
        return tf.cast(x, tf.float32) / 255.0
    return tf.cast(x, tf.float32)


@tf.autograph.experimental.do_not_convert
def preprocess(x, y):
    """(images, labels) with the images in [0, 1] (`to_unit_float`)."""
    return to_unit_float(x), y
