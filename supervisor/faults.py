"""Named fault points, so crash tests hit exact moments instead of lucky timings.

`RELAUNCH_FAULT="point:action[:step=G][:rank=R],..."` arms points; actions are `kill` (SIGKILL this
process), `hang` (sleep forever) and `enospc` (raise a disk-full OSError). Each armed fault fires once:
a marker file in `RELAUNCH_FAULT_DIR` remembers it across restarts, so a restarted process goes on.
Nothing is armed unless both variables are set; the driver forwards them to every actor.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

ENV_VARS = ("RELAUNCH_FAULT", "RELAUNCH_FAULT_DIR")


def _armed(point: str, step: int | None, rank: int | None):
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
        if "rank" in where and int(where["rank"]) != rank:
            continue
        marker = Path(marker_dir) / f"fired-{i}-{name}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return None
        return action
    return None


def fault_point(point: str, step: int | None = None, rank: int | None = None) -> None:
    action = _armed(point, step, rank)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault point {point})")
