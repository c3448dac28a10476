"""Tests of tf_twice.features: the ScatterNet features and their cache.

Tiny images (16x16) and filter banks (L = 4) keep the file to a few seconds.
No TensorFlow: the module is numpy + kymatio only.
"""

import ast
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip('kymatio')

from tests.paths import ROOT  # pylint: disable=wrong-import-position
from tf_twice import features  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

SIZE = 16
L = 4
K_J2 = 1 + 2 * L + L**2  # Orders 0, 1 and 2 with J = 2: 25 coefficients.


@pytest.fixture(autouse=True)
def _no_real_cache(monkeypatch, tmp_path):
    """No test writes to the real cache, even through the defaults."""
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    monkeypatch.setenv(features.CACHE_DIR_ENV, str(tmp_path / 'env-cache'))


def _images(n=3, channels=None, seed=0):
    shape = (n, SIZE, SIZE) + ((channels,) if channels else ())
    return np.random.default_rng(seed).random(shape).astype(np.float32)


def _count_computations(monkeypatch):
    """Replaces features.scattering by a wrapper; returns its call list."""
    calls = []
    compute = features.scattering

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return compute(*args, **kwargs)

    monkeypatch.setattr(features, 'scattering', counted)
    return calls


# --- the transform -----------------------------------------------------------

