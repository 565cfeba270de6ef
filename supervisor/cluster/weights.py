"""The weight stream's group, seen from the Supervisor: made, used and blamed (workers/weight_sync.py moves
the bytes).

The Supervisor hosts the group's rendezvous (a TCPStore on an ephemeral port), so every member joins in one
call. A group joins the TrainGroup's rank 0 and every engine; a new TrainGroup or a replaced engine gets a
new group (the controller opens one at every resync). When every rank can map every engine's shared weights
(CPU engines on the ranks' host: workers/shared_weights.py), the ranks write them in place and the group
carries only the hashes; otherwise the weights stream through it.

Joining and syncing are one call on each member, waited for together; whoever dies or hangs is blamed, not
those who gave up waiting for it. A rank that dies or hangs stops the stream for everyone: the engines give
up after workers/weight_sync.op_timeout and raise, the TrainGroup is blamed. An engine that dies, hangs or
breaks its transfer is dropped by rank 0 after at most that long (well within recover.step_timeout_secs),
which finishes the others and reports it: that engine alone is blamed, and replaced or resynced.
"""
from __future__ import annotations

import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from supervisor.cluster.errors import Group, GroupError
from workers.errors import StaleWeights, WeightSyncError
from workers.weight_sync import op_timeout


class WeightStream:
    def __init__(self, trainers, engines, config):
        from torch.distributed import TCPStore

        self.trainers, self.engines = trainers, engines
        # once the trainers are done, how long an engine may still be receiving: rank 0 gave up on it by then
        self.engine_grace = op_timeout(config).total_seconds() + 10.0
        engines.wait_started()  # the rendezvous then needs seconds, not an engine's start-up
        address = ray.util.get_node_ip_address()
        self.store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=op_timeout(config))
        name, world = f"weights-{uuid.uuid4().hex[:12]}", 1 + len(engines.members)
        gpu = config.cluster.gpus_per_worker > 0 and config.cluster.gpus_per_engine > 0
        backend = "nccl" if gpu else "gloo"
        # CPU ranks and CPU engines only: GPU ranks would stream from the device (CUDA IPC is the GPU's version)
        cpu = backend == "gloo" and config.cluster.gpus_per_worker == 0
        memories = [m.memory for m in engines.members] if cpu else [None] * len(engines.members)
        joined = [m.handle.init_weights_update_group.remote(address, self.store.port, world, name, backend, memories)
                  for m in trainers.members]
        refs = [m.handle.init_weights_update_group.remote(address, self.store.port, 1 + i, world, name, backend)
                for i, m in enumerate(engines.members)]
        (spec, *others), answers = self._gather(joined, trainers.members, refs, engines.members)
        wanted = {a["dtype"] for a in answers}
        if len(wanted) != 1:
            raise ValueError(f"the engines want their weights in different dtypes: {sorted(wanted)}")
        self.dtype = wanted.pop()
        self.names, self.shapes = spec["names"], spec["shapes"]
        # every rank mapped every engine's weights: the ranks write them in place (workers/shared_weights.py)
        self.shared = all(a["shared"] for a in (spec, *others))
        self.verified = False  # the first shared sync is checked against the trainer's own digest

    def sync(self, global_step: int, only: list[int] | None = None) -> dict:
        """Stream the weights of `global_step`'s update to the engines in `only` (default: all; []: only the
        digest). Returns rank 0's figures: digest, bytes, buckets, secs, digest_secs, wait_secs, and
        gather_secs (the stream) or write_secs (shared weights)."""
        trainers, engines = self.trainers, self.engines
        only = list(range(len(engines.members))) if only is None else only
        shared = self.shared and bool(only)
        verify = shared and not self.verified
        sends = [m.handle.send_weights.remote(global_step, [1 + i for i in only], self.dtype, shared, verify)
                 for m in trainers.members]
        targets = [engines.members[i] for i in only]
        receives = [m.handle.update_weights_from_distributed.remote(
            self.names, [self.dtype] * len(self.names), self.shapes, global_step + 1, shared) for m in targets]
        (sent, *_), digests = self._gather(sends, trainers.members, receives, targets)
        if sent["failed"]:
            names = tuple(engines.members[rank - 1].name for rank in sent["failed"])
            raise GroupError(Group.ROLLOUT, WeightSyncError("; ".join(sent["failed"].values())), names)
        if verify and not sent["verified"]:  # a bug in an engine's weight_shard: stop, do not train on
            raise GroupError(Group.TRAIN, ValueError(
                f"the ranks' writes into the engines' shared weights (digest {sent['digest']}) differ from the "
                f"trainer's weights ({sent['trainer_digest']}); rollout.shared_memory_weights=false streams them"),
                (trainers.members[0].name,))
        self.verified = self.verified or verify
        wrong = [m.name for m, d in zip(targets, digests) if d != sent["digest"]]
        if wrong:
            raise GroupError(Group.ROLLOUT, StaleWeights(f"digest {sent['digest']} sent, another landed"),
                             tuple(wrong))
        return sent

    def _gather(self, trainer_refs: list, ranks: list, engine_refs: list, engines: list) -> tuple[list, list]:
        """The results of the trainers' and the engines' calls, waited for together. Fails fast: the first
        death ends the wait; once the trainers are done, an engine still receiving gets one transfer's timeout
        more. Raises GroupError naming who died, else who hung (the TrainGroup first: engines wait on it), else
        who raised first (those who raised later gave up waiting on it)."""
        refs, timeout, start = trainer_refs + engine_refs, self.trainers.timeout, time.monotonic()
        whose = [(self.trainers, m) for m in ranks] + [(self.engines, m) for m in engines]
        deadline, pending, errors = start + timeout, list(refs), {}
        while pending:
            if not set(trainer_refs) & set(pending):  # rank 0 gave up on a silent engine after op_timeout
                deadline = min(deadline, time.monotonic() + self.engine_grace)
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0),
                                      fetch_local=False)
            if not ready:
                break
            try:
                ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 - classified by the controller
                errors[ready[0]] = e
                if isinstance(e, RayActorError):  # a death: the others only wait on it
                    break
        waited = round(time.monotonic() - start, 3)
        pending = [r for r in refs if r in set(pending)]  # in the order of `refs`: the trainers first
        dead = [r for r in refs if isinstance(errors.get(r), RayActorError)]
        if dead:
            pending = []  # those still running wait on the dead one: not hung
        raised = [r for r in errors if r not in dead]  # in the order they came: the first is the origin
        for culprits, error in ((dead, None), (pending, GetTimeoutError(f"no answer after {waited:.0f}s")),
                                (raised, None)):
            if culprits:
                group = whose[refs.index(culprits[0])][0]
                mine = [r for r in culprits if whose[refs.index(r)][0] is group]
                left = [r for r in refs if r not in errors]  # drained when their actors are removed
                self.trainers.orphans += [r for r in left if whose[refs.index(r)][0] is self.trainers]
                self.engines.orphans += [r for r in left if whose[refs.index(r)][0] is self.engines]
                first = whose[refs.index(mine[0])][1]
                raise GroupError(group.group, error or errors[mine[0]],
                                 tuple(whose[refs.index(r)][1].name for r in mine), first.node_id, waited)
        return ray.get(trainer_refs), ray.get(engine_refs)

    def close(self) -> None:
        """The rendezvous goes; the members drop their part when they join the next group."""
        self.store = None
