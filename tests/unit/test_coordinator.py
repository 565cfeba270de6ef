"""The checkpoint coordinator's own bookkeeping, with a stand-in TrainGroup that writes files."""
from __future__ import annotations

from pathlib import Path

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

    def save_recover(self, staging, global_step, driver_state=None):
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
