"""The quick tier (`./dev.sh test -m quick`): every unit test, and the e2e tests marked `quick`, one job per
capability, for use while developing; the whole suite is the proof."""
from __future__ import annotations

from pathlib import Path

import pytest

UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if UNIT in Path(item.fspath).parents:
            item.add_marker(pytest.mark.quick)
