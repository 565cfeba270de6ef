"""The trial lock: when a holder is stale (pure), and taking, refusing and taking over real lock files."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from supervisor.checkpoint.trial_lock import LEASE_SECS, Holder, TrialLock, TrialLocked, process_start, stale_reason

NOW = 1_000_000.0


def holder(host="here", pid=42, started=7.0, heartbeat=NOW) -> Holder:
    return Holder(host=host, pid=pid, started=started, token="t0", heartbeat=heartbeat)


@pytest.mark.parametrize("h, running_since, stale", [
    (holder(), 7.0, None),                                             # same host, same process: alive
    (holder(heartbeat=NOW - 10 * LEASE_SECS), 7.0, None),              # a live pid on this host needs no heartbeat
    (holder(), None, "its pid 42 is gone"),
    (holder(), 8.0, "its pid 42 now belongs to another process"),      # pid reused
    (holder(started=None), 8.0, None),                                 # start time unknown: the pid counts
    (holder(host="there", heartbeat=NOW - LEASE_SECS + 1), None, None),  # other host, within its lease
    (holder(host="there", heartbeat=NOW - LEASE_SECS - 1), 7.0,
     f"its heartbeat is {LEASE_SECS + 1:.0f} s old (lease {LEASE_SECS:.0f} s)"),
])
def test_stale_reason(h, running_since, stale):
    assert stale_reason(h, "here", NOW, running_since) == stale


def test_a_zombie_holds_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while process_start(proc.pid) is not None and time.time() < deadline:  # exited, not reaped yet
        time.sleep(0.05)
    assert process_start(proc.pid) is None and proc.poll() == 0
    assert process_start(os.getpid()) is not None


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(path, h: Holder) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(h)))


def test_a_live_holder_is_refused_and_named(tmp_path):
    path = tmp_path / "trial" / "run.lock"
    first = TrialLock(path)
    assert first.acquire() is None
    try:
        with pytest.raises(TrialLocked, match=rf"held by pid {os.getpid()} on {socket.gethostname()}"):
            TrialLock(path).acquire()
        assert json.loads(path.read_text())["token"] == first.holder.token
        assert sorted(p.name for p in path.parent.iterdir()) == ["run.lock"]  # the refused one left nothing
    finally:
        first.release()
    assert not path.exists()


@pytest.mark.parametrize("planted, why", [
    (lambda: holder(host=socket.gethostname(), pid=dead_pid(), heartbeat=time.time()), "is gone"),
    (lambda: holder(host=socket.gethostname(), pid=os.getpid(), started=-1.0, heartbeat=time.time()),
     "now belongs to another process"),
    (lambda: holder(host="elsewhere", heartbeat=time.time() - LEASE_SECS - 5), "heartbeat is"),
])
def test_a_dead_holders_lock_is_taken_over(tmp_path, planted, why):
    path = tmp_path / "run.lock"
    plant(path, planted())
    lock = TrialLock(path)
    assert why in lock.acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert json.loads(path.read_text())["started"] == process_start(os.getpid())
    lock.release()


def test_another_hosts_live_lease_is_respected(tmp_path):
    path = tmp_path / "run.lock"
    plant(path, holder(host="elsewhere", heartbeat=time.time() - 5))
    with pytest.raises(TrialLocked, match="held by pid 42 on elsewhere"):
        TrialLock(path).acquire()
    assert json.loads(path.read_text())["host"] == "elsewhere"


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    path = tmp_path / "run.lock"
    lock = TrialLock(path)
    lock.acquire()
    plant(path, holder(host="elsewhere", heartbeat=time.time()))  # taken over while we were frozen
    lock.release()
    assert json.loads(path.read_text())["host"] == "elsewhere"


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    path = tmp_path / "run.lock"
    lock = TrialLock(path)
    lock.acquire()
    first = json.loads(path.read_text())
    time.sleep(0.5)
    later = json.loads(path.read_text())
    lock.release()
    assert later["heartbeat"] > first["heartbeat"] and later["token"] == first["token"]
