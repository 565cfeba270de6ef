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

LINK_SECS = 30.0     # a link's set-up: a gloo pair and its store
HOLDING_SECS = 2.0   # a buddy that does not say what it holds within this long counts as lost
LANDED_POLL_SECS = 0.05  # how often the ranks are asked whether their copy landed, while the next update waits


class MemoryCopies:
    def __init__(self, spares: SparePool, warn: Callable[[str], None], linked: Callable[[dict[int, str]], None]):
        self.spares, self.warn, self.linked = spares, warn, linked  # the job's events: a warning, the new links
        self.buddies: dict[int, str] = {}  # rank -> the spare holding its copies (linked)
        self.staged: list[int] = []        # the steps every rank holds in its own two slots
        self.orphans: list[ray.ObjectRef] = []

    def begin(self, trainers: TrainGroup, global_step: int) -> None:
        """After `global_step`'s optimizer step on every rank: link the ranks that have no buddy to warm spares,
        then every rank stages its state (its slot of two steps back is overwritten) and sends it on."""
        self._link(trainers)
        self.staged = [s for s in self.staged if s == global_step - 1]
        trainers.call_all("begin_memory_copy", global_step)
        self.staged.append(global_step)

    def _link(self, trainers: TrainGroup) -> None:
        """Best effort: a spare that dies or stalls while linking leaves its ranks without a buddy (recovery from
        disk for them) and is tried again at the next step; a rank that died is the next group call's fault."""
        warm = self.spares.warm()
        plan = buddy_plan(trainers.nodes, {name: s.node for name, s in warm.items()}, self.buddies)
        new = [(rank, name) for rank, name in plan.items() if self.buddies.get(rank) != name]
        self.buddies = {rank: name for rank, name in plan.items() if self.buddies.get(rank) == name}
        if not new:
            return
        try:
            where = ray.get([warm[name].handle.where.remote() for _, name in new], timeout=LINK_SECS)
            calls = []
            for (rank, name), w in zip(new, where):
                key = uuid.uuid4().hex[:8]
                calls += [warm[name].handle.hold.remote(rank, w["port"], key),
                          trainers.members[rank].handle.memory_link.remote(w["ip"], w["port"], key)]
            ray.get(calls, timeout=LINK_SECS)
        except Exception as e:  # noqa: BLE001 - see above
            self.warn(f"linking ranks {[r for r, _ in new]} to their memory-tier buddies failed: "
                      f"{type(e).__name__}: {first_line(e)}; tried again at the next step")
            return
        self.buddies.update(new)
        nodes = {name: s.node for name, s in warm.items()}
        self.linked({rank: nodes[name] for rank, name in self.buddies.items()})

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
        """A new TrainGroup: no link and no staged step survive it."""
        self.buddies, self.staged = {}, []
