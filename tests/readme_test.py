"""The README and docs pages: their Python examples run and print what they
say, their links resolve, and they hold the test commands that CI runs."""

import contextlib
import io
import re

import pytest
from tests.paths import ROOT

README = ROOT / 'README.md'
DOCS = ROOT / 'docs'
# The README first, then every page under docs/ (found by the glob, so that a
# new page's examples run without editing this file).
PAGES = [README] + sorted(DOCS.glob('*.md'))
# The page that describes the CI environments.
SETUP = DOCS / 'setup.md'


def _name(page):
    return page.relative_to(ROOT).as_posix()


def _blocks(page):
    return re.findall(r'```python\n(.*?)```', page.read_text(), re.S)


EXAMPLES = [(_name(page), index)
            for page in PAGES for index in range(len(_blocks(page)))]


def test_readme_has_examples():
    assert _blocks(README)


@pytest.mark.parametrize('page,index', EXAMPLES)
def test_example_runs(page, index):
    block = _blocks(ROOT / page)[index]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block, f'{page} block {index}', 'exec'), {})  # pylint: disable=exec-used
    # A value shown in a comment after print(...) must be what it printed.
    for expected in re.findall(r'print\(.*\)\s*#\s*([0-9.]+)', block):
        assert expected in output.getvalue()


def _anchors(page):
    """GitHub's anchors of a page's headings."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith('```'):
            in_code = not in_code
        elif not in_code and line.startswith('#'):
            title = line.lstrip('#').strip().lower()
            anchors.add(re.sub(r'[^\w\- ]', '', title).replace(' ', '-'))
    return anchors


@pytest.mark.parametrize('page', [_name(page) for page in PAGES])
def test_relative_links_resolve(page):
    path = ROOT / page
    text = re.sub(r'```.*?```', '', path.read_text(), flags=re.S)
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', target):  # https:, mailto:
            continue
        file, _, anchor = target.partition('#')
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f'{page} links to a missing {target}'
        if anchor:
            assert anchor in _anchors(linked), (
                f'{page} links to a missing anchor {target}')


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


def test_readme_shows_the_set_up_commands_first():
    """The main job's command and a test command within the first 40 lines."""
    head = README.read_text().splitlines()[:40]
    assert any(line.startswith('python3.') and
               line.endswith(' python examples/train.py') for line in head)
    assert any(line.startswith('python3.') and ' pytest -n ' in line
               for line in head)


def test_readme_is_a_doorway():
    assert len(README.read_text().splitlines()) <= 250


def test_setup_page_states_the_kerases_ci_runs_the_newest_stack_with():
    match = re.search(r'^NEWEST_KERAS="\$\{NEWEST_KERAS:-([a-z0-9 -]+)\}"$',
                      CI_RUN.read_text(), re.M)
    assert match, '.ci/run does not set NEWEST_KERAS at the top'
    text = ' '.join(SETUP.read_text().split())  # Undo line wrapping.
    assert f'CI runs them with `NEWEST_KERAS={match.group(1)}`' in text
