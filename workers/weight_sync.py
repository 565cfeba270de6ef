"""The trainer -> engine weight stream: a process group of its own, fixed-size buckets, a digest per bucket.

Trainer rank 0 is rank 0 of a weights-update group; engine i joins it as rank `rank_offset` = 1 + i (the
shape of vLLM's and SGLang's RL weight-update API: `init_weights_update_group`, then
`update_weights_from_distributed(names, dtypes, shapes)`), through a TCPStore the Supervisor hosts. The
group is made from the store and ProcessGroupGloo (ProcessGroupNCCL on GPU) directly: the trainer's default
group is the training group, and `new_group` cannot make a world of other processes.

The parameters, in the trainer's order, are laid end to end in the engine's dtype and cut into buckets of
`bucket_bytes` (a parameter may span buckets). Every trainer rank takes part in gathering each parameter as
its first bucket needs it; rank 0 alone copies it into the bucket and sends the bucket, point to point, to
each target engine (so a subset can be pushed, and a dead target breaks only its own pair). The engine
receives each bucket into a buffer and copies it in place into its parameters. Both sides hash every
bucket (xxh3-64, in a thread: xxhash releases the GIL, so the hash overlaps the next transfer; 5x crc32's
speed here, about a tenth of a sync at ~100M); rank 0 sends
its hashes last, and the engine takes the version only when the last bucket landed and they agree. An engine
whose weights live on a GPU asks for `sum64` digests instead: a position-weighted sum of the bucket's 64-bit
words, computed on the device where the bytes are (no byte crosses to the host), and the same value where a
bucket is hashed on the CPU (the stream through host memory), so every side of a sync agrees.

When every trainer rank has mapped the engines' shared weights (workers/shared_weights.py: CPU engines on the
ranks' host; workers/cuda_weights.py: an engine on the ranks' GPU), `write_shared` replaces the stream: each rank writes its own shards straight into the engines'
parameters, the ranks hash the buckets there between them, and the group carries only rank 0's hashes.
"""
from __future__ import annotations

import datetime
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from supervisor.testing.fault_points import fault_point
from workers.errors import ShardWriteError, TransferTimedOut, WeightSyncError

TAG_DIGESTS = 1 << 30  # the tag of the hashes message; bucket k is sent with tag k
DIGESTS = ("xxh3", "sum64")  # an engine's weights on the CPU, on a GPU
# sum64's weight of word i: an odd multiple of the golden ratio's 64-bit constant (as a signed int64)
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of parameter `param` (flattened) at `offset` in its bucket."""
    param: int
    start: int
    length: int
    offset: int


def bucket_elements(itemsize: int, bucket_bytes: int) -> int:
    """How many elements a bucket holds: `bucket_bytes` rounded down to whole elements, at least one."""
    return max(1, bucket_bytes // itemsize)


def plan_buckets(numels: Sequence[int], itemsize: int, bucket_bytes: int) -> list[list[Piece]]:
    """The parameters laid end to end, cut every `bucket_bytes` (rounded down to whole elements)."""
    per_bucket = bucket_elements(itemsize, bucket_bytes)
    buckets, current, used = [], [], 0
    for i, numel in enumerate(numels):
        start = 0
        while start < numel:
            length = min(numel - start, per_bucket - used)
            current.append(Piece(i, start, length, used))
            start, used = start + length, used + length
            if used == per_bucket:
                buckets.append(current)
                current, used = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_len(bucket: list[Piece]) -> int:
    return bucket[-1].offset + bucket[-1].length


def combine(hashes: Sequence[int], kind: str = "xxh3") -> str:
    """One checksum string for a sync: its buckets' hashes, in order, hashed together, named by their kind."""
    return f"{kind}-" + hashlib.sha256(b"".join(h.to_bytes(8, "big") for h in hashes)).hexdigest()[:16]


