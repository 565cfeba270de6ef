"""TrainWorker: one rank of the TrainGroup, a Ray actor around the training engine.

It joins the group's torch.distributed process group (gloo on CPU, nccl on GPU) and answers the
Supervisor's collective calls; every rank is called together. Fault points at the entry and exit of every
method (and between writing the shards and reporting them) let tests kill or hang a rank at exact moments.
"""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import ray
import torch

from supervisor.durable import file_digest
from supervisor.faults import armed, fault_point, fault_points
from workers.model import weights_checksum


@ray.remote
class TrainWorker:
    def __init__(self, config, rank: int, world_size: int):
        torch.set_num_threads(1)  # deterministic CPU kernels, and no oversubscription of the node's cores
        self.config, self.rank, self.world_size = config, rank, world_size
        self.engine = None

    @fault_points
    def where(self) -> dict:
        """The node this rank runs on, and (for rank 0) a free port for the rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "port": port}

    @fault_points
    def setup(self, master_addr: str, master_port: int) -> None:
        from workers.engines.fsdp import FSDPEngine, init_process_group  # torch.distributed, transformers

        device = init_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        self.engine = FSDPEngine(self.config, self.rank, self.world_size, device)

    @fault_points
    def train(self, shard: dict, global_step: int) -> dict:
        return self.engine.train_step(shard)

    @fault_points
    def weights(self, global_step: int) -> tuple[dict | None, str | None]:
        """Collective; rank 0 returns (full state dict, checksum), the others (None, None). `global_step` is
        the last step the weights were updated by (-1: none yet)."""
        full = self.engine.full_state_dict()
        return (full, weights_checksum(full)) if self.rank == 0 else (None, None)

    @fault_points
    def save_recover(self, staging: str, global_step: int) -> dict[str, dict]:
        """Collective; returns {file: {size, sha256}} for the files this rank wrote."""
        directory = Path(staging)
        if armed("dcp_write", step=global_step, rank=self.rank) == "enospc":
            # A real disk-full inside DCP's writer: this rank's shard file is made to point at /dev/full.
            if not stat.S_ISCHR(os.stat("/dev/full").st_mode):
                raise RuntimeError("fault dcp_write:enospc needs the /dev/full device")
            (directory / f"__{self.rank}_0.distcp").symlink_to("/dev/full")
        self.engine.save(directory)
        fault_point("after_shards", step=global_step, rank=self.rank)
        mine = [p for p in directory.iterdir() if p.name.startswith(f"__{self.rank}_")]
        mine.append(directory / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            mine.append(directory / ".metadata")
        return {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in mine}

    @fault_points
    def load_recover(self, step_dir: str, saved_world_size: int) -> list[str]:
        return self.engine.load(Path(step_dir), same_world_size=saved_world_size == self.world_size)

    @fault_points
    def export_hf(self, directory: str, global_step: int) -> None:
        """Collective; rank 0 writes the HuggingFace files into `directory`."""
        full = self.engine.full_state_dict()
        if self.rank == 0:
            self.engine.export_hf(Path(directory), full)
