"""The README's Python examples run and print what the README says."""

import contextlib
import io
import re

import pytest
from tests.paths import ROOT

README = ROOT / 'README.md'
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


CI_RUN = README.parent / '.ci' / 'run'


def _ci_assignments():
    """NAME -> value of the single-quoted assignments in .ci/run."""
    return dict(re.findall(r"^([A-Z0-9_]+)='(.*)'$", CI_RUN.read_text(),
                           re.M))


def test_readme_contains_every_test_command_ci_runs():
    commands = {name: value for name, value in _ci_assignments().items()
                if name.endswith('_TEST_CMD')}
    # The oldest stack and both Keras forms of the newest one.
    assert len(commands) == 3
    lines = README.read_text().splitlines()
    for name, command in commands.items():
        assert command in lines, f'README.md lacks .ci/run\'s {name}'
    assert any('tf-privacy' in c and c.startswith('python3.11 ')
               for c in commands.values())
    assert any('TF_USE_LEGACY_KERAS=1 pytest' in c for c in commands.values())


def test_readme_states_the_kerases_ci_runs_the_newest_stack_with():
    match = re.search(r'^NEWEST_KERAS="\$\{NEWEST_KERAS:-([a-z0-9 -]+)\}"$',
                      CI_RUN.read_text(), re.M)
    assert match, '.ci/run does not set NEWEST_KERAS at the top'
    text = ' '.join(README.read_text().split())  # Undo line wrapping.
    assert f'CI runs them with `NEWEST_KERAS={match.group(1)}`' in text
