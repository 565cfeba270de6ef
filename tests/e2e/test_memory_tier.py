"""The memory tier on a real cluster, driving TrainWorker actors directly: two ranks on one node copy their
state after every step to a warm spare on another node, which holds both; a rank is SIGKILLed (by its pid), the
survivor rejoins a new process group in its own process and rolls back in place, the spare takes the dead
rank's place from what it holds, and the run ends bitwise equal to one that never failed (params, AdamW state,
LR scheduler, RNGs). Two kills in one run: rank 1 while rank 0 waits in the step's forward (before any optimizer
step), then rank 0 (itself a survivor of the first) after the step's optimizer step but before its memory copy
(the survivor rolls back one step), while its background save of the step before still hangs: it is abandoned,
and a save into that save's directory is refused while it may still land there.
A third kill has no spare: rank 0 is SIGKILLed after its copy landed in its peer (rank 1, a rank holding the
other's copy), and a new process takes its place with the copy the peer gives it (`held_copy`, carried by Ray).
A background recover save after the rejoins writes through the new writer group. The first spare receives the
copies over side links (as a holder on another host does), the second and the peer are written into (this
machine is one host)."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from harness import CONFIG, REPO
from test_async_save import batch

from supervisor.config import DEFAULT_CONFIG, load_config
from supervisor.testing.local_cluster import free_port
from workers.memory_tier import Slot, pack_meta, unpack_meta

pytestmark = pytest.mark.e2e

STEPS = 6


def shards(step: int) -> list[dict]:
    """Step `step`'s batch, split over two ranks (no rollouts: the tier does not care where a batch came from)."""
    return [{k: v.chunk(2)[r] for k, v in batch(1000 + step).items()} for r in range(2)]


def state(engine) -> dict:
    """What a bitwise continuation depends on, on one rank, copied."""
    from workers.engines.rng import rng_state

    opt = engine.optimizer
    return {"params": [p.to_local().clone() for p in engine.params],
            "adam": [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in opt.state[p].items()}
                     for p in engine.params],
            "lr": [g["lr"] for g in opt.param_groups], "scheduler": engine.scheduler.state_dict(), "rng": rng_state()}


def snapshot(worker) -> dict:
    """`state` of a TrainWorker's engine, run in the actor (this module is pickled by value for it)."""
    return state(worker.engine)


def full_weights(worker) -> dict:
    """Collective: the full weights, on rank 0 (FSDP's all-gathers over the group the rank is in now)."""
    return worker.engine.full_state_dict()


def differences(a: dict, b: dict) -> list[str]:
    """The parts of two ranks' snapshots that are not bitwise equal."""
    checks = {
        "params": all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])),
        "adam": all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in zip(a["adam"], b["adam"])),
        "lr": a["lr"] == b["lr"], "scheduler": a["scheduler"] == b["scheduler"],
        "rng.python": a["rng"]["python"] == b["rng"]["python"],
        "rng.numpy": torch.equal(a["rng"]["numpy"]["state"], b["rng"]["numpy"]["state"]),
        "rng.torch": torch.equal(a["rng"]["torch"], b["rng"]["torch"]),
    }
    return [name for name, ok in checks.items() if not ok]


