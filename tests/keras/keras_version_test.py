"""tf_twice._keras: which Keras tf.keras is, and a clear refusal of one
that tf_twice cannot use."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests import markers
from tf_twice import _keras
from tests.paths import ROOT

_TF_MM = '.'.join(tf.__version__.split('.')[:2])
_HAS_TF_KERAS = importlib.util.find_spec('tf_keras') is not None


def test_detects_the_keras_of_tf_keras():
    # tf.keras is the package `keras` (Keras 2 up to TensorFlow 2.15, Keras 3
    # after) or `tf_keras` (TF_USE_LEGACY_KERAS=1); the package has the
    # version.
    package = tf.keras.Model.__module__.split('.')[0]
    version = sys.modules[package].__version__
    major = int(version.split('.')[0])
    assert _keras.KERAS_PACKAGE == package
    assert _keras.KERAS_VERSION == version
    assert _keras.KERAS_MAJOR == major == markers.KERAS_MAJOR
    assert _keras.IS_KERAS_3 == (major == 3)


def test_has_tf_privacy_is_the_installed_state():
    assert _keras.has_tf_privacy() == (
        importlib.util.find_spec('tensorflow_privacy') is not None)
    assert markers.HAS_TF_PRIVACY == _keras.has_tf_privacy()


_OK = dict(tf_version='2.21.0', legacy_requested=False, keras_version='3.15.1',
           backend='tensorflow', tf_keras_installed=False)


@pytest.mark.parametrize('facts, fragments', [
    (dict(legacy_requested=True, keras_version=None, backend='tensorflow'),
     ['TF_USE_LEGACY_KERAS', 'pip install "tf-keras==2.21.*"',
      'unset TF_USE_LEGACY_KERAS', 'Keras 3']),
    (dict(tf_version='2.15.1', legacy_requested=True, keras_version=None),
     ['pip install "tf-keras==2.15.*"', '(Keras 2)']),
    (dict(backend='jax'), ['KERAS_BACKEND=tensorflow', "'jax'"]),
    (dict(keras_version=None, backend='torch'),
     ['KERAS_BACKEND=tensorflow', "'torch'"]),
    (dict(keras_version=None, error=ImportError('no module keras')),
     ['no module keras', 'pip install "keras>=3"',
      'pip install "tf-keras==2.21.*"']),
    (dict(keras_version='2.15.0'),
     ['does not match', 'pip install "tf-keras==2.21.*"',
      'TF_USE_LEGACY_KERAS=1']),
    (dict(tf_version='2.15.1', keras_version='3.1.0'),
     ['pip install "keras==2.15.*"']),
])
def test_problem_names_the_fix(facts, fragments):
    message = _keras.problem(**{**_OK, **facts})
    assert message is not None
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize('facts', [
    {},
    dict(tf_version='2.15.1', keras_version='2.15.0', backend=None),
    # tf-keras under TF_USE_LEGACY_KERAS: KERAS_BACKEND is not read.
    dict(legacy_requested=True, tf_keras_installed=True,
         keras_version='2.21.0', backend='jax'),
    dict(tf_version='2.22.0rc1', keras_version='3.16.0.dev2026'),
])
def test_usable_stacks_pass(facts):
    assert _keras.problem(**{**_OK, **facts}) is None


def test_configured_backend_reads_the_variable_then_keras_json(tmp_path):
    assert _keras.configured_backend({'KERAS_BACKEND': 'jax'}) == 'jax'
    (tmp_path / 'keras.json').write_text(json.dumps({'backend': 'torch'}))
    assert _keras.configured_backend({'KERAS_HOME': str(tmp_path)}) == 'torch'
    assert _keras.configured_backend(
        {'KERAS_HOME': str(tmp_path / 'missing')}) == 'tensorflow'


def _import_in_subprocess(module: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ('KERAS_BACKEND', 'TF_USE_LEGACY_KERAS')}
    environ.update(env, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.run(
        [sys.executable, '-c', f'import {module}; print("imported")'],
        env=environ, capture_output=True, text=True, timeout=300, check=False)


def _last_line(result) -> str:
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines[-1] if lines else ''


@pytest.mark.skipif(_HAS_TF_KERAS, reason='tf-keras is installed here')
def test_legacy_keras_without_tf_keras_is_refused_with_the_pin():
    result = _import_in_subprocess('tf_twice.keras', TF_USE_LEGACY_KERAS='1')
    assert result.returncode != 0
    last = _last_line(result)
    assert last.startswith('ImportError: TF_USE_LEGACY_KERAS'), last
    assert f'pip install "tf-keras=={_TF_MM}.*"' in last


@pytest.mark.parametrize('module, env', [
    ('tf_twice.mechanism', {'KERAS_BACKEND': 'jax'}),
    ('tf_twice.keras', {'KERAS_BACKEND': 'not_a_backend'}),
    ('tf_twice.sampling', 'keras.json'),
])
def test_a_non_tensorflow_backend_is_refused_on_keras_3(module, env,
                                                        tmp_path):
    if env == 'keras.json':
        (tmp_path / 'keras.json').write_text(json.dumps({'backend': 'torch'}))
        env = {'KERAS_HOME': str(tmp_path)}
    result = _import_in_subprocess(module, **env)
    # Keras 2 has no backends to choose; but from TensorFlow 2.16 on,
    # TensorFlow loads Keras 3 (always installed) even with tf-keras and
    # TF_USE_LEGACY_KERAS=1, so the backend setting reaches it there too.
    tf_minor = int(_TF_MM.split('.')[1])
    if markers.KERAS_MAJOR == 2 and tf_minor < 16:
        assert result.returncode == 0, result.stderr[-2000:]
        assert _last_line(result) == 'imported'
        return
    assert result.returncode != 0
    last = _last_line(result)
    assert last.startswith('ImportError: Keras 3 is configured for'), last
    assert 'KERAS_BACKEND=tensorflow' in last
