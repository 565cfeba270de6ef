"""The restart decision: a small pure object that routes a fault to the smallest repair and counts restarts.

No Ray, no clock of its own: given a classified fault and the time it was seen, it answers what to do and
how long to wait first. Every repair, the Supervisor's own restart included, spends one of `recover.retries`;
a skipped save spends none. The first restart after a quiet period is immediate; backoff applies only to
faults that follow each other within `recover.quiet_secs` (a crash loop), doubling up to its cap. A fault that
strikes while a repair is applied, within `recover.incident_secs` of the fault that started it, is part of
the same incident (a node that held a rank and an engine): it is repaired too, without spending a retry. So is a
death on the node the incident's fault came from, once Ray has that node dead, however late the repair sees it
(cold vLLM engines can take minutes to start before the repair calls the ranks): a lost node holds only so many
actors, so this cannot loop.
A runtime env that cannot be set up, or a worker whose constructor raises, fails the job before its first
start (the user's env or config is broken) and is a start-up fault to retry after it (a replacement node's
transient failure).
Its memory (restarts, the burst, the last fault, the incident) is rebuilt from the job's events when the
Supervisor restarts (`from_history`), and `budget` is the one count of retries the driver sizes Ray's own
restart limit from. The controller applies the decision; unit tests drive this object alone.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.cluster.errors import Group
from supervisor.config import Config, SaveErrorAction
from supervisor.control.classify import Fault, FaultKind
from supervisor.control.events import Event


class Action(str, enum.Enum):
    RESTART_TRAIN_GROUP = "restart_train_group"  # kill all ranks, new group, load the last valid checkpoint
    RESTART_ENGINES = "restart_engines"          # replace the faulty engines only, resync the current weights
    REPLAY_STEP = "replay_step"                  # run the step again from its start (retried user errors)
    SKIP_SAVE = "skip_save"                      # report the failed save and train on (recover.on_save_error)
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    delay_secs: float = 0.0
    counted: bool = True  # False: a further fault of the incident being repaired, which spent its retry already


def budget(config: Config) -> int:
    """How many repairs the run may spend (the Supervisor's own restarts included): recover.retries, or none
    when recovery is disabled. The policy gives up past it; the driver sizes Ray's backstop from it."""
    return config.recover.retries if config.recover.mode.enabled else 0


@dataclass
class RestartPolicy:
    retries: int
    backoff_secs: float = 1.0
    max_backoff_secs: float = 30.0
    quiet_secs: float = 300.0
    retry_user_errors: bool = False
    stop_on_save_error: bool = False
    restarts: int = 0
    burst: int = 0                      # restarts since the last quiet period
    last_fault: float | None = None     # when the previous fault was seen (wall clock, seconds)
    started: bool = False               # both groups started once: a runtime env that fails now is transient
    incident_secs: float = 60.0
    incident: float | None = None       # when the first fault of the incident being repaired was seen
    incident_node: str | None = None    # the node that fault came from

    @classmethod
    def from_config(cls, config: Config) -> "RestartPolicy":
        return cls(
            retries=budget(config),
            backoff_secs=config.recover.backoff_secs,
            max_backoff_secs=config.recover.max_backoff_secs,
            quiet_secs=config.recover.quiet_secs,
            incident_secs=config.recover.incident_secs,
            retry_user_errors=config.reward.retry_user_errors,
            stop_on_save_error=config.recover.on_save_error is SaveErrorAction.STOP,
        )

    @classmethod
    def from_history(cls, config: Config, rows: list[dict]) -> "RestartPolicy":
        """The policy of a restarted Supervisor: its memory (restarts spent, the crash-loop burst, the last
        fault, the incident, whether the groups started once) replayed from this job's event rows, as
        events.jsonl holds them, so that a Supervisor's restart neither refunds retries nor resets the backoff."""
        policy = cls.from_config(config)
        quiet = True  # whether the failure being decided came after a quiet period, as `decide` saw it
        node = None   # that failure's node
        for row in rows:
            if row["event"] == Event.FAILURE:
                quiet = policy.last_fault is None or row["time"] - policy.last_fault >= policy.quiet_secs
                policy.last_fault, node = row["time"], row.get("node")
            elif row["event"] == Event.RESTART:  # a counted repair of the failure just before it
                policy.restarts += 1
                policy.burst = 0 if quiet else policy.burst + 1
                policy.incident, policy.incident_node = policy.last_fault, node
            elif row["event"] == Event.LOADED:
                policy.started = True
        return policy

    def decide(self, fault: Fault, now: float = 0.0, repairing: bool = False) -> Decision:
        """What to do about `fault`, seen at `now`; `repairing`: it struck while a repair was being applied."""
        kind = fault.kind
        quiet = self.last_fault is None or now - self.last_fault >= self.quiet_secs
        same_node_lost = fault.node_lost and fault.node == self.incident_node  # node_lost: a node is named
        same_incident = repairing and self.incident is not None and (now - self.incident <= self.incident_secs
                                                                     or same_node_lost)
        self.last_fault = now
        if kind is FaultKind.INTERNAL_ERROR:
            return Decision(Action.FAIL, f"relaunch internal error: {fault.message}")
        if kind is FaultKind.STORAGE_ERROR and fault.in_save:
            if self.stop_on_save_error:
                return Decision(Action.FAIL, f"save failed: {fault.message} (recover.on_save_error=stop)")
            if fault.settled:  # every rank came back from the failed save: skip it, the group is fine
                return Decision(Action.SKIP_SAVE, f"save failed: {fault.message}; skipped "
                                                  f"(recover.on_save_error=skip)")
        if kind is FaultKind.USER_ERROR and not self.retry_user_errors:
            return Decision(Action.FAIL, f"user code raised: {fault.message}")
        if kind is FaultKind.RUNTIME_ENV and not self.started:  # before any start it is the job's own env
            return Decision(Action.FAIL, f"the runtime env could not be set up: {fault.message}")
        if kind is FaultKind.START_FAILED and not self.started:  # ... or its own config
            return Decision(Action.FAIL, fault.message)
        if same_incident and kind is not FaultKind.USER_ERROR:
            # one physical fault (a node with a rank and an engine) is one retry, however its parts are seen
            action = self.repair(fault)
            return Decision(action, f"{action.value} after {kind.value}, part of the fault {now - self.incident:.0f}s "
                                    f"ago (restart {self.restarts}/{self.retries})", counted=False)
        if self.restarts >= self.retries:
            return Decision(Action.FAIL, f"retries exhausted ({self.restarts}/{self.retries}); last fault: "
                                         f"{kind.value}: {fault.message}")
        self.burst = 0 if quiet else self.burst + 1
        delay = min(self.backoff_secs * 2 ** (self.burst - 1), self.max_backoff_secs) if self.burst else 0.0
        self.restarts += 1
        self.incident, self.incident_node = now, fault.node
        action = self.repair(fault)
        return Decision(action, f"restart {self.restarts}/{self.retries} after {kind.value}", delay)

    @staticmethod
    def repair(fault: Fault) -> Action:
        """The smallest repair for a fault: a fault is routed to the group it came from (a hung engine is
        replaced alone, an object lost under a rank's call restarts the TrainGroup); a storage error outside
        a save, or one that left some ranks stuck in the save's collectives, restarts the TrainGroup."""
        if fault.kind is FaultKind.USER_ERROR:
            return Action.REPLAY_STEP
        if fault.group is Group.ROLLOUT:  # an engine's fault is repaired on the engines alone
            return Action.RESTART_ENGINES
        return Action.RESTART_TRAIN_GROUP


def engines_to_replace(fault: Fault) -> tuple[str, ...]:
    """The engines a rollout fault names are replaced (dead, hung, a poisoned device, a broken sync: a
    process that still answers a probe may be unusable), but where only what they were given was at fault:
    a lost weights object, or weights of another version (a resync fixes both)."""
    if fault.group is not Group.ROLLOUT or fault.kind in (FaultKind.OBJECT_LOST, FaultKind.STALE_WEIGHTS):
        return ()
    return fault.actors


def train_group_sizes(wanted: int, minimum: int | None, samples: int) -> list[int]:
    """World sizes to try for a TrainGroup, largest first: `wanted`, then, if shrinking is allowed, every
    smaller size down to `minimum` that splits the step's samples evenly."""
    floor = minimum if minimum is not None else wanted
    return [n for n in range(wanted, floor - 1, -1) if samples % n == 0]
