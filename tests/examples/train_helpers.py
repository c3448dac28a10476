"""Shared settings and files of the training-script tests (train_*_test.py).

Every run is a handful of steps on scikit-learn's digits (shipped with
scikit-learn, nothing is downloaded) or on tiny files written by the test.
"""

import gzip
import math
import os
import struct

import numpy as np
import pytest

from tf_twice import datasets

# Small and fast: a few steps of expected batch 32 in chunks of 32, on the
# linear model (these tests check the script: its flags, ledger, records and
# resume; every model's per-example gradients are tested in tests/keras and
# tests/models_test.py, and the digits recipe's model trains in the README
# test). It traces and runs in about half the small CNN's time.
FAST = dict(steps=3, batch_size=32, physical_batch_size=32, seed=0,
            verbose=0, model='linear')
HYBRID = dict(FAST, mode='hybrid', public_examples=50, ranks='4',
              basis_refresh_steps=2, target_epsilon=8.0)


def check_private(results, steps):
    """A private run of `steps` steps, its ledger and statement agreeing."""
    assert results['steps'] == steps
    assert results['total_steps'] == steps
    assert results['optimizer_steps'] == steps
    assert math.isfinite(results['epsilon']) and results['epsilon'] > 0
    # The ledger (steps that ran) and the statement (the setting) agree.
    assert results['statement_epsilon'] == pytest.approx(
        results['epsilon'], rel=1e-9)
    assert 'Epsilon with twice sampling' in results['statement']
    assert results['ledger_segments'] == 1


def _write_idx_gz(path, array: np.ndarray) -> None:
    """uint8 `array` in the idx format (magic 0x0000 0x08 rank, dims)."""
    header = bytes([0, 0, 0x08, array.ndim])
    header += struct.pack(f'>{array.ndim}I', *array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


def tiny_fashion_mnist(directory, num_train=40, num_test=10) -> str:
    """Random Fashion-MNIST-shaped idx files in `directory`."""
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
