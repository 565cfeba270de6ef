"""The weight sync before and after, side by side in one run on the same model: the object-store push it
replaced (rank 0's full state dict returned through Ray's object store, the engine's `load_state_dict`), the
stream over the weights-update group (workers/weight_sync.py) and the ranks' writes into the engine's shared
weights (workers/shared_weights.py), each against a memcpy of the same bytes, and the digest's share.

    .venv/bin/python benchmarks/weight_sync.py [--size tiny|100m|0.5b] [--repeats 3] [--quick] [--address ADDR]
                                               [--json FILE] [KEY=VALUE ...]

A 2-rank FSDP TrainGroup and one built-in engine (`rollout.engine: hf`: the engine these paths were built for;
benchmarks/engines.py times the sync into vLLM), of the shipped config of `--size` (benchmarks/sizes.py), on a local
one-node cluster whose object store is sized for that model (as benchmarks/step.py's; or `--address`). Each
sync is timed from the Supervisor's side, calls included; the median of `--repeats` is reported. The digest's
cost is a sync's time with the hash against the same sync with the hash replaced by a constant. A shared sync
checks what it wrote against the trainer's own parts (hashed where they are): every parameter at a group's first
syncs, one at the others (here always the first, the embedding: the largest); both are reported, and the mean of a
rotation. At the end the engine checks, bitwise, that it holds the trainer's full weights
after each kind of sync. `--quick` is --size tiny with 2 repeats.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import ray
import torch
from report import arguments, report
from sizes import ENGINE, SIZES

from supervisor.cluster.groups import RolloutGroup, TrainGroup
from supervisor.config import load_config
from supervisor.launch import connect
from supervisor.testing.local_cluster import LocalCluster

# ---- the object-store push the stream replaced, kept here only to compare against ------------------------
def _full_state_dict(worker) -> dict | None:
    """Collective on every rank: rank 0's full state dict on CPU, returned into the object store."""
    full = worker.engine.full_state_dict()
    return full if worker.rank == 0 else None


def _load_state_dict(worker, state_dict: dict) -> None:
    worker.model.load_state_dict(state_dict, strict=False)


def object_store_push(trainers, engines) -> float:
    t0 = time.monotonic()
    refs = [m.handle.__ray_call__.remote(_full_state_dict) for m in trainers.members]
    ray.get([m.handle.__ray_call__.remote(_load_state_dict, refs[0]) for m in engines.members] + refs[1:])
    return time.monotonic() - t0


# ---- the stream --------------------------------------------------------------------------------------------
def _hash_with(worker, constant: bool) -> None:
    """Replace the digest's hash by a constant (everywhere, so that the digests still agree), or restore it."""
    import workers.weight_sync as ws

    if not hasattr(ws, "_bucket_hash"):
        ws._bucket_hash = ws.bucket_hash
    ws.bucket_hash = (lambda t, kind="xxh3": 0) if constant else ws._bucket_hash


def timed_sync(stream, shared: bool, hashed: bool = True) -> tuple[float, dict]:
    """One sync of every engine, by the stream or (`shared`) by writes into the engines' shared weights."""
    actors = [*stream.trainers.members, *stream.engines.members]
    ray.get([m.handle.__ray_call__.remote(_hash_with, not hashed) for m in actors])
    stream.shared = shared
    t0 = time.monotonic()
    sent = stream.sync(-1)
    secs = time.monotonic() - t0
    ray.get([m.handle.__ray_call__.remote(_hash_with, False) for m in actors])
    return secs, sent


def _holds(worker, full: dict) -> bool:
    own = dict(worker.model.named_parameters())
    return all(torch.equal(p, full[n]) for n, p in own.items())


def _scramble(worker) -> None:
    with torch.no_grad():
        for p in worker.model.parameters():
            p.fill_(0.5)


def holds_after(stream, trainers, engines, shared: bool) -> bool:
    """Scramble the engine's weights, sync, and compare them bitwise with the trainer's."""
    ray.get(engines.members[0].handle.__ray_call__.remote(_scramble))
    timed_sync(stream, shared)
    full = [m.handle.__ray_call__.remote(_full_state_dict) for m in trainers.members]
    equal = ray.get(engines.members[0].handle.__ray_call__.remote(_holds, full[0]))
    ray.get(full)
    return equal


