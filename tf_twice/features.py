"""Handcrafted ScatterNet features of images (numpy + kymatio, no TF).

Tramer & Boneh, "Differentially Private Learning Needs Better Features (or
Much More Data)", ICLR 2021 (arXiv:2011.11660), train DP models on the 2-D
scattering transform of the images (kymatio, Andreux et al., JMLR 2020):
with J = 2 and L = 8 orientations a 28x28 image gives 81 x 7 x 7 = 3,969
features.

* `scattering(images, J=2, L=8)`: the features, float32 [N, H/2**J, W/2**J,
  C*K] (channels last), K = 1 + J*L + L**2 * J*(J-1)/2 per input channel.
* `cached_scattering(images, name=...)`: the same, computed once and kept as
  a .npy file (`TF_TWICE_CACHE_DIR`, else ~/.cache/tf_twice/features).

The transform is fixed (its filters do not depend on any data) and applied
to each image alone, so the features of private images cost no privacy:
neighbouring image datasets give neighbouring feature datasets. Any
normalisation of the features must likewise stay per example or use public
constants (the models apply GroupNormalization per example); statistics of
the private training set would be an unaccounted release.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
import warnings

import numpy as np

__all__ = ['CACHE_DIR_ENV', 'cached_scattering', 'scattering']

CACHE_DIR_ENV = 'TF_TWICE_CACHE_DIR'
_DEFAULT_CACHE_DIR = os.path.join('~', '.cache', 'tf_twice', 'features')
_NAME = re.compile(r'[A-Za-z0-9._-]+')


def _sph_harm(m, n, theta, phi):
    """scipy's removed sph_harm: Y_n^m at azimuth theta, polar angle phi."""
    import scipy.special  # pylint: disable=import-outside-toplevel
    # scipy docs: sph_harm(m, n, azim, polar) = sph_harm_y(n, m, polar, azim).
    return scipy.special.sph_harm_y(n, m, phi, theta)


def _kymatio_scattering2d():
    """kymatio.numpy.Scattering2D; the one place that imports kymatio."""
    # pylint: disable=import-outside-toplevel
    import scipy.special
    # kymatio 0.3.0 (its last release) imports scipy.special.sph_harm in its
    # 3-D filter bank, which `import kymatio.numpy` reaches; scipy 1.15
    # deprecated it for sph_harm_y (angles swapped) and 1.17 removed it.
    if not hasattr(scipy.special, 'sph_harm'):
        scipy.special.sph_harm = _sph_harm
    try:
        from kymatio.numpy import Scattering2D
    except ImportError as e:
        raise ImportError('The ScatterNet features need kymatio: '
                          'pip install "tf_twice[features]"') from e
    return Scattering2D


