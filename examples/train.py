r"""Trains an image classifier with DP-SGD, twice sampling or hybrid clipping.

Modes (`--mode`):

* `nonprivate`: plain Keras `fit` on shuffled fixed-size batches. No
  privacy claim is made.
* `dpsgd`: standard DP-SGD with Poisson sampling: every step samples each
  training example with probability q1, clips its gradient to l2 norm
  `--l2_norm_clip` and adds Gaussian noise (`tf_twice.keras.DPModel` with
  coordinate sampling rate q2 = 1 and no l-infinity clip).
* `twice`: twice sampling: as `dpsgd`, plus an l-infinity clip of every
  coordinate (`--linf_norm_clip`, or `--d0` with c_inf = c2 / sqrt(d0)) and
  coordinate sampling: each coordinate of each sampled example's clipped
  gradient is kept with probability q2 (`--coordinate_sampling_rate`).
* `hybrid`: twice sampling with hybrid clipping: the gradient space is split
  into principal blocks of a basis learned from a held-out PUBLIC split of
  the training data (`--public_examples`, `--ranks`, `--parameter_groups`;
  relearned at the current weights every `--basis_refresh_steps` steps) plus
  the residual. Each block gets its own l2 budget (the global
  `--l2_norm_clip` split by the mean public projection norms), l-infinity
  clip (the residual as in `twice`, principal blocks per `--principal_d0`)
  and noise multiplier (optimised for `--target_epsilon`).

Defaults (they finish in well under a minute on two CPU cores): twice
sampling on digits with the small CNN, target epsilon 4, expected batch 128,
q2 = 0.5, c2 = 1, d0 = 100, 40 epochs, SGD with learning rate 0.5.

Privacy: the private modes feed Poisson-sampled logical batches
(`tf_twice.sampling.poisson_batches`) to the model, and a
`tf_twice.keras.PrivacyLedger` accounts for every step that runs. With
`--target_epsilon` the noise is calibrated (`tf_twice.accounting`) so that
the planned `--steps` (or `--epochs`) meet (epsilon, delta), and the ledger
stops training before the budget would be exceeded; `--noise_multiplier`
sets the noise directly instead. At the end the script prints the privacy
statement for the steps taken (`compute_twice_sampling_privacy_statement`)
next to the ledger's epsilon (they agree), and the test accuracy.

Seeds: `--seed` makes a run reproducible (weights, sampling, masks and
noise). A noise stream whose seed is known can be recomputed and subtracted,
so a seeded run is for experiments only; leave `--seed` unset (OS entropy)
for a release that relies on the guarantee.

Checkpoints: with `--checkpoint_dir` the model and its optimizer are saved
after every epoch (`ckpt.weights.h5`, the Keras weights format that Keras 2
and Keras 3 both read and write; written to a temporary file that then
replaces the previous checkpoint, so a crash mid-save keeps the last one
whole; it holds no random state, so the noise cannot be recomputed from
it; a resumed run draws fresh masks and noise, also with `--seed`, whose
stream depends on the restored weights), the ledger's state file
`privacy_ledger.json` is kept beside them (written before the checkpoint,
and ahead of the steps), and `run.json` records the run's kind (and, for
hybrid, its per-block clips and noise).
Running the same command again resumes: it restores the latest checkpoint,
continues the ledger (privacy already spent is never reset; steps of a
changed setting are composed with the earlier ones) and trains the steps
that remain of the plan (planned minus those the ledger charged). Hybrid runs
relearn the basis from the public split at the restored weights (bases are
not checkpointed). A directory of another mode, dataset, model or public
split, or a checkpoint without its ledger, is refused.

Data: `--dataset=digits` (default) is scikit-learn's 8x8 digits, shipped with
scikit-learn (no download): 1,797 images scaled to [0, 1], a fixed split of
360 test images, the rest for training. `fashion_mnist` reads the idx files
of Debian's `dataset-fashion-mnist` package (`apt-get install
dataset-fashion-mnist`; another directory with `--data_dir`): 60,000
training and 10,000 test images. `npz` reads any image dataset saved with
`numpy.savez` as x_train, y_train, x_test, y_test (`--data_path`).
`cifar10`, `svhn_cropped` and `mnist` are read with tensorflow-datasets from
a copy prepared beforehand (`--data_dir`; nothing is downloaded, the error
says how to prepare one). Integer images are scaled to [0, 1] by the
constant 255 and a missing channel axis is added: preprocessing must not
depend on the private data. `--public_examples` examples of the training
split (a fixed random subset) are held out as public data and excluded from
the private set.

Console: TensorFlow's C++ log is hidden unless TF_CPP_MIN_LOG_LEVEL is set,
and a few known TensorFlow/Keras notes (KNOWN_NOISE) are dropped; every
other warning, the privacy ledger's included, is shown.

Run (the default: twice sampling on digits at epsilon 4):

  python examples/train.py
  python examples/train.py --mode=dpsgd --target_epsilon=2 --epochs=20
  python examples/train.py --mode=hybrid --ranks=16 --public_examples=200
  python examples/train.py --dataset=fashion_mnist --model=tanh_cnn \
      --batch_size=2048 --steps=600 --learning_rate=4 --momentum=0.9 \
      --l2_norm_clip=0.1 --target_epsilon=3
  python examples/train.py --dataset=npz --data_path=my_images.npz
  python examples/train.py --dataset=cifar10 --batch_size=500 \
      --coordinate_sampling_rate=0.5 --d0=100 --model=resnet22 --steps=2500
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from absl import app
from absl import flags
import numpy as np

# TensorFlow's C++ start-up log (CUDA plug-in registration, CPU features,
# TensorRT, XLA stream notes) tells a user of this script nothing. The level
# must be set before TensorFlow is imported; a level the user has set is kept
# (TF_CPP_MIN_LOG_LEVEL=0 shows everything, e.g. to diagnose a GPU set-up).
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_twice
from tf_twice import accounting
from tf_twice import datasets
from tf_twice import models
from tf_twice import sampling
from tf_twice.hybrid import budgets as hybrid_budgets
from tf_twice.keras import DPModel
from tf_twice.keras import PrivacyLedger
from tf_twice.mechanism import basis as basis_lib

MODES = ('nonprivate', 'dpsgd', 'twice', 'hybrid')
PRIVATE_MODES = ('dpsgd', 'twice', 'hybrid')
DATASETS = ('digits', 'fashion_mnist', 'npz', 'cifar10', 'svhn_cropped',
            'mnist')
OPTIMIZERS = ('sgd', 'adam')
# Held-out test images of the digits split, and the seed of every fixed
# split (independent of --seed, so runs with different seeds see the same
# data).
DIGITS_TEST_EXAMPLES = 360
SPLIT_SEED = 0
# Used when neither --target_epsilon nor --noise_multiplier is given.
DEFAULT_TARGET_EPSILON = 4.0
DEFAULT_BATCH_SIZE = 128
DEFAULT_EPOCHS = 40
DEFAULT_COORDINATE_SAMPLING_RATE = 0.5
DEFAULT_D0 = 100.0
DEFAULT_PUBLIC_EXAMPLES = 200
DEFAULT_RANKS = (16,)
LEDGER_FILENAME = 'privacy_ledger.json'
# Keras's weights format (optimizer state included) on Keras 2 and 3.
CHECKPOINT_NAME = 'ckpt.weights.h5'
_CHECKPOINT_TEMPORARY = 'ckpt.saving.weights.h5'
RUN_FILENAME = 'run.json'
# Flags that must not change when a run is resumed from --checkpoint_dir.
_RESUME_KEYS = ('mode', 'dataset', 'data_path', 'model', 'public_examples')
# Log messages of TensorFlow and Keras that say nothing to a user of this
# script: vectorized_map's note that one gradient op falls back to a loop
# (it still gives per-example gradients), and Keras' timing note that the
# script's own callbacks (the ledger charges every step on the host) take
# longer than a small batch. Every other message is kept.
KNOWN_NOISE = (
    'uses a while_loop. Fix that!',
    'is slow compared to the batch time',
)


@dataclasses.dataclass
class TrainConfig:
    """The settings of one run; one field per command-line flag.

    `None` means "the documented default" (resolved by `resolve_plan`).
    """

    mode: str = 'twice'
    dataset: str = 'digits'
    data_dir: Optional[str] = None
    data_path: Optional[str] = None
    model: str = 'small_cnn'
    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    delta: Optional[float] = None
    example_sampling_rate: Optional[float] = None
    batch_size: Optional[float] = None
    coordinate_sampling_rate: Optional[float] = None
    l2_norm_clip: float = 1.0
    linf_norm_clip: Optional[float] = None
    d0: Optional[float] = None
    principal_d0: float = 1.0
    epochs: Optional[float] = None
    steps: Optional[int] = None
    physical_batch_size: int = 64
    learning_rate: float = 0.5
    momentum: float = 0.0
    optimizer: str = 'sgd'
    public_examples: Optional[int] = None
    ranks: Optional[Sequence[int]] = None
    parameter_groups: int = 1
    basis_refresh_steps: int = 20
    checkpoint_dir: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    seed: Optional[int] = None
    verbose: int = 1

    @classmethod
    def from_object(cls, config: Any) -> 'TrainConfig':
        """A TrainConfig from a TrainConfig, a mapping or flags-like object.

        Missing fields take their defaults; unknown mapping keys are refused.
        """
        if isinstance(config, cls):
            return dataclasses.replace(config)
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(names))
            if unknown:
                raise ValueError(f'unknown settings {unknown}; allowed: '
                                 f'{names}.')
            return cls(**dict(config))
        values = {}
        for name in names:
            if hasattr(config, name):
                values[name] = getattr(config, name)
        return cls(**values)


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

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(int(s) for s in self.x_train.shape[1:])


@dataclasses.dataclass
class Plan:
    """The resolved mechanism and schedule of a run.

    For hybrid mode the clip and noise fields hold one value per block
    (principal blocks first, the residual last); they are set by
    `build_run` once the basis is learned.
    """

    mode: str
    num_examples: int
    delta: Optional[float]
    example_sampling_rate: float
    expected_batch_size: float
    coordinate_sampling_rate: float
    l2_norm_clip: Any
    linf_norm_clip: Any
    d0: Optional[float]
    noise_multiplier: Any
    target_epsilon: Optional[float]
    steps_per_epoch: int
    planned_steps: int
    ranks: Tuple[int, ...] = ()
    block_dimensions: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass
class Run:
    """What `build_run` prepares and `train` executes."""

    config: TrainConfig
    plan: Plan
    data: Data
    model: tf.keras.Model
    inner_model: tf.keras.Model
    dataset: tf.data.Dataset
    callbacks: List[tf.keras.callbacks.Callback]
    ledger: Optional[PrivacyLedger]
    done_steps: int
    remaining_steps: int
    steps_per_iteration: int
    epochs: int
    checkpoint_path: Optional[str]
    basis_refresh: Any = None


# --- argument checks ----------------------------------------------------


def _flag_error(flag: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f'--{flag} must be {allowed}; got {value!r}.')


def _number(flag: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _flag_error(flag, 'a number', value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _flag_error(flag, 'a number', value) from None
    if math.isnan(number):
        raise _flag_error(flag, 'a number', value)
    return number


def _positive(flag: str, value: Any, *, finite: bool = True) -> float:
    number = _number(flag, value)
    if not number > 0 or (finite and math.isinf(number)):
        raise _flag_error(flag, 'a finite number > 0', value)
    return number


def _integer(flag: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _flag_error(flag, f'an integer >= {low}', value)
    if value < low:
        raise _flag_error(flag, f'an integer >= {low}', value)
    return int(value)


def _choice(flag: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise _flag_error(flag, f'one of {", ".join(allowed)}', value)
    return value


def _parse_ranks(ranks: Any) -> Tuple[int, ...]:
    if ranks is None:
        return DEFAULT_RANKS
    if isinstance(ranks, str):
        ranks = [r for r in ranks.split(',') if r.strip()]
    try:
        parsed = tuple(int(str(r).strip()) for r in ranks)
    except (TypeError, ValueError):
        raise _flag_error('ranks', 'a comma-separated list of integers >= 1',
                          ranks) from None
    if not parsed or min(parsed) < 1:
        raise _flag_error('ranks', 'a comma-separated list of integers >= 1',
                          ranks)
    return parsed


def check_config(config: Any) -> TrainConfig:
    """Checks what can be checked before the data is loaded.

    Returns:
      The config as a `TrainConfig`.

    Raises:
      ValueError: naming the flag and its allowed range.
    """
    config = TrainConfig.from_object(config)
    _choice('mode', config.mode, MODES)
    _choice('dataset', config.dataset, DATASETS)
    if (config.dataset == 'npz') != (config.data_path is not None):
        raise _flag_error('data_path', 'the .npz file to read for '
                          '--dataset=npz, and unset for other datasets',
                          config.data_path)
    _choice('model', config.model, tuple(sorted(models.MODELS)))
    _choice('optimizer', config.optimizer, OPTIMIZERS)
    private = config.mode in PRIVATE_MODES
    if config.target_epsilon is not None and (
            config.noise_multiplier is not None):
        raise ValueError('give exactly one of --target_epsilon and '
                         '--noise_multiplier (the noise is calibrated to the '
                         'target, or set directly); got both.')
    if not private and (config.target_epsilon is not None
                        or config.noise_multiplier is not None
                        or config.delta is not None):
        raise ValueError(
            '--mode=nonprivate makes no privacy claim; --target_epsilon, '
            '--noise_multiplier and --delta apply only to the modes '
            f'{", ".join(PRIVATE_MODES)}.')
    if config.target_epsilon is not None:
        _positive('target_epsilon', config.target_epsilon)
    if config.noise_multiplier is not None:
        _positive('noise_multiplier', config.noise_multiplier)
    if config.delta is not None:
        delta = _number('delta', config.delta)
        if not 0.0 < delta < 1.0:
            raise _flag_error('delta', 'in (0, 1)', config.delta)
    if config.example_sampling_rate is not None and (
            config.batch_size is not None):
        raise ValueError('give at most one of --example_sampling_rate (q1) '
                         'and --batch_size (the expected batch size n * q1); '
                         'got both.')
    if config.example_sampling_rate is not None:
        q1 = _number('example_sampling_rate', config.example_sampling_rate)
        if not 0.0 < q1 <= 1.0:
            raise _flag_error('example_sampling_rate', 'in (0, 1]',
                              config.example_sampling_rate)
    if config.batch_size is not None:
        _positive('batch_size', config.batch_size)
    q2 = config.coordinate_sampling_rate
    if q2 is not None:
        q2 = _number('coordinate_sampling_rate', q2)
        if not 0.0 < q2 <= 1.0:
            raise _flag_error('coordinate_sampling_rate', 'in (0, 1]',
                              config.coordinate_sampling_rate)
        if config.mode in ('dpsgd', 'nonprivate') and q2 != 1.0:
            raise _flag_error(
                'coordinate_sampling_rate',
                f'1 (or unset) for --mode={config.mode}; use --mode=twice '
                'for coordinate sampling', config.coordinate_sampling_rate)
    _positive('l2_norm_clip', config.l2_norm_clip)
    if config.linf_norm_clip is not None and config.d0 is not None:
        raise ValueError('give at most one of --linf_norm_clip and --d0 '
                         '(c_inf = l2_norm_clip / sqrt(d0)); got both.')
    if config.mode in ('dpsgd', 'nonprivate') and (
            config.linf_norm_clip is not None or config.d0 is not None):
        raise ValueError(f'--mode={config.mode} has no l-infinity clip; '
                         '--linf_norm_clip and --d0 apply to --mode=twice '
                         'and --mode=hybrid.')
    if config.linf_norm_clip is not None:
        _positive('linf_norm_clip', config.linf_norm_clip)
    if config.d0 is not None:
        if _number('d0', config.d0) < 1.0 or math.isinf(float(config.d0)):
            raise _flag_error('d0', 'a finite number >= 1', config.d0)
    if _number('principal_d0', config.principal_d0) < 1.0 or math.isinf(
            float(config.principal_d0)):
        raise _flag_error('principal_d0', 'a finite number >= 1',
                          config.principal_d0)
    if config.epochs is not None and config.steps is not None:
        raise ValueError('give at most one of --epochs and --steps; got '
                         'both.')
    if config.epochs is not None:
        _positive('epochs', config.epochs)
    if config.steps is not None:
        _integer('steps', config.steps, 1)
    _integer('physical_batch_size', config.physical_batch_size, 1)
    _positive('learning_rate', config.learning_rate)
    momentum = _number('momentum', config.momentum)
    if not 0.0 <= momentum < 1.0:
        raise _flag_error('momentum', 'in [0, 1)', config.momentum)
    if config.public_examples is not None:
        _integer('public_examples', config.public_examples, 0)
    if config.mode == 'hybrid':
        if config.public_examples is not None and (
                config.public_examples < 1):
            raise _flag_error('public_examples',
                              'an integer >= 1 for --mode=hybrid',
                              config.public_examples)
        config.ranks = _parse_ranks(config.ranks)
    elif config.ranks is not None:
        config.ranks = _parse_ranks(config.ranks)
    _integer('parameter_groups', config.parameter_groups, 1)
    _integer('basis_refresh_steps', config.basis_refresh_steps, 0)
    if config.seed is not None:
        _integer('seed', config.seed, 0)
    _integer('verbose', config.verbose, 0)
    return config


def default_delta(num_examples: int) -> float:
    """1 / n rounded down to a power of ten, and at most 1e-5."""
    return min(1e-5, 10.0 ** math.floor(math.log10(1.0 / num_examples)))


# --- data ---------------------------------------------------------------


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
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
    digits = datasets.load_digits()
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
        'importlib_resources package to prepare). Or save the dataset as an .npz with arrays x_train, '
        'y_train, x_test, y_test and run with --dataset=npz '
        '--data_path=FILE.')


def _load_tfds(name: str, data_dir: Optional[str]):
    try:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
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


def load_data(dataset: str = 'digits', *, public_examples: int = 0,
              data_dir: Optional[str] = None,
              data_path: Optional[str] = None) -> Data:
    """Loads `dataset` and holds out `public_examples` training examples.

    Args:
      dataset: one of DATASETS. 'digits' comes with scikit-learn (float32 in
        [0, 1]). 'fashion_mnist' reads the idx files of Debian's
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

    Raises:
      ValueError: an unknown dataset, `public_examples` out of range, or
        data that cannot be read.
      DataUnavailableError: (a ValueError) a tensorflow-datasets dataset
        that is not prepared here; the message says how to prepare it.
      FileNotFoundError: Fashion-MNIST or the .npz file is missing; the
        message says how to get it.
    """
    _choice('dataset', dataset, DATASETS)
    public_examples = _integer('public_examples', public_examples, 0)
    if dataset == 'digits':
        (x, y), (x_test, y_test), num_classes = _load_digits()
    elif dataset == 'fashion_mnist':
        (x, y), (x_test, y_test), num_classes = _load_fashion_mnist(data_dir)
    elif dataset == 'npz':
        if data_path is None:
            raise _flag_error('data_path', 'an .npz file for --dataset=npz',
                              data_path)
        (x, y), (x_test, y_test), num_classes = _load_npz(data_path)
    else:
        (x, y), (x_test, y_test), num_classes = _load_tfds(dataset, data_dir)
    if public_examples >= len(x):
        raise _flag_error('public_examples',
                          f'smaller than the {len(x)} training examples',
                          public_examples)
    order = np.random.default_rng(SPLIT_SEED + 1).permutation(len(x))
    public, private = order[:public_examples], np.sort(
        order[public_examples:])
    return Data(x_train=x[private], y_train=y[private], x_public=x[public],
                y_public=y[public], x_test=x_test, y_test=y_test,
                num_classes=num_classes)


# Not converted by autograph: only Python-level dtype checks, and converted
# functions are cached by code identity, which a copy of this script loaded
# again (the tests, the accuracy study) can alias after garbage collection.
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
def _preprocess(x, y):
    return to_unit_float(x), y


# --- the plan -----------------------------------------------------------


def _num_epochs_for_steps(n: int, batch_size: float, steps: int) -> float:
    """Epochs e with ceil(e * n / batch_size) == steps (the statement's
    step count), despite floating-point rounding."""
    epochs = steps * batch_size / n
    while math.ceil(epochs * n / batch_size) > steps:
        epochs = math.nextafter(epochs, 0.0)
    while math.ceil(epochs * n / batch_size) < steps:
        epochs = math.nextafter(epochs, math.inf)
    return epochs


def resolve_plan(config: TrainConfig, num_examples: int) -> Plan:
    """Sampling rates, clips, schedule and (single-block) noise of a run.

    Hybrid mode gets per-block clips and noise later, from the basis.

    Raises:
      ValueError: naming the flag, e.g. a batch size above n or a target
        epsilon that no noise multiplier reaches.
    """
    n = int(num_examples)
    if config.batch_size is not None:
        if float(config.batch_size) > n:
            raise _flag_error('batch_size', f'in (0, {n}] (the private '
                              'training examples)', config.batch_size)
        batch = float(config.batch_size)
    elif config.example_sampling_rate is not None:
        batch = float(config.example_sampling_rate) * n
    else:
        batch = float(min(DEFAULT_BATCH_SIZE, n))
    q1 = batch / n
    if config.mode == 'nonprivate':
        steps_per_epoch = int(math.ceil(n / batch))
    else:
        steps_per_epoch = sampling.poisson_schedule(
            n, expected_batch_size=batch).steps_per_epoch
    if config.steps is not None:
        planned = int(config.steps)
    else:
        epochs = DEFAULT_EPOCHS if config.epochs is None else config.epochs
        planned = max(1, int(math.ceil(float(epochs) * steps_per_epoch)))
    private = config.mode in PRIVATE_MODES
    if config.mode in ('twice', 'hybrid'):
        q2 = (DEFAULT_COORDINATE_SAMPLING_RATE
              if config.coordinate_sampling_rate is None
              else float(config.coordinate_sampling_rate))
    else:
        q2 = 1.0
    c2 = float(config.l2_norm_clip)
    d0 = None
    c_inf = None
    if config.mode in ('twice', 'hybrid'):
        if config.linf_norm_clip is not None:
            c_inf = float(config.linf_norm_clip)
        else:
            d0 = DEFAULT_D0 if config.d0 is None else float(config.d0)
            c_inf = c2 / math.sqrt(d0)
    delta = None
    target = None
    z = None
    if private:
        delta = (default_delta(n) if config.delta is None
                 else float(config.delta))
        if config.noise_multiplier is not None:
            z = float(config.noise_multiplier)
        else:
            target = (DEFAULT_TARGET_EPSILON if config.target_epsilon is None
                      else float(config.target_epsilon))
            if config.mode != 'hybrid':
                z = _calibrate(target, delta, planned, q1, q2, c2, c_inf)
    return Plan(mode=config.mode, num_examples=n, delta=delta,
                example_sampling_rate=q1, expected_batch_size=batch,
                coordinate_sampling_rate=q2, l2_norm_clip=c2,
                linf_norm_clip=c_inf, d0=d0, noise_multiplier=z,
                target_epsilon=target, steps_per_epoch=steps_per_epoch,
                planned_steps=planned,
                ranks=(tuple(config.ranks) if config.mode == 'hybrid'
                       else ()))


def _calibrate(target, delta, steps, q1, q2, c2, c_inf) -> float:
    try:
        return accounting.calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, steps=steps,
            example_sampling_rate=q1, coordinate_sampling_rate=q2,
            l2_norm_clip=c2, linf_norm_clip=c_inf)
    except ValueError as e:
        raise ValueError(f'--target_epsilon={target:g} cannot be met: {e}'
                         ) from e


# --- building the run ---------------------------------------------------


def _optimizer(config: TrainConfig) -> tf.keras.optimizers.Optimizer:
    if config.optimizer == 'adam':
        return tf.keras.optimizers.Adam(config.learning_rate)
    return tf.keras.optimizers.SGD(config.learning_rate,
                                   momentum=config.momentum)


def _loss() -> tf.keras.losses.Loss:
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _build_inner_model(config: TrainConfig, data: Data) -> tf.keras.Model:
    kwargs: Dict[str, Any] = dict(input_shape=data.input_shape,
                                  num_classes=data.num_classes)
    if config.model == 'small_cnn':
        # 'valid' convolutions need 10x10 inputs; 8x8 digits need 'same'.
        kwargs['padding'] = ('same' if min(data.input_shape[:2]) < 10
                             else 'valid')
    return models.build_model(config.model, **kwargs)


def _read_run_file(checkpoint_dir: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(checkpoint_dir, RUN_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _check_resume(config: TrainConfig, checkpoint_dir: str,
                  has_checkpoint: bool, has_ledger: bool) -> None:
    """Refuses to resume a run of another kind, or one without a ledger."""
    previous = _read_run_file(checkpoint_dir)
    if previous is not None:
        for key in _RESUME_KEYS:
            if previous.get(key) != getattr(config, key):
                raise ValueError(
                    f'--checkpoint_dir={checkpoint_dir!r} holds a run with '
                    f'--{key}={previous.get(key)!r}; resuming it needs the '
                    f'same value (got {getattr(config, key)!r}), or use a new '
                    '--checkpoint_dir.')
    if not has_checkpoint and tf.train.latest_checkpoint(checkpoint_dir):
        raise ValueError(
            f'--checkpoint_dir={checkpoint_dir!r} holds a TensorFlow-format '
            f'checkpoint; this version saves and resumes {CHECKPOINT_NAME} '
            '(Keras 3 cannot read the older format). Resume it with the '
            'version that wrote it, or use a new --checkpoint_dir.')
    if (config.mode in PRIVATE_MODES and has_checkpoint and not has_ledger):
        raise ValueError(
            f'--checkpoint_dir={checkpoint_dir!r} holds a checkpoint but no '
            f'{LEDGER_FILENAME}: the privacy spent on its steps is unknown, '
            'so it cannot be resumed as a private run. Use a new '
            '--checkpoint_dir.')


def _write_run_file(config: TrainConfig, plan: Plan,
                    checkpoint_dir: str) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    record: Dict[str, Any] = {key: getattr(config, key)
                              for key in _RESUME_KEYS}
    record['planned_steps'] = plan.planned_steps
    if plan.mode == 'hybrid':
        record['hybrid'] = dict(
            settings=_hybrid_record(config, plan),
            l2_norm_clip=list(plan.l2_norm_clip),
            linf_norm_clip=list(plan.linf_norm_clip),
            noise_multiplier=list(plan.noise_multiplier))
    with open(os.path.join(checkpoint_dir, RUN_FILENAME), 'w') as f:
        json.dump(record, f, indent=1, sort_keys=True)


class _EpochCheckpoint(tf.keras.callbacks.Callback):
    """Saves the weights and optimizer state after every epoch, atomically.

    Keras writes a temporary file in the same directory, which is synced
    and then replaces the checkpoint (``os.replace``): a crash mid-save
    leaves the previous checkpoint whole. List it after the ledger, which
    writes its state first.
    """

    def __init__(self, path: str):
        super().__init__()
        self._path = path
        self._temporary = os.path.join(os.path.dirname(path),
                                       _CHECKPOINT_TEMPORARY)

    def on_epoch_end(self, epoch, logs=None):
        self.model.save_weights(self._temporary)
        with open(self._temporary, 'rb+') as f:
            os.fsync(f.fileno())
        os.replace(self._temporary, self._path)


class _StopAfterSteps(tf.keras.callbacks.Callback):
    """Stops `fit` after a number of steps (mid-epoch if needed)."""

    def __init__(self, steps: int):
        super().__init__()
        self._steps = steps
        self._seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self._seen >= self._steps:
            self.model.stop_training = True


def _per_example_loss() -> tf.keras.losses.Loss:
    return tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')


def _basis_kwargs(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    groups = config.parameter_groups
    return dict(ranks=plan.ranks, groups=None if groups == 1 else groups)


def _hybrid_record(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    """What determines the per-block clips and noise of a hybrid run.

    Never the seed: run.json lies beside the checkpoints, and a seed
    recomputes the initial weights, the sampling, the masks and the noise.
    (Clips and noise from public data only, so reusing them under another
    seed keeps the guarantee.)
    """
    return dict(
        l2_norm_clip=float(config.l2_norm_clip),
        linf_norm_clip=config.linf_norm_clip, d0=plan.d0,
        principal_d0=float(config.principal_d0),
        ranks=list(plan.ranks), parameter_groups=config.parameter_groups,
        target_epsilon=plan.target_epsilon,
        noise_multiplier=config.noise_multiplier, delta=plan.delta,
        example_sampling_rate=plan.example_sampling_rate,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        planned_steps=plan.planned_steps, public_examples=int(
            config.public_examples))


def _learn_public_basis(config: TrainConfig, plan: Plan, data: Data,
                        inner: tf.keras.Model, seed: int):
    """(basis, public gradients) at the model's current weights."""
    grads = basis_lib.public_per_example_gradients(
        inner, _per_example_loss(), to_unit_float(data.x_public),
        data.y_public, batch_size=config.physical_batch_size)
    basis = basis_lib.learn_basis(grads, seed=seed,
                                  **_basis_kwargs(config, plan))
    return basis, grads


