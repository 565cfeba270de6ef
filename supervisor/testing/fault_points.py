"""Named fault points, so crash tests hit exact moments instead of lucky timings.

`RELAUNCH_FAULT="point:action[:step=G][:rank=R][:role=critic],..."` arms points. Every method the Supervisor
calls on a TrainWorker or RolloutWorker has two points, `{Class}.{method}.enter` and `.exit`
(`TrainWorker.train.enter`, `RolloutWorker.generate.exit`, ...; the engine's constructor too,
`RolloutWorker.__init__.enter`); `rank=` is the TrainWorker's rank or the engine's index, and `role=critic` arms a
point in the critic's TrainWorkers only (without it, a TrainWorker point is the actor's). The step of a call is its
`global_step` argument, or for `update_weights_from_distributed` the step whose update made the weights
(version - 1); `where`, `setup`, `load_recover`, `init_weights_update_group` and `weight_status` run at (re)starts
and resyncs and have none, so a point armed there without `step=` fires at the first call. A TrainWorker's rank is
the one it has (or, in `where` and `setup`, is about to take) in its group; a warm spare's `TrainWorker.warm` has
no rank.
Listing a point twice arms it twice. The Supervisor has a point at every phase boundary of a step (`step.begin`, `step.rolled_out`,
`step.scored`, `step.trained`, `step.pushed`, `step.exported`, `step.evaluated`, `step.logged`,
`step.saved`), and the recover store one at every write of a checkpoint; `after_object` in a rank that uploads
to an object store, once the first object of its part is there. `background_write` fires in a
TrainWorker's writer thread while a background recover save is being written; `weights_written` in a rank
that has written its part of a shared-memory weight sync, before its peers have; `memory_send` in a
TrainWorker's memory-tier sender thread, as it begins to send a step's copy to its holder.

Actions: `kill` (SIGKILL this process), `stop` (SIGSTOP it: a frozen process, seen only as a hang), `hang`
(sleep forever), `pause` (wait until the test creates `go` in `RELAUNCH_FAULT_DIR`, at most 300 s; each `go` ends
one pause), `killjob` (SIGKILL every process of this session: a local job's driver and its whole
embedded Ray cluster), `enospc` (raise a disk-full OSError). At the Supervisor's points, `kill_rank`,
`stop_rank`, `kill_engine` and `stop_engine` break the last TrainWorker or the first engine instead, and
`wait_spares` waits until the spare pools (TrainWorkers, and engines) are full and warm.
Each armed fault fires once: a marker file in `RELAUNCH_FAULT_DIR` remembers it across restarts, so a
restarted process goes on. Nothing is armed unless both variables are set; the driver forwards them.
"""
from __future__ import annotations

import errno
import functools
import inspect
import os
import signal
import time
from pathlib import Path

from supervisor.testing.processes import command_line, kill_all, session_members

ENV_VARS = ("RELAUNCH_FAULT", "RELAUNCH_FAULT_DIR")
PAUSE_SECS = 300.0


def armed(point: str, step: int | None = None, rank: int | None = None, role: str | None = None) -> str | None:
    """The action armed at this point for this step, rank and role, marked as fired; None when nothing is."""
    spec, marker_dir = os.environ.get("RELAUNCH_FAULT"), os.environ.get("RELAUNCH_FAULT_DIR")
    if not spec or not marker_dir:
        return None
    for i, entry in enumerate(spec.split(",")):
        name, action, *conds = entry.strip().split(":")
        where = dict(c.split("=", 1) for c in conds)
        if name != point:
            continue
        if "step" in where and int(where["step"]) != step:
            continue
        if "rank" in where and rank is not None and int(where["rank"]) != rank:
            continue
        if where.get("role", "actor") != (role or "actor"):
            continue
        marker = Path(marker_dir) / f"fired-{i}-{name}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            continue
        return action
    return None


def _kill_job() -> None:
    """SIGKILL this local job's whole session: its driver, every actor and the embedded Ray cluster."""
    sid = os.getsid(0)
    leader = command_line(sid)
    if "supervisor" not in leader and not any(arg.endswith("relaunch") for arg in leader):
        raise RuntimeError("fault action killjob needs a relaunch driver that leads its own session")
    kill_all(session_members(sid))


def _pause(bound: float = PAUSE_SECS) -> None:
    """Wait until the test creates `go` in RELAUNCH_FAULT_DIR (taken, so that the next pause waits again)."""
    go, deadline = Path(os.environ["RELAUNCH_FAULT_DIR"]) / "go", time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            go.unlink()
            return
        except FileNotFoundError:
            time.sleep(0.05)
    raise RuntimeError(f"paused at a fault point: no `go` came within {bound:.0f}s")


def fault_point(point: str, step: int | None = None, rank: int | None = None, role: str | None = None) -> None:
    apply(armed(point, step, rank, role), point)


def apply(action: str | None, point: str, pid: int | None = None) -> None:
    """Carry out `action` on this process, or on `pid` for kill and stop."""
    if action == "kill":
        os.kill(pid or os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(pid or os.getpid(), signal.SIGSTOP)
    elif action == "killjob":
        _kill_job()
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "pause":
        _pause()
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault point {point})")


def _call_step(name: str, bound: inspect.BoundArguments) -> int | None:
    args = bound.arguments
    if "global_step" in args:
        return args["global_step"]
    if name == "update_weights_from_distributed":
        return args["version"] - 1
    return None


def fault_points(method):
    """Give a worker method the fault points `{Class}.{name}.enter` and `.exit` (test instrumentation)."""
    name, point, signature = method.__name__, method.__qualname__, inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not os.environ.get("RELAUNCH_FAULT"):
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        step = _call_step(name, bound)
        # a TrainWorker learns its rank when it joins a group: `where` and `setup` are given it
        rank = bound.arguments.get("rank", getattr(self, "rank", None))
        role = getattr(getattr(self, "role", None), "name", None)  # a TrainWorker's: the actor's or the critic's
        fault_point(f"{point}.enter", step, rank, role)
        result = method(self, *args, **kwargs)
        fault_point(f"{point}.exit", step, rank, role)
        return result

    return wrapper