def _check(images, J, L):
    """Output shape [N, H/2**J, W/2**J, C*K] of `images`, or ValueError."""
    shape = images.shape
    if len(shape) not in (3, 4):
        raise ValueError(f'images must be [N, H, W] or [N, H, W, C], got '
                         f'shape {shape}.')
    if not (isinstance(J, int) and J >= 1 and isinstance(L, int) and L >= 1):
        raise ValueError(f'J and L must be positive integers, got {J}, {L}.')
    n, h, w = shape[:3]
    if h % 2**J or w % 2**J:
        raise ValueError(f'images: height {h} and width {w} must be divisible '
                         f'by 2**J = {2**J} (J={J}).')
    if np.issubdtype(images.dtype, np.integer):
        if images.size and (images.min() < 0 or images.max() > 255):
            raise ValueError('images: integer images must hold 0-255, got '
                             f'{images.min()} to {images.max()}.')
    elif not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f'images must be integers or floats, got '
                         f'{images.dtype}.')
    channels = shape[3] if len(shape) == 4 else 1
    # Coefficients of orders 0, 1 and 2 (kymatio's Scattering2D docs).
    k = 1 + J * L + L**2 * J * (J - 1) // 2
    return (n, h // 2**J, w // 2**J, channels * k)


def scattering(images, *, J=2, L=8, chunk_size=1024, progress=None):
    """Scattering features, float32 [N, H/2**J, W/2**J, C*K].

    images: [N, H, W] or [N, H, W, C]; integers (0-255) are divided by 255,
    floats are used as given. Channel c*K + k of the output is kymatio's
    coefficient k of input channel c. progress: a label for a text progress
    bar on stderr, or None for silence.
    """
    images = np.asarray(images)
    out_shape = _check(images, J, L)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f'chunk_size must be a positive integer, got '
                         f'{chunk_size!r}.')
    if images.ndim == 3:
        images = images[..., np.newaxis]
    n, h, w, _ = images.shape
    transform = _kymatio_scattering2d()(J=J, shape=(h, w), L=L)
    out = np.empty(out_shape, np.float32)
    start_time = time.monotonic()
    if progress is not None:
        _show(progress, 0, n, start_time)
    for start in range(0, n, chunk_size):
        x = np.moveaxis(images[start:start + chunk_size], -1, 1)  # N, C, H, W
        if np.issubdtype(x.dtype, np.integer):
            x = x.astype(np.float32) / np.float32(255)
        elif x.dtype not in (np.float32, np.float64):  # kymatio's two types
            x = x.astype(np.float32)
        s = transform(np.ascontiguousarray(x))  # [n, C, K, h, w]
        s = s.reshape((s.shape[0], -1) + s.shape[3:])
        out[start:start + chunk_size] = np.moveaxis(s, 1, -1)
        if progress is not None:
            _show(progress, start + x.shape[0], n, start_time)
    if progress is not None:
        sys.stderr.write('\n')
    return out


def _show(label, done, total, start_time):
    """Rewrites the progress line: label [#####-----] done/total (%), time."""
    fraction = done / total if total else 1.0
    bar = '#' * int(20 * fraction)
    sys.stderr.write(f'\r{label} [{bar:-<20}] {done}/{total} images '
                     f'({int(100 * fraction)}%), '
                     f'{time.monotonic() - start_time:.1f}s')
    sys.stderr.flush()


def cached_scattering(images, *, name, J=2, L=8, cache_dir=None,
                      progress=True):
    """`scattering(images, J=J, L=L)`, cached as a .npy file in `cache_dir`.

    name: the dataset and split (e.g. 'fashion_mnist-train'), letters, digits,
    '-', '_' and '.'. The file name also holds J, L and a digest of the
    images, so other images never reuse a stale file.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f'name must be a non-empty string of letters, '
                         f"digits, '-', '_' and '.', got {name!r}.")
    images = np.asarray(images)
    expected = _check(images, J, L)
    digest = hashlib.sha256(f'{images.dtype.str} {images.shape}'.encode())
    digest.update(np.ascontiguousarray(images).data)
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or _DEFAULT_CACHE_DIR
    cache_dir = os.path.expanduser(cache_dir)
    path = os.path.join(cache_dir, f'{name}.scattering-J{J}-L{L}.'
                                   f'{digest.hexdigest()[:16]}.npy')
    if os.path.exists(path):
        try:  # The .npy format only (np.load would also open zip files).
            with open(path, 'rb') as f:
                features = np.lib.format.read_array(f, allow_pickle=False)
            if features.shape == expected and features.dtype == np.float32:
                return features
            problem = f'shape {features.shape}, dtype {features.dtype}'
        except (OSError, ValueError, EOFError) as e:
            problem = repr(e)
        warnings.warn(f'Recomputing the unusable feature cache {path} '
                      f'({problem}; expected shape {expected}, float32).')
    features = scattering(images, J=J, L=L,
                          progress=name if progress else None)
    os.makedirs(cache_dir, exist_ok=True)
    # Written beside the target and renamed, so a reader (or a run killed
    # mid-write) never sees a partial file under the final name.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f'.{name}.',
                               suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            np.save(f, features)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return features
