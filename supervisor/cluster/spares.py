"""Warm spare TrainWorkers: processes started ahead of need, so a restart skips their start-up.

A spare has done its imports and built the unsharded model (TrainWorker.warm) but is in no process group:
it learns its rank when a new TrainGroup takes it. It holds one rank's resources, on a node chosen away
from the ranks (spare_plan.py), by a soft node affinity so that it still starts if that node filled up.
`take` hands out live spares at once and skips dead ones (lost with their node) after a short probe; the
Supervisor refills the pool after the first step the new group completed, so warming never competes with
the restart itself. Spares are named per trial, so a Supervisor that died leaves none behind for long.

A spare is also a buddy of the memory tier (memory_copies.py): it holds ranks' copies and, when one of them
dies, takes its place with that state (`claim`). It holds them from its start, not from its warm-up's end: its
holder's methods answer on a thread of their own while it warms (TrainWorker's HOLDER group), so the tier links
a rank to a spare as soon as the spare says where it runs (`holders`). A restart from disk makes every rank new (a survivor stuck in a
collective with a SIGSTOPped peer stays stuck until gloo's timeout, and DeepSpeed keeps global comm state);
a repair from memory keeps the survivors (groups.py: TrainGroup.rejoin).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from supervisor.cluster.drains import room_per_node
from supervisor.cluster.groups import drain, kill
from supervisor.cluster.spare_placement import choose_nodes, rank_resources
from supervisor.config import Config, RoleName
from workers.train_worker import TrainWorker

PROBE_SECS = 2.0  # how long a warm spare may take to answer before it counts as dead


@dataclass
class Spare:
    handle: ray.actor.ActorHandle
    name: str
    warm: ray.ObjectRef  # its warm() call: done once its imports and model build are
    located: ray.ObjectRef  # its located() call: done once it has started, and can hold ranks' copies
    memory: dict | None = None  # its peak memory once warm (workers/memory.py)
    node: str | None = None  # its node once located
    placed: str | None = None  # the node it was asked to start on (a soft affinity: where it most likely runs)


def spare_prefix(config: Config) -> str:
    return f"relaunch/{config.experiment_name}/{config.trial_name}/spare/"


def remove_leftover_spares(config: Config) -> int:
    """Kill this trial's spares left by a Supervisor that died (named actors, found by their prefix)."""
    removed = 0
    for name in ray.util.list_named_actors():
        if name.startswith(spare_prefix(config)):
            try:
                ray.kill(ray.get_actor(name), no_restart=True)
                removed += 1
            except ValueError:  # gone meanwhile
                pass
    return removed


