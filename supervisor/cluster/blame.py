"""Who is to blame when a call made on several actors at once fails: one rule for every gather (a worker
group's calls, cluster/groups.py, and the weight stream's, cluster/weights.py). Pure, but for `dead_nodes`,
which asks Ray which nodes it has dead when a death is blamed.

Each actor's call ended one way (`Outcome`); actors come in tiers, where a later tier may wait on an earlier
one but never the other way round (the engines wait on the TrainGroup's buckets and hashes; rank 0 gives up
on an engine after a transfer's timeout). The precedence, first match wins:

1. A death. Everyone else may be waiting on the dead actor. The dead of the earliest tier, first to die first.
2. Otherwise the earliest tier in which some call failed (raised, or never answered): a later tier's errors
   are its members giving up on it.
3. Within that tier, those that raised, the first first: a peer still inside a collective waits on them.
   If none raised, those that never answered: they hung. Only if none of them is left, those that gave up
   waiting (an engine's transfer timed out, workers/errors.py: TransferTimedOut): a stopped engine holds up
   the sender, and the engines behind it time out while it never answers.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from supervisor.cluster.errors import Group, GroupError
from workers.errors import TransferTimedOut


class Outcome(enum.Enum):
    OK = "ok"
    RAISED = "raised"    # the actor is alive and its call raised
    DIED = "died"        # the actor (or its node) is gone
    PENDING = "pending"  # no answer when the wait ended
    GAVE_UP = "gave_up"  # the actor is alive and raised because what it waited for never came


@dataclass(frozen=True)
class Call:
    outcome: Outcome
    tier: int = 0   # 0: the group the others wait on; 1: those that wait on it
    order: int = 0  # when it ended (raised or died), for "the first"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome             # DIED, RAISED or PENDING (a hang)
    culprits: tuple[int, ...]    # indices into the calls, the origin first
    settled: bool                # the culprits raised and no other call is left running or dead: nothing is stuck


def blame(calls: Sequence[Call]) -> Optional[Verdict]:
    """The actors at fault for `calls`, by the module's precedence; None when every call was OK."""
    failed = [i for i, c in enumerate(calls) if c.outcome is not Outcome.OK]
    if not failed:
        return None
    dead = [i for i in failed if calls[i].outcome is Outcome.DIED]
    if dead:
        tier = min(calls[i].tier for i in dead)
        return Verdict(Outcome.DIED, _first_first(calls, [i for i in dead if calls[i].tier == tier]), False)
    tier = min(calls[i].tier for i in failed)
    raised = [i for i in failed if calls[i].tier == tier and calls[i].outcome is Outcome.RAISED]
    settled = all(c.outcome is not Outcome.PENDING for c in calls)
    if raised:
        return Verdict(Outcome.RAISED, _first_first(calls, raised), settled)
    hung = tuple(i for i in failed if calls[i].tier == tier and calls[i].outcome is Outcome.PENDING)
    if hung:
        return Verdict(Outcome.PENDING, hung, False)
    return Verdict(Outcome.RAISED, _first_first(calls, [i for i in failed if calls[i].tier == tier]), settled)


def _first_first(calls: Sequence[Call], indices: list[int]) -> tuple[int, ...]:
    return tuple(sorted(indices, key=lambda i: (calls[i].order, i)))


def outcome_of(error: BaseException) -> Outcome:
    """A call's error as an outcome: an actor that raised is alive (it gave up, if what it waited for never
    came); any other error of Ray's (an actor died, its node or the object with it was lost) means it is gone."""
    from ray.exceptions import RayTaskError

    if not isinstance(error, RayTaskError):
        return Outcome.DIED
    gave_up = isinstance(error, TransferTimedOut) or isinstance(getattr(error, "cause", None), TransferTimedOut)
    return Outcome.GAVE_UP if gave_up else Outcome.RAISED


def group_error(verdict: Verdict, group: Group, errors: dict[int, BaseException], members: Sequence,
                waited: float) -> GroupError:
    """The GroupError a verdict raises: the culprits by name, the first one's node and error (for a hang, a
    timeout of `waited` seconds), and for a death whether Ray has that node dead."""
    from ray.exceptions import GetTimeoutError

    first = verdict.culprits[0]
    node = members[first].node_id
    error = (GetTimeoutError(f"no answer after {waited:.0f}s") if verdict.outcome is Outcome.PENDING
             else errors[first])
    lost = verdict.outcome is Outcome.DIED and node is not None and node in dead_nodes()
    return GroupError(group, error, tuple(members[i].name for i in verdict.culprits), node, waited,
                      verdict.settled, lost)


def dead_nodes() -> set[str]:
    """The nodes Ray has dead; none when Ray is not connected or its GCS does not answer."""
    import ray

    if not ray.is_initialized():
        return set()
    try:
        return {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
    except Exception:  # noqa: BLE001 - not knowing a node lost only makes its later faults cost a retry
        return set()
