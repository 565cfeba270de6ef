"""Named fault points, so crash tests hit exact moments instead of lucky timings.

`RELAUNCH_FAULT="point:action[:step=G][:rank=R],..."` arms points; actions are `kill` (SIGKILL this
process), `killjob` (SIGKILL every process of this session: a local job's driver and its whole embedded
Ray cluster), `hang` (sleep forever) and `enospc` (raise a disk-full OSError); the Supervisor's own points
also know `kill_trainer` (it SIGKILLs the last TrainWorker). Each armed fault fires once:
a marker file in `RELAUNCH_FAULT_DIR` remembers it across restarts, so a restarted process goes on.
Nothing is armed unless both variables are set; the driver forwards them to every actor.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from supervisor.processes import command_line, kill_all, session_members

ENV_VARS = ("RELAUNCH_FAULT", "RELAUNCH_FAULT_DIR")


def armed(point: str, step: int | None = None, rank: int | None = None) -> str | None:
    """The action armed at this point for this step and rank, marked as fired; None when nothing is."""
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
        marker = Path(marker_dir) / f"fired-{i}-{name}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return None
        return action
    return None


def _kill_job() -> None:
    """SIGKILL this local job's whole session: its driver, every actor and the embedded Ray cluster."""
    sid = os.getsid(0)
    leader = command_line(sid)
    if "supervisor" not in leader and not any(arg.endswith("relaunch") for arg in leader):
        raise RuntimeError("fault action killjob needs a relaunch driver that leads its own session")
    kill_all(session_members(sid))


def fault_point(point: str, step: int | None = None, rank: int | None = None) -> None:
    apply(armed(point, step, rank), point)


def apply(action: str | None, point: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "killjob":
        _kill_job()
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault point {point})")
