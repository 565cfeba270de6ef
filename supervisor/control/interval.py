"""`recover.freq_secs: auto`: how often to save, from what a save costs and how often the trial fails. Pure.

Saving often wastes the time each save stalls training; saving rarely wastes the work redone after a
failure. Young's optimum is T = sqrt(2 C M); Daly's refinement, used here, stays right when C is not small
against M: T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2M, else M. C is the training stall
of one recover save: the mean of the last few `commit` events' `blocked_secs` (asynchronous saves) or `secs`.
M is the time the trial's jobs ran (each job's first to last event, so days between two jobs do not count)
over the failures that rolled it back to a checkpoint (TrainGroup and Supervisor faults; an engine fault or
a storage error, whose save is skipped, loses no training). Before the
first such failure M is the larger of PRIOR_MTBF_SECS and the time observed. Before the first save is measured
the interval is the lower bound, so that the first save comes early and measures C.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from supervisor.cluster.errors import Group
from supervisor.control.classify import FaultKind
from supervisor.control.events import Event

MIN_SECS, MAX_SECS = 10.0, 3600.0
# Llama 3's 54-day pre-training on 16k GPUs saw 466 interruptions, one every 2.8 hours: a large job's MTBF.
PRIOR_MTBF_SECS = 3 * 3600.0
ROLLBACK_GROUPS = (Group.TRAIN, Group.CRITIC, Group.SUPERVISOR)  # failures whose repair reloads the last checkpoint
COSTS_KEPT = 5
CHANGE = 0.05  # a new interval is logged when it moved by more than this fraction


def daly(cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum checkpoint interval for a save costing `cost` s and MTBF `mtbf` s."""
    if cost >= 2 * mtbf:
        return mtbf
    r = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost


@dataclass
class AutoInterval:
    """Observes the trial's events and answers the recover save interval in force."""
    min_secs: float = MIN_SECS
    max_secs: float = MAX_SECS
    prior_mtbf_secs: float = PRIOR_MTBF_SECS
    spans: dict = field(default_factory=dict)  # job -> [its first, its last event time]
    failures: int = 0
    costs: deque = field(default_factory=lambda: deque(maxlen=COSTS_KEPT))
    logged: float | None = None  # the interval last reported

    @classmethod
    def from_history(cls, rows: list[dict]) -> "AutoInterval":
        interval = cls()
        for row in rows:
            interval.observe(row)
        return interval

    def observe(self, row: dict) -> None:
        """Account one event row (as written to events.jsonl)."""
        self.spans.setdefault(row.get("job"), [row["time"], row["time"]])[1] = row["time"]
        if row["event"] == Event.COMMIT:
            self.costs.append(float(row.get("blocked_secs", row["secs"])))
        elif row["event"] == Event.FAILURE and row.get("group") in ROLLBACK_GROUPS \
                and row.get("cause") != FaultKind.STORAGE_ERROR:
            self.failures += 1

    @property
    def save_cost(self) -> float | None:
        return sum(self.costs) / len(self.costs) if self.costs else None

    def running_secs(self, now: float) -> float:
        """How long the trial's jobs have run, the current one (the last seen) until `now`."""
        spans = list(self.spans.values())
        return sum(last - first for first, last in spans[:-1]) + (now - spans[-1][0] if spans else 0.0)

    def mtbf(self, now: float) -> float:
        observed = self.running_secs(now)
        return observed / self.failures if self.failures else max(self.prior_mtbf_secs, observed)

    def secs(self, now: float) -> float:
        """The interval in force at `now`."""
        cost = self.save_cost
        if cost is None:
            return self.min_secs
        return min(max(daly(max(cost, 1e-6), self.mtbf(now)), self.min_secs), self.max_secs)

    def update(self, now: float) -> tuple[float, bool]:
        """(the interval in force, whether it moved by more than CHANGE since it was last reported)."""
        secs = self.secs(now)
        moved = self.logged is None or abs(secs - self.logged) > CHANGE * self.logged
        if moved:
            self.logged = secs
        return secs, moved
