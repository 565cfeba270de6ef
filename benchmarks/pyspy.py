"""Where a running Supervisor spends its time: py-spy sampling the actor's process from outside, no code in it.

`SupervisorProfile` waits (on a thread) for the job's Supervisor actor, asks it for its pid (`progress()`), and
samples it with `py-spy record --idle --format raw` until stopped. `summary` reads the collapsed stacks: the
samples of the thread that runs the steps (under `Controller.run`), split into time spent waiting on workers
(blocked in Ray's get/wait), by the call waited for, and the Supervisor's own work, by function.
"""
from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

RATE = 200  # samples per second
WAITS = ("wait (ray/_private/worker.py", "get (ray/_private/worker.py", "get_objects (ray/_private/worker.py")


def executable() -> str | None:
    """py-spy beside this interpreter (a virtualenv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class SupervisorProfile:
    def __init__(self, config, out: Path):
        self.config, self.out = config, out
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._attach, daemon=True)
        self._thread.start()

    def _attach(self) -> None:
        import ray

        from supervisor.control.actor import NAMESPACE, supervisor_name

        while not self._stop.is_set():
            if not ray.is_initialized():  # the job's driver connects in run_job; never start a Ray here
                time.sleep(0.2)
                continue
            try:
                actor = ray.get_actor(supervisor_name(self.config), namespace=NAMESPACE)
                pid = ray.get(actor.progress.remote(), timeout=10)["supervisor_pid"]
                break
            except Exception:  # noqa: BLE001 - not started yet
                time.sleep(0.2)
        else:
            return
        self.proc = subprocess.Popen([executable(), "record", "--idle", "--format", "raw", "--rate", str(RATE),
                                      "--pid", str(pid), "--output", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop sampling (py-spy writes its file on SIGINT)."""
        self._stop.set()
        self._thread.join()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


def _where(frame: str) -> tuple[str, str]:
    """`name (path/file.py:12)` -> (name, path/file.py)."""
    name, _, where = frame.partition(" (")
    return name, where.rsplit(":", 1)[0]


def _label(frame: str) -> str:
    name, path = _where(frame)
    return f"{name} ({path.rsplit('/', 1)[-1]})"


def _waits(frame: str) -> bool:
    name, path = _where(frame)
    return path.endswith("ray/_private/worker.py") and name in ("get", "wait", "get_objects")


def _ours(frame: str) -> bool:
    return _where(frame)[1].startswith(("supervisor/", "workers/"))


OUTSIDE_STEPS = ("Controller._start", "Controller._shutdown")  # start-up and shutdown: not a step's
PLUMBING = ("_Members.gather", "_Members.call_all", "RolloutGroup._call", "drain", "kill")  # not the call's name


def _call(frames: list[str]) -> str:
    """The relaunch function a wait is for: the innermost of ours that is not the groups' plumbing."""
    names = [_where(f)[0] for f in frames if _ours(f)]
    return next((n for n in reversed(names) if n not in PLUMBING and "<" not in n), "?")


def summary(raw: Path, steps: int, top: int = 8) -> dict:
    """Milliseconds per step of the job's thread (the one under `Controller.run`, start-up and shutdown left out):
    blocked on workers in Ray's
    get/wait, by the call waited for, and its own work: the functions with most self time, and relaunch's
    functions inclusive (leaving out those that hold nearly all of it: the loop itself)."""
    own, inclusive, waits = collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        names = [_where(f)[0] for f in frames]
        if "Controller.run" not in names or any(n in OUTSIDE_STEPS for n in names):
            continue
        n = int(count)
        if any(_waits(f) for f in frames):
            waits[_call(frames)] += n
            continue
        own[_label(frames[-1])] += n
        for label in dict.fromkeys(_label(f) for f in frames if _ours(f)):
            inclusive[label] += n
    mine, waiting = sum(own.values()), sum(waits.values())
    ms = 1000 / RATE / max(steps, 1)
    return {"ms_per_step": (mine + waiting) * ms, "waiting_ms_per_step": waiting * ms, "own_ms_per_step": mine * ms,
            "waits": [(f, n * ms) for f, n in waits.most_common(top)],
            "top_self": [(f, n * ms) for f, n in own.most_common(top)],
            "top_inclusive": [(f, n * ms) for f, n in inclusive.most_common() if n < 0.9 * mine][:top]}
