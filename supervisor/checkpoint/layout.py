"""Every path of the on-disk layout, in one place (DESIGN.md "On-disk layout").

Pure: nothing here creates or touches a file (`inside` only follows symlinks). Names come from the validated
config, and every derived path is checked to stay inside the trial's root, so no name can walk out of it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

RECOVER_INFO_FILES = (
    "step_info.json",
    "saver_info.json",
    "evaluator_info.json",
    "stats_logger_info.json",
    "checkpoint_info.json",
    "dataloader_info.pkl",
)
STEP_DIR = re.compile(r"^globalstep(\d+)$")
EXPORT_DIR = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
TMP_PREFIX = ".tmp."


@dataclass(frozen=True)
class TrialLayout:
    fileroot: Path
    user: str
    experiment_name: str
    trial_name: str

    @classmethod
    def from_config(cls, config) -> "TrialLayout":
        return cls(config.cluster.fileroot, config.cluster.user, config.experiment_name, config.trial_name)

    def _inside(self, root: Path, *parts: str) -> Path:
        path = root.joinpath(*parts)
        if ".." in path.relative_to(root).parts:
            raise ValueError(f"path {path} leaves {root}")
        return path

    @property
    def checkpoint_root(self) -> Path:
        return self._inside(self.fileroot, "checkpoints", self.user, self.experiment_name, self.trial_name)

    @property
    def log_root(self) -> Path:
        return self._inside(self.fileroot, "logs", self.user, self.experiment_name, self.trial_name)

    @property
    def export_root(self) -> Path:
        return self.checkpoint_root / "default"

    @property
    def recover_checkpoint(self) -> Path:
        return self.export_root / "recover_checkpoint"

    @property
    def recover_info(self) -> Path:
        return self.checkpoint_root / "recover_info"

    @property
    def stats_log(self) -> Path:
        return self.log_root / "stats.jsonl"

    @property
    def events_log(self) -> Path:
        return self.log_root / "events.jsonl"

    def step_dir(self, global_step: int) -> Path:
        return self.recover_checkpoint / f"globalstep{global_step}"

    def export_dir(self, epoch: int, epoch_step: int, global_step: int) -> Path:
        return self.export_root / f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"

    def recover_state_paths(self) -> list[Path]:
        """What clean-restart removes: recover_info/ and recover_checkpoint/ of this trial, nothing else."""
        return [self.recover_info, self.recover_checkpoint]


def step_of(path: Path) -> int | None:
    """The global step a recover step directory holds, from its name (None: not a step directory)."""
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def inside(root: Path, relative: str) -> Path:
    """`root / relative` when it names something inside `root`; ValueError when `relative` (a path recorded in
    a checkpoint's manifest or DCP metadata) is absolute, climbs out with `..`, or leads out through a symlink."""
    rel = PurePosixPath(relative)
    if not rel.parts or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"path {relative!r} is not inside the checkpoint directory")
    path = root / rel
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"path {relative!r} leads out of the checkpoint directory through a symlink")
    return path