def _hybrid_setup(config: TrainConfig, plan: Plan, data: Data,
                  inner: tf.keras.Model,
                  recorded: Optional[Mapping[str, Any]]):
    """Learns the basis from the PUBLIC split; sets per-block clips/noise.

    The per-block clips and noise are `tf_twice.hybrid.plan_blocks` of the
    flags' one-block mechanism: l2 budgets from the public projection norms;
    the residual's l-infinity clip is `--linf_norm_clip` (capped at its c2)
    or c2 / sqrt(`--d0`), principal block j's is c2_j / sqrt(min(
    `--principal_d0`, r_j)); the noise is `--noise_multiplier` on every
    block or optimised per block for the target epsilon after the planned
    steps. All of it comes from public data and the flags, never from the
    private set. A resumed run with the same settings reuses the recorded
    clips and noise.
    """
    seed = 0 if config.seed is None else config.seed
    basis, grads = _learn_public_basis(config, plan, data, inner, seed)
    plan.ranks = tuple(basis.ranks)
    plan.block_dimensions = tuple(basis.block_dimensions)
    record = _hybrid_record(config, plan)
    if recorded is not None and recorded.get('settings') == json.loads(
            json.dumps(record)):
        plan.l2_norm_clip = tuple(recorded['l2_norm_clip'])
        plan.linf_norm_clip = tuple(recorded['linf_norm_clip'])
        plan.noise_multiplier = tuple(recorded['noise_multiplier'])
        return basis
    one_block = tf_twice.TwiceSamplingConfig.single(
        num_examples=plan.num_examples,
        expected_batch_size=plan.expected_batch_size,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        l2_norm_clip=float(config.l2_norm_clip),
        linf_norm_clip=config.linf_norm_clip,
        noise_multiplier=config.noise_multiplier)
    budget = {} if config.noise_multiplier is not None else dict(
        target_epsilon=plan.target_epsilon, delta=plan.delta,
        steps=plan.planned_steps)
    try:
        planned = hybrid_budgets.plan_blocks(
            one_block, basis, grads,
            residual_d0=None if config.linf_norm_clip is not None else plan.d0,
            principal_d0=float(config.principal_d0), **budget)
    except ValueError as e:
        if not budget:
            raise
        raise ValueError(f'--target_epsilon={plan.target_epsilon:g} '
                         f'cannot be met: {e}') from e
    plan.l2_norm_clip = planned.l2_norm_clips
    plan.linf_norm_clip = planned.linf_norm_clips
    plan.noise_multiplier = planned.noise_multipliers
    return basis


