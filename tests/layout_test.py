"""The package's layout rule: no module of tf_twice/ above 500 lines.

A module that outgrows it holds more than one idea; docs/architecture.md
says where each idea lives.
"""

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

MAX_LINES = 500


def test_no_module_is_longer_than_the_layout_allows():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for path in (ROOT / 'tf_twice').rglob('*.py')}
    assert len(lengths) > 50, lengths  # The package was found.
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not too_long, (f'split these modules (at most {MAX_LINES} lines '
                          f'each): {too_long}')
