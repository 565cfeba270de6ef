"""The GPU paths, on one CUDA GPU (benchmarks/gpu_check.sh runs them on a lent machine): every test here is marked
`gpu` and skipped where torch sees no CUDA device, so CI collects and skips them.

The training tests share one process group: a world of one on nccl (CUDA tensors) with gloo beside it (CPU
tensors), as a TrainWorker on a GPU joins; NCCL refuses two ranks on one device, so one GPU holds one rank.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
# the default job on the built-in engine (vLLM's GPU wheel does not travel to a lent machine), on one GPU
GPU = ["rollout.engine=hf", "cluster.n_train_workers=1", "cluster.gpus_per_worker=0.25",
       "cluster.gpus_per_engine=0.25"]


def pytest_collection_modifyitems(items) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_overrides() -> list[str]:
    return list(GPU)


@pytest.fixture(scope="session")
def gpu_config(tmp_path_factory):
    from supervisor.config import load_config

    return load_config(None, [*GPU, f"cluster.fileroot={tmp_path_factory.mktemp('runs')}", "recover.mode=on",
                              "recover.write_mode=async"])


@pytest.fixture(scope="session")
def world_of_one(gpu_config):
    """This process as rank 0 of 1, as a TrainWorker on a GPU joins its group (workers/engines/base.py)."""
    import torch.distributed as dist

    from supervisor.testing.local_cluster import free_port
    from workers.engines.base import init_process_group
    from workers.gpu import deterministic_cuda

    deterministic_cuda()
    device = init_process_group(gpu_config, 0, 1, "127.0.0.1", free_port())
    yield device
    dist.destroy_process_group()