class SparePool:
    """One group's spares (`role`: the actor's, or the critic's in a PPO job)."""

    def __init__(self, config: Config, size: int, role: RoleName = RoleName.ACTOR):
        self.config, self.size, self.role = config, size, role
        self.spares: list[Spare] = []
        self.orphans: list[ray.ObjectRef] = []
        self.dropped = 0  # spares dropped as holders since the last refill (the Supervisor refills their places)
        self.lent: list[Spare] = []  # the spares `take` and `claim` handed out since the last refill (`give_back`)

    def __len__(self) -> int:
        return len(self.spares)

    def take(self, n: int) -> list[tuple[ray.actor.ActorHandle, dict | None]]:
        """Up to `n` spares as (handle, where) pairs, removed from the pool: warm ones that answer a probe
        within PROBE_SECS, then ones still warming (where None: their setup waits for the warm-up, which is
        still sooner than a cold start). A dead or silent warm spare is killed and dropped."""
        if n <= 0 or not self.spares:
            return []
        warmed = set(ray.wait([s.warm for s in self.spares], num_returns=len(self.spares), timeout=0)[0])
        probes = {s.name: s.handle.warm.remote() for s in self.spares if s.warm in warmed}
        ready = set(ray.wait(list(probes.values()), num_returns=len(probes), timeout=PROBE_SECS)[0]) \
            if probes else set()
        live, warming, broken = [], [], []
        for s in self.spares:
            if s.warm not in warmed:
                warming.append((s, None))
            elif probes[s.name] not in ready:  # warm but silent: stopped, or its node unreachable
                broken.append(s)
                self.orphans.append(probes[s.name])
            else:
                try:
                    live.append((s, ray.get(probes[s.name])))
                except Exception:  # noqa: BLE001 - a dead spare (lost with its node, or killed): skipped
                    broken.append(s)
        taken = (live + warming)[:n]
        self.orphans += [s.warm for s, where in taken if where is None]  # retrieved later, so Ray stays quiet
        self._kill(broken)
        self.spares = [s for s, _ in (live + warming)[n:]]
        self.lent += [s for s, _ in taken]
        return [(s.handle, where) for s, where in taken]

    def give_back(self, handles: list[ray.actor.ActorHandle]) -> None:
        """Spares handed out (`take`, `claim`) that were not used (a repair that could not place its ranks after
        all): back in the pool as they were, instead of killed and started again."""
        back = [s for s in self.lent if any(s.handle is h for h in handles)]
        self.lent = [s for s in self.lent if s not in back]
        self.spares = back + self.spares

    def peak_memory(self) -> list[dict]:
        """The peak memory of every spare that finished warming, read once from its warm-up's answer."""
        self._read_warm_ups()
        return [s.memory for s in self.spares if s.memory]

    def warm(self) -> dict[str, Spare]:
        """The spares that finished warming and answered it (name -> spare), without waiting."""
        self._read_warm_ups()
        return {s.name: s for s in self.spares if s.memory}

    def holders(self) -> dict[str, Spare]:
        """The spares that have started and said where (name -> spare, its node known), warm or not: each can
        hold ranks' copies. Without waiting."""
        waiting = [s for s in self.spares if s.node is None]
        ready = set(ray.wait([s.located for s in waiting], num_returns=len(waiting), timeout=0)[0]) \
            if waiting else ()
        for s in waiting:
            if s.located in ready:
                try:
                    s.node = ray.get(s.located)["node_id"]
                except Exception:  # noqa: BLE001 - a dead spare: `take` finds and drops it
                    s.node = ""
        return {s.name: s for s in self.spares if s.node}

    def _read_warm_ups(self) -> None:
        waiting = [s for s in self.spares if s.memory is None]
        ready = set(ray.wait([s.warm for s in waiting], num_returns=len(waiting), timeout=0)[0]) if waiting else ()
        for s in waiting:
            if s.warm in ready:
                try:
                    s.memory = ray.get(s.warm)["memory"]
                except Exception:  # noqa: BLE001 - a dead spare: `take` finds and drops it
                    s.memory = {}

    def claim(self, names: list[str]) -> dict[str, ray.actor.ActorHandle]:
        """The named spares (the buddies that hold dead ranks' state), removed from the pool to take their places."""
        claimed = {s.name: s.handle for s in self.spares if s.name in names}
        self.lent += [s for s in self.spares if s.name in claimed]
        self.spares = [s for s in self.spares if s.name not in claimed]
        return claimed

    def drop(self, names: list[str]) -> None:
        """Kill the named spares and remove them from the pool (a holder that died or stalled while a rank was
        linked to it): never planned as a buddy again; the pool refills their places after the next step."""
        dropped = [s for s in self.spares if s.name in names]
        self.spares = [s for s in self.spares if s.name not in names]
        self._kill(dropped)
        self.dropped += len(dropped)

    def refill(self, avoid: list[str | None], placed: list[str] = ()) -> list[str]:
        """Start spares up to the pool's size on nodes with room, away from `avoid` where possible; returns the
        nodes they were placed on. Not waited for: each is checked when it is next taken. `placed`: the nodes
        another pool's refill placed spares on a moment ago, whose room Ray may not show as taken yet (a spare sent
        to a node without room waits there: its node affinity is soft only where the node cannot hold it at all)."""
        self.lent = []
        need = rank_resources(self.config.cluster)
        room = room_per_node()
        for node in placed:
            if node in room:
                room[node] = {k: v - need.get(k, 0.0) for k, v in room[node].items()}
        nodes = choose_nodes(room, {n for n in avoid if n}, need, self.size - len(self.spares))
        for node in nodes:
            name = spare_prefix(self.config) + ("" if self.role is RoleName.ACTOR else f"{self.role}-") + \
                uuid.uuid4().hex[:8]
            handle = TrainWorker.options(
                name=name, num_cpus=self.config.cluster.cpus_per_worker, num_gpus=self.config.cluster.gpus_per_worker,
                max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
            ).remote(self.config, self.role)
            self.spares.append(Spare(handle, name, handle.warm.remote(), handle.located.remote(), placed=node))
        return nodes

    def make_room(self, n: int, keep: frozenset[str] = frozenset(), reserve: int = 0,
                  last: frozenset[str] = frozenset(), freed: int = 0) -> int:
        """Kill spares until the cluster has free CPUs for `n` more workers (replacements of engines lost with
        a node must not wait behind spares); returns how many were killed. Never those in `keep` (by name: the
        spares about to take moving ranks' places), nor the first `reserve` of the others (free spares that
        moving ranks will take); those in `last` (holding ranks' memory copies) only once no other is left.
        `freed`: the workers' room that spares killed for the same engines already freed, which Ray may show
        free by now or not yet (counted once either way). The pool refills when there is room."""
        free = sum(r.get("CPU", 0.0) for r in room_per_node().values()) // self.config.cluster.cpus_per_worker
        others = [s for s in self.spares if s.name not in keep][reserve:]
        victims = sorted(others, key=lambda s: s.name in last)[:max(0, n - max(int(free), freed))]
        gone = {s.name for s in victims}
        self.spares = [s for s in self.spares if s.name not in gone]
        self._kill(victims)
        return len(victims)

    def _kill(self, spares: list[Spare]) -> None:
        # the pool's other leftover calls are only collected, not waited for: a taken spare's warm-up may run on
        self.orphans = drain(self.orphans, 0)[0] + kill([s.handle for s in spares],
                                                        [s.warm for s in spares] + [s.located for s in spares])

    def shutdown(self) -> None:
        spares, self.spares = self.spares, []
        self._kill(spares)
        self.orphans = []