def test_output_is_kymatios_own_transposed_to_channels_last():
    images = _images(n=3, channels=2)
    out = features.scattering(images, J=2, L=L, chunk_size=2)
    assert out.shape == (3, SIZE // 4, SIZE // 4, 2 * K_J2)
    assert out.dtype == np.float32
    kymatio = features._kymatio_scattering2d()(J=2, shape=(SIZE, SIZE), L=L)
    own = kymatio(np.moveaxis(images, -1, 1))  # [N, C, K, h, w]
    assert own.shape == (3, 2, K_J2, SIZE // 4, SIZE // 4)
    expected = np.moveaxis(own.reshape(3, 2 * K_J2, 4, 4), 1, -1)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    # Channel c*K + k is coefficient k of input channel c: the second
    # channel's block is that channel's features alone, [N, H, W] input.
    second = features.scattering(images[..., 1], J=2, L=L)
    assert second.shape == (3, 4, 4, K_J2)
    np.testing.assert_allclose(out[..., K_J2:], second, rtol=1e-6, atol=1e-7)
    # The chunks (2 + 1 images above) are stitched in order.
    np.testing.assert_array_equal(
        out, features.scattering(images, J=2, L=L, chunk_size=1024))


def test_constant_image_has_only_the_order_0_coefficient():
    value = 0.6
    constant = np.full((1, SIZE, SIZE), value, np.float32)
    # Wavelets have zero mean: on a constant image their coefficients are
    # float32 round-off (about 1e-7 * value); any structure gives far more.
    tolerance = 1e-5 * value
    out = features.scattering(constant, J=2, L=L)
    # kymatio's Gaussian low-pass has a DC gain of 1 up to about 4e-5.
    np.testing.assert_allclose(out[..., 0], value, rtol=1e-3)
    assert np.abs(out[..., 1:]).max() < tolerance
    bumped = constant.copy()
    bumped[0, 5, 9] *= 1.01
    assert np.abs(features.scattering(bumped, J=2, L=L)[..., 1:]).max() > (
        10 * tolerance)


def test_integer_images_are_divided_by_255():
    images = np.random.default_rng(1).integers(0, 256, (4, SIZE, SIZE))
    reference = features.scattering(images.astype(np.float64) / 255, J=1,
                                    L=L)
    assert np.abs(reference).max() > 0.01
    for dtype in (np.uint8, np.int64):
        np.testing.assert_allclose(
            features.scattering(images.astype(dtype), J=1, L=L), reference,
            rtol=1e-5, atol=1e-7)
    # Float images are used as given, not rescaled.
    np.testing.assert_allclose(
        features.scattering(images.astype(np.float32), J=1, L=L),
        255 * reference, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match='0-255'):
        features.scattering(images.astype(np.int16) + 1, J=1, L=L)


@pytest.mark.parametrize('shape, J', [
    ((2, 18, 16), 2), ((2, 16, 14), 2), ((2, 16, 16, 1), 5)])
def test_size_not_divisible_by_2_to_the_j_raises(shape, J):
    with pytest.raises(ValueError, match=r'images: .* divisible by 2\*\*J'):
        features.scattering(np.zeros(shape, np.float32), J=J, L=L)


def test_progress_bar_writes_to_stderr_only_when_asked(capsys, tmp_path):
    images = _images(n=5)
    features.scattering(images, J=1, L=L, chunk_size=2)
    features.cached_scattering(images, name='quiet', J=1, L=L,
                               cache_dir=tmp_path, progress=False)
    assert capsys.readouterr() == ('', '')
    features.scattering(images, J=1, L=L, chunk_size=2, progress='toy train')
    out, err = capsys.readouterr()
    assert out == ''
    # One line, rewritten at the start and after each chunk (2, 4 and 5
    # images), then a newline.
    assert err.count('\r') == 4 and err.count('\n') == 1
    assert err.endswith('\n')
    assert 'toy train [--------------------] 0/5 images (0%)' in err
    assert 'toy train [########------------] 2/5 images (40%)' in err
    assert 'toy train [####################] 5/5 images (100%)' in err
    features.cached_scattering(images, name='toy-test', J=1, L=L,
                               cache_dir=tmp_path)
    assert ('toy-test [####################] 5/5 images (100%)'
            in capsys.readouterr().err)


# --- the cache ---------------------------------------------------------------

def test_cache_second_call_loads_the_file_without_recomputing(monkeypatch,
                                                               tmp_path):
    calls = _count_computations(monkeypatch)
    images = _images()
    first = features.cached_scattering(images, name='toy-train', J=2, L=L,
                                       cache_dir=tmp_path, progress=False)
    second = features.cached_scattering(images.copy(), name='toy-train',
                                        J=2, L=L, cache_dir=tmp_path,
                                        progress=False)
    assert len(calls) == 1
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, features.scattering(images, J=2,
                                                             L=L))
    (path,) = tmp_path.iterdir()
    assert path.name.startswith('toy-train.scattering-J2-L4.')
    assert path.suffix == '.npy'


def test_cache_keys_on_images_transform_and_name(monkeypatch, tmp_path):
    calls = _count_computations(monkeypatch)
    images = np.random.default_rng(2).integers(0, 256, (2, SIZE, SIZE),
                                               dtype=np.int32)
    other_images = images.copy()
    other_images[1, 3, 4] ^= 1  # One bit of one pixel.
    # The same bytes and shape as float32 (denormals): other images.
    same_bytes = images.view(np.float32)
    variants = [dict(), dict(images=other_images), dict(images=same_bytes),
                dict(J=1), dict(L=2), dict(name='toy-test'),
                dict()]  # The last is the first again.
    for variant in variants:
        kwargs = dict(dict(images=images, name='toy-train', J=2, L=L),
                      **variant)
        features.cached_scattering(kwargs.pop('images'), cache_dir=tmp_path,
                                   progress=False, **kwargs)
    assert len(calls) == 6
    assert len(list(tmp_path.iterdir())) == 6


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garbage(path):
    path.write_bytes(b'not a numpy file at all')


def _wrong_shape(path):
    np.save(path, np.zeros((1, 2, 3), np.float32))


def _wrong_dtype(path):
    np.save(path, np.load(path).astype(np.float64))


@pytest.mark.parametrize('damage', [_truncate, _garbage, _wrong_shape,
                                    _wrong_dtype])
def test_unusable_cache_file_is_recomputed_with_a_warning(monkeypatch,
                                                          tmp_path, damage):
    calls = _count_computations(monkeypatch)
    images = _images()
    kwargs = dict(name='toy-train', J=2, L=L, cache_dir=tmp_path,
                  progress=False)
    good = features.cached_scattering(images, **kwargs)
    (path,) = tmp_path.iterdir()
    damage(path)
    with pytest.warns(UserWarning, match='Recomputing the unusable'):
        again = features.cached_scattering(images, **kwargs)
    np.testing.assert_array_equal(again, good)
    assert len(calls) == 2
    # The file was rewritten: the next call loads it, silently.
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        np.testing.assert_array_equal(
            features.cached_scattering(images, **kwargs), good)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == [path]


def test_cache_file_is_written_atomically(monkeypatch, tmp_path):
    images = _images()
    features.cached_scattering(images, name='ok', J=1, L=L,
                               cache_dir=tmp_path / 'new' / 'dir',
                               progress=False)
    # The directory was made; only the final file is left, no temporary.
    (name,) = [p.name for p in (tmp_path / 'new' / 'dir').iterdir()]
    assert name.startswith('ok.scattering-J1-L4.') and name.endswith('.npy')

    def fail_mid_write(file, array):
        del array
        file.write(b'\x93NUMPY partial')
        raise OSError('disk full')

    monkeypatch.setattr(np, 'save', fail_mid_write)
    with pytest.raises(OSError, match='disk full'):
        features.cached_scattering(images, name='failed', J=1, L=L,
                                   cache_dir=tmp_path / 'other',
                                   progress=False)
    # Neither a partial file under the final name nor the temporary remain.
    assert not list((tmp_path / 'other').iterdir())


@pytest.mark.parametrize('name', ['', 'a/b', '../x', 'a b', 'caf\u00e9',
                                  None, 3])
def test_bad_name_raises(tmp_path, name):
    with pytest.raises(ValueError, match='name must be'):
        features.cached_scattering(_images(n=1), name=name, J=1, L=L,
                                   cache_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())


def test_default_cache_dir_is_the_environment_variable_else_home(
        monkeypatch, tmp_path):
    images = _images(n=1)
    features.cached_scattering(images, name='env', J=1, L=L, progress=False)
    assert len(list((tmp_path / 'env-cache').glob('env.*.npy'))) == 1
    monkeypatch.delenv(features.CACHE_DIR_ENV)
    features.cached_scattering(images, name='home', J=1, L=L, progress=False)
    home_cache = tmp_path / 'home' / '.cache' / 'tf_twice' / 'features'
    assert len(list(home_cache.glob('home.*.npy'))) == 1


# --- kymatio and scipy -------------------------------------------------------

def _y21(azimuth, polar):
    """Y_2^1 with the Condon-Shortley phase, in closed form."""
    return (-0.5 * math.sqrt(15 / (2 * math.pi)) * math.sin(polar)
            * math.cos(polar) * np.exp(1j * azimuth))


def _y11(azimuth, polar):
    return -0.5 * math.sqrt(3 / (2 * math.pi)) * math.sin(polar) * np.exp(
        1j * azimuth)


POINTS = [(1.1, 0.4), (5.0, 2.3), (0.3, 1.2)]  # (azimuth, polar angle)


def test_sph_harm_takes_the_azimuth_first_as_kymatio_expects():
    """scipy's own sph_harm or the shim's: kymatio calls it with (m, l,
    azimuth, polar)."""
    features._kymatio_scattering2d()
    from scipy import special  # pylint: disable=import-outside-toplevel
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)  # scipy 1.15, 1.16
        for azimuth, polar in POINTS:
            assert special.sph_harm(1, 2, azimuth, polar) == pytest.approx(
                _y21(azimuth, polar), rel=1e-12, abs=1e-14)
            assert special.sph_harm(1, 1, azimuth, polar) == pytest.approx(
                _y11(azimuth, polar), rel=1e-12, abs=1e-14)


