"""The trial lock: when a holder is stale (pure), and taking, refusing and taking over real lock files."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from supervisor.checkpoint.layout import as_path
from supervisor.checkpoint.storage import storage_for
from supervisor.checkpoint.trial_lock import (LEASE_SECS, BucketLock, Holder, LockLost, TrialLock, TrialLocked,
                                              process_start, stale_reason)

NOW = 1_000_000.0


def holder(host="here", pid=42, started=7.0, heartbeat=NOW, machine=None) -> Holder:
    return Holder(host=host, pid=pid, started=started, token="t0", heartbeat=heartbeat, machine=machine)


@pytest.mark.parametrize("h, running_since, stale", [
    (holder(), 7.0, None),                                             # same host, same process: alive
    (holder(heartbeat=NOW - 10 * LEASE_SECS), 7.0, None),              # a live pid on this host needs no heartbeat
    (holder(), None, "its pid 42 is gone"),
    (holder(), 8.0, "its pid 42 now belongs to another process"),      # pid reused
    (holder(started=None), 8.0, None),                                 # start time unknown: the pid counts
    (holder(host="there", heartbeat=NOW - LEASE_SECS + 1), None, None),  # other host, within its lease
    (holder(machine="boot-b/pidns:4"), None, None),  # this host's name on another machine or container: its lease
    (holder(host="there", heartbeat=NOW - LEASE_SECS - 1), 7.0,
     f"its heartbeat is {LEASE_SECS + 1:.0f} s old (lease {LEASE_SECS:.0f} s)"),
])
def test_stale_reason(h, running_since, stale):
    assert stale_reason(h, "here", NOW - h.heartbeat, running_since) == stale


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


class Room:
    """One lock's place: a file, or an object in the S3 server's bucket."""

    def __init__(self, path):
        self.path = path
        self.bucket = not isinstance(path, Path)
        self.fs = storage_for(path, retry_secs=5)
        self.lease = LEASE_SECS

    def lock(self) -> TrialLock:
        return BucketLock(self.path, self.lease) if self.bucket else TrialLock(self.path, self.lease)

    def read(self) -> dict | None:
        return json.loads(self.fs.read_bytes(self.path)) if self.fs.is_file(self.path) else None

    def plant(self, h: Holder) -> None:
        self.fs.mkdir(self.path.parent)
        self.fs.write_bytes(self.path, json.dumps(asdict(h)).encode())

    def plant_stale(self, host="elsewhere") -> None:
        """Another host's lock whose heartbeat is past its lease: in a file, by its heartbeat; in a bucket, by the
        store's clock only (its heartbeat field says now), with a lease of 1 s."""
        if self.bucket:
            self.plant(holder(host=host, heartbeat=time.time()))
            self.lease = 1.0
            time.sleep(2.1)  # the store's clock counts whole seconds
        else:
            self.plant(holder(host=host, heartbeat=time.time() - LEASE_SECS - 5))

    def siblings(self) -> list[str]:
        return sorted(p.name for p in self.fs.iterdir(self.path.parent))


@pytest.fixture(params=["file", "bucket"])
def room(request, tmp_path) -> Room:
    if request.param == "file":
        return Room(tmp_path / "trial" / "run.lock")
    return Room(as_path(request.getfixturevalue("s3_server").url(tmp_path.name)) / "trial" / "run.lock")


def test_a_live_holder_is_refused_and_named(room):
    first = room.lock()
    assert first.acquire() is None
    try:
        with pytest.raises(TrialLocked, match=rf"held by pid {os.getpid()} on {socket.gethostname()}"):
            room.lock().acquire()
        assert room.read()["token"] == first.holder.token
        assert room.siblings() == ["run.lock"]  # the refused one left nothing
    finally:
        first.release()
    assert room.read() is None


@pytest.mark.parametrize("planted, why", [
    (lambda: holder(host=socket.gethostname(), pid=dead_pid(), heartbeat=time.time()), "is gone"),
    (lambda: holder(host=socket.gethostname(), pid=os.getpid(), started=-1.0, heartbeat=time.time()),
     "now belongs to another process"),
    (None, "heartbeat is"),  # another host's, past its lease
])
def test_a_dead_holders_lock_is_taken_over(room, planted, why):
    room.plant(planted()) if planted else room.plant_stale()
    lock = room.lock()
    assert why in lock.acquire()
    assert room.read()["pid"] == os.getpid()
    assert room.read()["started"] == process_start(os.getpid())
    lock.release()


def test_another_hosts_live_lease_is_respected(room):
    room.plant(holder(host="elsewhere", heartbeat=time.time() - 5))
    with pytest.raises(TrialLocked, match="held by pid 42 on elsewhere"):
        room.lock().acquire()
    assert room.read()["host"] == "elsewhere"


def test_a_bucket_lock_is_judged_by_the_stores_clock_not_its_holders(s3_server, tmp_path):
    """A holder whose clock runs an hour behind writes heartbeats that look an hour old: in a bucket its lock,
    refreshed by the store's clock just now, is live."""
    room = Room(as_path(s3_server.url(tmp_path.name)) / "trial" / "run.lock")
    room.plant(holder(host="elsewhere", heartbeat=time.time() - 3600))
    with pytest.raises(TrialLocked, match=r"held by pid 42 on elsewhere \(heartbeat \d s ago"):  # not 3600
        room.lock().acquire()
    assert room.read()["host"] == "elsewhere"


def test_release_leaves_a_lock_that_is_no_longer_ours(room):
    lock = room.lock()
    lock.acquire()
    room.plant(holder(host="elsewhere", heartbeat=time.time()))  # taken over while we were frozen
    lock.release()
    assert room.read()["host"] == "elsewhere"


