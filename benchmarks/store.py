"""Recover saves on an object store vs the local disk: what a rank's save, a Supervisor's validation and a rank's
load cost at a real size, and how much a background save slows the training steps it overlaps.

    .venv/bin/python benchmarks/store.py [--size 100m|0.5b] [--quick] [--json FILE]

The store is moto's S3 server on this machine (supervisor/testing/object_store.py), reached through s3fs over HTTP
as a bucket would be; the local disk is a temporary directory. One process, a gloo group of one rank, the real FSDP2
engine and the TrainWorker's path (checkpoint/transfer.py): the engine writes its shards, the rank hashes and (on the
store) uploads them; a load downloads them and loads. The background rows run training steps while the save is
written (and uploaded) on a thread, as a TrainWorker's writer does, against the same steps with no save.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from report import arguments, report
from sizes import SIZES

from supervisor.checkpoint.layout import as_path
from supervisor.checkpoint.storage import storage_for
from supervisor.checkpoint.transfer import RankDir
from supervisor.config import load_config
from supervisor.testing.local_cluster import free_port
from supervisor.testing.object_store import S3Server, apply_env
from workers.train_worker import _digests

QUICK = ["model.hidden_size=128", "model.intermediate_size=256", "model.num_layers=2"]
RETRY_SECS = 600.0


def batch() -> dict:
    ids = torch.randint(4, 14, (4, 6))
    mask = torch.zeros_like(ids)
    mask[:, -1] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": mask,
            "advantages": torch.randn(4)}


def step_secs(engine, n: int, until: threading.Event | None = None) -> list[float]:
    """Seconds of each of `n` training steps (with `until`: steps until it is set, at least one)."""
    times = []

    def more() -> bool:
        return len(times) < n if until is None else not times or not until.is_set()

    while more():
        started = time.monotonic()
        engine.train_step(batch(), 1)
        times.append(time.monotonic() - started)
    return times


def staging(url: str) -> str:
    """The step directory the Supervisor makes before the ranks write (nothing to make on an object store)."""
    storage_for(as_path(url)).mkdir(as_path(url))
    return url


def sync_save(engine, url: str, step: int) -> tuple[float, int]:
    """A rank's synchronous save: (seconds, bytes)."""
    staging(url)
    started = time.monotonic()
    with RankDir(url, RETRY_SECS) as target:
        names = engine.save(target.local, step)
        digests = _digests(target.local, names)
        target.upload(names)
    return time.monotonic() - started, sum(d["size"] for d in digests.values())


def background_save(engine, url: str, step: int) -> dict[str, float]:
    """A background save as the TrainWorker runs it, with training steps going on until it is durable."""
    done = threading.Event()
    staging(url)
    started = time.monotonic()
    target = RankDir(url, RETRY_SECS)
    names = engine.save_local(target.local, step)
    shards = engine.save_async(target.local, step)
    blocked = time.monotonic() - started

    def finish() -> None:
        try:
            written = names + shards.result()
            _digests(target.local, written)
            target.upload(written)
        finally:
            target.close()
            done.set()

    threading.Thread(target=finish).start()
    during = step_secs(engine, 0, until=done)
    return {"blocked_secs": blocked, "total_secs": time.monotonic() - started,
            "step_during_secs": statistics.mean(during), "steps_during": len(during)}


def load(engine, url: str, step: int) -> float:
    started = time.monotonic()
    with RankDir(url, RETRY_SECS) as source:
        engine.load(source.fetch(), step, same_world_size=True)
    return time.monotonic() - started


def validate(url: str) -> float:
    """What a Supervisor that did not write the step does before loading it: hash every object."""
    root = as_path(url)
    fs = storage_for(root, RETRY_SECS)
    started = time.monotonic()
    for f in fs.files(root):
        fs.digest(f)
    return time.monotonic() - started


def main() -> None:
    parser = arguments(__doc__, "a tiny model (CI)", cluster=False)
    parser.add_argument("--size", default="100m", choices=[s for s in SIZES if s != "tiny"])
    args = parser.parse_args()
    from workers.engines.base import make_engine

    torch.set_num_threads(1)
    config = load_config(None, ["recover.write_mode=async", *QUICK]) if args.quick else \
        load_config(SIZES[args.size].config, ["recover.write_mode=async"])
    server, local = S3Server(), Path(tempfile.mkdtemp(prefix="relaunch-store-"))
    apply_env(server, direct=True)  # straight to moto: the proxy is for outages
    stores = {"local disk": str(local), "S3 (moto, HTTP)": server.url("bench")}
    figures: dict[str, dict] = {}
    try:
        engine = make_engine(config, 0, 1, "127.0.0.1", free_port())
        baseline = statistics.mean(step_secs(engine, 3)[1:])  # AdamW's moments exist from the first step on
        for name, root in stores.items():
            f = figures[name] = {}
            f["save_secs"], f["bytes"] = sync_save(engine, f"{root}/globalstep1", 1)
            f["validate_secs"] = validate(f"{root}/globalstep1")
            f["load_secs"] = load(engine, f"{root}/globalstep1", 1)
            background_save(engine, f"{root}/globalstep2", 2)  # the first one allocates the CPU buffers
            f.update(background_save(engine, f"{root}/globalstep3", 3))
            f["stall"] = f["step_during_secs"] / baseline - 1
    finally:
        dist.destroy_process_group()
        server.shutdown()
        shutil.rmtree(local, ignore_errors=True)
    mb = next(iter(figures.values()))["bytes"] / 1e6
    rows = [("", *figures), ("state saved (model, AdamW moments, scheduler)", *[f"{mb:.0f} MB"] * len(figures))]
    for label, key in (("sync save (write, hash, upload)", "save_secs"), ("validation (hash every file)", "validate_secs"),
                       ("load (download, load)", "load_secs")):
        rows.append((label, *[f"{f[key]:.2f} s ({mb / f[key]:.0f} MB/s)" for f in figures.values()]))
    rows += [
        ("background save: blocked / until durable",
         *[f"{f['blocked_secs']:.2f} s / {f['total_secs']:.1f} s" for f in figures.values()]),
        (f"step while it is written (alone: {baseline:.2f} s)",
         *[f"{f['step_during_secs']:.2f} s (+{f['stall']:.0%}, {f['steps_during']} steps)" for f in figures.values()]),
    ]
    report(rows, {"benchmark": "store", "step_secs": baseline, **figures}, args.json)


if __name__ == "__main__":
    main()
