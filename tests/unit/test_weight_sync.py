"""The weight stream's pure parts (the bucket plan, the digest), and a real stream between two gloo members in
one process: what lands is bitwise what was sent, written in place, and a broken stream is reported."""
from __future__ import annotations

import datetime
import threading

import pytest
import torch
from torch.distributed import TCPStore

from workers.errors import WeightSyncError
from workers.weight_sync import (Piece, as_message, bucket_len, combine, from_message, join_group, local_digest,
                                 plan_buckets, receive, send)

TIMEOUT = datetime.timedelta(seconds=5)


def test_buckets_are_fixed_size_and_cover_every_element_once():
    plan = plan_buckets([10, 3, 25, 0, 4], itemsize=4, bucket_bytes=48)  # 12 elements a bucket
    assert [bucket_len(b) for b in plan] == [12, 12, 12, 6]
    covered = {}
    for bucket in plan:
        offsets = [p.offset for p in bucket]
        assert offsets == sorted(offsets) and offsets[0] == 0
        for p in bucket:
            for e in range(p.start, p.start + p.length):
                covered[(p.param, e)] = covered.get((p.param, e), 0) + 1
    assert covered == {(i, e): 1 for i, n in enumerate([10, 3, 25, 0, 4]) for e in range(n)}
    assert plan[0] == [Piece(0, 0, 10, 0), Piece(1, 0, 2, 10)]  # a parameter may span buckets


def test_a_bucket_smaller_than_an_element_still_holds_one():
    assert [bucket_len(b) for b in plan_buckets([3], itemsize=4, bucket_bytes=1)] == [1, 1, 1]


def test_unsigned_64_bit_hashes_cross_as_int64_and_come_back_unchanged():
    hashes = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    message = as_message(hashes)
    assert message.dtype == torch.int64 and from_message(message) == hashes


