"""The classifier, tested with real exception objects: the ones DCP, gloo, torch and Ray really raise."""
from __future__ import annotations

import datetime
import errno
import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray import exceptions as rex
from torch.distributed.checkpoint.api import CheckpointException

from supervisor.cluster.errors import Group, GroupError
from supervisor.control.classify import FaultKind, classify
from workers.errors import StaleWeights, WeightSyncError
from workers.rewards import Rewards, UserCodeError


def from_worker(error: BaseException, group=Group.TRAIN, actor="TrainWorker[rank 1]", settled=True) -> GroupError:
    """What the groups raise for a call whose actor raised `error`: Ray wraps it in a RayTaskError."""
    wrapped = rex.RayTaskError("TrainWorker.save_recover", "traceback", error).as_instanceof_cause()
    return GroupError(group, wrapped, (actor,), "node1", 0.1, settled)


full_disk = pytest.mark.skipif(not stat.S_ISCHR(os.stat("/dev/full").st_mode) if os.path.exists("/dev/full") else True,
                               reason="needs the /dev/full device")


def real_dcp_enospc(tmp_path: Path) -> CheckpointException:
    """DCP's own writer hits a full disk: its shard file points at /dev/full."""
    (tmp_path / "__0_0.distcp").symlink_to("/dev/full")
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(4096)}, checkpoint_id=str(tmp_path), no_dist=True)
    return info.value


def real_torch_save_enospc() -> RuntimeError:
    with pytest.raises(RuntimeError) as info:
        torch.save({"w": torch.zeros(4096)}, "/dev/full")
    return info.value


def _peer(rank: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        os._exit(0)  # dies the way a SIGKILLed rank does, without leaving the group
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(1 << 16))
        queue.put(None)
    except BaseException as e:  # noqa: BLE001 - the error under test
        queue.put(e)


def real_gloo_peer_error() -> BaseException:
    from supervisor.testing.local_cluster import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    error = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert error is not None, "the survivor's collective did not fail"
    return error


@full_disk
def test_disk_full_inside_dcp_is_a_storage_error(tmp_path):
    error = real_dcp_enospc(tmp_path)
    fault = classify(from_worker(error))
    assert fault.kind is FaultKind.STORAGE_ERROR and "No space left" in fault.message
    assert fault.settled and fault.actors == ("TrainWorker[rank 1]",)


def test_a_missing_directory_inside_dcp_is_a_storage_error_but_elsewhere_a_bug(tmp_path):
    import traceback

    # what a rank's DCP upload raises when its staging directory was removed under it: (error, traceback) per rank
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "gone" / "__1_0.distcp"))
    gone_fault = classify(from_worker(CheckpointException("write failed", {1: (missing, traceback.extract_stack())})))
    assert gone_fault.kind is FaultKind.STORAGE_ERROR and "No such file" in gone_fault.message
    assert classify(from_worker(FileNotFoundError(2, "No such file", "x"))).kind is FaultKind.INTERNAL_ERROR


@full_disk
def test_disk_full_in_torch_save_and_a_plain_oserror_are_storage_errors():
    assert classify(from_worker(real_torch_save_enospc())).kind is FaultKind.STORAGE_ERROR
    assert classify(from_worker(OSError(errno.EACCES, "Permission denied", "/x"))).kind is FaultKind.STORAGE_ERROR
    assert classify(PermissionError(errno.EACCES, "Permission denied")).kind is FaultKind.STORAGE_ERROR


def test_a_survivors_gloo_error_after_its_peer_died_is_a_collective_failure():
    error = real_gloo_peer_error()
    fault = classify(from_worker(error, actor="TrainWorker[rank 0]", settled=False))
    assert fault.kind is FaultKind.COLLECTIVE_FAILED, (type(error), error)
    assert fault.group is Group.TRAIN


def test_a_broken_weight_stream_is_a_collective_failure_of_the_engine():
    """An engine whose transfer broke (or whose digests disagreed) raises WeightSyncError; rank 0 reports the
    targets it dropped with one too: either way a fault of the engines, repaired on them alone."""
    fault = classify(from_worker(WeightSyncError("weight stream broken: Connection closed by peer"), Group.ROLLOUT,
                                 actor="RolloutWorker[1]"))
    assert fault.kind is FaultKind.COLLECTIVE_FAILED and fault.group is Group.ROLLOUT
    assert fault.actors == ("RolloutWorker[1]",)


