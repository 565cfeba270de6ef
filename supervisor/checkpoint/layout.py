"""Every path and file name of the on-disk layout, in one place (docs/on-disk.md).

Pure: nothing here creates or touches a file (`inside` only follows symlinks). Names come from the validated
config, and every derived path is checked to stay inside the trial's root, so no name can walk out of it. The
engines' own shard files (DCP's `__{rank}_*.distcp`, DeepSpeed's `global_step{G}/`) are named by their
libraries; the names relaunch needs to find them are here too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from supervisor.config import Config

# recover_info/ (and each step directory's meta/ mirror of it)
STEP_INFO = "step_info.json"
SAVER_INFO = "saver_info.json"
EVALUATOR_INFO = "evaluator_info.json"
STATS_LOGGER_INFO = "stats_logger_info.json"
CHECKPOINT_INFO = "checkpoint_info.json"
DATALOADER_INFO = "dataloader_info.pkl"
RECOVER_INFO_FILES = (STEP_INFO, SAVER_INFO, EVALUATOR_INFO, STATS_LOGGER_INFO, CHECKPOINT_INFO, DATALOADER_INFO)

# a recover step directory, recover_checkpoint/globalstep{G}/
STEP_DIR = re.compile(r"^globalstep(\d+)$")
MANIFEST = "manifest.json"      # every file of the step with its size and sha256, the engine, the world size
RUN_CONFIG = "run_config.json"  # the full config of the run, so `relaunch export` can rebuild the model
META = "meta"                   # the recover_info of the step, mirrored beside its shards
DCP_METADATA = ".metadata"      # DCP's index, written by rank 0 last: a DCP step without it is incomplete
DEEPSPEED_RANK_FILE = "zero_pp_rank_{}_"  # DeepSpeed's per-rank shard files carry this in their names
REFERENCE_DIR = "reference"     # recover_checkpoint/reference/: the KL reference's weights, shared by steps
REFERENCE_PREFIX = f"../{REFERENCE_DIR}/"  # a step manifest's entry for the reference file it needs

# a step directory moved out of the way of training on, never deleted on the pointer's word (invariant 2)
DAMAGED = "damaged"          # passed over by loading: kept for inspection
UNCOMMITTED = "uncommitted"  # newer than the pointer: kept until a newer step is committed

EXPORT_DIR = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
TMP_PREFIX = ".tmp."


@dataclass(frozen=True)
class TrialLayout:
    fileroot: Path
    user: str
    experiment_name: str
    trial_name: str

    @classmethod
    def from_config(cls, config: Config) -> "TrialLayout":
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

    @property
    def trackers_dir(self) -> Path:
        """logging.trackers' files: tensorboard/ event files, wandb/ runs, state.json (what they hold)."""
        return self.log_root / "trackers"

    @property
    def lock(self) -> Path:
        """The trial's run lock (checkpoint/trial_lock.py): one run of a trial at a time, whatever its cluster."""
        return self.checkpoint_root / "run.lock"

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


def aside_dir(step_dir: Path, why: str, tag: str) -> Path:
    """Where a step directory is moved aside: `{why}.globalstep{G}.{tag}` beside it (why: DAMAGED, UNCOMMITTED)."""
    return step_dir.with_name(f"{why}.{step_dir.name}.{tag}")


def step_set_aside(path: Path, why: str) -> int | None:
    """The global step of a directory moved aside for `why`, from its name (None: not one)."""
    m = re.match(rf"^{why}\.globalstep(\d+)\.", path.name)
    return int(m.group(1)) if m else None


def rng_file(directory: Path, rank: int) -> Path:
    """One rank's RNG states in a step directory."""
    return directory / f"rng_rank{rank}.pt"


def deepspeed_tag(global_step: int) -> str:
    """DeepSpeed's checkpoint tag (its subdirectory) inside our step directory."""
    return f"global_step{global_step}"


def reference_file(recover_root: Path, step: int) -> Path:
    """The KL reference's weights as refreshed after `step`."""
    return recover_root / REFERENCE_DIR / f"ref_globalstep{step}.safetensors"


def step_of_reference(name: str) -> int | None:
    m = re.search(r"ref_globalstep(\d+)\.safetensors$", name)
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
