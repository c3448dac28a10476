"""The test modules marked ``tf_free`` import no TensorFlow.

CI runs them in one environment only (tests/conftest.py): that is sound
only if their results cannot depend on the TensorFlow and Keras stack, so
their imports must not load TensorFlow (a test body may still compare with
tensorflow-privacy where it is installed, which is the environment that
runs them).
"""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

_TESTS = pathlib.Path(__file__).resolve().parent
_MARK = re.compile(r'^pytestmark = pytest\.mark\.tf_free\b', re.M)


def _marked_modules():
    return sorted(
        '.'.join(path.relative_to(_TESTS.parent).with_suffix('').parts)
        for path in _TESTS.rglob('*_test.py')
        if _MARK.search(path.read_text()))


def test_marked_modules_import_no_tensorflow():
    modules = _marked_modules()
    assert 'tests.accounting.rdp_test' in modules and len(modules) >= 10
    probe = ('import importlib, sys\n'
             f'for name in {modules!r}:\n'
             '    importlib.import_module(name)\n'
             '    assert "tensorflow" not in sys.modules, name\n')
    subprocess.run([sys.executable, '-c', probe], check=True,
                   cwd=_TESTS.parent, timeout=600)
