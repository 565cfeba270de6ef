"""An engine's weights moved into shared memory: the model is unchanged, ties stay tied, and a mapping made
through /proc sees and makes the same bytes; a handle that names other memory maps nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from workers.shared_weights import SharedWeights, attach


def tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=True))
    model[1].weight = model[0].weight  # tied, as a Qwen2 lm_head with its embedding
    return model


def test_the_parameters_move_into_the_segment_unchanged_and_stay_tied():
    model = tied_model()
    x = torch.tensor([[1, 2, 3]])
    before = model(x)
    shared = SharedWeights(model)
    assert torch.equal(model(x), before)
    assert model[1].weight is model[0].weight
    assert shared.layout == [("0.weight", [7, 4]), ("1.bias", [7])]  # the tie once
    assert shared.nbytes == (7 * 4 + 7) * 4


def test_a_mapping_through_proc_writes_into_the_engines_parameters():
    model = tied_model()
    shared = SharedWeights(model)
    segment = attach(shared.handle())
    assert segment is not None and segment.numel() == shared.nbytes
    segment.view(torch.float32)[:28].fill_(2.5)  # what a trainer rank does: its part, in place
    assert torch.equal(model[0].weight, torch.full((7, 4), 2.5))
    assert not torch.equal(model[1].bias, torch.full((7,), 2.5))


def test_another_process_maps_the_same_memory():
    model = tied_model()
    shared = SharedWeights(model)
    handle = shared.handle()
    code = ("import sys, torch; from workers.shared_weights import attach; "
            f"s = attach({handle!r}); s.view(torch.float32)[28:].fill_(-1.0); print(s is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "True"
    assert torch.equal(model[1].bias.detach(), torch.full((7,), -1.0))


def test_a_handle_to_other_memory_maps_nothing():
    shared = SharedWeights(tied_model())
    handle = shared.handle()
    assert attach(handle | {"nonce": "00" * 16}) is None  # another segment where this one was
    assert attach(handle | {"bytes": handle["bytes"] + 4}) is None
    assert attach(handle | {"path": "/proc/999999999/fd/3"}) is None  # another host or pid namespace


def test_a_file_that_is_not_a_weights_segment_maps_nothing(tmp_path):
    shared = SharedWeights(tied_model())
    other = open(tmp_path / "weights", "wb+")
    other.truncate(4096 + shared.nbytes)
    handle = shared.handle() | {"path": f"/proc/{os.getpid()}/fd/{other.fileno()}"}
    assert attach(handle) is None  # right size, but not a memfd of relaunch's: not opened, not mapped
    other.close()


def test_a_writer_of_an_earlier_group_writes_into_memory_the_engine_no_longer_serves():
    model = tied_model()
    shared = SharedWeights(model)
    old = shared.handle()
    late = attach(old)  # a rank of a killed TrainGroup that outlived its kill keeps this mapping
    before = [p.detach().clone() for p in model.parameters()]
    handle = shared.renew("weights-2")
    assert [torch.equal(p, b) for p, b in zip(model.parameters(), before)] == [True, True]  # carried over
    late.view(torch.float32).fill_(9.0)
    assert [torch.equal(p, b) for p, b in zip(model.parameters(), before)] == [True, True]
    assert handle["generation"] == "weights-2" and model[1].weight is model[0].weight
    now = attach(handle)  # the new group's ranks map the new segment, and write what the engine serves
    now.view(torch.float32)[:28].fill_(2.5)
    assert torch.equal(model[0].weight, torch.full((7, 4), 2.5))
    assert attach(old) is None  # nor can it map the new one through the handle it had


# ---- write_shared: three trainer ranks (processes, one gloo group) write into an engine (this process) ----
SHAPES = [(2, 3), (5, 4), (1, 7), (6,)]  # fewer rows than ranks, uneven shards, a vector
# Bounds a failure only (a sync that works returns as soon as it is done): three spawned ranks importing torch
# on a loaded 2-core machine took over 20 s to meet.
RENDEZVOUS_SECS = 180


def full_weights() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(shape) for shape in SHAPES]


def trainer_rank(rank: int, world: int, init: str, handle: dict, weights_port: int, fail_rank: int,
                 out: str) -> None:
    """One trainer rank: its dim-0 shards as FSDP2 cuts them (torch.chunk), written by write_shared, then a
    collective of the training group as TrainWorker.send_weights's check runs next. What it returned or raised
    goes to `out`.{rank}."""
    import datetime
    from pathlib import Path

    import torch.distributed as dist

    from workers.shared_weights import attach
    from workers.weight_sync import join_group, write_shared

    timeout = datetime.timedelta(seconds=RENDEZVOUS_SECS)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    weights = full_weights()

    def shard(i: int) -> tuple[int, torch.Tensor]:
        if rank == fail_rank and i == 2:
            raise ValueError("a bug in weight_shard")
        t = weights[i]
        rows = -(-t.shape[0] // world)
        part = t[rank * rows:(rank + 1) * rows]
        return rank * rows * (t.numel() // t.shape[0]), part

    group = join_group("127.0.0.1", weights_port, 0, 2, "w", "gloo", timeout) if rank == 0 else None
    try:
        write_shared(shard, [t.numel() for t in weights], torch.float32, 16, [attach(handle)], rank, world, group,
                     [1], timeout, step=0)
        dist.barrier(timeout=datetime.timedelta(seconds=10))  # the next collective: every rank must be in it
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - the test reads it
        outcome = f"{type(e).__name__}: {e}"
    Path(f"{out}.{rank}").write_text(outcome)
    dist.destroy_process_group()


def run_trainers(tmp_path, fail_rank: int = -1) -> tuple[torch.nn.Module, str | BaseException, list[str]]:
    """The engine's weights and what it got (its digest or error), and what each rank's call ended with."""
    import datetime
    import threading

    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    from workers.weight_sync import join_group, receive_shared

    engine = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES])
    shared = SharedWeights(engine)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: dict = {}

    def receive() -> None:
        timeout = datetime.timedelta(seconds=RENDEZVOUS_SECS)
        group = join_group("127.0.0.1", store.port, 1, 2, "w", "gloo", timeout)
        try:
            out["digest"] = receive_shared([p.numel() for p in engine], torch.float32, 16, group, timeout)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["digest"] = e

    thread = threading.Thread(target=receive)
    thread.start()
    mp.start_processes(trainer_rank, args=(3, f"file://{tmp_path}/init", shared.handle(), store.port, fail_rank,
                                           str(tmp_path / "outcome")), nprocs=3, start_method="spawn")
    thread.join(RENDEZVOUS_SECS)
    return engine, out["digest"], [(tmp_path / f"outcome.{r}").read_text() for r in range(3)]


def test_three_ranks_write_an_engine_bitwise_with_the_streams_digest(tmp_path):
    from workers.weight_sync import local_digest

    engine, digest, outcomes = run_trainers(tmp_path)
    assert all(torch.equal(p, w) for p, w in zip(engine, full_weights()))
    assert digest == local_digest(full_weights(), torch.float32, 16)  # 16-byte buckets: 4 elements each
    assert outcomes == ["returned"] * 3


def test_a_rank_that_fails_to_write_fails_every_rank_with_its_error_and_the_engine_at_once(tmp_path):
    from workers.errors import WeightSyncError

    _, digest, outcomes = run_trainers(tmp_path, fail_rank=1)
    want = ("ShardWriteError: trainer rank 1 could not write its shards into the engines' shared weights: "
            "ValueError: a bug in weight_shard")
    assert outcomes == [want] * 3  # the same error on every rank, none left in the next collective
    assert isinstance(digest, WeightSyncError) and "could not write" in str(digest)  # told, not timed out


def test_a_cuda_ipc_handle_opens_nowhere_that_does_not_see_its_gpu():
    """A rank on another GPU, or on none (this machine), gets no buffer from an engine's handle and streams."""
    from workers.cuda_weights import open_handle

    assert open_handle({"cuda_ipc": [], "gpu": "GPU-not-this-one", "bytes": 4, "layout": []}) is None
    assert open_handle({"layout": []}) is None  # malformed
