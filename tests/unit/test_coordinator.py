"""The checkpoint coordinator's own bookkeeping, with a stand-in TrainGroup that writes files."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.checkpoint.durable import file_digest
from supervisor.checkpoint.layout import TrialLayout
from supervisor.config import load_config
from supervisor.control.coordinator import CheckpointCoordinator
from supervisor.control.events import EventLog
from supervisor.control.step_info import StepInfo
from workers.engines.reference import reference_file


class RefWritingTrainers:
    """Rank 0 rewrites the reference file on a refresh step, with the bytes the run has now."""

    world_size = 1

    def __init__(self):
        self.reference_bytes = b"A" * 64

    def save_recover(self, staging, global_step):
        if (global_step + 1) % 2 == 0:
            ref = reference_file(Path(staging).parent, global_step)
            ref.parent.mkdir(exist_ok=True)
            ref.write_bytes(self.reference_bytes)
        return {}


def test_a_replayed_reference_refresh_is_hashed_again(tmp_path):
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "recover.mode=on", "recover.freq_steps=2",
                                "actor.kl_coef=0.1", "actor.ref_update_steps=2"])
    layout = TrialLayout.from_config(config)
    coordinator = CheckpointCoordinator(config, layout, EventLog(layout.events_log))
    trainers, infos = RefWritingTrainers(), {"dataloader_info.pkl": {}}
    step = StepInfo(epoch=0, epoch_step=1, global_step=1, steps_per_epoch=12)
    coordinator.write_recover(trainers, step, infos)
    trainers.reference_bytes = b"B" * 64  # the refresh step replayed after a rollback: other bytes (GPU, shrink)
    staged = coordinator.write_recover(trainers, step, infos)
    ref = reference_file(layout.recover_checkpoint, 1)
    assert staged.files["../reference/" + ref.name]["sha256"] == file_digest(ref)
    later = coordinator.write_recover(trainers, StepInfo(epoch=0, epoch_step=2, global_step=2, steps_per_epoch=12),
                                      infos)  # a save that names it without writing it
    assert later.files["../reference/" + ref.name]["sha256"] == file_digest(ref)


class ExportingTrainers:
    """Rank 0 writes an HF export holding `weights`, in the foreground or on a background thread."""

    world_size = 1

    def __init__(self, weights: bytes):
        self.weights = weights

    def export_hf(self, directory, global_step):
        Path(directory).mkdir()
        (Path(directory) / "config.json").write_text("{}")
        (Path(directory) / "model.safetensors").write_bytes(self.weights)

    def begin_export(self, directory, global_step):
        self.export_hf(directory, global_step)

    def export_result(self, global_step, block):
        return True


def _exporting_coordinator(tmp_path):
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "saver.freq_steps=1"])
    layout = TrialLayout.from_config(config)
    return CheckpointCoordinator(config, layout, EventLog(layout.events_log)), layout


@pytest.mark.parametrize("background", [False, True])
def test_a_replayed_steps_export_is_replaced_when_its_weights_differ_and_kept_when_equal(tmp_path, background):
    from supervisor.control.events import read_jsonl

    coordinator, layout = _exporting_coordinator(tmp_path)
    step = StepInfo(epoch=0, epoch_step=3, global_step=3, steps_per_epoch=12)
    final = layout.export_dir(0, 3, 3)
    def export(weights: bytes) -> None:
        trainers = ExportingTrainers(weights)
        coordinator.export_hf(trainers, step, background)
        coordinator.collect_export(trainers, block=True)

    export(b"abandoned timeline")
    first = final.stat().st_ino
    export(b"abandoned timeline")  # the step trained again with the same weights
    assert final.stat().st_ino == first  # kept, not rewritten
    export(b"the new timeline")  # trained again with other weights (an elastic resume, a GPU)
    assert (final / "model.safetensors").read_bytes() == b"the new timeline"
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporary or old copy left
    exports = [e for e in read_jsonl(layout.events_log) if e["event"] == "export"]
    assert [e["outcome"] for e in exports] == ["published", "kept", "replaced"]


def test_replacing_an_export_never_leaves_its_path_without_a_complete_export(tmp_path, monkeypatch):
    import os
    import shutil

    from supervisor.checkpoint import exports
    from supervisor.checkpoint.storage import LocalStorage

    old, new = tmp_path / "old", tmp_path / "export"
    for d, weights in ((old, b"old"), (new, b"new")):
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(weights)
    final = tmp_path / "final"
    old.rename(final)
    seen = []

    def whole():  # the export a reader would find at `final` now
        seen.append((final / "model.safetensors").read_bytes() if (final / "config.json").is_file() else None)

    for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree"), (LocalStorage, "exchange")):
        real = getattr(module, name)

        def watched(*args, real=real, **kwargs):
            whole()
            result = real(*args, **kwargs)
            whole()
            return result

        monkeypatch.setattr(module, name, watched)
    assert exports.publish_export(LocalStorage(), new, final) is exports.ExportOutcome.REPLACED
    assert seen and set(seen) <= {b"old", b"new"} and seen[-1] == b"new"


def test_exports_beyond_saver_keep_last_are_pruned_oldest_step_first(tmp_path):
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "saver.freq_steps=1", "saver.keep_last=2"])
    layout = TrialLayout.from_config(config)
    coordinator = CheckpointCoordinator(config, layout, EventLog(layout.events_log))
    for g in (8, 9, 10):  # 10 sorts before 9 as a name: retention goes by step
        coordinator.export_hf(ExportingTrainers(b"w%d" % g), StepInfo(0, g, g, 12))
    assert {p.name for p in layout.export_root.iterdir()} == {layout.export_dir(0, g, g).name for g in (9, 10)}
