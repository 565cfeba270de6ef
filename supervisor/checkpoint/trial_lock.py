"""One trial, one run: an exclusive lock file in the trial's directory, held by the driver for the whole run.

The lock lives beside the trial's checkpoints, so it holds across separate Ray clusters and across machines that
share the fileroot. It names its holder (host, pid, the process's start time, the job's token) and a heartbeat
that a thread of the holder refreshes every `REFRESH_SECS`. The driver holds it, not the Supervisor actor: the
driver lives as long as the run (a Supervisor that Ray restarts runs under the same driver, and a `relaunch
submit` job's driver is its entrypoint), and an actor dies with its driver.

A lock left by a dead holder is taken over:
- same host (its name, and its kernel's boot id and pid namespace: machines or containers that share a host name
  are other hosts): the holder's pid is gone, or now belongs to another process (its start time differs);
- other host: its heartbeat is older than `LEASE_SECS` (for a lock file, by this machine's clock: hosts' clocks
  must agree to well within the lease, as NTP keeps them; for a lock in a bucket, by the store's own clock).

Taking the lock is one `link` of a complete file onto the lock's name, which fails when the name exists (on NFS
too), so two contenders never both win. A stale lock is first renamed aside, and only the lock that was judged
stale is discarded.

With an `s3://` fileroot the lock is an object in the bucket, where the trial's checkpoints are, so that heads
which share only the bucket keep apart too (`BucketLock`): S3's conditional requests stand in for link and rename.
It is created only where no object is (If-None-Match), and refreshed, discarded or released only while it is the
very object that was judged or written (If-Match on its ETag). Its heartbeat's age is the store's: the time of
the answer less the object's last modification, both by the store's clock.

A holder that finds its lock no longer its own (another run took it over, its heartbeat having gone stale), or
that could not refresh it for `FENCE_SECS` less than the lease (its disk or store cut off), records why in `lost`:
the driver then stops its run before another may start, so that two runs never write one trial.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

from supervisor.checkpoint.layout import ObjectPath, TrialLayout


LEASE_SECS = 60.0    # another host's lock without a heartbeat for this long is stale
REFRESH_SECS = 10.0  # how often the holder refreshes its heartbeat
FENCE_SECS = 20.0    # a holder that could not refresh for its lease less this gives the trial up first


class TrialLocked(Exception):
    """The trial is run by a live holder; the message names it."""


class LockLost(Exception):
    """This run's lock is no longer surely its own: it must write nothing more to the trial."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float | None  # the process's start time (seconds since boot on Linux), None where unknown
    token: str
    heartbeat: float       # wall clock of the holder's last refresh
    machine: str | None = None  # the kernel's boot id and the pid namespace (`this_machine`); None in older locks

    def describe(self, age: float) -> str:
        """`age`: seconds since its last heartbeat."""
        return (f"pid {self.pid} on {self.host} (heartbeat {max(0.0, age):.0f} s ago, "
                f"token {self.token})")


def stale_reason(holder: Holder, host: str, age: float, running_since: float | None,
                 lease: float = LEASE_SECS, machine: str | None = None) -> str | None:
    """Why `holder`'s lock is left by a dead run, or None while it may be alive. Pure.

    `age`: seconds since the holder's last heartbeat. `running_since`: the start time of the process that has `holder.pid` on this host now (None: no such
    process); it only counts when the holder is on this host, and on this `machine` when its lock names one."""
    if holder.host == host and (holder.machine is None or holder.machine == machine):
        if running_since is None:
            return f"its pid {holder.pid} is gone"
        if holder.started is not None and running_since != holder.started:
            return f"its pid {holder.pid} now belongs to another process"
        return None
    if age > lease:
        return f"its heartbeat is {age:.0f} s old (lease {lease:.0f} s)"
    return None


