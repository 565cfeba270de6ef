"""The weight stream's group, seen from the Supervisor: made, used and blamed (workers/weight_sync.py moves
the bytes).

The Supervisor hosts the group's rendezvous (a TCPStore on an ephemeral port), so every member joins in one
call. A group joins the TrainGroup's rank 0 and every engine; a new TrainGroup or a replaced engine gets a
new group (the controller opens one at every resync). When every rank can map every engine's shared weights
(CPU engines on the ranks' host: workers/shared_weights.py; engines on the GPU every rank uses, through CUDA
IPC: workers/cuda_weights.py), the ranks write them in place and the group (gloo) carries only the hashes;
otherwise the weights stream through it: over nccl between GPUs, over gloo where either side is on the CPU.

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

from supervisor.cluster.blame import Call, Outcome, blame, group_error, outcome_of
from supervisor.cluster.errors import Group, GroupError
from workers.errors import ShardWriteError, StaleWeights, WeightSyncError
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
        # in place: CPU ranks write CPU engines' memory on their host; GPU ranks an engine's buffer on their GPU.
        # NCCL refuses two members on one device: nccl only where every member has a GPU of its own, else the
        # group is gloo (in place, it only carries the hashes; otherwise the stream goes through host memory)
        uuids = gpus(trainers, engines) if gpu else []
        in_place = len(set(uuids)) == 1 if gpu else config.cluster.gpus_per_worker == 0
        backend = "nccl" if gpu and len(set(uuids)) == len(uuids) else "gloo"
        # each engine's shared weights in a segment of this group's own: no writer of an earlier group reaches it
        memories = (engines.gather([m.handle.share_weights.remote(name) for m in engines.members]) if in_place
                    else [None] * len(engines.members))
        joined = [m.handle.init_weights_update_group.remote(address, self.store.port, world, name, backend, memories)
                  for m in trainers.members]
        refs = [m.handle.init_weights_update_group.remote(address, self.store.port, 1 + i, world, name, backend)
                for i, m in enumerate(engines.members)]
        (spec, *others), answers = self._gather(joined, trainers.members, refs, engines.members)
        wanted, kinds = {a["dtype"] for a in answers}, {a["digest"] for a in answers}
        if len(wanted) != 1 or len(kinds) != 1:
            raise ValueError(f"the engines want their weights in different dtypes or digests: {sorted(wanted | kinds)}")
        self.dtype, self.digest = wanted.pop(), kinds.pop()
        self.names, self.shapes = spec["names"], spec["shapes"]
        # every rank mapped every engine's weights: the ranks write them in place (workers/shared_weights.py)
        self.shared = all(a["shared"] for a in (spec, *others))
        # whether a shared sync was checked whole against the trainer's own parts, before and after the
        # TrainGroup's first optimizer step (right after a load, a stale shard cannot show); every other shared
        # sync checks one parameter, a different one each version
        self.checked: set[bool] = set()

    def sync(self, global_step: int, only: list[int] | None = None) -> dict:
        """Stream the weights of `global_step`'s update to the engines in `only` (default: all; []: only the
        digest). Returns rank 0's figures: digest, bytes, buckets, secs, digest_secs, wait_secs, and
        gather_secs (the stream) or write_secs, checked and check_secs (shared weights). A shared sync whose
        writes differ from the trainer's own parts stops the job (an internal error)."""
        trainers, engines = self.trainers, self.engines
        only = list(range(len(engines.members))) if only is None else only
        shared = self.shared and bool(only)
        trained = trainers.steps > 0
        check_all = shared and trained not in self.checked
        sends = [m.handle.send_weights.remote(global_step, [1 + i for i in only], self.dtype, shared, check_all,
                                              self.digest) for m in trainers.members]
        targets = [engines.members[i] for i in only]
        receives = [m.handle.update_weights_from_distributed.remote(
            self.names, [self.dtype] * len(self.names), self.shapes, global_step + 1, shared) for m in targets]
        (sent, *_), digests = self._gather(sends, trainers.members, receives, targets)
        if sent["failed"]:
            names = tuple(engines.members[rank - 1].name for rank in sent["failed"])
            raise GroupError(Group.ROLLOUT, WeightSyncError("; ".join(sent["failed"].values())), names)
        if shared and sent["mismatch"] is not None:  # a bug in an engine's weight_shard: stop, do not train on
            raise GroupError(Group.TRAIN, ShardWriteError(
                f"{self.names[sent['mismatch']]} as the ranks wrote it into the engines' shared weights differs "
                f"from the trainer's own (version {global_step + 1}); "
                f"rollout.shared_memory_weights=false streams them instead"), (trainers.members[0].name,))
        if check_all:
            self.checked.add(trained)
        wrong = [m.name for m, d in zip(targets, digests) if d != sent["digest"]]
        if wrong:
            raise GroupError(Group.ROLLOUT, StaleWeights(f"digest {sent['digest']} sent, another landed"),
                             tuple(wrong))
        return sent

    def _gather(self, trainer_refs: list, ranks: list, engine_refs: list, engines: list) -> tuple[list, list]:
        """The results of the trainers' and the engines' calls, waited for together, or GroupError naming who
        is to blame (cluster/blame.py; the engines are the later tier: they wait on the trainers). A death ends
        the wait; once the trainers are done, an engine still receiving gets one transfer's timeout more."""
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
                if outcome_of(e) is Outcome.DIED:  # the others only wait on it
                    break
        calls = [Call(outcome_of(errors[r]) if r in errors else Outcome.PENDING if r in pending else Outcome.OK,
                      tier=int(whose[i][0] is self.engines), order=list(errors).index(r) if r in errors else 0)
                 for i, r in enumerate(refs)]
        verdict = blame(calls)
        if verdict is None:
            return ray.get(trainer_refs), ray.get(engine_refs)
        left = [r for r in refs if r not in errors]  # drained when their actors are removed
        self.trainers.orphans += [r for r in left if r in trainer_refs]
        self.engines.orphans += [r for r in left if r in engine_refs]
        group = whose[verdict.culprits[0]][0]
        raise group_error(verdict, group.group, {i: errors[r] for i, r in enumerate(refs) if r in errors},
                          [m for _, m in whose], round(time.monotonic() - start, 3))

    def close(self) -> None:
        """The rendezvous goes; the members drop their part when they join the next group."""
        self.store = None


def gpus(trainers, engines) -> list[str]:
    """The GPU (its UUID: each process numbers its GPUs its own way) of every rank, then every engine, asked of
    each: one GPU for all lets the ranks write the engines' weights through CUDA IPC."""
    where = trainers.gather([m.handle.where.remote(r) for r, m in enumerate(trainers.members)])
    where += engines.gather([m.handle.where.remote() for m in engines.members])
    return [w["gpu"] for w in where]