def _mechanism(plan: Plan) -> tf_twice.TwiceSamplingConfig:
    """The plan's mechanism as the one config the library derives from."""

    def per_block(value):
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)

    return tf_twice.TwiceSamplingConfig(
        num_examples=plan.num_examples,
        expected_batch_size=plan.expected_batch_size,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        blocks=tuple(
            tf_twice.Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                           noise_multiplier=z)
            for c2, c_inf, z in zip(per_block(plan.l2_norm_clip),
                                    per_block(plan.linf_norm_clip),
                                    per_block(plan.noise_multiplier))))


def build_run(config: Any, data: Optional[Data] = None) -> Run:
    """Builds the model, the input pipeline, the ledger and the callbacks.

    Args:
      config: a `TrainConfig`, mapping or flags-like object.
      data: the loaded data; default: `load_data` with the config's dataset
        and public split.

    Raises:
      ValueError: naming a flag outside its range, or a checkpoint
        directory that cannot be resumed.
    """
    config = check_config(config)
    if data is not None:
        held_out = len(data.x_public)
        if config.public_examples is None:
            config.public_examples = held_out
        elif config.public_examples != held_out:
            raise _flag_error('public_examples', f'{held_out}, the size of '
                              'the public split of the data given',
                              config.public_examples)
        if config.mode == 'hybrid' and not held_out:
            raise ValueError('--mode=hybrid needs public examples; the data '
                             'given has no public split (--public_examples '
                             '>= 1).')
    elif config.public_examples is None:
        config.public_examples = (DEFAULT_PUBLIC_EXAMPLES
                                  if config.mode == 'hybrid' else 0)
    if data is None:
        data = load_data(config.dataset,
                         public_examples=config.public_examples,
                         data_dir=config.data_dir,
                         data_path=config.data_path)
    n = len(data.x_train)
    plan = resolve_plan(config, n)
    if config.seed is not None:
        tf.keras.utils.set_random_seed(config.seed)
    inner = _build_inner_model(config, data)
    private = config.mode in PRIVATE_MODES

    checkpoint_path = None
    ledger_path = None
    has_checkpoint = False
    if config.checkpoint_dir:
        os.makedirs(config.checkpoint_dir, exist_ok=True)
        checkpoint_path = os.path.join(config.checkpoint_dir,
                                       CHECKPOINT_NAME)
        ledger_path = os.path.join(config.checkpoint_dir, LEDGER_FILENAME)
        has_checkpoint = os.path.exists(checkpoint_path)
        _check_resume(config, config.checkpoint_dir, has_checkpoint,
                      os.path.exists(ledger_path))

    basis = None
    if config.mode == 'hybrid':
        previous = (_read_run_file(config.checkpoint_dir)
                    if config.checkpoint_dir else None)
        basis = _hybrid_setup(config, plan, data, inner,
                              None if previous is None
                              else previous.get('hybrid'))
    if private:
        model = DPModel(inner, _mechanism(plan),
                        physical_batch_size=config.physical_batch_size,
                        seed=config.seed, basis=basis)
    else:
        model = inner
    model.compile(optimizer=_optimizer(config), loss=_loss(),
                  metrics=['accuracy'])

    ledger = None
    if private:
        ledger = PrivacyLedger.for_model(
            model, delta=plan.delta, target_epsilon=plan.target_epsilon,
            max_steps=plan.planned_steps, state_path=ledger_path,
            log_dir=config.tensorboard_dir, verbose=config.verbose)
    if has_checkpoint:
        # Weights and optimizer state; the step keys are never saved (a
        # seeded stream depends on the restored weights: no replay).
        # Keras restores an optimizer's state only into existing variables.
        model.optimizer.build(model.trainable_variables)
        model.load_weights(checkpoint_path)
        if basis is not None:
            # The basis is not checkpointed: relearn it from the PUBLIC
            # split at the restored weights (same structure, same event).
            seed = 0 if config.seed is None else config.seed
            basis, _ = _learn_public_basis(config, plan, data, inner, seed)
            model.set_basis(basis)
    if config.checkpoint_dir:
        _write_run_file(config, plan, config.checkpoint_dir)

    if ledger is not None:
        done = ledger.steps
    else:
        done = int(model.optimizer.iterations.numpy()) if has_checkpoint \
            else 0
    remaining = max(0, plan.planned_steps - done)
    per_iteration = max(1, min(plan.steps_per_epoch, remaining))
    epochs = max(1, int(math.ceil(remaining / per_iteration)))

    if private:
        # A resumed run starts past every step index an earlier run drew,
        # so no logical batch of the seed's stream is used twice.
        dataset = sampling.poisson_batches(
            data.x_train, data.y_train,
            physical_batch_size=config.physical_batch_size,
            expected_batch_size=plan.expected_batch_size,
            steps=per_iteration, seed=config.seed, start_step=done,
            preprocess_fn=_preprocess)
    else:
        batch = int(round(plan.expected_batch_size))
        dataset = tf.data.Dataset.from_tensor_slices(
            (data.x_train, data.y_train))
        dataset = dataset.shuffle(
            len(data.x_train), seed=config.seed,
            reshuffle_each_iteration=True).repeat().batch(batch)
        dataset = dataset.map(_preprocess).prefetch(tf.data.AUTOTUNE)

    basis_refresh = None
    if basis is not None and config.basis_refresh_steps:
        basis_refresh = basis_lib.BasisRefresh(
            inner, (to_unit_float(data.x_public), data.y_public),
            _per_example_loss(), config.basis_refresh_steps,
            on_refresh=model.set_basis,
            batch_size=config.physical_batch_size,
            seed=0 if config.seed is None else config.seed,
            **_basis_kwargs(config, plan))

    callbacks: List[tf.keras.callbacks.Callback] = []
    if ledger is not None:
        callbacks.append(ledger)  # First, so later callbacks log epsilon.
    if basis_refresh is not None:
        callbacks.append(basis_refresh)
    if ledger is None and remaining % per_iteration:
        # A private run stops at the ledger's max_steps.
        callbacks.append(_StopAfterSteps(remaining))
    if config.tensorboard_dir:
        callbacks.append(tf.keras.callbacks.TensorBoard(
            config.tensorboard_dir, update_freq='epoch'))
    if checkpoint_path is not None:
        callbacks.append(_EpochCheckpoint(checkpoint_path))
    return Run(config=config, plan=plan, data=data, model=model,
               inner_model=inner, dataset=dataset, callbacks=callbacks,
               ledger=ledger, done_steps=done, remaining_steps=remaining,
               steps_per_iteration=per_iteration, epochs=epochs,
               checkpoint_path=checkpoint_path, basis_refresh=basis_refresh)


