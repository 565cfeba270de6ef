"""Where a TrainGroup repair loads from: the memory tier (survivors roll back in place; a dead rank's place is
taken by the spare that holds its state, or by a new process or free spare that loads it from the peer rank
holding it) or the last valid disk checkpoint, and, from disk, whether the survivors keep their processes.
Pure: every reason memory cannot serve is one line here, the job log's and the `recovery` event's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from supervisor.control.classify import FaultKind

# faults where the ranks still alive can be settled and hold their state: a death, its echo in a peer's
# collective, and a hang once its culprits are killed (hang_culprits)
MEMORY_FAULTS = (FaultKind.WORKER_DIED, FaultKind.COLLECTIVE_FAILED, FaultKind.HANG)


class Source(str, enum.Enum):
    MEMORY = "memory"
    DISK = "disk"
    NONE = "none"  # an engine repair: the trainer's state is untouched


@dataclass(frozen=True)
class Choice:
    source: Source
    reason: str
    step: int | None = None                    # the global step restored from memory
    adopters: dict[int, str] = field(default_factory=dict)  # lost rank -> the buddy spare taking its place
    givers: dict[int, str] = field(default_factory=dict)  # lost rank -> the peer rank giving its state to a new one
    bundled: frozenset[int] = frozenset()  # the givers' ranks that start again in their own bundle

    @property
    def lost(self) -> list[int]:
        return sorted(self.adopters | self.givers)


def recovery_source(*, enabled: str | None, kind: FaultKind, world_size: int, lost: set[int],
                    buddies: dict[int, str], holding: dict[str, dict[int, list[int]]], staged: list[int],
                    snapshots: set[int], peers: dict[str, int] | None = None, bundled: set[int] = frozenset(),
                    spares: frozenset[str] = frozenset(), free_bundles: int = 0,
                    beside: dict[str, list[int]] | None = None) -> Choice:
    """`enabled`: None when the tier serves this job, else why not (the engine, the config). `lost`: the ranks
    that did not answer a probe (dead, or stuck); `buddies`: rank -> holder of its copies; `holding`: what
    each live holder reported holding, rank -> steps landed (a dead one is absent); `staged`: the steps every
    surviving rank holds in its own slots; `snapshots`: the steps whose Supervisor state is kept. `peers`: the holders
    that are ranks, name -> rank (a peer gives the copy to a new process; any other holder is a warm spare,
    which takes the place of the rank it holds); `bundled`: the lost ranks whose bundle can start a new
    process now (its node alive, not draining); `spares`: the names of the pool's live spares on nodes that
    stay (an adopter must be one), `free_bundles`: the group's bundles no rank holds; a spare that adopts no rank,
    or a free bundle, can take a peer-held rank's place. `beside`: the job's other trained groups (PPO's actor
    beside a faulty critic, or its critic beside a faulty actor), role -> the steps every rank of that group holds
    in its own slots: their ranks roll back in place to the step restored, so it must be one of those."""
    def disk(reason: str) -> Choice:
        return Choice(Source.DISK, reason)

    if enabled is not None:
        return disk(enabled)
    if kind is FaultKind.SUPERVISOR_DIED:
        return disk("the Supervisor restarted: the state it kept in memory is gone")
    if world_size == 0:
        return disk("no TrainGroup was running: the fault struck as it started")
    if kind not in MEMORY_FAULTS:
        return disk(f"a {kind.value} fault: the ranks may not be settled")
    if not lost:
        return disk("every rank answered: nothing to take the place of")
    no_buddy = sorted(r for r in lost if r not in buddies)
    if no_buddy:
        return disk(f"rank {no_buddy[0]} had no buddy holding its state")
    gone = sorted(r for r in lost if buddies[r] not in holding)
    if gone:
        return disk(f"rank {gone[0]} and its buddy were lost together")
    peers = peers or {}
    adopters = {r: buddies[r] for r in sorted(lost) if buddies[r] not in peers}
    givers = {r: buddies[r] for r in sorted(lost) if buddies[r] in peers}
    both = sorted(r for r in givers if peers[givers[r]] in lost)  # a stuck rank may still answer as a holder
    if both:
        return disk(f"rank {both[0]} and its buddy rank {peers[givers[both[0]]]} were lost together")
    if len(set(adopters.values())) < len(adopters):
        return disk(f"ranks {sorted(adopters)} share one buddy: it can take only one place")
    leaving = sorted(r for r in adopters if adopters[r] not in spares)
    if leaving:
        return disk(f"rank {leaving[0]}'s buddy is on a node going away")
    homeless = sorted(r for r in givers if r not in bundled)
    if len(homeless) > len(spares - set(adopters.values())) + free_bundles:
        return disk(f"rank {homeless[0]}'s state is held by a peer, but it has no bundle to start again in and no "
                    f"warm spare is free")
    common = set(snapshots) if len(lost) == world_size else set(staged) & snapshots  # staged: the survivors'
    for r in lost:
        common &= set(holding[buddies[r]].get(r, []))
    if not common:
        return disk(f"no step is held in memory for every rank (staged {sorted(staged)}, "
                    f"held {[holding[buddies[r]].get(r, []) for r in sorted(lost)]})")
    for role, steps in sorted((beside or {}).items()):
        if not common & set(steps):
            return disk(f"the {role}'s ranks hold no step in memory that every lost rank's copy does (the {role}'s "
                        f"{sorted(steps)}, the lost ranks' {sorted(common)})")
        common &= set(steps)
    step = max(common)
    return Choice(Source.MEMORY, f"step {step} from memory", step, adopters, givers,
                  frozenset(r for r in givers if r in bundled))


def can_keep(*, rejoins: bool, kind: FaultKind, committed: bool, reference: bool, shrunk: bool) -> str | None:
    """What decides before any rank is asked whether a repair from disk can keep the ranks that still answer:
    None if it may, else why every rank starts again. `rejoins`: the engine re-forms its process group in place
    (fsdp); `committed`: a checkpoint exists (else every rank starts from the initial weights, which a survivor
    no longer holds); `reference`: the job has a KL reference, which a survivor may have refreshed past the
    checkpoint's; `shrunk`: the group runs with fewer ranks than asked (a new start tries every rank again)."""
    if not rejoins:
        return "the engine cannot re-form its process group in place"
    if kind not in MEMORY_FAULTS:
        return f"a {kind.value} fault: the ranks may not be settled"
    if not committed:
        return "no checkpoint yet: every rank starts from the initial weights"
    if reference:
        return "a survivor's KL reference may be newer than the checkpoint's"
    if shrunk:
        return "the group runs shrunk: a new start asks for every rank again"
    return None


