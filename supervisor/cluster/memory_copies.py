"""The memory tier on the Supervisor's side: which warm spare holds which rank's copies (buddies.py), the copy
begun on every rank after each optimizer step, and what each buddy says it holds.

A rank stages its state into one of its two slots (workers/memory_tier.py) and streams it to its buddy in the
background, over a gloo link of their own, during the next step's rollout; the next update waits until it has
landed. A repair asks the buddies what they hold, and recovery_source.py takes the newest step every lost rank's
buddy holds whole (all ranks or none). Links are made to warm spares only (a spare still building its model
would block the rank's side of the link) and kept while the spare stays in the pool.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable

import ray

from supervisor.cluster.buddies import buddy_plan
from supervisor.cluster.blame import Outcome, outcome_of
from supervisor.cluster.errors import GroupError, first_line
from supervisor.cluster.groups import TrainGroup, drain, wait_for_write
from supervisor.cluster.spares import SparePool
from workers.memory_tier import NoRoom

LINK_SECS = 30.0     # a link's set-up: a gloo pair and its store
HOLDING_SECS = 2.0   # a buddy that does not say what it holds within this long counts as lost
LANDED_POLL_SECS = 0.05  # how often the ranks are asked whether their copy landed, while the next update waits


class MemoryCopies:
    def __init__(self, spares: SparePool, warn: Callable[[str], None], linked: Callable[[dict[int, str]], None]):
        self.spares, self.warn, self.linked = spares, warn, linked  # the job's events: a warning, the new links
        self.buddies: dict[int, str] = {}  # rank -> the spare holding its copies (linked)
        self.staged: list[int] = []        # the steps every rank holds in its own two slots
        self.slots: dict[int, dict] = {}   # rank -> what one of its slots holds, once it has its two
        self.off: str | None = None        # why the tier was turned off for the run (a node without room)
        self.orphans: list[ray.ObjectRef] = []

    def begin(self, trainers: TrainGroup, global_step: int) -> None:
        """After `global_step`'s optimizer step on every rank: link the ranks that have no buddy to warm spares,
        then every rank stages its state (its slot of two steps back is overwritten) and sends it on."""
        self._link(trainers)
        if self.off is not None:
            return
        self.staged = [s for s in self.staged if s == global_step - 1]
        if all(trainers.call_all("begin_memory_copy", global_step)):
            self.staged.append(global_step)

    def _link(self, trainers: TrainGroup) -> None:
        """Best effort: a spare that dies or stalls while linking leaves its ranks without a buddy (recovery from
        disk for them) and is tried again at the next step; a rank that died is the next group call's fault.
        Every rank gets its own slots first, one rank after another, and a buddy its slots before the link, each
        once its node has the room (NoRoom): a node without it turns the tier off for the run."""
        warm = self.spares.warm()
        plan = buddy_plan(trainers.nodes, {name: s.node for name, s in warm.items()}, self.buddies)
        new = [(rank, name) for rank, name in plan.items() if self.buddies.get(rank) != name]
        self.buddies = {rank: name for rank, name in plan.items() if self.buddies.get(rank) == name}
        if not new and len(self.slots) == trainers.world_size:
            return
        try:
            for rank, m in enumerate(trainers.members):  # a rank's shards, so its slots, may differ from another's
                if rank not in self.slots:
                    self.slots[rank] = ray.get(m.handle.memory_slots.remote(), timeout=LINK_SECS)
            for rank, name in new:
                holder, member = warm[name].handle, trainers.members[rank].handle
                held = ray.get(holder.hold.remote(rank, self.slots[rank]), timeout=LINK_SECS)
                if not ray.get(member.memory_attach.remote(held), timeout=LINK_SECS):  # another host
                    where, key = ray.get(holder.where.remote(), timeout=LINK_SECS), uuid.uuid4().hex[:8]
                    ray.get(holder.listen.remote(rank, where["port"], key), timeout=LINK_SECS)
                    ray.get(member.memory_link.remote(where["ip"], where["port"], key), timeout=LINK_SECS)
        except Exception as e:  # noqa: BLE001 - see above
            if isinstance(e, NoRoom):  # Ray's error is an instance of the worker's error class too
                self._turn_off(trainers, warm, str(getattr(e, "cause", e)))
                return
            self.warn(f"linking ranks {[r for r, _ in new]} to their memory-tier buddies failed: "
                      f"{type(e).__name__}: {first_line(e)}; tried again at the next step")
            return
        if new:
            self.buddies.update(new)
            nodes = {name: s.node for name, s in warm.items()}
            self.linked({rank: nodes[name] for rank, name in self.buddies.items()})

    def _turn_off(self, trainers: TrainGroup, warm: dict, reason: str) -> None:
        """No room for the copies: every rank and buddy gives its slots back, recovery from disk from now on."""
        self.off = f"a node has no room for the memory tier's copies: {reason}"
        self.warn(f"{self.off}; recovery from disk for the rest of the run")
        refs = [m.handle.drop_memory.remote() for m in trainers.members] + \
               [s.handle.release.remote() for s in warm.values()]
        ray.wait(refs, num_returns=len(refs), timeout=LINK_SECS)
        self.buddies, self.staged = {}, []
        self.linked({})

    def wait_landed(self, trainers: TrainGroup, global_step: int) -> None:
        """Before the next step trains: wait until every linked rank's copy of `global_step` has landed at its
        buddy (a send takes a fraction of the rollout that precedes this), so that a rank lost during training
        never costs a step trained again. A send that failed or is still running after LINK_SECS (a buddy
        died or stalled) unlinks every rank: recovery from disk until they are linked again at the next step."""
        ranks = sorted(self.buddies) if global_step in self.staged else []
        if not ranks:
            return
        members = [trainers.members[r] for r in ranks]
        poll = lambda: trainers.gather([m.handle.memory_result.remote(global_step) for m in members],  # noqa: E731
                                       members=members)
        try:
            wait_for_write(poll, LINK_SECS, sleep=lambda _: time.sleep(LANDED_POLL_SECS))
        except GroupError as e:
            if outcome_of(e.error) is Outcome.DIED:
                raise  # a rank died: the fault it is
            self.warn(f"the memory copy of step {global_step} did not land ({first_line(e.error)}); its ranks "
                      f"are linked again at the next step")
            self.buddies = {}
        except TimeoutError:
            self.warn(f"the memory copy of step {global_step} was still being sent after {LINK_SECS:.0f}s; its "
                      f"ranks are linked again at the next step")
            self.buddies = {}

    def holding(self) -> dict[str, dict[int, list[int]]]:
        """What each buddy holds whole, rank -> steps; a buddy that is dead or silent is absent."""
        names = set(self.buddies.values())
        spares = {name: s for name, s in ((s.name, s) for s in self.spares.spares) if name in names}
        refs = {name: s.handle.holding.remote() for name, s in spares.items()}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=HOLDING_SECS) if refs else ([], [])
        self.orphans = drain(self.orphans, 0)[0] + pending
        held = {}
        for name, ref in refs.items():
            if ref in ready:
                try:
                    held[name] = {int(rank): steps for rank, steps in ray.get(ref).items()}
                except Exception:  # noqa: BLE001 - a dead buddy holds nothing
                    pass
        return held

    def adopted(self) -> None:
        """After a repair from memory: the buddies that took dead ranks' places are ranks now, and the survivors
        left their links; every rank is linked again at the next step. Until its copy, no rank's own slots
        hold a step that every rank holds."""
        self.reset()

    def reset(self) -> None:
        """A new TrainGroup: no link and no staged step survive it; its ranks get their slots again."""
        self.buddies, self.staged, self.slots = {}, [], {}
