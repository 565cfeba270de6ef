"""Processes of this machine found through psutil, and SIGKILL for a set of them at once.

Used to break things on purpose, the way machines break: a node's raylet with every process under it
(`relaunch demo`, the tests), or a local job's whole session (fault points). Always by the ids of
processes we started or that descend from them, never by name.
"""
from __future__ import annotations

import os
import signal

import psutil


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return [pid]


def session_members(sid: int) -> list[int]:
    """Every process of session `sid` (a driver started in a new session and its embedded Ray)."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return members


def command_line(pid: int) -> list[str]:
    """The arguments `pid` was started with; empty when it is gone or not ours to read."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


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