def this_machine() -> str | None:
    """What tells this kernel and pid namespace from another's with the same host name (None: not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/pidns:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def process_start(pid: int) -> float | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None when there is none or it has
    exited (a zombie its parent has not reaped yet holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # not Linux: only whether the pid exists is known
        return _pid_exists(pid)
    fields = stat.rsplit(")", 1)[1].split()  # after the command name in parentheses: field 3 on
    if fields[0] in ("Z", "X"):
        return None
    return float(fields[19])  # field 22, starttime


def _pid_exists(pid: int) -> float | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0.0


class TrialLock:
    """The lock of one trial's directory: `acquire` (or TrialLocked naming the holder), `release`, and a
    heartbeat thread while held."""

    def __init__(self, path: Path, lease: float = LEASE_SECS):
        self.path, self.lease = path, lease
        self.holder: Holder | None = None
        self.lost: str | None = None  # why the lock is no longer this run's, once the heartbeat found it so
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> Holder | None:
        """The holder named in the lock file; None when there is no lock. A file that is not a lock (torn by
        hand, or another tool's) is named as such rather than guessed at."""
        data = self._load()
        if data is None:
            return None
        try:
            return Holder(**json.loads(data))
        except (ValueError, TypeError) as e:
            raise TrialLocked(f"{self.path}: not a relaunch lock file ({e}); remove it if no run uses this trial") from e

    def live_holder(self) -> Holder | None:
        """The holder when it may be alive, None when the trial is free (no lock, or a stale one)."""
        holder = self.read()
        if holder is None:
            return None
        reason = stale_reason(holder, socket.gethostname(), self._age(holder), process_start(holder.pid),
                              self.lease, this_machine())
        return None if reason else holder

    def check_held(self, token: str) -> None:
        """LockLost unless the lock names `token` and its heartbeat is younger than the lease less FENCE_SECS: the
        Supervisor asks before each commit, so that a run whose driver is frozen (its heartbeat stopped while
        the Supervisor trains on) stops committing before another run may take the trial over."""
        holder = self._read_quietly()
        if holder is None or holder.token != token:
            raise LockLost(f"{self.path} is no longer held by this run: " +
                           (f"it is held by {holder.describe(self._age(holder))}" if holder else "it is gone"))
        if (age := self._age(holder)) > self.lease - FENCE_SECS:
            raise LockLost(f"{self.path} was not refreshed by this run's driver for {age:.0f} s (frozen, or cut off "
                           f"from the store): after {self.lease:.0f} s another run may take the trial over")

    def check_free(self) -> None:
        """TrialLocked, naming the holder, when a live run holds the trial; writes nothing."""
        holder = self.live_holder()
        if holder is not None:
            raise self._refusal(holder)

    def _refusal(self, holder: Holder) -> TrialLocked:
        return TrialLocked(f"trial is already running: {self.path} is held by {holder.describe(self._age(holder))}")

    def acquire(self) -> str | None:
        """Take the lock; return why a stale lock was taken over (None: there was none). TrialLocked when a live
        run holds it. Creates the trial's directory, and nothing else, when it is missing."""
        pid = os.getpid()
        me = Holder(socket.gethostname(), pid, process_start(pid), uuid.uuid4().hex[:12], time.time(), this_machine())
        self._make_parent()
        taken_over = None
        for _ in range(3):  # a stale lock removed, then someone else's may appear: look again
            holder = self.read()
            if holder is not None:
                if holder.token == me.token:  # our own create landed though its answer was lost, and was retried
                    self._claim(me)
                    return taken_over
                age = self._age(holder)
                reason = stale_reason(holder, me.host, age, process_start(holder.pid), self.lease, me.machine)
                if reason is None:
                    raise self._refusal(holder)
                if self._discard(holder):
                    taken_over = f"took over the lock of {holder.describe(age)}: {reason}"
            if self._create(me):
                self._claim(me)
                return taken_over
        raise TrialLocked(f"{self.path}: could not take the lock (others keep taking it)")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still ours."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self.holder and self._ours():
            self._remove()
        self.holder = None

    def __enter__(self) -> "TrialLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- file operations ----------------------------------------------------------------------
    def _age(self, holder: Holder) -> float:
        """Seconds since `holder`'s last heartbeat (the lock as last read)."""
        return time.time() - holder.heartbeat

    def _load(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def _make_parent(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _beside(self) -> Path:
        """A fresh name next to the lock (not a `.tmp.` name: the Supervisor's cleanup of interrupted saves
        removes those, and it runs while the lock is held)."""
        return self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex[:8]}")

    def _write_tmp(self, holder: Holder) -> Path:
        tmp = self._beside()
        with open(tmp, "w") as f:
            json.dump(asdict(holder), f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _create(self, holder: Holder) -> bool:
        """Publish a complete lock file under the lock's name, only when that name is free."""
        tmp = self._write_tmp(holder)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _discard(self, stale: Holder) -> bool:
        """Rename the lock aside; keep it gone only when it is the stale one judged, else put it back."""
        aside = self._beside()
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = Holder(**json.loads(aside.read_text()))
        except (ValueError, TypeError):
            moved = None
        if moved is not None and moved.token != stale.token:
            try:
                os.link(aside, self.path)  # a live run took it meanwhile: give it back
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
        return moved is not None and moved.token == stale.token

    def _ours(self) -> bool:
        holder = self._read_quietly()
        return holder is not None and self.holder is not None and holder.token == self.holder.token

    def _read_quietly(self) -> Holder | None:
        """The holder, None also when the lock is not a relaunch lock."""
        try:
            return self.read()
        except TrialLocked:
            return None

    def _claim(self, me: Holder) -> None:
        """The lock is ours: hold it, and keep its heartbeat."""
        self.holder = me
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="trial-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        refreshed, missing = time.monotonic(), 0
        while not self._stop.wait(REFRESH_SECS):
            try:
                holder = self._read_quietly()
                if holder is None or holder.token != self.holder.token:
                    # gone twice in a row (not once: a contender's discard renames it aside and back), or another's
                    missing = missing + 1 if holder is None else 2
                    if missing >= 2:
                        self.lost = f"{self.path} is no longer held by this run: " + \
                            (f"it is held by {holder.describe(self._age(holder))}" if holder else "it is gone")
                        return  # the driver stops its run and says why
                    continue
                missing = 0
                self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
                self._refresh(self.holder)
                refreshed = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a full or unreachable disk or store: the next beat tries again
                print(f"relaunch: warning: cannot refresh {self.path}: {type(e).__name__}: {e}", flush=True)
                if time.monotonic() - refreshed > self.lease - FENCE_SECS:  # give up before anyone may take over
                    self.lost = f"{self.path} could not be refreshed for {time.monotonic() - refreshed:.0f} s; " \
                                f"after {self.lease:.0f} s another run may take the trial over"
                    return

    def _refresh(self, holder: Holder) -> None:
        os.replace(self._write_tmp(holder), self.path)


class BucketLock(TrialLock):
    """The trial's lock as an object in an S3 bucket, taken and given up with conditional requests."""

    def __init__(self, path: ObjectPath, lease: float = LEASE_SECS):
        from supervisor.checkpoint.storage import filesystem

        super().__init__(path, lease)
        self.s3 = filesystem(path.protocol, timeout=10)
        self.bucket, self.key = path.key.split("/", 1)
        self._judged: str | None = None   # the ETag of the lock object as last read
        self._written: str | None = None  # the ETag of the lock object as this run last wrote it
        self._judged_age = 0.0            # its age as last read, by the store's clock

    def _call(self, method: str, **kwargs) -> dict:
        return self._store(lambda: self.s3.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs))

    def _store(self, fn):
        """`fn()`, whatever the store's client raised for a store that does not answer made an OSError."""
        try:
            return fn()
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - botocore's connection errors are not OSErrors
            raise OSError(errno.EIO, f"the store did not answer ({type(e).__name__}: {e})", str(self.path)) from e

    def _load(self) -> str | None:
        try:  # the ETag first: a discard then matches only the object read, or an older one, never a newer
            head = self._call("head_object")
            self._judged = head["ETag"]
            answered = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
            self._judged_age = (answered - head["LastModified"]).total_seconds()
            return self._store(lambda: self.s3.cat_file(self.path.key)).decode()
        except FileNotFoundError:
            self._judged = None
            return None

    def _age(self, holder: Holder) -> float:
        return self._judged_age  # the object's, by the store's clock: no host's clock enters

    def _claim(self, me: Holder) -> None:
        if self._written is None:  # our object, found on a read: its ETag is the one read
            self._written = self._judged
        super()._claim(me)

    def _make_parent(self) -> None:
        pass  # a bucket's prefixes need no making

    def _create(self, holder: Holder) -> bool:
        try:
            self._written = self._call("put_object", Body=json.dumps(asdict(holder)).encode(), IfNoneMatch="*")["ETag"]
            return True
        except FileExistsError:
            return False

    def _discard(self, stale: Holder) -> bool:
        return self._delete_if(self._judged)

    def _refresh(self, holder: Holder) -> None:
        body = json.dumps(asdict(holder)).encode()
        try:
            self._written = self._call("put_object", Body=body, IfMatch=self._written)["ETag"]
        except OSError as e:
            if not (_precondition_failed(e) and self._adopt()):
                raise  # the next beat tries again; a lock taken over meanwhile is no longer ours (`_ours`)
            self._written = self._call("put_object", Body=body, IfMatch=self._written)["ETag"]

    def _remove(self) -> None:
        if not self._delete_if(self._written) and self._adopt():
            self._delete_if(self._written)

    def _adopt(self) -> bool:
        """A write of ours may have landed without its answer reaching us (a timeout): its ETag is not the one
        we hold. When the object still names this run, take its ETag as ours."""
        if not self._ours():  # reads the object, and its ETag first
            return False
        self._written = self._judged
        return True

    def _delete_if(self, etag: str | None) -> bool:
        """Delete the lock object only while it is the one with `etag`."""
        try:
            self._call("delete_object", IfMatch=etag)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise


def _precondition_failed(e: OSError) -> bool:
    response = getattr(e.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") == "PreconditionFailed"


def trial_lock(layout: TrialLayout) -> TrialLock:
    """The trial's lock: in the bucket on an `s3://` fileroot, else a file (under `cluster.local_root` for
    another URL, whose store has no conditional requests we use)."""
    if isinstance(layout.lock, ObjectPath):
        return BucketLock(layout.lock)
    return TrialLock(layout.lock)