def test_the_digest_depends_on_every_bucket_and_their_order():
    assert combine([1, 2]) != combine([2, 1]) != combine([1, 2, 0])
    assert combine([1, 2]) == combine([1, 2]) and combine([1, 2]).startswith("xxh3-")
    ts = [torch.arange(10.0), torch.ones(3)]
    changed = [ts[0].clone(), ts[1].clone()]
    changed[1][2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # one bit of one element
    assert local_digest(ts, torch.float32, 16) != local_digest(changed, torch.float32, 16)


def test_a_bucket_hashed_in_pieces_where_they_lie_is_the_bucket_hashed_whole():
    from workers.weight_sync import bucket_hash, pieces_hash

    torch.manual_seed(0)
    pieces = [torch.randn(7), torch.randn(3, 4)[:, 1], torch.randn(0), torch.randn(100)]  # one not contiguous
    assert pieces_hash(pieces) == bucket_hash(torch.cat([p.reshape(-1) for p in pieces]))
    assert pieces_hash(pieces[:2]) != pieces_hash(pieces[1::-1])


def stream(sent: list[torch.Tensor], into: list[torch.Tensor], bucket_bytes: int, receiver=receive):
    """Rank 0 sends `sent` to rank 1, which writes into `into`; returns (rank 0's result, rank 1's)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    out: dict = {}

    def member(rank: int) -> None:
        group = join_group("127.0.0.1", store.port, rank, 2, "g", "gloo", TIMEOUT)
        try:
            out[rank] = (send(lambda i: sent[i], [t.numel() for t in sent], torch.float32, bucket_bytes, True,
                              group, [1], TIMEOUT) if rank == 0 else
                         receiver(into, torch.float32, bucket_bytes, group, TIMEOUT))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


def test_a_stream_lands_bitwise_in_place_with_the_same_digest_on_both_sides():
    torch.manual_seed(0)
    sent = [torch.randn(37, 5), torch.randn(1000), torch.randn(3, 3)]
    into = [torch.zeros_like(t) for t in sent]
    pointers = [t.data_ptr() for t in into]
    result, digest = stream(sent, into, bucket_bytes=256)
    assert all(torch.equal(a, b) for a, b in zip(sent, into))
    assert [t.data_ptr() for t in into] == pointers  # written in place
    assert result["digest"] == digest == local_digest(sent, torch.float32, 256)
    assert result["failed"] == {} and result["buckets"] == 19 and result["bytes"] == 4 * (185 + 1000 + 9)


def test_a_receiver_that_stops_is_dropped_and_reported_while_the_sender_finishes():
    sent = [torch.randn(1 << 21)]  # more than the socket buffers hold

    def gives_up(into, dtype, bucket_bytes, group, timeout):
        group.recv([torch.empty(bucket_bytes // 4)], 0, 0).wait(timeout)  # the first bucket only
        raise WeightSyncError("the engine went away")

    result, error = stream(sent, [torch.zeros(1 << 21)], bucket_bytes=1 << 16, receiver=gives_up)
    assert isinstance(error, WeightSyncError)
    assert list(result["failed"]) == [1] and result["digest"] == local_digest(sent, torch.float32, 1 << 16)


def test_digests_that_disagree_leave_no_version(monkeypatch):
    import workers.weight_sync as ws

    calls = iter(range(10**6))
    monkeypatch.setattr(ws, "bucket_hash", lambda t, kind="xxh3": next(calls))  # every hash differs from the last
    with pytest.raises(WeightSyncError, match="another digest"):
        result, error = stream([torch.ones(8)], [torch.zeros(8)], bucket_bytes=16)
        raise error


def test_every_parameter_is_checked_once_in_as_many_syncs_as_there_are_parameters():
    from workers.weight_sync import to_check

    assert sorted(k for v in range(17, 17 + 5) for k in to_check(v, 5, whole=False)) == [0, 1, 2, 3, 4]
    assert to_check(3, 5, whole=True) == [0, 1, 2, 3, 4]


def checking_rank(rank: int, init: str, out: str) -> None:
    """One of two trainer ranks checking what was written (mismatched) in several cases: its parts are dim-0
    shards as FSDP2 cuts them; rank 0 also holds the written memory. Each case's answer goes to `out`.{rank}."""
    import datetime
    import json
    from pathlib import Path

    import torch.distributed as dist

    from workers.weight_sync import mismatched

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    full = [torch.randn(37, 5), torch.randn(1000), torch.randn(3, 3)]
    numels = [t.numel() for t in full]
    written = torch.cat([t.reshape(-1) for t in full])

    def part(i: int, shift: int = 0, stale: bool = False) -> tuple[int, torch.Tensor]:
        t = full[i].reshape(full[i].shape[0], -1)
        rows = -(-t.shape[0] // 2)
        mine = t[rank * rows:(rank + 1) * rows] + (1.0 if stale and rank == 1 else 0.0)
        return (rank * rows + shift * (rank == 1)) * t.shape[1], mine

    def check(which, part_of=part, flat=written) -> list[int]:
        return mismatched(part_of, flat if rank == 0 else None, numels, torch.float32, which)

    answers = {"whole": check([0, 1, 2])}
    corrupt = written.clone()
    corrupt[185 + 999] = torch.nextafter(corrupt[185 + 999], torch.tensor(9.0))  # rank 1's last element of param 1
    answers["corrupt"] = check([0, 1, 2], flat=corrupt)
    answers["not_its_turn"] = check([2], flat=corrupt)
    answers["stale"] = check([0, 1, 2], part_of=lambda i: part(i, stale=i == 0))  # rank 1 trained on, unwritten
    answers["misplaced"] = check([0, 1, 2], part_of=lambda i: part(i, shift=-1 if i == 2 else 0))
    answers["sum64"] = mismatched(part, corrupt if rank == 0 else None, numels, torch.float32, [1], "sum64")
    answers["chunked"] = [mismatched(part, f if rank == 0 else None, numels, torch.float32, [0, 1, 2], chunk=7)
                          for f in (written, corrupt)]  # hashed 7 elements at a time: the same answers
    Path(f"{out}.{rank}").write_text(json.dumps(answers))
    dist.destroy_process_group()


def test_a_parameter_written_stale_or_misplaced_differs_from_the_ranks_own_parts_and_only_hashes_cross():
    """Two ranks: each hashes its own part, rank 0 the same spans of what was written. A changed element, a rank
    that trained on past what it wrote, and a part placed one row off are seen, each in its parameter."""
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(checking_rank, args=(f"file://{tmp}/init", f"{tmp}/answers"), nprocs=2,
                           start_method="spawn")
        rank0, rank1 = (json.loads(Path(f"{tmp}/answers.{r}").read_text()) for r in range(2))
    assert rank0 == {"whole": [], "corrupt": [1], "not_its_turn": [], "stale": [0], "misplaced": [2], "sum64": [1],
                     "chunked": [[], [1]]}
    assert rank1 == {key: [[], []] if key == "chunked" else [] for key in rank0}  # only rank 0 answers


def fsdp_rank(rank: int, init: str, out: str) -> None:
    """One of three FSDP2 ranks: every parameter's placed_part (the engine's own method) laid where it says, on
    rank 0, against the parameter whole; parameters of 1, 2, 5 and 7 rows, so some ranks hold none of one."""
    import datetime
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workers.engines.fsdp import FSDPEngine

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, 3)) for rows in (1, 2, 5, 7)])
    fully_shard(model, mesh=init_device_mesh("cpu", (3,)))
    engine = SimpleNamespace(params=list(model.parameters()), rank=rank, world_size=3)
    answers = []
    for i, param in enumerate(engine.params):
        start, part = FSDPEngine.placed_part(engine, i)
        parts = [None] * 3
        dist.all_gather_object(parts, (start, part.tolist()))
        whole = param.full_tensor().reshape(-1)
        laid = torch.full_like(whole, float("nan"))
        for first, values in parts:
            values = torch.tensor(values).reshape(-1)
            laid[first:first + values.numel()] = values
        answers.append([bool(torch.equal(laid, whole)), sum(1 for _, v in parts if len(v))])
    Path(f"{out}.{rank}").write_text(json.dumps(answers))
    dist.destroy_process_group()


