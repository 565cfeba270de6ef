"""Real Ray clusters on this machine for the end-to-end tests, and helpers to run and break jobs.

One multi-node cluster is shared by the module that asks for it (head + two 3-CPU worker nodes, so a
TrainGroup fits on one node and the other is a spare). Every cluster gets its own temp dir and ports;
nodes are killed only through the process ids this suite started (the raylet and all its descendants).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_grpo.yaml"
# The job the fault tests break: two epochs (24 steps), a recover checkpoint every 5 steps.
SHORT = ["total_train_epochs=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_tmp(prefix: str) -> Path:
    # Ray's unix sockets live under the temp dir; pytest's own paths are too long for them.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it at once (a node's raylet and all its workers)."""
    pids = descendants(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def kill_session(sid: int) -> None:
    """SIGKILL a driver started with start_new_session and its whole embedded Ray cluster."""
    for p in session_pids(sid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(extra or {})
    return env


def relaunch(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=REPO, env=env or job_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_relaunch(*args: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "supervisor", *args], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


class Trial:
    """Paths of one trial under its own fileroot."""

    def __init__(self, fileroot: Path):
        self.fileroot = fileroot
        user = __import__("getpass").getuser()
        self.root = fileroot / "checkpoints" / user / "tiny-grpo" / "trial0"
        self.logs = fileroot / "logs" / user / "tiny-grpo" / "trial0"

    @property
    def overrides(self) -> list[str]:
        return [f"cluster.fileroot={self.fileroot}"]

    def stats(self) -> list[dict]:
        path = self.logs / "stats.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def events(self, name: str | None = None) -> list[dict]:
        path = self.logs / "events.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if name is None or r["event"] == name]

    def exports(self) -> list[Path]:
        d = self.root / "default"
        return sorted((p for p in d.iterdir() if p.name.startswith("epoch")),
                      key=lambda p: int(p.name.rsplit("globalstep", 1)[1])) if d.exists() else []

    def final_weights(self) -> bytes:
        return (self.exports()[-1] / "model.safetensors").read_bytes()

    def wait_for_step(self, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.stats() and self.stats()[-1]["global_step"] >= step:
                return
            assert proc.poll() is None, f"job ended early with {proc.returncode}"
            time.sleep(0.2)
        raise TimeoutError(f"step {step} not reached")


def curve(stats: list[dict]) -> list[tuple]:
    """What must match between an interrupted and an uninterrupted run: every step's metrics."""
    return [(r["global_step"], r["reward"], r["loss"], r["grad_norm"]) for r in stats]


def status_json(trial: Trial, *extra: str) -> dict:
    r = relaunch("status", str(CONFIG), *trial.overrides, *extra, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class MultiNodeCluster:
    def __init__(self):
        from ray.cluster_utils import Cluster

        self.temp_dir = short_tmp("rlc")
        self.cluster = Cluster()
        self.head = self.cluster.add_node(
            num_cpus=1, object_store_memory=150 * 1024**2, gcs_server_port=free_port(), temp_dir=str(self.temp_dir),
            include_dashboard=False, _system_config={
                "health_check_period_ms": 500, "health_check_failure_threshold": 3,
                "health_check_timeout_ms": 500, "health_check_initial_delay_ms": 0,
            })
        self.workers = [self.cluster.add_node(num_cpus=3, object_store_memory=150 * 1024**2) for _ in range(2)]
        self.address = self.cluster.address

    def node_of(self, node_id: str):
        return next(n for n in self.workers if n.node_id == node_id)

    def kill_node(self, node) -> None:
        """End the node's raylet and every process under it at once, then forget it."""
        kill_tree(node.all_processes["raylet"][0].process.pid)
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def add_spare(self):
        node = self.cluster.add_node(num_cpus=3, object_store_memory=150 * 1024**2)
        self.workers.append(node)
        return node

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = MultiNodeCluster()
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def trial(tmp_path) -> Trial:
    return Trial(tmp_path / "runs")


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> Trial:
    """An uninterrupted run of the short job, for the exactness comparisons."""
    t = Trial(tmp_path_factory.mktemp("reference") / "runs")
    r = relaunch("run", str(CONFIG), *SHORT, *t.overrides, "--address", cluster.address)
    assert r.returncode == 0, r.stdout + r.stderr
    return t