def test_a_holder_whose_lock_was_taken_over_knows_it_lost_it_and_by_whom(room, monkeypatch):
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    lock = room.lock()
    lock.acquire()
    assert lock.lost is None
    room.plant(holder(host="elsewhere", heartbeat=time.time()))  # taken over while our heartbeat was stale
    deadline = time.time() + 10
    while lock.lost is None and time.time() < deadline:
        time.sleep(0.05)
    lock.release()
    assert lock.lost.startswith(f"{room.path} is no longer held by this run: it is held by pid 42 on elsewhere")
    assert room.read()["host"] == "elsewhere"


def test_a_holder_cut_off_from_its_lock_gives_the_trial_up_before_its_lease_runs_out(room, monkeypatch):
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.FENCE_SECS", LEASE_SECS - 0.5)  # gives up after 0.5 s
    lock = room.lock()
    lock.acquire()
    lock._refresh = lambda holder: (_ for _ in ()).throw(OSError(5, "the store did not answer"))
    deadline = time.time() + 10
    while lock.lost is None and time.time() < deadline:
        time.sleep(0.05)
    lock.release()
    assert lock.lost is not None and "could not be refreshed for" in lock.lost


def test_a_lock_missing_for_one_beat_is_not_lost(room, monkeypatch):
    """A contender's discard renames the lock aside and back: one beat may find none."""
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    lock = room.lock()
    lock.acquire()
    reads, real = [], lock.read
    lock.read = lambda: None if len(reads.append(1) or reads) == 1 else real()  # the first beat finds none
    deadline = time.time() + 10
    while len(reads) < 4 and time.time() < deadline:  # three beats after the one that found none
        time.sleep(0.05)
    assert lock.lost is None and len(reads) >= 4
    lock.release()


def test_the_supervisors_check_before_a_commit(room, monkeypatch):
    """Held and refreshed: nothing. Another's, or gone: LockLost naming that. Not refreshed for the lease less
    FENCE_SECS (its driver frozen): LockLost, before anyone may take it over."""
    lock = room.lock()
    lock.acquire()
    token = lock.holder.token
    lock.check_held(token)
    with pytest.raises(LockLost, match="it is held by pid"):
        lock.check_held("another")
    lock._stop.set()  # the driver freezes: no more heartbeats
    lock._thread.join()
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.FENCE_SECS", LEASE_SECS - 1.0)
    time.sleep(2.1)  # a bucket's clock counts whole seconds
    with pytest.raises(LockLost, match="was not refreshed by this run's driver for"):
        lock.check_held(token)
    lock.release()
    with pytest.raises(LockLost, match="it is gone"):
        lock.check_held(token)


def test_a_stale_lock_replaced_by_a_live_one_after_it_was_judged_is_not_discarded(room):
    """Two contenders judge the same stale lock; the first takes it over; the second's discard must not remove
    the first's live lock (a rename aside and back on a file, a delete conditional on the ETag in a bucket)."""
    room.plant_stale()
    late = room.lock()
    stale = late.read()
    first = room.lock()
    first.acquire()
    assert late._discard(stale) is False
    assert room.read()["token"] == first.holder.token
    first.release()


def test_the_holder_refreshes_its_heartbeat(room, monkeypatch):
    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    lock = room.lock()
    lock.acquire()
    first = room.read()
    time.sleep(0.5)
    later = room.read()
    lock.release()
    assert later["heartbeat"] > first["heartbeat"] and later["token"] == first["token"]


def test_a_heartbeat_whose_answer_was_lost_is_not_the_end_of_the_lock(s3_server, tmp_path):
    """A refresh that landed in the bucket while its answer was lost (a timeout) leaves this run holding an
    ETag the object no longer has: the next refresh and the release still work, the lock being ours."""
    room = Room(as_path(s3_server.url(tmp_path.name)) / "trial" / "run.lock")
    lock = room.lock()
    lock.acquire()
    lock._stop.set()  # no background beats: this test beats by hand
    lock._thread.join()
    room.plant(Holder(**{**asdict(lock.holder), "heartbeat": time.time()}))  # our write, its answer lost
    lock._refresh(Holder(**{**asdict(lock.holder), "heartbeat": time.time() + 1}))
    assert room.read()["heartbeat"] > lock.holder.heartbeat
    lock.release()
    assert room.read() is None


def test_a_store_that_fails_a_heartbeat_does_not_stop_the_next(room, monkeypatch, capsys):
    from botocore.exceptions import EndpointConnectionError

    monkeypatch.setattr("supervisor.checkpoint.trial_lock.REFRESH_SECS", 0.05)
    lock = room.lock()
    calls = []
    real = lock._refresh

    def flaky(holder):
        calls.append(holder)
        if len(calls) == 1:  # what s3fs lets through when the endpoint does not answer: not an OSError
            raise EndpointConnectionError(endpoint_url="http://store:9000")
        real(holder)

    lock._refresh = flaky
    lock.acquire()
    first = room.read()["heartbeat"]
    time.sleep(0.5)
    later = room.read()["heartbeat"]
    lock.release()
    assert len(calls) >= 3 and later > first
    assert "cannot refresh" in capsys.readouterr().out


def test_a_create_that_landed_though_its_answer_was_lost_is_ours(room):
    """The store took the lock's create, the answer was lost, the retried create found the object there: the
    object names this run, which holds it (it once refused itself, naming its own pid)."""
    lock = room.lock()
    real = lock._create
    lock._create = lambda me: real(me) and False
    assert lock.acquire() is None
    assert room.read()["token"] == lock.holder.token
    lock.release()
    assert room.read() is None