# --- training and reporting ---------------------------------------------


def privacy_statement(plan: Plan, steps: int) -> Tuple[str, float]:
    """The statement and its epsilon for `steps` steps of `plan`."""
    n, batch = plan.num_examples, plan.expected_batch_size
    epochs = _num_epochs_for_steps(n, batch, steps)
    common = dict(block_dimensions=plan.block_dimensions)
    eps, _ = accounting.compute_twice_sampling_privacy(
        n, batch, plan.noise_multiplier, epochs, plan.delta,
        plan.coordinate_sampling_rate, plan.l2_norm_clip,
        plan.linf_norm_clip, **common)
    text = accounting.compute_twice_sampling_privacy_statement(
        number_of_examples=n, batch_size=batch, num_epochs=epochs,
        noise_multiplier=plan.noise_multiplier, delta=plan.delta,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        l2_norm_clip=plan.l2_norm_clip, linf_norm_clip=plan.linf_norm_clip,
        **common)
    return text, float(eps)


def evaluate(model: tf.keras.Model, data: Data,
             batch_size: int = 512) -> Tuple[float, float]:
    """(test loss, test accuracy) of `model` on the test split."""
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
    test = test.batch(batch_size).map(_preprocess)
    results = model.evaluate(test, verbose=0, return_dict=True)
    return float(results['loss']), float(results['accuracy'])


