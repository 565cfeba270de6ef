"""The memory tier's pure parts (layout, slots, meta), and the FSDP engine's half of it in one process of a gloo
group of one: a staged slot restores the state bitwise, and a rejoin re-forms the group around the built model."""
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from supervisor.config import DEFAULT_CONFIG, load_config
from supervisor.testing.local_cluster import free_port
from workers.engines.rng import rng_state
from workers.memory_tier import KINDS, Slot, Slots, StateLayout, pack_meta, slot_index, unpack_meta


@pytest.mark.parametrize("step, index", [(0, 0), (1, 1), (2, 0), (7, 1), (100, 0)])
def test_step_g_goes_into_slot_g_mod_2(step, index):
    assert slot_index(step) == index


def test_a_slot_holds_a_step_only_once_its_meta_is_set_and_until_the_step_two_later_overwrites_it():
    slots = Slots(6, torch.float32)
    with pytest.raises(RuntimeError, match="no memory copy of step 4"):
        slots.holding(4)
    slots.for_step(4).meta = {"global_step": 4}
    slots.for_step(5).meta = {"global_step": 5}
    assert slots.landed() == [4, 5] and slots.holding(4) is slots.slots[0]
    slots.for_step(6).meta = None  # step 6 being copied over step 4: neither is held
    assert slots.landed() == [5]
    with pytest.raises(RuntimeError, match=r"held: \[5\]"):
        slots.holding(4)


def test_slots_are_allocated_zeroed_and_separate():
    slots = Slots(1000, torch.bfloat16)
    a, b = (s.flat for s in slots.slots)
    assert a.dtype == torch.bfloat16 and a.numel() == 1000 and not a.any()
    assert a.data_ptr() != b.data_ptr()


def test_the_layout_lays_params_then_each_moment_end_to_end():
    shards = [torch.zeros(3, 2), torch.zeros(4)]
    layout = StateLayout.of(shards)
    assert layout.numels == (6, 4) and layout.numel == 30
    flat = torch.arange(30, dtype=torch.float32)
    parts = layout.parts(flat)
    assert list(parts) == list(KINDS)
    assert [v.tolist() for v in parts["param"]] == [list(range(0, 6)), list(range(6, 10))]
    assert [v.tolist() for v in parts["exp_avg"]] == [list(range(10, 16)), list(range(16, 20))]
    assert [v.tolist() for v in parts["exp_avg_sq"]] == [list(range(20, 26)), list(range(26, 30))]
    parts["exp_avg"][1].fill_(-1)  # views: writing a part writes the slot
    assert flat[16:20].tolist() == [-1] * 4


def test_the_layout_refuses_mixed_dtypes_and_slots_that_do_not_fit():
    with pytest.raises(ValueError, match="one dtype"):
        StateLayout.of([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    layout = StateLayout.of([torch.zeros(2)])
    with pytest.raises(ValueError, match="does not fit"):
        layout.parts(torch.zeros(7))
    with pytest.raises(ValueError, match="does not fit"):
        layout.parts(torch.zeros(6, dtype=torch.float16))


def test_meta_survives_the_byte_round_trip_rngs_and_all():
    random.random(), np.random.rand(), torch.rand(1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    meta = {"global_step": 12, "adam_steps": [torch.tensor(13.0), None], "rng": rng_state(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "scheduler": sched.state_dict()}
    packed = pack_meta(meta)
    assert packed.dtype == torch.uint8
    back = unpack_meta(packed)
    assert back["global_step"] == 12 and back["adam_steps"][1] is None
    assert torch.equal(back["adam_steps"][0], meta["adam_steps"][0])
    assert back["param_groups"] == meta["param_groups"] and back["scheduler"] == meta["scheduler"]
    assert back["rng"]["python"] == meta["rng"]["python"]
    assert torch.equal(back["rng"]["torch"], meta["rng"]["torch"])
    assert torch.equal(back["rng"]["numpy"]["state"], meta["rng"]["numpy"]["state"])


# ---- the FSDP engine, one rank ---------------------------------------------------------------------------
@pytest.fixture
def engine():
    from workers.engines.base import make_engine

    config = load_config(DEFAULT_CONFIG, ["actor.warmup_steps=5", "recover.mode=on", "recover.freq_steps=1",
                                          "recover.write_mode=async"])
    try:
        yield make_engine(config, 0, 1, "127.0.0.1", free_port())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 14, (8, 6), generator=g)
    response = torch.zeros(8, 6, dtype=torch.long)
    response[:, -1] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response,
            "advantages": torch.randn(8, generator=g)}


def state(engine) -> dict:
    """Everything a continuation depends on, copied."""
    opt = engine.optimizer
    return {"params": [p.to_local().clone() for p in engine.params],
            "adam": [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in opt.state[p].items()}
                     for p in engine.params],
            "lr": [g["lr"] for g in opt.param_groups], "scheduler": engine.scheduler.state_dict(),
            "rng": torch.get_rng_state()}


def assert_same(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["adam"], b["adam"]))
    assert a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"] and torch.equal(a["rng"], b["rng"])


