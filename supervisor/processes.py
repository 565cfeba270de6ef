"""Processes of this machine found through /proc, and SIGKILL for a set of them at once.

Used to break things on purpose, the way machines break: a node's raylet with every process under it
(`relaunch demo`, the tests), or a local job's whole session (fault points). Always by the ids of
processes we started or that descend from them, never by name.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def session_members(sid: int) -> list[int]:
    """Every process of session `sid` (a driver started in a new session and its embedded Ray)."""
    members = []
    for p in _pids():
        try:
            if os.getsid(p) == sid:
                members.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return members


def kill_all(pids: list[int]) -> None:
    """SIGKILL every process in `pids`, the caller itself last if it is among them."""
    me = os.getpid()
    for p in pids:
        if p != me:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if me in pids:
        os.kill(me, signal.SIGKILL)
