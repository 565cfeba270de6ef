"""The two worker groups the Supervisor drives: their Ray placement, calls, and how their faults look.

Every call waits on all the actors' results at once and fails fast: the first dead actor raises
`WorkerFault` within moments, naming the actor and its node; results still missing after the step
timeout raise a HANG fault. Nothing here decides what to do about a fault (that is policy.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from supervisor.policy import Fault, FaultKind
from workers.rollout_worker import RolloutWorker, merge_rollouts
from workers.train_worker import TrainWorker


SETUP_TIMEOUT_SECS = 180.0


class WorkerFault(Exception):
    def __init__(self, fault: Fault):
        super().__init__(fault.message)
        self.fault = fault


class CapacityError(RuntimeError):
    """The cluster did not offer the group's resources within recover.capacity_timeout_secs."""


@dataclass
class Member:
    handle: ray.actor.ActorHandle
    name: str
    node_id: str | None = None
    pid: int | None = None
    node_ref: ray.ObjectRef | None = None  # an engine's node id, read once it has answered


def gather(members: list[Member], refs: list[ray.ObjectRef], timeout: float, dead_kind: FaultKind) -> list:
    """All results in order; raise WorkerFault at the first failure, or HANG after `timeout` seconds."""
    start = time.monotonic()
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = timeout - (time.monotonic() - start)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not ready:
            stuck = ", ".join(members[index[r]].name for r in pending)
            raise WorkerFault(Fault(FaultKind.HANG, f"no answer after {timeout:.0f}s from {stuck}",
                                    actor=members[index[pending[0]]].name,
                                    node=members[index[pending[0]]].node_id, detect_secs=timeout))
        try:
            ray.get(ready[0])
        except RayTaskError as e:
            if isinstance(e.cause, RayActorError):  # a nested call to a dead actor
                _raise_dead(members[index[ready[0]]], e, dead_kind, time.monotonic() - start)
            raise
        except RayActorError as e:
            _raise_dead(members[index[ready[0]]], e, dead_kind, time.monotonic() - start)
    return ray.get(list(refs))


def _raise_dead(member: Member, error: RayError, kind: FaultKind, waited: float):
    cause = str(error).strip().splitlines()[0][:300]
    raise WorkerFault(Fault(kind, f"{member.name} died: {cause}", actor=member.name,
                            node=member.node_id, detect_secs=round(waited, 3))) from error