@pytest.mark.parametrize("error, group, kind", [
    (rex.ActorDiedError(), Group.TRAIN, FaultKind.WORKER_DIED),
    (rex.ActorDiedError(), Group.ROLLOUT, FaultKind.ENGINE_DIED),
    (rex.ActorUnavailableError("node unreachable", None), Group.TRAIN, FaultKind.WORKER_DIED),
    (rex.NodeDiedError("node died"), Group.ROLLOUT, FaultKind.ENGINE_DIED),
    (rex.WorkerCrashedError(), Group.TRAIN, FaultKind.WORKER_DIED),
    (rex.GetTimeoutError("no answer"), Group.ROLLOUT, FaultKind.HANG),
    (rex.GetTimeoutError("no answer"), Group.TRAIN, FaultKind.HANG),
    (rex.ObjectLostError("ab" * 14, "owner", "call site"), Group.ROLLOUT, FaultKind.OBJECT_LOST),
    (rex.OwnerDiedError("ab" * 14, "owner", "call site"), Group.ROLLOUT, FaultKind.OBJECT_LOST),
    (rex.RuntimeEnvSetupError("Failed to set up runtime environment"), Group.TRAIN, FaultKind.RUNTIME_ENV),
])
def test_ray_errors_of_a_group_call(error, group, kind):
    fault = classify(GroupError(group, error, ("X",), "node1", 1.0))
    assert fault.kind is kind and fault.group is group and fault.node == "node1" and not fault.node_lost
    assert classify(GroupError(group, error, ("X",), "node1", 1.0, node_lost=True)).node_lost


def test_errors_raised_inside_workers_are_unwrapped():
    lost = rex.ObjectLostError("ab" * 14, "owner", "call site")  # an engine's argument lost with its node
    assert classify(from_worker(lost, Group.ROLLOUT)).kind is FaultKind.OBJECT_LOST
    nested = rex.RayTaskError("f", "tb", rex.RayTaskError("g", "tb", rex.ActorDiedError()).as_instanceof_cause())
    assert classify(GroupError(Group.TRAIN, nested.as_instanceof_cause())).kind is FaultKind.WORKER_DIED
    stale = classify(from_worker(StaleWeights("asked for 3, holds 2"), Group.ROLLOUT, "RolloutWorker[0]"))
    assert stale.kind is FaultKind.STALE_WEIGHTS


def test_nccl_and_cuda_errors_of_a_rank():
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
    assert classify(from_worker(nccl)).kind is FaultKind.COLLECTIVE_FAILED
    cuda = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert classify(from_worker(cuda)).kind is FaultKind.DEVICE_ERROR


def test_user_code_errors_come_from_the_reward_function():
    def reward(prompt, completion, row):
        return row["missing"]

    with pytest.raises(UserCodeError) as info:
        Rewards(reward)([{"prompt": "p"}], ["c"])
    assert classify(info.value).kind is FaultKind.USER_ERROR


def test_only_a_bug_in_relaunch_is_an_internal_error():
    assert classify(AttributeError("'NoneType' object has no attribute 'pid'")).kind is FaultKind.INTERNAL_ERROR
    assert classify(from_worker(TypeError("bad argument"))).kind is FaultKind.INTERNAL_ERROR
    # a RuntimeError that is not a collective's, in an engine: a bug, not a peer failure
    assert classify(from_worker(RuntimeError("shape mismatch"), Group.ROLLOUT)).kind is FaultKind.INTERNAL_ERROR


def _init_failed(text: str) -> rex.ActorDiedError:
    """What Ray raises for a call on an actor whose constructor raised: the constructor's error as text only."""
    tb = f'Traceback (most recent call last):\n  File "rollout_worker.py", line 52, in __init__\n{text}'
    return rex.ActorDiedError(rex.RayTaskError("RolloutWorker.__init__", tb, RuntimeError(text)))


def test_a_constructor_that_raised_is_a_start_failure_naming_its_error_unless_it_may_pass():
    fault = classify(GroupError(Group.ROLLOUT, _init_failed("ValueError: no KV cache room for max_model_len 38"),
                                ("RolloutWorker[0]",), "node1", 1.0))
    assert fault.kind is FaultKind.START_FAILED and fault.group is Group.ROLLOUT
    assert fault.message == "RolloutWorker[0] failed to start: ValueError: no KV cache room for max_model_len 38"
    busy = _init_failed("RuntimeError: The server socket has failed to listen: address already in use")
    assert classify(GroupError(Group.TRAIN, busy, ("TrainWorker[rank 0]",))).kind is FaultKind.WORKER_DIED


def test_torchs_own_error_types_are_known_by_type_whatever_their_text():
    """torch's out-of-memory and distributed errors, whose text names no marker, are told by their types."""
    assert classify(from_worker(torch.OutOfMemoryError("allocation failed"))).kind is FaultKind.DEVICE_ERROR
    assert classify(from_worker(dist.DistError("store timed out"))).kind is FaultKind.COLLECTIVE_FAILED
