"""The README's Python examples run and print what the README says."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'
BLOCKS = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)


def test_readme_has_examples():
    assert BLOCKS


@pytest.mark.parametrize('index', range(len(BLOCKS)))
def test_readme_example_runs(index):
    block = BLOCKS[index]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block, f'README.md block {index}', 'exec'), {})  # pylint: disable=exec-used
    # A value shown in a comment after print(...) must be what it printed.
    for expected in re.findall(r'print\(.*\)\s*#\s*([0-9.]+)', block):
        assert expected in output.getvalue()