def memcpy_secs(nbytes: int) -> float:
    """A warm copy (the destination's pages already touched), median of five."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        dst.copy_(src)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def measure(address: str, size: str, overrides: list[str], repeats: int) -> dict:
    config = load_config(SIZES[size].config, [
        "cluster.n_rollout_workers=1", "cluster.n_train_workers=2", "actor.backend=fsdp", ENGINE,
        "recover.step_timeout_secs=600", f"cluster.fileroot={tempfile.mkdtemp(prefix='relaunch-bench-')}",
        *overrides])
    connect(config, address)
    trainers = engines = None
    try:
        engines = RolloutGroup(config, config.recover.step_timeout_secs)
        trainers = TrainGroup(config, 2, config.recover.step_timeout_secs)
        stream = engines.connect(trainers)
        if not stream.shared:
            raise SystemExit("the ranks could not map the engine's shared weights (rollout.shared_memory_weights?)")
        timed_sync(stream, False)  # warm: the first transfers set up the pairs' buffers
        whole = timed_sync(stream, True)[1]  # a group's first shared sync checks every bucket
        times = {k: [] for k in ("object_store", "stream", "stream_unhashed", "shared", "shared_unhashed")}
        sent = {}
        for _ in range(repeats):  # alternating, so that a busy moment of the machine hits each alike
            times["object_store"].append(object_store_push(trainers, engines))
            for kind, shared in (("stream", False), ("shared", True)):
                secs, sent[kind] = timed_sync(stream, shared)
                times[kind].append(secs)
                times[f"{kind}_unhashed"].append(timed_sync(stream, shared, hashed=False)[0])
        equal = {kind: holds_after(stream, trainers, engines, kind == "shared") for kind in ("stream", "shared")}
        nbytes = sent["stream"]["bytes"]
        return {"bytes": nbytes, "buckets": sent["stream"]["buckets"], "params": nbytes // 4,
                "params_count": len(stream.names),
                **{f"{k}_secs": statistics.median(v) for k, v in times.items()},
                "rank0": {"stream": {k: sent["stream"][k] for k in ("secs", "gather_secs", "wait_secs", "digest_secs")},
                          "shared": {k: sent["shared"][k] for k in ("secs", "write_secs", "digest_secs", "check_secs")},
                          "shared_whole_check": {k: whole[k] for k in ("secs", "check_secs")}},
                "digests_agree": sent["stream"]["digest"] == sent["shared"]["digest"],
                "memcpy_secs": memcpy_secs(nbytes), "stream_equals_trainer": equal["stream"],
                "shared_equals_trainer": equal["shared"]}
    finally:
        for group in (trainers, engines):
            if group is not None:
                group.shutdown()
        ray.shutdown()


def table(size: str, f: dict) -> list[tuple[str, ...]]:
    gbps = {k: f["bytes"] / f[f"{k}_secs"] / 1e9 for k in ("object_store", "stream", "shared", "memcpy")}
    digest = {k: f[f"{k}_secs"] / f[f"{k}_unhashed_secs"] - 1 for k in ("stream", "shared")}
    r0s, r0m = f["rank0"]["stream"], f["rank0"]["shared"]
    return [
        (f"model ({size})", f"{f['params'] / 1e6:.1f}M parameters, {f['bytes'] / 1e6:.1f} MB fp32, "
                            f"{f['buckets']} buckets"),
        ("object-store push (before)", f"{f['object_store_secs']:.3f} s, {gbps['object_store']:.2f} GB/s"),
        ("stream (after)", f"{f['stream_secs']:.3f} s, {gbps['stream']:.2f} GB/s"),
        ("shared memory (after, same host)", f"{f['shared_secs']:.3f} s, {gbps['shared']:.2f} GB/s"),
        ("memcpy of the same bytes", f"{f['memcpy_secs']:.4f} s, {gbps['memcpy']:.2f} GB/s"),
        ("speed-up stream / object store", f"{f['object_store_secs'] / f['stream_secs']:.1f}x"),
        ("speed-up shared memory / object store", f"{f['object_store_secs'] / f['shared_secs']:.1f}x"),
        ("bandwidth / memcpy: object store, stream, shared",
         " / ".join(f"{gbps[k] / gbps['memcpy']:.1%}" for k in ("object_store", "stream", "shared"))),
        ("digest: added to the sync, stream / shared",
         f"{digest['stream']:+.1%} / {digest['shared']:+.1%} ({f['stream_unhashed_secs']:.3f} s / "
         f"{f['shared_unhashed_secs']:.3f} s without it)"),
        ("rank 0, stream: sync, gathering, waiting, hashing",
         " / ".join(f"{r0s[k]:.3f} s" for k in ("secs", "gather_secs", "wait_secs", "digest_secs"))),
        ("rank 0, shared: writing, hashing its buckets, checking the embedding",
         " / ".join(f"{r0m[k]:.3f} s" for k in ("write_secs", "digest_secs", "check_secs"))),
        ("rank 0, shared: checking every parameter (a group's first syncs), and its mean per sync",
         f"{f['rank0']['shared_whole_check']['check_secs']:.3f} s, "
         f"{f['rank0']['shared_whole_check']['check_secs'] / f['params_count']:.4f} s"),
        ("engine holds the trainer's weights bitwise: stream, shared",
         f"{f['stream_equals_trainer']}, {f['shared_equals_trainer']} (digests agree: {f['digests_agree']})"),
    ]


def main() -> None:
    parser = arguments(__doc__, "--size tiny, 2 repeats")
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    size, repeats = ("tiny", 2) if args.quick else (args.size, args.repeats)
    cluster = None if args.address else LocalCluster(n_workers=0, head_cpus=4, object_store=SIZES[size].object_store)
    try:
        f = measure(args.address or cluster.address, size, args.overrides, repeats)
    finally:
        if cluster:
            cluster.shutdown()
    rows = table(size, f)
    report(rows, {"benchmark": "weight_sync", "size": size, **f, "rows": [list(r) for r in rows]}, args.json)


if __name__ == "__main__":
    main()
