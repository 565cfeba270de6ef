"""The weight stream's group, seen from the Supervisor: made, used and blamed (workers/weight_sync.py moves
the bytes).

The Supervisor hosts the group's rendezvous (a TCPStore on an ephemeral port), so every member joins in one
call. A group joins the TrainGroup's rank 0 and every engine; a new TrainGroup or a replaced engine gets a
new group (the controller opens one at every resync). A sync is one call on every rank and on each target
engine, gathered trainers first: a rank that dies or hangs stops the stream for everyone, the engines
included (they give up after workers/weight_sync.op_timeout), so the TrainGroup is blamed; an engine that
dies, hangs or breaks its transfer is dropped by rank 0, which finishes the others and reports it, so that
engine alone is blamed.
"""
from __future__ import annotations

import uuid

import ray

from supervisor.cluster.errors import Group, GroupError
from workers.errors import StaleWeights, WeightSyncError
from workers.weight_sync import op_timeout


class WeightStream:
    def __init__(self, trainers, engines, config):
        from torch.distributed import TCPStore

        self.trainers, self.engines = trainers, engines
        engines.wait_started()  # the rendezvous then needs seconds, not an engine's start-up
        address = ray.util.get_node_ip_address()
        self.store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=op_timeout(config))
        name, world = f"weights-{uuid.uuid4().hex[:12]}", 1 + len(engines.members)
        gpu = config.cluster.gpus_per_worker > 0 and config.cluster.gpus_per_engine > 0
        backend = "nccl" if gpu else "gloo"
        rank0 = trainers.members[0]
        joined = rank0.handle.init_weights_update_group.remote(address, self.store.port, world, name, backend)
        refs = [m.handle.init_weights_update_group.remote(address, self.store.port, 1 + i, world, name, backend)
                for i, m in enumerate(engines.members)]
        try:
            wanted = {r["dtype"] for r in engines.gather(refs)}
        except GroupError:
            trainers.orphans.append(joined)
            raise
        spec = trainers.gather([joined], members=[rank0])[0]
        if len(wanted) != 1:
            raise ValueError(f"the engines want their weights in different dtypes: {sorted(wanted)}")
        self.dtype = wanted.pop()
        self.names, self.shapes = spec["names"], spec["shapes"]

    def sync(self, global_step: int, only: list[int] | None = None) -> dict:
        """Stream the weights of `global_step`'s update to the engines in `only` (default: all; []: only the
        digest). Returns rank 0's figures: digest, bytes, secs, digest_secs."""
        trainers, engines = self.trainers, self.engines
        only = list(range(len(engines.members))) if only is None else only
        sends = [m.handle.send_weights.remote(global_step, [1 + i for i in only], self.dtype)
                 for m in trainers.members]
        targets = [engines.members[i] for i in only]
        receives = [m.handle.update_weights_from_distributed.remote(
            self.names, [self.dtype] * len(self.names), self.shapes, global_step + 1) for m in targets]
        try:
            sent = trainers.gather(sends)[0]
        except GroupError:
            engines.orphans += receives
            raise
        digests = engines.gather(receives, members=targets)  # a dropped engine fails or hangs here, named
        if sent["failed"]:
            names = tuple(engines.members[rank - 1].name for rank in sent["failed"])
            raise GroupError(Group.ROLLOUT, WeightSyncError("; ".join(sent["failed"].values())), names)
        wrong = [m.name for m, d in zip(targets, digests) if d != sent["digest"]]
        if wrong:
            raise GroupError(Group.ROLLOUT, StaleWeights(f"digest {sent['digest']} sent, another landed"),
                             tuple(wrong))
        return sent

    def close(self) -> None:
        """The rendezvous goes; the members drop their part when they join the next group."""
        self.store = None
