"""A TrainWorker's engine on one GPU: FSDP2 on CUDA under nccl, its steps deterministic, DCP's save and load of CUDA
tensors, every CUDA RNG in the checkpoint, a background save staged through pinned memory, and the memory tier's
copy into pinned slots, each restored bit for bit."""
from __future__ import annotations

import torch
import torch.distributed as dist

from supervisor.checkpoint.layout import rng_file
from workers.memory_tier import Slots


def batch(seed: int) -> dict:
    """A GRPO batch of the default job's shape (8 sequences, the last token the answer), on the CPU as the
    Supervisor sends it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 14, (8, 6), generator=g)
    response = torch.zeros(8, 6, dtype=torch.long)
    response[:, -1] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response,
            "advantages": torch.randn(8, generator=g)}


def new_engine(config, device):
    from workers.engines.base import build_parts
    from workers.engines.fsdp import FSDPEngine

    tokenizer, model = build_parts(config)
    return FSDPEngine(config, 0, 1, device, tokenizer, model)


def state(engine) -> dict:
    """What a bitwise continuation depends on: weights, AdamW's state, the schedule, every RNG (copied)."""
    from workers.engines.fsdp import local
    from workers.engines.rng import rng_state

    opt = engine.optimizer
    return {"params": [local(p).detach().clone() for p in engine.params],
            "adam": [{k: local(v).clone() for k, v in opt.state[p].items()} for p in engine.params if p in opt.state],
            "scheduler": engine.scheduler.state_dict(), "rng": rng_state()}


def same(a: dict, b: dict) -> bool:
    tensors = all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])) and len(a["adam"]) == len(b["adam"]) \
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["adam"], b["adam"]))
    rng = a["rng"]["python"] == b["rng"]["python"] and torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and \
        all(torch.equal(x, y) for x, y in zip(a["rng"]["cuda"], b["rng"]["cuda"]))
    return tensors and rng and a["scheduler"] == b["scheduler"]


def test_fsdp2_trains_on_the_gpu_under_nccl_and_a_step_is_deterministic(gpu_config, world_of_one):
    assert world_of_one.type == "cuda" and "nccl" in str(dist.get_backend())
    runs = []
    for _ in range(2):  # the same steps from the same init, twice: the same bits (workers/gpu.py's settings)
        engine = new_engine(gpu_config, world_of_one)
        assert all(p.is_cuda for p in engine.params)
        metrics = [engine.train_step(batch(s), s) for s in range(3)]
        runs.append((metrics, state(engine)))
    assert all(m["loss"] == m["loss"] for m in runs[0][0])  # finite, not NaN
    assert runs[0][0] == runs[1][0] and same(runs[0][1], runs[1][1])


def test_a_dcp_checkpoint_of_cuda_tensors_and_every_cuda_rng_loads_bit_for_bit(gpu_config, world_of_one, tmp_path):
    engine = new_engine(gpu_config, world_of_one)
    for s in range(2):
        engine.train_step(batch(s), s)
    torch.cuda.manual_seed_all(7)
    torch.rand(3, device="cuda")  # the CUDA generator moved, as sampling on the rank would
    files = engine.save(tmp_path, 1)
    assert ".metadata" in files and rng_file(tmp_path, 0).name in files
    at_save = state(engine)
    metrics = engine.train_step(batch(2), 2)  # draws nothing from the CUDA generator: it is where the save left it
    continued, draw = state(engine), torch.rand(5, device="cuda")
    assert not same(at_save, continued)
    assert engine.load(tmp_path, 1, same_world_size=True) == []  # nothing missing: the CUDA RNG is there
    assert same(at_save, state(engine)) and torch.equal(torch.rand(5, device="cuda"), draw)
    engine.load(tmp_path, 1, same_world_size=True)
    assert engine.train_step(batch(2), 2) == metrics and same(state(engine), continued)


def test_a_background_save_is_staged_in_pinned_memory_and_loads_what_the_step_left(gpu_config, world_of_one,
                                                                                  tmp_path):
    engine = new_engine(gpu_config, world_of_one)
    assert gpu_config.async_recover and engine.stager is not None
    engine.train_step(batch(0), 0)
    at_save = state(engine)
    written = engine.save_local(tmp_path, 0)
    shards = engine.save_async(tmp_path, 0)  # returns once staged: training goes on while it is written
    for s in (1, 2):
        engine.train_step(batch(s), s)
    files = shards.result(timeout=120) + written
    assert all((tmp_path / f).is_file() for f in files)
    staged = staged_tensors(engine.stager)
    assert staged and all(t.is_pinned() for t in staged)  # copied off the GPU into pinned host memory
    engine.load(tmp_path, 0, same_world_size=True)
    loaded = state(engine)
    assert all(torch.equal(x, y) for x, y in zip(at_save["params"], loaded["params"]))
    assert all(torch.equal(x[k], y[k]) for x, y in zip(at_save["adam"], loaded["adam"]) for k in x)


def staged_tensors(stager) -> list[torch.Tensor]:
    """The CPU tensors of the state dict DCP's stager staged into, kept from save to save."""
    cache = getattr(stager, "state_dict_cache", None)
    assert cache is not None, f"no staged state dict in {type(stager).__name__} (torch {torch.__version__})"
    found = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x.to_local() if hasattr(x, "to_local") else x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(cache)
    return [t for t in found if t.device.type == "cpu" and t.numel() > 1]


def test_the_memory_tier_copies_into_pinned_slots_and_a_rank_rolls_back_bit_for_bit(gpu_config, world_of_one):
    engine = new_engine(gpu_config, world_of_one)
    layout = engine.memory_layout
    slots = Slots(layout.numel, layout.dtype, pin=True)
    assert all(slot.flat.is_pinned() for slot in slots.slots)
    engine.train_step(batch(0), 0)
    engine.stage_memory(slots.for_step(0), 0)
    at_copy = state(engine)
    redo = engine.train_step(batch(1), 1), state(engine)  # the step that a fault then cuts short
    torch.rand(3, device="cuda")
    engine.load_memory(slots.holding(0).flat, slots.holding(0).meta)
    assert same(at_copy, state(engine))
    assert engine.train_step(batch(1), 1) == redo[0] and same(state(engine), redo[1])
