"""When the driver restarts a hung Supervisor: a pure object fed with the Supervisor's progress answers.

A Supervisor can hang without dying (SIGSTOPped, or blocked in fsync on a hung NFS mount) while it holds every
actor of the job; nothing inside it can notice. The driver can: the Supervisor reports how long ago its
controller last made a transition (each step, repair or start is one, and each is bounded by the timeouts of
the calls it makes), and the driver bounds how long `progress()` may go unanswered while Ray says the actor is
alive (recover.step_timeout_secs, at least 30 s; twice recover.start_timeout_secs until a new Supervisor first
answers: it is importing and reading the run's history). Either bound passed, the driver has Ray restart the
Supervisor, which rebuilds from disk and counts its own restart against `recover.retries` like any other
fault.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_UNANSWERED_SECS = 30.0  # a loaded machine can be slow to answer a query; a frozen process never answers
SLACK_SECS = 120.0          # kills, probes and checkpoint validation between the bounded calls of a transition
CALLS_PER_STEP = 8          # the most group calls one transition waits on in turn (rollout, train, weights, ...)
WRITES_PER_STEP = 3         # background writes one transition may wait on in turn: the previous export before a
                            # new one, that export and the previous save before a new save (one writer thread)


def stall_bound(recover) -> float:
    """The longest a healthy controller goes without a transition: a start (the wait for capacity and two
    start-up bounds), a step's calls each bounded by recover.step_timeout_secs, the waits for background
    writes (each bounded by recover.write_timeout_secs) and the longest backoff."""
    start = recover.capacity_timeout_secs + 2 * recover.start_timeout_secs
    return start + CALLS_PER_STEP * recover.step_timeout_secs + WRITES_PER_STEP * recover.write_timeout_secs + \
        recover.max_backoff_secs + SLACK_SECS


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
        return cls(unanswered, stall_bound(recover), max(2 * recover.start_timeout_secs, unanswered), now)

    def verdict(self, now: float, progress: dict | None, alive: bool) -> str | None:
        """Why the Supervisor is hung, or None. `progress` is its answer (None: none in time), `alive` whether
        Ray has it running (not dead, not being restarted by Ray: that is no hang, and the next one starts)."""
        if progress is not None or not alive:
            self.last_answer = now
            self.answered = progress is not None
        if progress is not None and progress["since_transition_secs"] > self.stalled_secs:
            return f"its controller made no transition for {progress['since_transition_secs']:.0f}s"
        bound = self.unanswered_secs if self.answered else self.start_secs
        if now - self.last_answer > bound:
            return f"it has not answered for {now - self.last_answer:.0f}s"
        return None

    def restarted(self, now: float) -> None:
        """The driver had it restarted: the new Supervisor is starting."""
        self.last_answer, self.answered = now, False
