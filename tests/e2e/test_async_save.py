"""A background recover save on the real FSDP2 engine: training goes on while the save is written, and the
checkpoint holds the state of the step it was begun at, not of the steps trained since."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from supervisor.config import load_config
from supervisor.testing.local_cluster import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture
def engine():
    from workers.engines.base import make_engine

    try:  # a process group of one rank, as a TrainWorker joins it
        yield make_engine(load_config(None, ["recover.write_mode=async"]), 0, 1, "127.0.0.1", free_port())
    finally:
        dist.destroy_process_group()


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 14, (8, 6), generator=g)
    response = torch.zeros(8, 6, dtype=torch.long)
    response[:, -1] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response,
            "advantages": torch.randn(8, generator=g)}


@pytest.mark.quick
def test_training_on_during_a_background_save_does_not_leak_into_it(engine, tmp_path):
    engine.train_step(batch(0), 0)
    at_save = {k: v.clone() for k, v in engine.full_state_dict().items()}
    written_now = engine.save_local(tmp_path, 0)
    shards = engine.save_async(tmp_path, 0)
    for step in (1, 2):  # the optimizer updates the very tensors the save was staged from
        engine.train_step(batch(step), step)
    trained_on = engine.full_state_dict()
    assert any(not torch.equal(at_save[k], trained_on[k]) for k in at_save)
    files = shards.result(timeout=60) + written_now
    assert ".metadata" in files and all((tmp_path / f).is_file() for f in files)
    engine.load(tmp_path, 0, same_world_size=True)
    loaded = engine.full_state_dict()
    assert all(torch.equal(at_save[k], loaded[k]) for k in at_save)
