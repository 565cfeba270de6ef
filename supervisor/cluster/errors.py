"""What a call to a worker group raises: the group, the actor and node it came from, and the raw error.
The controller's classifier (control/classify.py) turns these into faults."""
from __future__ import annotations

import enum


class Group(str, enum.Enum):
    TRAIN = "train"          # the TrainGroup's ranks (the actor's)
    CRITIC = "critic"        # a critic's TrainGroup's ranks (PPO)
    ROLLOUT = "rollout"      # the inference engines
    SUPERVISOR = "supervisor"


class GroupError(Exception):
    """What a call to a worker group raised, with where it came from; `error` is the raw exception."""

    def __init__(self, group: Group, error: BaseException, actors: tuple[str, ...] = (), node: str | None = None,
                 waited: float | None = None, settled: bool = False, node_lost: bool = False):
        super().__init__(f"{group.value}: {type(error).__name__}: {first_line(error)}")
        self.group, self.error, self.actors, self.node = group, error, actors, node
        self.waited, self.settled, self.node_lost = waited, settled, node_lost


class CapacityError(RuntimeError):
    """The cluster did not offer a group's resources within recover.capacity_timeout_secs: not a fault to
    retry, the job stops naming what is missing."""


def first_line(error: BaseException) -> str:
    lines = [x for x in str(error).strip().splitlines() if x.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]