class TrainGroup:
    """A placement group plus N TrainWorker ranks sharing one torch.distributed process group."""

    def __init__(self, config, world_size: int, timeout: float):
        self.config, self.world_size, self.timeout = config, world_size, timeout
        cluster = config.cluster
        bundle = {"CPU": cluster.cpus_per_worker}
        if cluster.gpus_per_worker:
            bundle["GPU"] = cluster.gpus_per_worker
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        if not self.pg.wait(config.recover.capacity_timeout_secs):
            remove_placement_group(self.pg)
            raise CapacityError(
                f"the cluster did not offer {world_size} x {bundle} for the TrainGroup within "
                f"recover.capacity_timeout_secs={config.recover.capacity_timeout_secs:g}s "
                f"(available now: {ray.available_resources()})")
        self.members = [
            Member(TrainWorker.options(
                num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(config, r, world_size), f"TrainWorker[rank {r}]")
            for r in range(world_size)
        ]
        # Start-up (imports, model build, rendezvous) is not a step: it gets a longer bound than a step.
        setup_timeout = max(timeout, SETUP_TIMEOUT_SECS)
        where = gather(self.members, [m.handle.where.remote() for m in self.members], setup_timeout,
                       FaultKind.WORKER_DIED)
        for m, w in zip(self.members, where):
            m.node_id, m.pid = w["node_id"], w["pid"]
        gather(self.members, [m.handle.setup.remote(where[0]["ip"], where[0]["port"]) for m in self.members],
               setup_timeout, FaultKind.WORKER_DIED)

    def _all(self, call) -> list:
        return gather(self.members, [call(m) for m in self.members], self.timeout, FaultKind.WORKER_DIED)

    @property
    def nodes(self) -> list[str]:
        return [m.node_id for m in self.members]

    def train(self, shards: list[dict], global_step: int) -> list[dict]:
        return gather(self.members, [m.handle.train.remote(s, global_step) for m, s in zip(self.members, shards)],
                      self.timeout, FaultKind.WORKER_DIED)

    def weights(self) -> tuple[ray.ObjectRef, str]:
        """(reference to rank 0's full state dict, its checksum); the dict stays in the object store."""
        pairs = [m.handle.weights.options(num_returns=2).remote() for m in self.members]
        gather(self.members, [c for _, c in pairs], self.timeout, FaultKind.WORKER_DIED)
        return pairs[0][0], ray.get(pairs[0][1])

    def save_recover(self, staging: str, global_step: int, driver_state: dict | None = None) -> dict:
        files = {}
        for part in self._all(lambda m: m.handle.save_recover.remote(staging, global_step, driver_state)):
            files.update(part)
        return files

    def load_recover(self, step_dir: str, saved_world_size: int) -> list[str]:
        return self._all(lambda m: m.handle.load_recover.remote(step_dir, saved_world_size))[0]

    def export_hf(self, directory: str, global_step: int) -> None:
        self._all(lambda m: m.handle.export_hf.remote(directory, global_step))

    def shutdown(self) -> None:
        for m in self.members:
            ray.kill(m.handle, no_restart=True)
        remove_placement_group(self.pg)


class RolloutGroup:
    """M independent inference engines; each can be restarted alone."""

    def __init__(self, config, timeout: float):
        self.config, self.timeout = config, timeout
        self.members = [self._spawn(i) for i in range(config.cluster.n_rollout_workers)]

    def _spawn(self, i: int) -> Member:
        # Not waited for: the engine starts while the TrainGroup does; its first push waits for it.
        handle = RolloutWorker.options(num_cpus=self.config.cluster.cpus_per_worker, max_restarts=0).remote(self.config)
        return Member(handle, f"RolloutWorker[{i}]", node_ref=handle.node_id.remote())

    def _all(self, call) -> list:
        # A new engine may still be starting: the first call to it gets the start-up bound.
        timeout = self.timeout if all(m.node_id for m in self.members) else max(self.timeout, SETUP_TIMEOUT_SECS)
        return gather(self.members, [call(i, m) for i, m in enumerate(self.members)], timeout,
                      FaultKind.ENGINE_DIED)

    def generate(self, prompts: list[str], global_step: int, greedy: bool = False) -> dict:
        """Split the samples into contiguous chunks, one per engine, and merge the results in order."""
        n = len(self.members)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        chunks = self._all(lambda i, m: m.handle.generate.remote(
            prompts[bounds[i]:bounds[i + 1]], list(range(bounds[i], bounds[i + 1])), global_step, greedy))
        return merge_rollouts(chunks)

    def push(self, weights: ray.ObjectRef, version: int) -> None:
        self._all(lambda i, m: m.handle.load_weights.remote(weights, version))
        for m in self.members:
            if m.node_id is None:
                m.node_id = ray.get(m.node_ref)

    def weight_status(self) -> list[tuple[int | None, str]]:
        return self._all(lambda i, m: m.handle.weight_status.remote())

    def restart_dead(self) -> list[str]:
        """Replace every engine that does not answer; returns the names of those replaced."""
        replaced = []
        for i, m in enumerate(self.members):
            try:
                gather([m], [m.handle.weight_status.remote()], self.timeout, FaultKind.ENGINE_DIED)
            except WorkerFault:
                ray.kill(m.handle, no_restart=True)
                self.members[i] = self._spawn(i)
                replaced.append(m.name)
        return replaced

    @property
    def nodes(self) -> list[str]:
        return [m.node_id for m in self.members]

    def shutdown(self) -> None:
        for m in self.members:
            ray.kill(m.handle, no_restart=True)
