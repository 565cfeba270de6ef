"""The restart decision: a small pure object that counts faults against `recover.retries`.

No Ray, no clock: given a fault, it answers what to do and how long to wait first. The Supervisor applies
the decision; unit tests drive this object alone.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class FaultKind(str, enum.Enum):
    WORKER_DIED = "worker_died"      # a TrainWorker process or its node is gone
    HANG = "hang"                    # a step, collective or save exceeded recover.step_timeout_secs
    ENGINE_DIED = "engine_died"      # a RolloutWorker process or its node is gone
    USER_ERROR = "user_error"        # the reward function or dataset raised


class Action(str, enum.Enum):
    RESTART_TRAIN_GROUP = "restart_train_group"  # kill all ranks, new group, load last valid checkpoint
    RESTART_ENGINES = "restart_engines"          # restart the dead engines only, push current weights
    FAIL = "fail"


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    message: str
    actor: Optional[str] = None
    node: Optional[str] = None
    detect_secs: Optional[float] = None


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    delay_secs: float = 0.0


@dataclass
class RestartPolicy:
    retries: int
    backoff_secs: float = 1.0
    max_backoff_secs: float = 30.0
    retry_user_errors: bool = False
    restarts: int = 0

    @classmethod
    def from_config(cls, config) -> "RestartPolicy":
        return cls(
            retries=config.recover.retries if config.recover.mode.enabled else 0,
            backoff_secs=config.recover.backoff_secs,
            max_backoff_secs=config.recover.max_backoff_secs,
            retry_user_errors=config.reward.retry_user_errors,
        )

    def decide(self, fault: Fault) -> Decision:
        if fault.kind is FaultKind.USER_ERROR and not self.retry_user_errors:
            return Decision(Action.FAIL, f"user code raised: {fault.message}")
        if self.restarts >= self.retries:
            return Decision(Action.FAIL, f"retries exhausted ({self.restarts}/{self.retries}); last fault: "
                                         f"{fault.kind.value}: {fault.message}")
        delay = min(self.backoff_secs * 2 ** self.restarts, self.max_backoff_secs)
        self.restarts += 1
        action = Action.RESTART_ENGINES if fault.kind is FaultKind.ENGINE_DIED else Action.RESTART_TRAIN_GROUP
        return Decision(action, f"restart {self.restarts}/{self.retries} after {fault.kind.value}", delay)


def train_group_sizes(wanted: int, minimum: int | None, samples: int) -> list[int]:
    """World sizes to try for a TrainGroup, largest first: `wanted`, then, if shrinking is allowed, every
    smaller size down to `minimum` that splits the step's samples evenly."""
    floor = minimum if minimum is not None else wanted
    return [n for n in range(wanted, floor - 1, -1) if samples % n == 0]
