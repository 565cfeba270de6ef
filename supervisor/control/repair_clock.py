"""Where the time of a repair goes, from the fault to the first step completed after it.

A repair starts at its first fault (a fault while repairing adds to the same repair) and ends after the
next completed step; its parts (backoff, teardown, validate, scheduling, process_start, rendezvous, load,
resync) are summed over the repair, and the `recovery` event gives them with the total and the first step.
Kept apart from the restart code, which only says which part it is in.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class RepairClock:
    def __init__(self):
        self._repair: dict | None = None

    def start(self, cause: str, what: str, detection: float | None) -> None:
        if self._repair is None:
            self._repair = {"cause": cause, "what": what, "seen": time.time(), "parts": {},
                            "detection": detection or 0.0, "resynced": None}

    def add(self, part: str, secs: float) -> None:
        if self._repair is not None:
            parts = self._repair["parts"]
            parts[part] = parts.get(part, 0.0) + secs

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t)

    def resynced(self) -> None:
        if self._repair is not None:
            self._repair["resynced"] = time.time()

    def finish(self) -> dict | None:
        """After a completed step: the `recovery` event's fields of the repair in progress (None if none)."""
        rep, self._repair = self._repair, None
        if rep is None:
            return None
        now = time.time()
        return {"cause": rep["cause"], "what": rep["what"], "detection": round(rep["detection"], 3),
                **{k: round(v, 3) for k, v in rep["parts"].items()},
                "total": round(now - rep["seen"] + rep["detection"], 3),
                "first_step": round(now - (rep["resynced"] or rep["seen"]), 3)}
