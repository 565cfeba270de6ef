"""Reading a DCP checkpoint someone else wrote runs none of their code: real DCP files, no Ray."""
import os
import pickle
import warnings

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