def test_a_killed_rank_is_replaced_from_memory_and_the_run_ends_bitwise(cluster, tmp_path):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.train_worker import TrainWorker

    config = load_config(CONFIG, [f"cluster.fileroot={tmp_path}", "recover.mode=on", "recover.freq_steps=1",
                                  "recover.write_mode=async", "actor.warmup_steps=8"])
    # the survivor of kill 2 (rank 1 then) is still writing its background save of step 3 when it rejoins
    faults = {"RELAUNCH_FAULT": "background_write:hang:step=3:rank=1", "RELAUNCH_FAULT_DIR": str(tmp_path)}
    ray.init(address=cluster.address, namespace="relaunch-test", logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **faults}})
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # `snapshot` and the helpers it calls

    ranks_node, spare_node = (n.node_id for n in cluster.workers[:2])
    actors = []

    def start(node: str, name: str | None = None):
        """A TrainWorker on `node`; a spare has a `name`, which it holds ranks' copies under."""
        actor = TrainWorker.options(num_cpus=1, max_restarts=0, name=name, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(node, soft=False))).remote(config)
        actors.append(actor)
        return actor

    def seed(worker, rank: int) -> None:
        import random

        import numpy as np

        random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)

    def draw(worker) -> None:
        """Every RNG moves on each step, as sampling would: only a restored RNG continues the reference's."""
        import random

        import numpy as np

        random.random(), np.random.rand(), torch.rand(1)

    def form(ranks: list) -> None:
        """A new group of fresh ranks (setup), rank 0 hosting its rendezvous; each rank's RNGs seeded by its rank."""
        where = ray.get(ranks[0].where.remote(0))
        ray.get([r.setup.remote(where["ip"], where["port"], i, 2) for i, r in enumerate(ranks)])
        ray.get([r.__ray_call__.remote(seed, i) for i, r in enumerate(ranks)])

    def train(ranks: list, step: int) -> None:
        ray.get([r.train.remote(s, step) for r, s in zip(ranks, shards(step))])
        ray.get([r.__ray_call__.remote(draw) for r in ranks])

    def copy(ranks: list, step: int) -> None:
        """Each rank's memory copy of `step`, waited for until it landed."""
        results = []
        for r in ranks:
            r.begin_memory_copy.remote(step)
            results.append(r.memory_result.remote(step))  # submitted at once: serialized after the copy began
        while None in ray.get(results):
            time.sleep(0.02)
            results = [r.memory_result.remote(step) for r in ranks]

    def save(ranks: list, step: int) -> ray.ObjectRef:
        """A background recover save of `step` begun on every rank; the ref of its results."""
        staging = tmp_path / f"step{step}"
        staging.mkdir()
        ray.get([r.begin_save.remote(str(staging), step) for r in ranks])
        ray.get([r.start_upload.remote(step) for r in ranks])
        return [r.save_result.remote(step) for r in ranks]

    def link(ranks: dict, holder, shared: bool) -> None:
        """`holder` holds the copies of `ranks` (rank -> actor), under the name it holds as: `shared`, written into
        by the ranks (this machine is one host), else received over a side link per rank, each on a port of its
        own (as from another host)."""
        name = ray.get(holder.__ray_call__.remote(lambda worker: worker.holder_as))
        for i, r in ranks.items():
            held = ray.get(holder.hold.remote(i, ray.get(r.memory_slots.remote()), name))
            if shared:
                assert ray.get(r.memory_attach.remote(held))
                continue
            where = ray.get(holder.where.remote())
            key = f"rank{i}-{time.monotonic_ns()}"
            ray.get(holder.listen.remote(i, where["port"], key))
            ray.get(r.memory_link.remote(where["ip"], where["port"], key))

    try:
        # ---- the reference: the same steps, uninterrupted -------------------------------------------------
        ref = [start(ranks_node), start(ranks_node)]
        form(ref)
        for step in range(STEPS):
            train(ref, step)
        want = ray.get([r.__ray_call__.remote(snapshot) for r in ref])
        want_full = ray.get([r.__ray_call__.remote(full_weights) for r in ref])[0]
        for r in ref:
            ray.kill(r)

        # ---- the run: two ranks, a spare on the other node holding both ------------------------------------
        ranks, spare = [start(ranks_node), start(ranks_node)], start(spare_node, "spare-1")
        ray.get(spare.warm.remote())
        form(ranks)
        link(dict(enumerate(ranks)), spare, shared=False)
        for step in range(3):
            train(ranks, step)
            copy(ranks, step)
        deadline = time.monotonic() + 30  # a copy lands at the holder a moment after the rank's send ended
        while (held := ray.get(spare.holding.remote())) != {0: [1, 2], 1: [1, 2]} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == {0: [1, 2], 1: [1, 2]}

        # kill 1: rank 1, while rank 0 waits for it in step 3's forward
        waiting = ranks[0].train.remote(shards(3)[0], 3)
        time.sleep(1.0)
        probe = ray.get(ranks[0].progress.remote(), timeout=5)  # its own concurrency group: answers now
        assert probe["phase"] == "train" and probe["seq"] > 0
        os.kill(ray.get(ranks[1].where.remote())["pid"], signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(waiting, timeout=60)
        where = ray.get(ranks[0].where.remote())
        kept = ray.get([ranks[0].rejoin.remote(where["ip"], where["port"], 0, 2, 2),
                        spare.adopt.remote(where["ip"], where["port"], 1, 2, 2)], timeout=120)[1]
        ranks = [ranks[0], spare]
        assert kept is True  # the slots it held for rank 1 are its own now, holding step 2
        assert ray.get(spare.progress.remote())["phase"] == "idle"
        # a second fault in the next step, before any copy: both roll back to step 2 again in place, the adopter
        # from those slots
        train(ranks, 3)
        where = ray.get(ranks[0].where.remote())
        ray.get([r.rejoin.remote(where["ip"], where["port"], i, 2, 2) for i, r in enumerate(ranks)], timeout=120)

        # kill 2: rank 0, after step 4's optimizer step on both ranks, before its memory copy of step 4
        spare = start(spare_node, "spare-2")
        ray.get(spare.warm.remote())
        link(dict(enumerate(ranks)), spare, shared=True)
        train(ranks, 3)
        copy(ranks, 3)
        save(ranks, 3)  # rank 1's part hangs in its writer thread
        train(ranks, 4)
        ray.get(ranks[1].begin_memory_copy.remote(4))  # rank 1's copy of step 4 was begun; rank 0's never
        os.kill(ray.get(ranks[0].where.remote())["pid"], signal.SIGKILL)
        where = ray.get(spare.where.remote())
        ray.get([spare.adopt.remote(where["ip"], where["port"], 0, 2, 3),
                 ranks[1].rejoin.remote(where["ip"], where["port"], 1, 2, 3)], timeout=120)
        ranks = [spare, ranks[1]]
        # step 3 saved again into the same directory (on an object store, the step's own prefix): refused on the
        # survivor while its abandoned upload may still land there, as a storage error (the run skips the save)
        with pytest.raises(ray.exceptions.RayTaskError, match="abandoned at a repair is still uploading") as e:
            ray.get(ranks[1].begin_save.remote(str(tmp_path / "step3"), 3))
        assert isinstance(e.value.cause, OSError)
        # kill 3, no spare: rank 1 holds rank 0's copies (a peer); rank 0 dies after its copy of step 4 landed
        # there, and a new process takes its place from that copy while rank 1 rolls back in place
        with pytest.raises(ray.exceptions.RayTaskError, match="holds no copies as spare-2"):
            ray.get(ranks[0].hold.remote(1, ray.get(ranks[1].memory_slots.remote()), "spare-2"))  # a rank now
        link({0: ranks[0]}, ranks[1], shared=True)
        train(ranks, 4)
        copy(ranks, 4)
        assert ray.get(ranks[1].holding.remote()) == {0: [4]}
        os.kill(ray.get(ranks[0].where.remote())["pid"], signal.SIGKILL)
        new = start(ranks_node)
        where = ray.get(new.where.remote(0))
        kept = ray.get([new.adopt_copy.remote(where["ip"], where["port"], 0, 2, 4, *ranks[1].held_copy.remote(0, 4)),
                        ranks[1].rejoin.remote(where["ip"], where["port"], 1, 2, 4)], timeout=120)[0]
        ranks = [new, ranks[1]]
        assert kept is True  # the peer's copy it loaded is its own copy of step 4 until it stages two steps
        # a second fault in the next step, before any copy: both roll back to step 4 again in place, the new
        # process from that copy
        train(ranks, 5)
        where = ray.get(new.where.remote(0))
        ray.get([r.rejoin.remote(where["ip"], where["port"], i, 2, 4) for i, r in enumerate(ranks)], timeout=120)
        train(ranks, 5)

        got = ray.get([r.__ray_call__.remote(snapshot) for r in ranks])
        assert [differences(g, w) for g, w in zip(got, want)] == [[], []]
        full = ray.get([r.__ray_call__.remote(full_weights) for r in ranks])[0]  # DTensor gathers on the new group
        assert full.keys() == want_full.keys() and all(torch.equal(full[k], want_full[k]) for k in full)

        # a background recover save through the writer group the rejoin and the adoption made again, on rank 1
        # a writer thread of its own (its old one still hangs in the abandoned save of step 3)
        save(ranks, 5)
        deadline = time.monotonic() + 60
        while None in (written := ray.get([r.save_result.remote(5) for r in ranks])):
            assert time.monotonic() < deadline, "the background save did not finish"
            time.sleep(0.1)
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {name for files in written for name in files}
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()


# ---- the FSDP engine's half, in one process: a gloo group of one rank, no Ray ----------------------------
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


@pytest.mark.quick
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
    assert differences(state(engine), staged) == []
    assert engine.train_step(batch(2), 2) == first


@pytest.mark.quick
def test_a_rejoin_keeps_the_model_and_makes_the_groups_a_new_engine_makes(engine):
    from workers.engines.base import make_engine

    fresh_groups = dist.distributed_c10d._world.group_count  # WORLD, the mesh's (none of its own), the writer's
    engine.train_step(batch(0), 0)
    before = state(engine)
    engine.rejoin("127.0.0.1", free_port(), 0, 1)
    assert dist.distributed_c10d._world.group_count == fresh_groups
    assert differences(state(engine), before) == []
    assert all(p.device_mesh.get_group() is dist.group.WORLD for p in engine.params)
    assert engine.writer_group is not None and dist.get_world_size(engine.writer_group) == 1
    metrics = engine.train_step(batch(1), 1)  # clip_grad_norm_ and the loss's all_reduce on the new group
    assert metrics["grad_norm"] == metrics["grad_norm"]  # not NaN
    assert torch.equal(engine.full_param(0), engine.params[0].full_tensor())
    with pytest.raises(ValueError, match="cannot rejoin as rank 1 of 2"):
        engine.rejoin("127.0.0.1", free_port(), 1, 2)
    dist.destroy_process_group()
    other = make_engine(engine.config, 0, 1, "127.0.0.1", free_port())
    assert dist.distributed_c10d._world.group_count == fresh_groups and other.writer_group is not None
