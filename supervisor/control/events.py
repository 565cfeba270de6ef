"""The run's two logs: stats.jsonl (one object per completed step) and events.jsonl (one per event).

Only the Supervisor writes them, but for the `interrupted` row the driver writes once Ctrl-C has ended the
Supervisor. events.jsonl is the history of every attempt and only grows;
stats.jsonl is cut back to the checkpoint's step on resume, so it ends with exactly one line per step.
"""
from __future__ import annotations

import enum
import json
import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

from supervisor.checkpoint.durable import write_atomic
from supervisor.config import RoleName


class Event(str, enum.Enum):
    """The kinds of events.jsonl rows (the row's `event` field)."""
    START = "start"                          # a job (or the Supervisor's new life) began
    STATE = "state"                          # the controller entered another state
    FAILURE = "failure"                      # a fault, classified: cause, group, actor, node, step, phase
    RESTART = "restart"                      # the policy's decision to repair: n of limit, what, delay
    REPAIR = "repair"                        # a further fault of the same incident, repaired without a retry
    LOADED = "loaded"                        # a (re)formed TrainGroup loaded a checkpoint (or started fresh)
    RESYNC = "resync"                        # every engine holds the trainer's version and checksum
    COMMIT = "commit"                        # a recover checkpoint was published
    EXPORT = "export"                        # an HF export was published
    SAVE_FAILED = "save_failed"              # a save or export failed on storage and was skipped
    FALLBACK = "fallback"                    # a damaged checkpoint was passed over for an older one
    CLEANUP = "cleanup"                      # leftovers of interrupted saves or of a dead Supervisor removed
    WARNING = "warning"
    SHRINK = "shrink"                        # the TrainGroup restarted with fewer ranks (elastic resume)
    SPARES = "spares"                        # warm spares taken, refilled or released
    BUDDIES = "buddies"                      # the memory tier's links changed: rank -> the node holding its copies
    ENGINES_RESTARTED = "engines_restarted"
    RECOVERY = "recovery"                    # where a repair's time went
    PREEMPTION = "preemption"                # a node's drain notice acted on: what moved off it, or why not
    RECOVER_INTERVAL = "recover_interval"    # recover.freq_secs auto moved
    DONE = "done"
    FAILED = "failed"                        # a user-code error or a bug: no retry
    GAVE_UP = "gave_up"                      # retries exhausted
    INTERRUPTED = "interrupted"              # Ctrl-C (SIGINT) to the driver: the last valid checkpoint is kept


ENDED = (Event.DONE, Event.GAVE_UP, Event.FAILED, Event.INTERRUPTED)  # the events that end a job


def group_of(role: RoleName) -> dict:
    """The `group` key of an event about a trained group's ranks, spares or copies: none for the actor's, so that
    a GRPO job's events are what they always were."""
    return {} if role is RoleName.ACTOR else {"group": role.value}


def _append(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        _drop_torn_tail(f)
        f.write((json.dumps(obj, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _drop_torn_tail(f) -> None:
    """Cut off a last line without its newline (a crash mid-write): a row appended to it would be read as
    part of the torn line and skipped with it."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    f.truncate(f.read().rfind(b"\n") + 1)


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line; a torn last line (a crash mid-write) is skipped."""
    return parse_jsonl(path.read_text()) if path.exists() else []


def parse_jsonl(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# Each append is fsynced: on a hung mount it blocks in the kernel. A guard reports it as a bounded wait
# (control/watchdog.py) for the driver's watchdog; by default there is none.
Guard = Callable[[], AbstractContextManager]


class EventLog:
    def __init__(self, path: Path, attempt: int = 0, job: str | None = None, guard: Guard = nullcontext):
        self.path, self.attempt, self.job, self.guard = path, attempt, job, guard
        self.listeners: list[Callable[[dict], None]] = []  # see every row once it is written (auto intervals,
        #                                                    trackers)

    def emit(self, event: Event, **fields) -> dict:
        row = {"event": event.value, "time": time.time(), "job": self.job, "attempt": self.attempt, **fields}
        with self.guard():
            _append(self.path, row)
        for listener in self.listeners:
            listener(row)
        return row


class StatsLog:
    def __init__(self, path: Path, guard: Guard = nullcontext):
        self.path, self.guard = path, guard
        self.listeners: list[Callable[[dict], None]] = []  # see every row once it is written (trackers)

    def append(self, row: dict) -> None:
        with self.guard():
            _append(self.path, row)
        for listener in self.listeners:
            listener(row)

    def truncate_after(self, global_step: int) -> None:
        """Drop rows of steps after `global_step` (they will be trained again), and a torn last line."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        keep = [r for r in read_jsonl(self.path) if r.get("global_step", -1) <= global_step]
        if len(keep) != len(lines):
            write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())
