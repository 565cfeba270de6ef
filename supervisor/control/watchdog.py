"""When the driver restarts a hung Supervisor: a pure object fed with the Supervisor's progress answers.

A Supervisor can hang without dying (SIGSTOPped, or blocked in fsync on a hung NFS mount) while it holds every
actor of the job; nothing inside it can notice. The driver can, from three things the Supervisor reports:
- the waits its controller is blocked in right now (`Waits`: what, the bound of that wait, for how long), so a
  controller stuck in the kernel while `progress()` still answers from another thread is seen once that one
  wait passes its own bound (plus WAIT_SLACK_SECS), not hours later;
- how long ago its controller last made a transition (each step, repair or start is one, and each is bounded
  by the timeouts of the calls it makes) or a reward call returned (a step that scores many samples one
  reward.timeout_secs-bounded call after another is healthy however long it takes): the backstop for a wait
  nobody reported;
- and the driver bounds how long `progress()` may go unanswered while Ray says the actor is alive
  (recover.step_timeout_secs, at least 30 s; twice recover.start_timeout_secs until a new Supervisor first
  answers: it is importing and reading the run's history).
Any bound passed, the driver has Ray restart the Supervisor, which rebuilds from disk and counts its own restart
against `recover.retries` like any other fault.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

MIN_UNANSWERED_SECS = 30.0  # a loaded machine can be slow to answer a query; a frozen process never answers
WAIT_SLACK_SECS = 10.0      # a reported wait past its bound by this much (measured by the Supervisor: no RPC lag)
SLACK_SECS = 120.0          # kills, probes and checkpoint validation between the bounded calls of a transition
CALLS_PER_STEP = 8          # the most group calls one transition waits on in turn (rollout, train, weights, ...)
WRITES_PER_STEP = 3         # background writes one transition may wait on in turn: the previous export before a
                            # new one, that export and the previous save before a new save (one writer thread)


def stall_bound(config) -> float:
    """The longest a healthy controller goes without a transition or a reward call's return: a start (the wait
    for capacity and two start-up bounds), a step's calls each bounded by recover.step_timeout_secs, one reward
    call, the waits for background writes (each bounded by recover.write_timeout_secs) and the longest backoff."""
    recover = config.recover
    start = recover.capacity_timeout_secs + 2 * recover.start_timeout_secs
    return start + CALLS_PER_STEP * recover.step_timeout_secs + config.reward.timeout_secs + \
        WRITES_PER_STEP * recover.write_timeout_secs + recover.max_backoff_secs + SLACK_SECS


@dataclass(frozen=True)
class Wait:
    what: str          # "the commit of step 9", named for the driver's log line
    bound_secs: float  # the longest this wait takes when nothing is hung
    since: float       # the waiting process's monotonic clock when it began


class Waits:
    """The waits the controller is blocked in, oldest first. The controller (and the checkpoint validation it
    runs beside a group's start) opens and closes them; `progress()` reads them from another thread, so the
    tuple is replaced whole, never changed in place."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.open: tuple[Wait, ...] = ()
        self._lock = threading.Lock()

    @contextmanager
    def on(self, what: str, bound_secs: float) -> Iterator[None]:
        wait = Wait(what, bound_secs, self.clock())
        with self._lock:
            self.open = (*self.open, wait)
        try:
            yield
        finally:
            with self._lock:
                self.open = tuple(w for w in self.open if w is not wait)

    def report(self) -> list[dict]:
        """The open waits as `progress()` answers them: how long each has lasted, by this process's clock."""
        now = self.clock()
        return [{"what": w.what, "bound_secs": w.bound_secs, "for_secs": now - w.since} for w in self.open]


@dataclass
class Watchdog:
    unanswered_secs: float    # progress() unanswered this long while the actor is alive: hung
    stalled_secs: float       # no transition of the controller for this long: hung
    start_secs: float         # the unanswered bound of a Supervisor that has not answered yet: it is starting
    last_answer: float = 0.0  # driver's clock
    answered: bool = False    # this incarnation of the Supervisor has answered once

    @classmethod
    def from_config(cls, config, now: float) -> "Watchdog":
        recover = config.recover
        unanswered = max(recover.step_timeout_secs, MIN_UNANSWERED_SECS)
        # a Supervisor's start gets what a TrainGroup's start gets: two start-up bounds (process, then setup)
        return cls(unanswered, stall_bound(config), max(2 * recover.start_timeout_secs, unanswered), now)

    def verdict(self, now: float, progress: dict | None, alive: bool) -> str | None:
        """Why the Supervisor is hung, or None. `progress` is its answer (None: none in time), `alive` whether
        Ray has it running (not dead, not being restarted by Ray: that is no hang, and the next one starts)."""
        if progress is not None or not alive:
            self.last_answer = now
            self.answered = progress is not None
        if progress is not None:
            for wait in progress["waits"]:
                if wait["for_secs"] > wait["bound_secs"] + WAIT_SLACK_SECS:
                    return f"its controller has waited {wait['for_secs']:.0f}s on {wait['what']}, " \
                           f"bounded by {wait['bound_secs']:.0f}s"
            if progress["since_transition_secs"] > self.stalled_secs:
                return f"its controller made no transition for {progress['since_transition_secs']:.0f}s"
        bound = self.unanswered_secs if self.answered else self.start_secs
        if now - self.last_answer > bound:
            return f"it has not answered for {now - self.last_answer:.0f}s"
        return None

    def restarted(self, now: float) -> None:
        """The driver had it restarted: the new Supervisor is starting."""
        self.last_answer, self.answered = now, False