def bucket_hash(t: torch.Tensor, kind: str = "xxh3") -> int:
    """The bucket's hash, unsigned 64-bit: xxh3-64 of its bytes on the CPU (a GPU tensor is copied to the host
    first), or `sum64` where the tensor is."""
    if kind == "sum64":
        return sum64(t)
    return xxhash.xxh3_64_intdigest(t.view(torch.uint8).cpu().numpy())


def shard_digest(shards: Iterable[tuple[int, torch.Tensor]]) -> str:
    """One rank's parts of the streamed weights (`shards`: each parameter's `weight_shard`, in order) hashed
    together: the same rank's before and after it moves prove it holds what it held, with nothing gathered."""
    h = xxhash.xxh3_64()
    for start, part in shards:
        h.update(start.to_bytes(8, "big"))
        h.update(part.detach().contiguous().view(torch.uint8).cpu().numpy())
    return f"xxh3-{h.hexdigest()}"


_word_weights: dict[torch.device, torch.Tensor] = {}


def sum64(t: torch.Tensor) -> int:
    """The bytes of `t` as little-endian 64-bit words (zero-padded), each times an odd weight of its position,
    summed modulo 2**64: two elementwise passes on whatever device `t` is on, and the same value on any device
    (integer sums wrap exactly, in any order). It catches a changed, lost or misplaced word; it is a check
    against corruption, not a cryptographic hash."""
    data = t.detach().reshape(-1).view(torch.uint8)
    if data.numel() % 8 or data.storage_offset() % 8:
        data = torch.nn.functional.pad(data, (0, -data.numel() % 8))  # a copy, aligned
    words = data.view(torch.int64)
    weights = _word_weights.get(words.device)
    if weights is None or weights.numel() < words.numel():
        weights = (torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device) * GOLDEN) | 1
        _word_weights[words.device] = weights
    return int((words * weights[:words.numel()]).sum()) & ((1 << 64) - 1)


def as_message(hashes: Sequence[int]) -> torch.Tensor:
    """Unsigned 64-bit hashes as the int64 tensor a process group carries (the same bits)."""
    return torch.from_numpy(np.array(hashes, dtype=np.uint64).view(np.int64))


def from_message(t: torch.Tensor) -> list[int]:
    return t.numpy().view(np.uint64).tolist()


def pieces_hash(pieces: Sequence[torch.Tensor], kind: str = "xxh3") -> int:
    """`bucket_hash` of the pieces laid end to end, hashed where they are: xxh3's streaming form gives the
    same value, without a copy of the bucket (a new allocation, its pages faulted in, at every digest);
    sum64 hashes them joined, on their device."""
    if kind == "sum64":
        return sum64(torch.cat([piece.reshape(-1) for piece in pieces]))
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece.contiguous().view(torch.uint8).cpu().numpy())
    return hasher.intdigest()


def local_digest(tensors: Sequence[torch.Tensor], dtype: torch.dtype, bucket_bytes: int, kind: str = "xxh3") -> str:
    """The digest a sync of `tensors` (full, in the stream's order) gives, computed in one process over the
    tensors' own memory: what an engine reports of the weights it holds, and what tests check a sync against."""
    flat = [t.detach().reshape(-1).to(dtype) for t in tensors]
    plan = plan_buckets([f.numel() for f in flat], torch.empty(0, dtype=dtype).element_size(), bucket_bytes)
    return combine([pieces_hash([flat[p.param][p.start:p.start + p.length] for p in b], kind) for b in plan], kind)


def flat_digest(flat: torch.Tensor, dtype: torch.dtype, bucket_bytes: int, kind: str = "xxh3") -> str:
    """The digest of parameters laid end to end in `flat` (an engine's shared weights), hashed in place."""
    per = bucket_elements(dtype.itemsize, bucket_bytes)
    return combine([bucket_hash(flat[k:k + per], kind) for k in range(0, flat.numel(), per)], kind)