def _as_list(value):
    if isinstance(value, (list, tuple)):
        return [None if v is None else float(v) for v in value]
    return None if value is None else float(value)


def train(config: Any, data: Optional[Data] = None) -> Dict[str, Any]:
    """Builds and runs one training run; returns its results.

    Args:
      config: a `TrainConfig`, a mapping of its fields, or a flags-like
        object (e.g. absl's FLAGS).
      data: optional pre-loaded `Data` (for repeated runs).

    Returns:
      A dict with the mode, the data sizes, the mechanism (sampling rates,
      clips, noise multiplier(s), delta), `steps` run now, `total_steps`
      accounted (earlier runs included), `epsilon` (the ledger's),
      `statement_epsilon` and `statement` (from
      `compute_twice_sampling_privacy_statement` for `total_steps` steps),
      `test_accuracy`, `test_loss` and `train_seconds`. Privacy fields are
      None in nonprivate mode.
    """
    run = build_run(config, data)
    config, plan = run.config, run.plan
    if config.verbose:
        _print_plan(run)
    iterations_before = int(run.model.optimizer.iterations.numpy())
    start = time.time()
    if run.remaining_steps > 0:
        if run.ledger is not None:
            run.model.fit(run.dataset, epochs=run.epochs,
                          callbacks=run.callbacks, verbose=config.verbose)
        else:
            # The dataset shuffles itself (Keras 3 warns about its own
            # default shuffle=True for a dataset).
            run.model.fit(run.dataset, epochs=run.epochs,
                          steps_per_epoch=run.steps_per_iteration,
                          callbacks=run.callbacks, verbose=config.verbose,
                          shuffle=False)
    seconds = time.time() - start
    steps = int(run.model.optimizer.iterations.numpy()) - iterations_before
    test_loss, test_accuracy = evaluate(run.model, run.data)
    results: Dict[str, Any] = dict(
        mode=config.mode, dataset=config.dataset, model=config.model,
        num_examples=plan.num_examples,
        num_public_examples=int(len(run.data.x_public)),
        num_test_examples=int(len(run.data.x_test)),
        example_sampling_rate=plan.example_sampling_rate,
        expected_batch_size=plan.expected_batch_size,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        l2_norm_clip=_as_list(plan.l2_norm_clip),
        linf_norm_clip=_as_list(plan.linf_norm_clip),
        noise_multiplier=_as_list(plan.noise_multiplier),
        ranks=list(plan.ranks), delta=plan.delta,
        target_epsilon=plan.target_epsilon,
        planned_steps=plan.planned_steps, resumed_steps=run.done_steps,
        steps=steps, total_steps=run.done_steps + steps,
        optimizer_steps=int(run.model.optimizer.iterations.numpy()),
        epsilon=None, statement_epsilon=None, statement=None,
        stopped_by_budget=False, test_loss=test_loss,
        test_accuracy=test_accuracy, train_seconds=seconds)
    if run.ledger is not None:
        results['total_steps'] = run.ledger.steps
        results['epsilon'] = run.ledger.epsilon if run.ledger.steps else 0.0
        results['stopped_by_budget'] = run.ledger.stopped_by_budget
        if run.ledger.steps:
            text, eps = privacy_statement(plan, run.ledger.steps)
            results['statement'] = text
            results['statement_epsilon'] = eps
        results['ledger_segments'] = len(run.ledger.get_state()['segments'])
    return results


