"""The memory tier's pure parts (layout, slots, meta) and its side link between two threads (the FSDP engine's
half is tested in tests/e2e/test_memory_tier.py)."""
import gc
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from supervisor.testing.local_cluster import free_port
from workers.engines.rng import rng_state
from workers.memory_tier import KINDS, NoRoom, Slots, StateLayout, check_room, pack_meta, slot_index, unpack_meta


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


def test_a_segment_that_is_not_the_holders_is_not_mapped():
    from workers.memory_tier import SharedSlots

    held = SharedSlots(10, torch.float32)
    assert SharedSlots.attach({**held.handle, "nonce": "00" * 16}) is None  # a pid and fd reused by another
    assert SharedSlots.attach({**held.handle, "path": "/proc/1/fd/999999"}) is None  # another host's path
    assert SharedSlots.attach({**held.handle, "numel": 11}) is None
    assert SharedSlots.attach(held.handle).landed() == []


def test_slots_kept_for_a_rank_linked_again_hold_the_restored_step_alone():
    """A holder linked again to a rank after a repair from memory keeps its slots (nothing allocated again) with
    the step the repair restored: a later step it held is of the timeline rolled back, and the mapping sees that."""
    from workers.memory_tier import SharedSlots

    held = SharedSlots(4, torch.float32)
    for step in (8, 9):
        held.for_step(step).flat.fill_(step)
        held.for_step(step).meta = {"global_step": step}
    held.keep_only(8)
    assert held.landed() == [8] and SharedSlots.attach(held.handle).landed() == [8]
    assert torch.equal(held.holding(8).flat, torch.full((4,), 8.0))
    held.keep_only(7)  # a step it does not hold: nothing is left
    assert held.landed() == []


def test_slots_are_allocated_zeroed_and_separate():
    slots = Slots(1000, torch.bfloat16)
    a, b = (s.flat for s in slots.slots)
    assert a.dtype == torch.bfloat16 and a.numel() == 1000 and not a.any()
    assert a.data_ptr() != b.data_ptr()


GIB = 2**30


def test_the_copies_fit_only_with_the_headroom_left_free():
    check_room("rank 0's two copies", 6 * GIB, available=10 * GIB, total=24 * GIB)  # 10 - 3.6 = 6.4 free
    with pytest.raises(NoRoom, match=r"rank 0's two copies need 7\.00 GiB; the node has 10\.00 GiB available "
                                     r"and keeps 15% of its 24\.0 GiB free"):
        check_room("rank 0's two copies", 7 * GIB, available=10 * GIB, total=24 * GIB)


def test_slots_are_refused_before_anything_is_allocated_on_a_node_without_room(monkeypatch):
    from types import SimpleNamespace

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=8 * GIB, available=2 * GIB))
    with pytest.raises(NoRoom, match="need 2.00 GiB"):
        Slots.with_room("the copies", 2**28, torch.float32)  # two slots of 1 GiB
    assert Slots.with_room("the copies", 2**20, torch.float32).numel == 2**20  # 8 MiB fit


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


@pytest.mark.parametrize("host", ["same host: the holder's slots mapped", "another host: the gloo pair"])
def test_the_side_link_lands_each_step_whole_in_the_holders_slot_of_that_step(host):
    import datetime
    import time

    from workers.memory_tier import Holding, Link, SharedLink, SharedSlots

    timeout, port = datetime.timedelta(seconds=20), free_port()
    holding = Holding(SharedSlots(1000, torch.float32))
    if host.startswith("same"):
        link = SharedLink(SharedSlots.attach(holding.slots.handle))
    else:
        holding.listen(port, "rank1-gen0", timeout)
        link = Link("127.0.0.1", port, "rank1-gen0", timeout)
    mine = Slots(1000, torch.float32)
    try:
        for step in (3, 4, 5):
            slot = mine.for_step(step)
            slot.flat.copy_(torch.arange(1000.0) + step)
            slot.meta = {"global_step": step, "rng": rng_state()}
            link.send(slot, 0).result(timeout=20)
        deadline = time.monotonic() + 20
        while holding.landed() != [4, 5] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holding.landed() == [4, 5]  # step 5 went into step 3's slot
        held = holding.slots.holding(5)
        assert torch.equal(held.flat, torch.arange(1000.0) + 5)
        assert torch.equal(held.meta["rng"]["torch"], mine.for_step(5).meta["rng"]["torch"])
        assert held.flat.data_ptr() != mine.for_step(5).flat.data_ptr()
        assert holding.slots.for_step(4).meta["global_step"] == 4
    finally:
        link.close()


def test_a_side_link_to_a_holder_that_froze_after_listening_returns_at_once_and_only_its_send_fails():
    """A holder that started its side link's store and then froze (SIGSTOP, an unreachable node) never joins
    the gloo pair: the rank's `memory_link` must not block its next step on it. The link returns at once;
    the send fails (the Supervisor sees a copy that did not land and links the rank again)."""
    import datetime
    import time

    import torch.distributed as dist

    from workers.memory_tier import Link

    port = free_port()
    frozen = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,  # its store, no pair
                           timeout=datetime.timedelta(seconds=30))
    started = time.monotonic()
    link = Link("127.0.0.1", port, "rank0-gen0", datetime.timedelta(seconds=2))
    try:
        assert time.monotonic() - started < 1.0
        slot = Slots(10, torch.float32).for_step(3)
        slot.meta = {"global_step": 3}
        with pytest.raises(Exception):  # noqa: B017 - gloo's timeout, whichever class this torch gives it
            link.send(slot, 0).result(timeout=30)
    finally:
        link.close()
        del frozen


def test_a_holding_given_back_lets_its_segment_go():
    """Review finding 1: the memfd's fd was never closed, so every holding replaced or given back kept its
    segment's memory until the holder died (and the room check then saw it as used)."""
    from workers.memory_tier import Holding, SharedSlots

    def segments() -> int:
        found = 0
        for fd in Path("/proc/self/fd").iterdir():
            try:
                found += os.readlink(fd).startswith(f"/memfd:{SharedSlots.NAME}")
            except OSError:  # the listing's own fd, gone already
                pass
        return found

    gc.collect()  # earlier tests' segments, once unreferenced, go first
    before = segments()
    holding = Holding(SharedSlots(1000, torch.float32))
    assert segments() > before  # its fd, and the mapping's own
    holding.close()
    holding.close()  # again: nothing more to give back
    del holding  # the last view of the slots: the mapping goes, and with the fd closed, the segment
    gc.collect()
    assert segments() == before
