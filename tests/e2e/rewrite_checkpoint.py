"""Rewrite a recover checkpoint with another number of real FSDP2 ranks (gloo, no Ray): every rank
loads SOURCE (DCP reshards it) and saves its own shards, then the result is published through the
RecoverStore as the Supervisor publishes it.

    python rewrite_checkpoint.py SOURCE FILEROOT WORLD_SIZE    # prints the new step directory
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, world_size: int, port: int, source: Path, staging: Path) -> None:
    import torch.distributed as dist

    from supervisor.checkpoint.layout import step_of
    from supervisor.tools.export import run_config
    from workers.engines.base import build_parts
    from workers.engines.fsdp import FSDPEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    config = run_config(source)
    engine = FSDPEngine(config, rank, world_size, torch.device("cpu"), *build_parts(config))
    engine.load(source, step_of(source), same_world_size=False)
    engine.save(staging, step_of(source))
    dist.barrier()
    dist.destroy_process_group()


def main(source: Path, fileroot: Path, world_size: int) -> Path:
    from supervisor.checkpoint.durable import file_digest
    from supervisor.checkpoint.layout import RUN_CONFIG, TrialLayout
    from supervisor.checkpoint.store import RecoverStore, read_checkpoint
    from supervisor.testing.local_cluster import free_port

    ckpt = read_checkpoint(source)
    store = RecoverStore(TrialLayout(fileroot, "u", "rewritten", "t"), keep_last=2)
    staging = store.staging_dir(ckpt.global_step)
    mp.spawn(rank_main, args=(world_size, free_port(), source, staging), nprocs=world_size)
    shutil.copy(source / RUN_CONFIG, staging / RUN_CONFIG)
    files = {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in staging.iterdir() if p.is_file()}
    path = store.commit(staging, ckpt.global_step, world_size, ckpt.manifest["config_hash"], files, ckpt.infos)
    store.wait_for_pruning()
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), int(sys.argv[3])))
