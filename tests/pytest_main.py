"""Entry point of the Bazel py_test targets: runs pytest on one test file.

The test files are plain pytest modules (no `absltest.main()`), so a target
that ran the file directly would pass without running a test.
"""

import sys

import pytest

if __name__ == '__main__':
    sys.exit(pytest.main(['-q', *sys.argv[1:]]))