def test_a_staged_slot_rolls_the_engine_back_bitwise_and_the_step_redone_is_the_same(engine):
    slot = Slot(torch.zeros(engine.memory_layout.numel))
    for step in range(2):
        engine.train_step(batch(step), step)
    engine.stage_memory(slot, 1)
    assert slot.step == 1
    staged = state(engine)
    first = engine.train_step(batch(2), 2)
    torch.rand(3)  # the RNG moved on too
    assert staged["lr"] != [g["lr"] for g in engine.optimizer.param_groups]  # warm-up: the lr moved
    engine.load_memory(slot.flat, unpack_meta(pack_meta(slot.meta)))
    assert_same(state(engine), staged)
    assert engine.train_step(batch(2), 2) == first


def test_a_rejoin_keeps_the_model_and_makes_the_groups_a_new_engine_makes(engine):
    from workers.engines.base import make_engine

    fresh_groups = dist.distributed_c10d._world.group_count  # WORLD, the mesh's (none of its own), the writer's
    engine.train_step(batch(0), 0)
    before = state(engine)
    engine.rejoin("127.0.0.1", free_port(), 0, 1)
    assert dist.distributed_c10d._world.group_count == fresh_groups
    assert_same(state(engine), before)
    assert all(p.device_mesh.get_group() is dist.group.WORLD for p in engine.params)
    assert engine.writer_group is not None and dist.get_world_size(engine.writer_group) == 1
    metrics = engine.train_step(batch(1), 1)  # clip_grad_norm_ and the loss's all_reduce on the new group
    assert metrics["grad_norm"] == metrics["grad_norm"] and torch.equal(engine.full_param(0), engine.params[0].full_tensor())
    with pytest.raises(ValueError, match="cannot rejoin as rank 1 of 2"):
        engine.rejoin("127.0.0.1", free_port(), 1, 2)
    dist.destroy_process_group()
    other = make_engine(engine.config, 0, 1, "127.0.0.1", free_port())
    assert dist.distributed_c10d._world.group_count == fresh_groups and other.writer_group is not None


def test_the_side_link_lands_each_step_whole_in_the_holders_slot_of_that_step():
    import datetime
    import time

    from workers.memory_tier import Holding, Link

    timeout, port = datetime.timedelta(seconds=20), free_port()
    holding = Holding(port, "rank1-gen0", timeout)
    link = Link("127.0.0.1", port, "rank1-gen0", timeout)
    mine = Slots(1000, torch.float32)
    try:
        for step in (3, 4, 5):
            slot = mine.for_step(step)
            slot.flat.copy_(torch.arange(1000.0) + step)
            slot.meta = {"global_step": step, "rng": rng_state()}
            link.send(slot).result(timeout=20)
        deadline = time.monotonic() + 20
        while holding.landed() != [4, 5] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holding.landed() == [4, 5]  # step 5 went into step 3's slot
        held = holding.slots.holding(5)
        assert torch.equal(held.flat, torch.arange(1000.0) + 5)
        assert torch.equal(held.meta["rng"]["torch"], mine.for_step(5).meta["rng"]["torch"])
        assert held.flat.data_ptr() != mine.for_step(5).flat.data_ptr()
    finally:
        link.close()
