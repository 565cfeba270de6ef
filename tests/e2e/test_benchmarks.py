"""Every benchmark runs in its quick mode, so that none of them rots: it prints its table and its JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, job_env

pytestmark = pytest.mark.e2e


def bench(name: str, *args: str, tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--quick", "--json", str(out), *args], cwd=REPO,
                       env=job_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text()) | {"stdout": r.stdout}


def test_generation_benchmark(tmp_path):
    figures = bench("generation", tmp_path=tmp_path)
    assert figures["rows"] and all(row["same_tokens"] for row in figures["rows"])
    assert "speed-up" in figures["stdout"]


def test_recovery_benchmark(cluster, tmp_path):
    figures = bench("recovery", "--address", cluster.address, tmp_path=tmp_path)
    assert figures["identical"] and figures["recovery"]["total"] > 0
    # side by side: without spares both ranks start cold; with two, both come from the pool
    runs = [(r["spare_workers"], r["ranks_from_spares"], r["cold_ranks"]) for r in figures["runs"]]
    assert runs == [(0, 0, 2), (2, 2, 0)]
    assert "failure -> next completed step" in figures["stdout"]
