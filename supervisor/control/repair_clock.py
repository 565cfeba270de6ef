"""What a repair cost, timed to the one finish line a user feels: the completion of the step that was in flight.

A repair starts at its first fault (a fault while repairing adds to the same repair) and ends only when the step
that was in flight when the fault struck has completed again; steps completed before the fault and trained again
because the checkpoint loaded was older (a replay) are inside the clock, not after it. Its parts (backoff,
teardown, validate, scheduling, process_start, rendezvous, load, resync, then `replay`: the replayed steps, and
`redo`: the step in flight trained again) are summed over the repair. The `recovery` event gives them with the
`total` (detection included), the step loaded and its `source`, the steps trained again, and what was `lost`
beyond one steady step (the median of the run's steady steps before the finish, from stats.jsonl, measured from
one completed step to the next as the baselines measure theirs).
Kept apart from the restart code, which only says which part it is in.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from supervisor.control.recovery_source import Source

PARTS = ("detection", "backoff", "teardown", "validate", "scheduling", "process_start", "rendezvous", "load",
         "resync", "replay", "redo")


@dataclass(frozen=True)
class _Load:
    """A load of a repair: the step it rolled back to (-1: a fresh start), where from, and why not from memory."""
    step: int
    source: Source
    reason: str | None


@dataclass
class _Repair:
    cause: str
    what: str
    in_flight: int            # the global step that was in flight when the fault struck: the finish line
    seen: float               # wall clock when the fault was seen
    detection: float          # seconds from the fault to its being seen (a hang's timeout, a death's report)
    parts: dict[str, float] = field(default_factory=dict)
    load: _Load | None = None   # the latest load of the TrainGroup; None: no rollback (an engine repair)
    floor: _Load | None = None  # the deepest load that training went on from, before a later fault
    disk_reason: str | None = None  # why the load under way goes to disk, where the memory tier was asked
    resumed: float | None = None  # wall clock when training went on (after the resync)
    replayed_until: float | None = None  # wall clock when the last replayed step completed since `resumed`
    replayed: float = 0.0     # the replay's seconds before a later fault in the same repair stopped it


class RepairClock:
    def __init__(self):
        self._repair: _Repair | None = None

    @property
    def running(self) -> bool:
        return self._repair is not None

    def start(self, cause: str, what: str, detection: float | None, in_flight: int) -> None:
        if self._repair is None:
            self._repair = _Repair(cause, what, in_flight, time.time(), detection or 0.0)

    def add(self, part: str, secs: float) -> None:
        if self._repair is not None:
            parts = self._repair.parts
            parts[part] = parts.get(part, 0.0) + secs

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t)

    def loaded(self, global_step: int, source: Source) -> None:
        """A load of the repair in progress; it replaces one that training never went on from (a repair from
        memory whose resync failed, so that it loaded from disk instead)."""
        rep = self._repair
        if rep is not None:
            rep.load = _Load(global_step, source, rep.disk_reason if source == Source.DISK else None)

    def disk_because(self, reason: str) -> None:
        """Why the load under way goes to disk (the memory tier could not serve it): the event says so."""
        if self._repair is not None:
            self._repair.disk_reason = reason

    def resumed(self) -> None:
        """Training goes on. A repair resumed before (a second fault struck while it replayed steps) keeps the
        replay it had done as `replay`; what came after belongs to the second repair's parts."""
        rep = self._repair
        if rep is not None:
            if rep.replayed_until is not None:
                rep.replayed += rep.replayed_until - (rep.resumed or rep.seen)
                rep.replayed_until = None
            rep.resumed = time.time()
            if rep.load is not None and (rep.floor is None or rep.load.step < rep.floor.step):
                rep.floor = rep.load

    def completed(self, global_step: int, steady_steps: list[float]) -> dict | None:
        """After a completed step: the `recovery` event's fields when it was the step in flight at the fault (or
        a later one), else None and the clock runs on. `steady_steps`: the run's step times (one completed step
        to the next, repairs left out) before the finish."""
        rep = self._repair
        if rep is None:
            return None
        now = time.time()
        if global_step < rep.in_flight:
            rep.replayed_until = now
            return None
        self._repair = None
        resumed = rep.resumed or rep.seen
        replay = rep.replayed + ((rep.replayed_until - resumed) if rep.replayed_until else 0.0)
        total = now - rep.seen + rep.detection
        steady = statistics.median(steady_steps) if steady_steps else None
        fields = {"detection": rep.detection, **rep.parts, "replay": replay,
                  "redo": now - (rep.replayed_until or resumed), "total": total,
                  "steady_step": steady, "lost": None if steady is None else total - steady}
        # a repair that later faults extended reports its deepest rollback, the one the steps trained again count
        # from (a restarted Supervisor's replay from disk, cut short by a rank repaired from memory, is from disk)
        load = min((x for x in (rep.floor, rep.load) if x is not None), key=lambda x: x.step, default=None)
        return {"cause": rep.cause, "what": rep.what, "global_step": rep.in_flight,
                "source": Source.NONE if load is None else load.source,
                "reason": None if load is None else load.reason,
                "loaded_step": None if load is None else load.step,
                "replayed_steps": 0 if load is None else max(rep.in_flight - load.step - 1, 0),
                **{k: None if v is None else round(v, 3) for k, v in fields.items()}}


def steady_steps(rows: list[dict], before: int) -> list[float]:
    """A step's time as a user feels it, from one completed step to the next, for the stats rows of steps before
    `before`; a TrainGroup's first step (no `time/between_steps`: the gap before it was a repair) is left out."""
    return [r["time/step"] + r["time/between_steps"] for r in rows
            if "time/between_steps" in r and r.get("global_step", before) < before]


def recovery_line(rec: dict) -> str:
    """A `recovery` event in one line: the time to the step in flight, what was lost beyond a steady step, where
    the state came from, the steps trained again, and where the time went."""
    lost = f" ({rec['lost']:.1f}s lost beyond a {rec['steady_step']:.1f}s step)" if rec.get("lost") is not None else ""
    if rec.get("loaded_step") is None:
        source = "nothing rolled back"
    else:
        n = rec["replayed_steps"]
        source = f"loaded step {rec['loaded_step']} from {rec['source']}, {n} step{'' if n == 1 else 's'} trained again"
    parts = ", ".join(f"{p} {rec[p]:.2f}s" for p in PARTS if rec.get(p))
    return (f"{rec['cause']} -> {rec['what']}: step {rec.get('global_step', '?')} completed {rec['total']:.1f}s after "
            f"the fault{lost}; {source}; {parts}")