def _print_plan(run: Run) -> None:
    plan, config = run.plan, run.config
    print(f'{config.mode} on {config.dataset} ({config.model}): '
          f'{plan.num_examples} private training examples, '
          f'{len(run.data.x_public)} public, {len(run.data.x_test)} test.')
    if config.mode in PRIVATE_MODES:
        print(f'  Poisson rate q1 = {plan.example_sampling_rate:.6g} '
              f'(expected batch {plan.expected_batch_size:g}), coordinate '
              f'rate q2 = {plan.coordinate_sampling_rate:g}, l2 clip '
              f'{_fmt(plan.l2_norm_clip)}, l-inf clip '
              f'{_fmt(plan.linf_norm_clip)}, noise multiplier '
              f'{_fmt(plan.noise_multiplier)}, delta {plan.delta:g}'
              + ('' if plan.target_epsilon is None else
                 f', target epsilon {plan.target_epsilon:g}') + '.')
    print(f'  {plan.planned_steps} steps planned ({plan.steps_per_epoch} per '
          f'epoch), {run.done_steps} done before, {run.remaining_steps} to '
          'run now.')


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)):
        return '(' + ', '.join(_fmt(v) for v in value) + ')'
    return 'none' if value is None else f'{value:.4g}'


def print_results(results: Mapping[str, Any]) -> None:
    """Prints the privacy statement, both epsilons and the test accuracy."""
    if results['mode'] in PRIVATE_MODES:
        if results['statement']:
            print()
            print(results['statement'])
        print(f"Privacy ledger: epsilon = {results['epsilon']:.4f} at delta "
              f"= {results['delta']:g} after {results['total_steps']} "
              'steps.')
        if results['statement_epsilon'] is not None:
            print('Privacy statement for the same steps: epsilon = '
                  f"{results['statement_epsilon']:.4f}.")
        if results.get('ledger_segments', 1) > 1:
            print('(The ledger composes steps of different settings from '
                  'earlier runs; the statement assumes all steps used the '
                  'current one, the ledger is the bound that holds.)')
    else:
        print('Nonprivate training: no privacy guarantee.')
    print(f"Test accuracy: {results['test_accuracy']:.4f} "
          f"({results['num_test_examples']} test examples; "
          f"{results['steps']} steps in {results['train_seconds']:.1f} s).")


