"""What a recover save costs the training loop: synchronous vs background (DCP async_save) saves of the real
FSDP2 engine's state (model, AdamW moments, scheduler), and the synchronous write's bandwidth against a raw
fsync'd write of the same number of bytes to the same disk.

    .venv/bin/python benchmarks/save.py [--size 100m|0.5b] [--quick] [--dir DIR] [--json FILE]

`--size` picks the model of a shipped config (benchmarks/sizes.py): 100m (the default, ~130M parameters, a
state of about 1.5 GB) or 0.5b (the Qwen2.5-0.5B shape, ~390M parameters, about 4.6 GB). `--quick` uses a tiny
one so that CI runs it in seconds. One process, a gloo group of one rank: the figures are the engine's and
the disk's, not the network's.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from report import arguments, report
from sizes import SIZES

from supervisor.config import load_config
from supervisor.testing.local_cluster import free_port

QUICK = ["model.hidden_size=128", "model.intermediate_size=256", "model.num_layers=2"]
CHUNK = 64 * 1024**2


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_fsync_write(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` to one file and fsync it: what the disk offers a single writer."""
    block = os.urandom(CHUNK)
    started = time.monotonic()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, CHUNK)])
        f.flush()
        os.fsync(f.fileno())
    return time.monotonic() - started


def main() -> None:
    parser = arguments(__doc__, "a tiny model (CI)", cluster=False)
    parser.add_argument("--dir", help="where to write (default: a temporary directory; it is removed)")
    parser.add_argument("--size", default="100m", choices=[s for s in SIZES if s != "tiny"])
    args = parser.parse_args()
    from workers.engines.base import make_engine

    torch.set_num_threads(1)
    config = load_config(None, ["recover.write_mode=async", *QUICK]) if args.quick else \
        load_config(SIZES[args.size].config, ["recover.write_mode=async"])
    root = Path(tempfile.mkdtemp(prefix="relaunch-save-", dir=args.dir))
    try:
        engine = make_engine(config, 0, 1, "127.0.0.1", free_port())  # a process group of one rank
        ids = torch.randint(4, 14, (4, 6))
        mask = torch.zeros_like(ids)
        mask[:, -1] = 1
        engine.train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": mask,
                           "advantages": torch.randn(4)}, 0)  # AdamW's moments exist from the first step on
        figures: dict[str, float] = {}
        started = time.monotonic()
        engine.save(root / "sync", 0)
        figures["sync_secs"] = time.monotonic() - started
        nbytes = dir_bytes(root / "sync")
        figures["bytes"] = nbytes
        figures["raw_fsync_secs"] = raw_fsync_write(root / "raw.bin", nbytes)
        for name in ("async_first", "async_steady"):  # the second save reuses the first one's CPU buffers
            (root / name).mkdir()
            started = time.monotonic()
            engine.save_local(root / name, 0)
            shards = engine.save_async(root / name, 0)
            figures[f"{name}_blocked_secs"] = time.monotonic() - started
            shards.result()
            figures[f"{name}_total_secs"] = time.monotonic() - started
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    mb = nbytes / 1e6
    sync_mbps, raw_mbps = mb / figures["sync_secs"], mb / figures["raw_fsync_secs"]
    ratio_blocked = figures["async_steady_blocked_secs"] / figures["sync_secs"]
    rows = [
        ("state saved (model, AdamW moments, scheduler)", f"{mb:.1f} MB"),
        ("sync save: training blocked", f"{figures['sync_secs']:.3f} s ({sync_mbps:.0f} MB/s)"),
        ("async save, first: blocked / until durable",
         f"{figures['async_first_blocked_secs']:.3f} s / {figures['async_first_total_secs']:.3f} s"),
        ("async save, steady: blocked / until durable",
         f"{figures['async_steady_blocked_secs']:.3f} s / {figures['async_steady_total_secs']:.3f} s"),
        ("async blocked / sync blocked (goal <= 10%)", f"{ratio_blocked:.1%}"),
        ("raw fsync'd write of the same bytes", f"{figures['raw_fsync_secs']:.3f} s ({raw_mbps:.0f} MB/s)"),
        ("sync save bandwidth / raw (goal >= 70%)", f"{sync_mbps / raw_mbps:.1%}"),
    ]
    report(rows, {"benchmark": "save", **figures, "async_over_sync_blocked": ratio_blocked,
                  "sync_over_raw_bandwidth": sync_mbps / raw_mbps}, args.json)

if __name__ == "__main__":
    main()
