"""The quick tier (`./dev.sh test -m quick`): every unit test, and the e2e tests marked `quick`, one job per
capability, for use while developing; the whole suite is the proof.

The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup` in pyproject.toml; `-n 0` runs it in one
process), each with a Ray cluster of its own: an e2e job spends about 40% of its time waiting (on timeouts,
process starts, a killed node), which the other worker's job fills. Tests are spread one by one, except that a
module whose tests share a module-scoped fixture (one job they all read) runs on one worker, so that the job
runs once."""
from __future__ import annotations

from pathlib import Path

import pytest

UNIT = Path(__file__).parent / "unit"


def _shares_a_module_fixture(item) -> bool:
    return any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if UNIT in Path(item.fspath).parents:
            item.add_marker(pytest.mark.quick)
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