# --- command line -------------------------------------------------------


class _DropKnownNoise(logging.Filter):
    """Drops log records whose message contains one of KNOWN_NOISE."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in KNOWN_NOISE)


def quiet_known_noise() -> None:
    """Drops TensorFlow's and Keras' KNOWN_NOISE messages (idempotent).

    The filter sits on the 'tensorflow' logger, where those records are
    made; other TensorFlow messages, tf_twice's own loggers (the ledger's
    privacy warnings) and Python warnings are untouched.
    """
    logger = logging.getLogger('tensorflow')
    if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
        logger.addFilter(_DropKnownNoise())


def device_summary() -> str:
    """One line on where TensorFlow runs (its own device log is hidden)."""
    gpus = tf.config.list_physical_devices('GPU')
    where = f'{len(gpus)} GPU(s)' if gpus else 'CPU only, no GPU visible'
    return f'TensorFlow {tf.__version__}: {where}.'


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the command-line flags (one per `TrainConfig` field)."""
    defaults = TrainConfig()
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum('mode', defaults.mode, MODES, 'What to train.', **fv)
    flags.DEFINE_enum('dataset', defaults.dataset, DATASETS, 'Dataset.',
                      **fv)
    flags.DEFINE_string('data_dir', None, 'fashion_mnist: the directory of '
                        'its idx files (default: TF_TWICE_FASHION_MNIST_DIR, '
                        f'else {datasets.DEFAULT_FASHION_MNIST_DIR}); '
                        'tensorflow-datasets: its data directory.', **fv)
    flags.DEFINE_string('data_path', None, 'npz: the .npz file (arrays '
                        'x_train, y_train, x_test, y_test).', **fv)
    flags.DEFINE_enum('model', defaults.model, sorted(models.MODELS),
                      'Model (tf_twice.models).', **fv)
    flags.DEFINE_float('target_epsilon', None,
                       'Epsilon to calibrate the noise to for the planned '
                       f'steps (default {DEFAULT_TARGET_EPSILON:g} unless '
                       '--noise_multiplier is given).', **fv)
    flags.DEFINE_float('noise_multiplier', None,
                       'Noise multiplier z (instead of --target_epsilon).',
                       **fv)
    flags.DEFINE_float('delta', None, 'Delta; default: 1/n rounded down to '
                       'a power of ten, at most 1e-5.', **fv)
    flags.DEFINE_float('example_sampling_rate', None, 'Poisson rate q1.', **fv)
    flags.DEFINE_float('batch_size', None, 'Expected batch size n * q1 '
                       f'(default {DEFAULT_BATCH_SIZE}).', **fv)
    flags.DEFINE_float('coordinate_sampling_rate', None,
                       'Coordinate rate q2 (twice/hybrid; default '
                       f'{DEFAULT_COORDINATE_SAMPLING_RATE:g}).', **fv)
    flags.DEFINE_float('l2_norm_clip', defaults.l2_norm_clip,
                       'l2 clip c2 (hybrid: the global budget).', **fv)
    flags.DEFINE_float('linf_norm_clip', None, 'l-infinity clip c_inf.', **fv)
    flags.DEFINE_float('d0', None, 'c_inf = l2_norm_clip / sqrt(d0) '
                       f'(default {DEFAULT_D0:g}).', **fv)
    flags.DEFINE_float('principal_d0', defaults.principal_d0,
                       'Hybrid: l-infinity clip c2_j / sqrt(principal_d0) '
                       'of the principal blocks (1: none).', **fv)
    flags.DEFINE_float('epochs', None, 'Epochs (1/q1 steps each; default '
                       f'{DEFAULT_EPOCHS}).', **fv)
    flags.DEFINE_integer('steps', None, 'Steps (instead of --epochs).', **fv)
    flags.DEFINE_integer('physical_batch_size', defaults.physical_batch_size,
                         'Examples per vectorized chunk.', **fv)
    flags.DEFINE_float('learning_rate', defaults.learning_rate,
                       'Learning rate.', **fv)
    flags.DEFINE_float('momentum', defaults.momentum, 'SGD momentum.', **fv)
    flags.DEFINE_enum('optimizer', defaults.optimizer, OPTIMIZERS,
                      'Keras optimizer.', **fv)
    flags.DEFINE_integer('public_examples', None,
                         'Training examples held out as public data '
                         f'(default {DEFAULT_PUBLIC_EXAMPLES} for hybrid, '
                         'else 0).', **fv)
    flags.DEFINE_list('ranks', None, 'Hybrid: ranks of the principal blocks '
                      f'(default {",".join(map(str, DEFAULT_RANKS))}).', **fv)
    flags.DEFINE_integer('parameter_groups', defaults.parameter_groups,
                         'Hybrid: parameter groups of the basis.', **fv)
    flags.DEFINE_integer('basis_refresh_steps', defaults.basis_refresh_steps,
                         'Hybrid: re-learn the basis every K steps (0: '
                         'learn it once).', **fv)
    flags.DEFINE_string('checkpoint_dir', None,
                        'Checkpoints and the privacy ledger; resumable.', **fv)
    flags.DEFINE_string('tensorboard_dir', None, 'TensorBoard logs.', **fv)
    flags.DEFINE_integer('seed', None, 'Seed (experiments only; default: '
                         'OS entropy).', **fv)
    flags.DEFINE_integer('verbose', defaults.verbose,
                         'Keras progress output (0, 1, 2).', **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    quiet_known_noise()
    print(device_summary())
    try:
        results = train(flags.FLAGS)
    except (DataUnavailableError, FileNotFoundError) as e:
        # Not a usage error: the message alone, without the flags' help.
        raise SystemExit(f'Error: {e}') from e
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    print_results(results)


if __name__ == '__main__':
    define_flags()
    app.run(main)