def test_shim_agrees_with_sph_harm_y():
    features._kymatio_scattering2d()
    from scipy import special  # pylint: disable=import-outside-toplevel
    if special.sph_harm is not features._sph_harm:
        pytest.skip('scipy has its own sph_harm; the shim is not applied')
    assert features._sph_harm.__doc__
    for azimuth, polar in POINTS:
        for n, m in [(0, 0), (1, 1), (2, -1), (3, 2)]:
            assert features._sph_harm(m, n, azimuth, polar) == pytest.approx(
                special.sph_harm_y(n, m, polar, azimuth), rel=1e-12)
        assert features._sph_harm(1, 2, azimuth, polar) == pytest.approx(
            _y21(azimuth, polar), rel=1e-12)


def test_missing_kymatio_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, 'kymatio.numpy', None)
    with pytest.raises(ImportError,
                       match=r'pip install "tf_twice\[features\]"'):
        features.scattering(_images(n=1), J=1, L=L)


def test_module_imports_neither_tensorflow_nor_kymatio():
    code = ('import sys, tf_twice.features; '
            "print(sorted({'tensorflow', 'kymatio'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == '[]'


def _imports_kymatio(node):
    if isinstance(node, ast.Import):
        return any(a.name.split('.')[0] == 'kymatio' for a in node.names)
    return (isinstance(node, ast.ImportFrom)
            and (node.module or '').split('.')[0] == 'kymatio')


def test_kymatio_is_imported_in_one_place_only():
    tree = ast.parse((ROOT / 'tf_twice' / 'features.py').read_text())
    everywhere = [n for n in ast.walk(tree) if _imports_kymatio(n)]
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                   and n.name == '_kymatio_scattering2d']
    assert len(everywhere) == 1
    assert [n for n in ast.walk(function) if _imports_kymatio(n)] == everywhere
