"""The quick tier (`./dev.sh test -m quick`): every unit test, and the e2e tests marked `quick`, one job per
capability, for use while developing; the whole suite is the proof.

The suite runs on two pytest-xdist workers (`-n 2` in pyproject.toml; `-n 0` runs it in one process), each
with a Ray cluster of its own: an e2e job spends about 40% of its time waiting (on timeouts, process starts, a
killed node), which the other worker's job fills. Tests are handed out one by one, except that a module with
a module-scoped fixture (one job its tests all read) goes to one worker whole, so that the job runs once.
(xdist's own `xdist_group` marks do nothing under pytest 9.2, which ignores the node id they rewrite.)"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

UNIT = Path(__file__).parent / "unit"

# The suite keeps both cores busy (sampled: 98%), so its time is the CPU it spends. Two of Ray's per-node daemons,
# in every cluster and job it starts (inherited from here): the log monitor globs its logs directory for new files
# every 0.1 s below 1000 files (a suite's cluster gathers hundreds, one set per dead worker): every 0.5 s instead,
# so a new worker's first lines reach the driver up to 0.4 s later; each node's agent samples every process for
# the dashboard's metrics every 5 s, which no test reads.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if UNIT in Path(item.fspath).parents:
            item.add_marker(pytest.mark.quick)


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.suffix == ".py" and 'scope="module"' in path.read_text()


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        """A test is its own unit of work, but for the modules whose tests share a module-scoped fixture."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _has_module_fixture(config.rootpath / module) else nodeid

    return ModuleFixtureScheduling(config, log)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, started for this pytest worker, with this process (and what it starts) pointed at it."""
    import os

    from supervisor.testing.object_store import S3Server

    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
