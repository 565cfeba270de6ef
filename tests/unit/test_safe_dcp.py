"""Reading a DCP checkpoint someone else wrote runs none of their code: real DCP files, no Ray."""
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from supervisor.checkpoint import safe_load


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def load(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        safe_load.load(state, path, no_dist=True)


def test_model_optimizer_and_scheduler_round_trip_through_the_safe_reader(tmp_path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5)
    save({"model": model.state_dict(), "scheduler": sched.state_dict(), "x": torch.ones(2, dtype=torch.bfloat16)},
         tmp_path)
    meta = safe_load.read_metadata(tmp_path).state_dict_metadata
    assert {"model.weight", "scheduler.base_lrs", "x"} <= set(meta)

    other = torch.nn.Linear(3, 2)
    other_sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(other.parameters(), lr=0.5), lambda s: 1.0)
    state = {"model": other.state_dict(), "scheduler": other_sched.state_dict(),
             "x": torch.zeros(2, dtype=torch.bfloat16)}
    load(state, tmp_path)
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["scheduler"]["base_lrs"] == [0.01] and torch.equal(state["x"], torch.ones(2, dtype=torch.bfloat16))


def test_pickle_payload_as_metadata_is_refused_before_it_runs(tmp_path):
    save({"w": torch.ones(2)}, tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(safe_load.UnsafeCheckpointError, match="posix.system"):
        safe_load.read_metadata(tmp_path)
    with pytest.raises(safe_load.UnsafeCheckpointError):
        load({"w": torch.zeros(2)}, tmp_path)
    assert not marker.exists()


def test_metadata_that_is_some_other_plain_object_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(safe_load.UnsafeCheckpointError, match="not DCP Metadata"):
        safe_load.read_metadata(tmp_path)


def test_pickle_payload_in_a_non_tensor_entry_is_refused_by_weights_only_loading(tmp_path):
    marker = tmp_path / "ran"
    save({"w": torch.ones(2), "extra": _Payload(marker)}, tmp_path)  # DCP torch.save()s non-tensor entries
    assert not marker.exists()
    with pytest.raises(safe_load.UnsafeCheckpointError, match="Weights only load failed"):
        load({"w": torch.zeros(2), "extra": None}, tmp_path)
    assert not marker.exists()
    # what DCP does on its own: the payload runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": torch.zeros(2), "extra": None}, checkpoint_id=str(tmp_path), no_dist=True)
    assert marker.exists()


def test_check_dcp_refuses_a_pickle_in_a_non_tensor_entry_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    save({"w": torch.ones(2), "scheduler": {"last_epoch": 3, "evil": _Payload(marker)}}, tmp_path)
    with pytest.raises(safe_load.UnsafeCheckpointError, match="Weights only load failed"):
        safe_load.check_dcp(tmp_path)
    assert not marker.exists()
    safe_load.check_dcp(tmp_path, entries=False)  # a checkpoint this process wrote: its metadata only


@pytest.mark.parametrize("where", ["/etc/passwd", "../outside.distcp", "link.distcp"])
def test_check_dcp_refuses_storage_paths_out_of_the_directory(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    save({"w": torch.ones(2)}, ckpt)
    if where == "link.distcp":
        (tmp_path / "elsewhere.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
        (ckpt / where).symlink_to(tmp_path / "elsewhere.distcp")
    metadata = safe_load.read_metadata(ckpt)
    for info in metadata.storage_data.values():
        info.relative_path = where
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="not inside|leads out"):
        safe_load.check_dcp(ckpt)


def test_deepspeed_files_are_read_weights_only_and_a_payload_is_refused_naming_the_file(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    states = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
                                         "fp32": [torch.ones(3)]}}, states)
    evil, marker = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "ran"
    torch.save({"module": _Payload(marker)}, evil)
    with safe_load.deepspeed_files():
        # DeepSpeed asks for weights_only=False; it gets weights_only loading with its own few classes
        loaded = torch.load(states, map_location="cpu", weights_only=False)
        assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
        with pytest.raises(safe_load.UnsafeCheckpointError, match=f"{evil}: refused"):
            torch.load(evil, map_location="cpu", weights_only=False)
    assert not marker.exists()
    torch.load(states, weights_only=False)  # torch.load is itself again afterwards


def _deepspeed_checkpoint(tmp_path, model_states) -> Path:
    """A committed DeepSpeed-engine step whose ZeRO file holds `model_states`."""
    from test_recovery import infos

    from supervisor.checkpoint.durable import file_digest
    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.checkpoint.store import RecoverStore

    store = RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)
    staging = store.staging_dir(4)
    (staging / "global_step4").mkdir()
    torch.save(model_states, staging / "global_step4" / "mp_rank_00_model_states.pt")
    torch.save({"cpu": torch.ones(2)}, staging / "rng_rank0.pt")
    files = {str(f.relative_to(staging)): {"size": f.stat().st_size, "sha256": file_digest(f)}
             for f in staging.rglob("*.pt")}
    return store.commit(staging, 4, 1, "hash", files, infos(4), engine="deepspeed")


def test_inspect_says_how_deepspeed_files_are_read_and_checks_them_so(tmp_path):
    from supervisor.tools.inspect_checkpoint import inspect

    valid, report = inspect(_deepspeed_checkpoint(tmp_path, {"module": {"w": torch.ones(3)}}))
    assert valid, report
    assert "full unpickler" not in report
    assert "1 file read with weights_only" in report


def test_inspect_refuses_a_deepspeed_file_that_would_run_code_even_with_a_matching_manifest(tmp_path):
    from supervisor.tools.inspect_checkpoint import inspect

    marker = tmp_path / "executed"
    valid, report = inspect(_deepspeed_checkpoint(tmp_path, {"module": _Payload(marker)}))
    assert not valid and "mp_rank_00_model_states.pt" in report.splitlines()[1]
    assert not marker.exists()
