"""The end-to-end tests' shared fixtures (their helpers are in harness.py).

One multi-node LocalCluster per pytest-xdist worker is shared by every test there that asks for it (head + two
3-CPU worker nodes, so a TrainGroup fits on one node and the other is a spare), with its own temp dir and ports,
and so is one uninterrupted reference run of the short job.
"""
from __future__ import annotations

import pytest
from harness import CONFIG, SHORT, Trial, relaunch

from supervisor.testing.local_cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster(s3_server):
    """Its nodes see the S3 server (started first: they inherit its endpoint and credentials), as a real cluster's
    nodes see a bucket."""
    c = LocalCluster()
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def trial(tmp_path) -> Trial:
    return Trial(tmp_path / "runs")


@pytest.fixture(scope="session")
def reference(cluster, tmp_path_factory) -> Trial:
    """An uninterrupted run of the short job, for the exactness comparisons (no warm spare: nothing fails)."""
    t = Trial(tmp_path_factory.mktemp("reference") / "runs")
    r = relaunch("run", str(CONFIG), *SHORT, "recover.spare_workers=0", *t.overrides, "--address", cluster.address)
    assert r.returncode == 0, r.stdout + r.stderr
    return t