def keep_survivors(*, kind: FaultKind, world_size: int, lost: set[int], placeable: set[int],
                   node_lost: bool) -> str | None:
    """For a repair from disk that can_keep allowed, once the ranks were asked: None when those that still
    answer keep their processes (they re-form the group with the built model and load the checkpoint, like the
    ranks started again in the lost ones' places), else why every rank starts again. `placeable`: the lost ranks
    that a bundle of the group's placement group or a warm spare can take; `node_lost`: a lost rank's node is
    gone (the group is placed again, and elastically, by a new start)."""
    if not world_size or len(lost) == world_size:
        return "no rank is left to keep"
    if kind is FaultKind.HANG and not lost:
        return "every rank answered after a hang: what hung may still run in one of them"
    if node_lost:
        return "a lost rank's node is gone"
    unplaced = sorted(lost - placeable)
    if unplaced:
        return f"rank {unplaced[0]} has no bundle to start again in and no warm spare is free"
    return None


def hang_culprits(pending: set[int], progress: dict[int, dict | None]) -> set[int]:
    """The ranks a hung group call waits on, so that killing them turns the hang into deaths the others can
    recover from. `pending`: the ranks whose call did not return; `progress`: each rank's answer to a probe
    served beside its running method (phase, and its process group's collective sequence number `seq`), None
    when it did not answer (a stopped process, a lost node). When some ranks returned, those still in the call
    are the culprits (nobody waits on the others); when every rank is still in it, the silent ones are, or else
    the ranks behind the others' collectives (stuck in their own code while the others wait for them). Empty
    when no culprit can be named: every rank answers from the same collective."""
    if pending and any(r not in pending for r in progress):
        return set(pending)
    silent = {r for r, answer in progress.items() if answer is None}
    if silent:
        return silent
    seqs = {r: answer.get("seq") for r, answer in progress.items()}
    if None in seqs.values():
        return set()
    newest = max(seqs.values())
    return {r for r, seq in seqs.items() if seq < newest}