def op_timeout(config) -> datetime.timedelta:
    """How long one transfer (or the group's rendezvous) may wait: a third of recover.step_timeout_secs, so
    that rank 0 gives up on a hung engine, and reports it, well before the Supervisor calls the sync a hang."""
    return datetime.timedelta(seconds=config.recover.step_timeout_secs / 3)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: datetime.timedelta):
    """This process's member of the weights-update group `group_name` (a new name for every group)."""
    from torch.distributed import PrefixStore, TCPStore

    store = PrefixStore(f"{group_name}/", TCPStore(master_address, master_port, is_master=False, timeout=timeout))
    if backend == "nccl":  # the stream between GPUs (an engine on the ranks' own GPU is written in place instead)
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, opts)
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(store, rank, world_size, opts)


def send(full: Callable[[int], torch.Tensor], numels: Sequence[int], dtype: torch.dtype, bucket_bytes: int,
         sender: bool, group, targets: Sequence[int], timeout: datetime.timedelta,
         device: torch.device | str = "cpu", kind: str = "xxh3") -> dict:
    """Every trainer rank calls it; rank 0 is the `sender` (its `group` may be None when there are no
    `targets`: a digest only). `full(i)` is the collective that gathers parameter i. Returns, on rank 0,
    the digest, the targets that failed (weights rank -> why) and figures; on the others, {}.

    A target whose transfer fails or times out is dropped and reported; the gather loop always runs to its
    end, so that no rank is left waiting in an all-gather for a rank that gave up."""
    plan = plan_buckets(numels, torch.empty(0, dtype=dtype).element_size(), bucket_bytes)
    live, failed = list(targets), {}
    size = max((bucket_len(b) for b in plan), default=0) if sender else 0
    buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]
    in_flight: list[list] = [[], []]  # per buffer: the (target, work) pairs still sending it
    hashing: list[Future | None] = [None, None]  # per buffer: its bucket's hash, while it runs
    hashes: list[Future] = []
    error: BaseException | None = None
    current, tensor = -1, None
    t0, hash_secs, gather_secs, wait_secs = time.monotonic(), [0.0], 0.0, [0.0]

    def drop(target: int, e: BaseException) -> None:
        live.remove(target)
        failed[target] = f"transfer to weights rank {target}: {str(e).splitlines()[0][:200]}"

    def post(data: torch.Tensor, tag: int) -> list:
        works = []
        for target in list(live):
            try:
                works.append((target, group.send([data], target, tag)))
            except Exception as e:  # noqa: BLE001 - a closed pair raises here rather than in wait()
                drop(target, e)
        return works

    def settle(works: list) -> None:
        t1 = time.monotonic()
        for target, work in works:
            if target in live:
                try:
                    work.wait(timeout)
                except Exception as e:  # noqa: BLE001 - that target is dropped and reported
                    drop(target, e)
        works.clear()
        wait_secs[0] += time.monotonic() - t1

    def timed_hash(t: torch.Tensor) -> int:
        t1 = time.monotonic()
        value = bucket_hash(t, kind)
        hash_secs[0] += time.monotonic() - t1
        return value

    with ThreadPoolExecutor(1, thread_name_prefix="digest") as hasher:
        for k, bucket in enumerate(plan):
            buf = buffers[k % 2]
            if sender:
                settle(in_flight[k % 2])
                if hashing[k % 2] is not None:
                    hashing[k % 2].result()  # the buffer's previous bucket is hashed
            for piece in bucket:
                if piece.param != current:
                    t1 = time.monotonic()
                    current, tensor = piece.param, full(piece.param)  # collective: every rank, every parameter
                    gather_secs += time.monotonic() - t1
                    if not sender:
                        tensor = None
                if sender and error is None:
                    try:
                        buf[piece.offset:piece.offset + piece.length].copy_(
                            tensor.reshape(-1)[piece.start:piece.start + piece.length])
                    except Exception as e:  # noqa: BLE001 - raised after the loop, which the peers need finished
                        error = e
            if sender and error is None:
                data = buf[:bucket_len(bucket)]
                hashing[k % 2] = hasher.submit(timed_hash, data)
                hashes.append(hashing[k % 2])
                in_flight[k % 2] = post(data, k)
        if not sender:
            return {}
        for works in in_flight:
            settle(works)
        if error is not None:
            raise error
        values = [f.result() for f in hashes]
    settle(post(as_message(values).to(device), TAG_DIGESTS))  # nccl carries CUDA tensors only
    nbytes = sum(bucket_len(b) for b in plan) * buffers[0].element_size()
    return {"digest": combine(values, kind), "failed": failed, "bytes": nbytes, "buckets": len(plan),
            "secs": time.monotonic() - t0, "digest_secs": hash_secs[0], "gather_secs": gather_secs,
            "wait_secs": wait_secs[0]}