def test_the_fsdp_engines_parts_placed_by_dtensor_lay_each_parameter_out_exactly():
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fsdp_rank, args=(f"file://{tmp}/init", f"{tmp}/answers"), nprocs=3, start_method="spawn")
        answers = json.loads(Path(f"{tmp}/answers.0").read_text())
    assert answers == [[True, 1], [True, 2], [True, 3], [True, 3]]  # laid whole; ranks holding a part of each


def test_an_engines_shared_weights_hash_in_place_as_the_stream_hashes_them():
    from workers.weight_sync import flat_digest

    torch.manual_seed(0)
    ts = [torch.randn(37, 5), torch.randn(1000)]
    assert flat_digest(torch.cat([t.reshape(-1) for t in ts]), torch.float32, 256) == local_digest(ts, torch.float32, 256)


def test_a_failed_write_into_shared_weights_is_an_internal_error_not_a_retried_fault():
    from supervisor.cluster.errors import Group, GroupError
    from supervisor.control.classify import FaultKind, classify
    from workers.errors import ShardWriteError

    error = ShardWriteError("trainer rank 1 could not write its shards into the engines' shared weights: "
                            "ValueError: a bug in weight_shard")
    fault = classify(GroupError(Group.TRAIN, error, ("TrainWorker[rank 1]",), settled=True))
    assert fault.kind is FaultKind.INTERNAL_ERROR and "rank 1" in fault.message


def test_sum64_sees_a_changed_or_moved_word_and_ignores_alignment():
    """The GPU engines' digest: any changed or swapped 64-bit word shows; a bucket that starts mid-word, or whose
    length is not whole words, hashes as its bytes do (tests/gpu checks that the GPU gives the same values)."""
    from workers.weight_sync import sum64

    words = torch.arange(1, 65, dtype=torch.int64)
    changed, swapped = words.clone(), words.clone()
    changed[7] += 1
    swapped[[3, 4]] = swapped[[4, 3]]
    assert len({sum64(words), sum64(changed), sum64(swapped)}) == 3
    raw = torch.arange(1, 200, dtype=torch.int16)  # 398 bytes
    assert sum64(raw[1:]) == sum64(raw[1:].clone()) != sum64(raw[2:].clone())
    assert 0 <= sum64(raw) < 2**64


def test_sum64_digests_agree_however_the_buckets_are_cut():
    from workers.weight_sync import flat_digest

    ts = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    flat = torch.cat([t.reshape(-1) for t in ts])
    digest = local_digest(ts, torch.float32, 24, kind="sum64")
    assert digest.startswith("sum64-") and digest == flat_digest(flat, torch.float32, 24, kind="sum64")
    assert digest != local_digest(ts, torch.float32, 24)  # the kinds differ: an engine says which it checks with


def test_a_ranks_shard_digest_changes_with_any_element_or_where_its_part_starts():
    """What a handoff compares before and after the ranks move (controller: `_rejoin_from_memory`): equal only for
    the same parts at the same places, in any dtype."""
    from workers.weight_sync import shard_digest

    parts = [(0, torch.arange(6, dtype=torch.float32)), (3, torch.ones(4, dtype=torch.bfloat16))]
    same = [(start, t.clone()) for start, t in parts]
    assert shard_digest(parts) == shard_digest(same)
    changed = [(0, parts[0][1].clone()), parts[1]]
    changed[0][1][5] += 1
    assert shard_digest(changed) != shard_digest(parts)
    assert shard_digest([(1, parts[0][1]), parts[1]]) != shard_digest(parts)
