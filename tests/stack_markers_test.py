"""The markers that let CI run a test module in fewer environments hold.

CI runs the modules marked ``tf_free`` in one environment only, and skips
those marked ``keras_free`` in the environment that repeats another's
TensorFlow with the other Keras (tests/conftest.py). That is sound only if
their results cannot depend on what is skipped:

* a ``tf_free`` module's imports must not load TensorFlow (a test body may
  still compare with tensorflow-privacy where it is installed, which is
  the environment that runs them);
* a ``keras_free`` module must build and call no Keras object. TensorFlow
  itself imports Keras, so this is checked on the sources: the module and
  the test helpers it imports must not name Keras.
"""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

_TESTS = pathlib.Path(__file__).resolve().parent
_HELPER_IMPORT = re.compile(
    r'^(?:from tests import (\w+)|from tests\.(\w+) import|import tests\.(\w+))',
    re.M)


def _marked_modules(marker):
    mark = re.compile(rf'^pytestmark = pytest\.mark\.{marker}\b', re.M)
    return sorted(path for path in _TESTS.rglob('*_test.py')
                  if mark.search(path.read_text()))


def _module_name(path):
    return '.'.join(path.relative_to(_TESTS.parent).with_suffix('').parts)


def test_tf_free_modules_import_no_tensorflow():
    modules = [_module_name(path) for path in _marked_modules('tf_free')]
    assert 'tests.accounting.rdp_test' in modules and len(modules) >= 10
    probe = ('import importlib, sys\n'
             f'for name in {modules!r}:\n'
             '    importlib.import_module(name)\n'
             '    assert "tensorflow" not in sys.modules, name\n')
    subprocess.run([sys.executable, '-c', probe], check=True,
                   cwd=_TESTS.parent, timeout=600)


def _sources_with_helpers(path):
    """The module's source and those of the tests/ helpers it imports,
    recursively."""
    seen, todo = {}, [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen[current] = current.read_text()
        for match in _HELPER_IMPORT.finditer(seen[current]):
            helper = _TESTS / f'{next(filter(None, match.groups()))}.py'
            if helper.exists():
                todo.append(helper)
    return seen


def test_keras_free_modules_name_no_keras():
    paths = _marked_modules('keras_free')
    assert _TESTS / 'mechanism' / 'kernels_test.py' in paths
    for path in paths:
        for source_path, source in _sources_with_helpers(path).items():
            unmarked = source.replace('pytest.mark.keras_free', '')
            assert 'keras' not in unmarked.lower(), (path, source_path)