def write_shared(shard: Callable[[int], tuple[int, torch.Tensor]], numels: Sequence[int], dtype: torch.dtype,
                 bucket_bytes: int, segments: Sequence[torch.Tensor], rank: int, world_size: int, group,
                 targets: Sequence[int], timeout: datetime.timedelta, step: int, kind: str = "xxh3") -> dict:
    """The shared-memory sync (workers/shared_weights.py); every trainer rank calls it, with the mapped
    segments of `targets`. `shard(i)` is this rank's contiguous part of parameter i: (first element, tensor).
    Each rank writes its parts into every segment, then, once all have (a barrier on the training group),
    hashes its share of the buckets there (bucket k on rank k % world_size): the digest is of the engine's own
    memory, and the same as the stream's, whatever the world size. Rank 0 sends each target its hashes, the
    engine's signal that its weights are whole, and returns what `send` returns; the others {}.

    A rank whose writes fail still takes part in every collective; then every rank raises the same
    ShardWriteError naming it, rank 0 tells the engines to give up, and the Supervisor sees that error from
    every rank at once, not a hang of its peers."""
    t0, error = time.monotonic(), None
    flats = [s.view(dtype) for s in segments]
    first = np.cumsum([0, *numels[:-1]]).tolist()
    try:
        for i in range(len(numels)):
            start, part = shard(i)
            start += first[i]
            for flat in flats:
                flat[start:start + part.numel()].copy_(part.reshape(-1))
        if flats and flats[0].is_cuda:  # another process reads them next: the copies are done, not queued
            torch.cuda.current_stream().synchronize()
        fault_point("weights_written", step=step, rank=rank)  # tests: a rank dies with its part written
    except Exception as e:  # noqa: BLE001 - raised once the peers are through the collectives below
        error = e
    write_secs = time.monotonic() - t0
    dist.barrier()  # every rank's parts are in place
    per, total = bucket_elements(dtype.itemsize, bucket_bytes), sum(numels)
    count = -(-total // per)
    t1 = time.monotonic()
    hashes = torch.zeros(len(flats), count, dtype=torch.int64)
    if error is None:
        for j, flat in enumerate(flats):
            hashes[j, rank:count:world_size] = as_message([bucket_hash(flat[k * per:(k + 1) * per], kind)
                                                           for k in range(rank, count, world_size)])
    failed = torch.zeros(world_size, dtype=torch.int64)
    failed[rank] = error is not None
    digest_secs = time.monotonic() - t1
    message = torch.cat([hashes.reshape(-1), failed])
    dist.all_reduce(message)  # a sum in which each entry has one nonzero term: every bucket's hash everywhere
    hashes, failed = message[:hashes.numel()].view(len(flats), count), message[hashes.numel():]
    if failed.any():  # every rank knows it: all take the same branch, and the same collectives
        raise _write_failed(error, failed, group if rank == 0 else None, targets, count, timeout)
    if rank != 0:
        return {}
    unsent, t2 = {}, time.monotonic()
    for j, target in enumerate(targets):
        try:
            group.send([torch.cat([hashes[j], torch.zeros(1, dtype=torch.int64)])], target, TAG_DIGESTS).wait(timeout)
        except Exception as e:  # noqa: BLE001 - that target is dropped and reported
            unsent[target] = f"transfer to weights rank {target}: {str(e).splitlines()[0][:200]}"
    return {"digest": combine(from_message(hashes[0]), kind), "failed": unsent,
            "bytes": total * flats[0].element_size(), "buckets": count, "secs": time.monotonic() - t0,
            "digest_secs": digest_secs, "write_secs": write_secs, "wait_secs": time.monotonic() - t2}


def _write_failed(error: BaseException | None, failed: torch.Tensor, group, targets: Sequence[int], count: int,
                  timeout: datetime.timedelta) -> ShardWriteError:
    """Collective, once some rank's writes failed: the one error every rank raises. The failed ranks' errors
    reach every rank; rank 0 (`group` given) tells each engine to give up rather than wait for hashes."""
    texts: list = [None] * len(failed)
    dist.all_gather_object(texts, None if error is None else f"{type(error).__name__}: {str(error)[:300]}")
    if group is not None:
        for target in targets:
            try:
                group.send([torch.ones(count + 1, dtype=torch.int64)], target, TAG_DIGESTS).wait(timeout)
            except Exception:  # noqa: BLE001 - that engine gives up on its own after `timeout`
                pass
    ranks = failed.nonzero().reshape(-1).tolist()
    return ShardWriteError(f"trainer rank {ranks[0]} could not write its shards into the engines' shared weights: "
                           f"{texts[ranks[0]]}" + (f" (and ranks {ranks[1:]})" if ranks[1:] else ""))


def to_check(version: int, count: int, whole: bool) -> list[int]:
    """Which of the `count` parameters a shared sync checks against the trainer's own parts: all of them
    (`whole`), else one, a different one each version, so that `count` consecutive syncs cover them all."""
    return list(range(count)) if whole else [version % count]


def mismatched(part: Callable[[int], tuple[int, torch.Tensor]], flat: torch.Tensor | None, numels: Sequence[int],
               dtype: torch.dtype, which: Sequence[int], kind: str = "xxh3", chunk: int = 1 << 22) -> list[int]:
    """Collective, on every trainer rank: parameters `which` as the trainer holds them, compared on rank 0 with
    where the ranks wrote them (`flat`: an engine's shared weights as rank 0 maps them, laid end to end in `dtype`;
    None on the other ranks). Each rank hashes its own part (`part`: the engine's placed_part, placed by the
    sharding itself, not by the shards the ranks wrote) and only the hashes cross the group: rank 0 hashes the
    same spans of `flat`. The indices that differ, or whose parts do not cover the parameter exactly once, on
    rank 0: a stale or misplaced shard shows. Hashed `chunk` elements at a time (span_hash)."""
    mine = torch.zeros(len(which), 3, dtype=torch.int64)  # per parameter: first element, elements, hash
    for n, i in enumerate(which):
        start, tensor = part(i)
        mine[n, :2] = torch.tensor([start, tensor.numel()])
        mine[n, 2:] = as_message([span_hash(tensor.reshape(-1), dtype, kind, chunk)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if flat is None:
        return []
    first, bad = np.cumsum([0, *numels[:-1]]).tolist(), []
    for n, i in enumerate(which):
        spans = sorted((int(r[n, 0]), int(r[n, 1]), from_message(r[n, 2:])[0]) for r in every if r[n, 1] > 0)
        covered, held = 0, True
        for start, count, digest in spans:
            span = flat[first[i] + start:first[i] + start + count]
            held = held and start == covered and span_hash(span, dtype, kind, chunk) == digest
            covered = start + count
        if not held or covered != numels[i]:
            bad.append(i)
    return bad


def span_hash(t: torch.Tensor, dtype: torch.dtype, kind: str, chunk: int) -> int:
    """`bucket_hash` of flat `t` cast to `dtype`, `chunk` elements at a time, the pieces' hashes hashed together
    (one piece: its own hash): no cast or temporary larger than a piece, whatever the parameter's size."""
    hashes = [bucket_hash(t[k:k + chunk].to(dtype).contiguous(), kind) for k in range(0, t.numel(), chunk)]
    return hashes[0] if len(hashes) == 1 else xxhash.xxh3_64_intdigest(as_message(hashes).numpy().tobytes())


def received(work, timeout: datetime.timedelta) -> None:
    """Wait for an engine's receive. One that broke raises WeightSyncError; one that waited the whole timeout
    for a sender that sent nothing raises TransferTimedOut: the engine was left waiting, it is not at fault."""
    started = time.monotonic()
    try:
        work.wait(timeout)
    except RuntimeError as e:
        waited = time.monotonic() - started >= 0.9 * timeout.total_seconds()
        raise (TransferTimedOut if waited else WeightSyncError)(
            f"weight stream broken: {str(e).splitlines()[0][:300]}") from e


def receive_shared(numels: Sequence[int], dtype: torch.dtype, bucket_bytes: int, group,
                   timeout: datetime.timedelta, kind: str = "xxh3") -> str:
    """The engine's side of the shared-memory sync: the trainer ranks wrote its weights in place and hashed
    them there; rank 0's hashes arrive once every rank has (and a last word: nonzero when a rank's writes
    failed, and the weights are not whole). The digest of what the engine holds."""
    theirs = torch.empty(-(-sum(numels) // bucket_elements(dtype.itemsize, bucket_bytes)) + 1, dtype=torch.int64)
    try:
        received(group.recv([theirs], 0, TAG_DIGESTS), timeout)
    except WeightSyncError:
        raise
    except RuntimeError as e:
        raise WeightSyncError(f"weight stream broken: {str(e).splitlines()[0][:300]}") from e
    if theirs[-1]:
        raise WeightSyncError("a trainer rank could not write its shards into this engine's shared weights")
    return combine(from_message(theirs[:-1]), kind)


def receive(params: Sequence[torch.Tensor], dtype: torch.dtype, bucket_bytes: int, group,
            timeout: datetime.timedelta, device: torch.device | str = "cpu", kind: str = "xxh3") -> str:
    """Receive every bucket from rank 0 into buffers on `device` (where the group's backend carries them) and
    write it in place into `params`; the digest of what landed. Raises WeightSyncError if a transfer failed or
    the digests disagree."""
    flat = [p.data.view(-1) for p in params]
    plan = plan_buckets([f.numel() for f in flat], torch.empty(0, dtype=dtype).element_size(), bucket_bytes)
    size = max((bucket_len(b) for b in plan), default=0)
    buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]
    hashes: list[Future] = []

    def post(k: int):
        return group.recv([buffers[k % 2][:bucket_len(plan[k])]], 0, k) if k < len(plan) else None

    with ThreadPoolExecutor(1, thread_name_prefix="digest") as hasher:
        try:
            work = post(0)
            for k, bucket in enumerate(plan):
                received(work, timeout)
                if k >= 1:
                    hashes[k - 1].result()  # the other buffer is free again
                work = post(k + 1)
                data = buffers[k % 2][:bucket_len(bucket)]
                hashes.append(hasher.submit(bucket_hash, data, kind))
                with torch.no_grad():
                    for piece in bucket:
                        flat[piece.param][piece.start:piece.start + piece.length].copy_(
                            data[piece.offset:piece.offset + piece.length])
            theirs = torch.empty(len(plan), dtype=torch.int64, device=device)
            received(group.recv([theirs], 0, TAG_DIGESTS), timeout)
        except WeightSyncError:
            raise
        except RuntimeError as e:
            raise WeightSyncError(f"weight stream broken: {str(e).splitlines()[0][:300]}") from e
        mine, sent = [f.result() for f in hashes], from_message(theirs.cpu())
    if mine != sent:
        bad = next(k for k, (a, b) in enumerate(zip(mine, sent)) if a != b)
        raise WeightSyncError(f"bucket {bad} of {len(plan)} arrived with another digest than it was sent with")
    return combine(mine, kind)
