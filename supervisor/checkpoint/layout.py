"""Every path and file name of the on-disk layout, in one place (docs/on-disk.md).

Pure: nothing here creates or touches a file (`inside` only follows symlinks). Names come from the validated
config, and every derived path is checked to stay inside the trial's root, so no name can walk out of it. The
checkpoints live under `cluster.fileroot`, a local path or an object store's URL (checkpoint/storage.py); the logs
and the run lock need appends and an exclusive create, so with a URL they live under `cluster.local_root`. The
engines' own shard files (DCP's `__{rank}_*.distcp`, DeepSpeed's `global_step{G}/`) are named by their
libraries; the names relaunch needs to find them are here too.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Union

from supervisor.config import Config, RoleName

# recover_info/ (and each step directory's meta/ mirror of it)
STEP_INFO = "step_info.json"
SAVER_INFO = "saver_info.json"
EVALUATOR_INFO = "evaluator_info.json"
STATS_LOGGER_INFO = "stats_logger_info.json"
CHECKPOINT_INFO = "checkpoint_info.json"
DATALOADER_INFO = "dataloader_info.pkl"
RECOVER_INFO_FILES = (STEP_INFO, SAVER_INFO, EVALUATOR_INFO, STATS_LOGGER_INFO, CHECKPOINT_INFO, DATALOADER_INFO)
KL_CTL_INFO = "kl_ctl_info.json"  # PPO's KL coefficient in the rewards (critic.kl_in_reward), where a job has one
OPTIONAL_INFO_FILES = (KL_CTL_INFO,)  # written by the jobs that have the state, read where the manifest names them

# a recover step directory, recover_checkpoint/globalstep{G}/
STEP_DIR = re.compile(r"^globalstep(\d+)$")
MANIFEST = "manifest.json"      # every file of the step with its size and sha256, the engine, the world size
RUN_CONFIG = "run_config.json"  # the full config of the run, so `relaunch export` can rebuild the model
META = "meta"                   # the recover_info of the step, mirrored beside its shards
DCP_METADATA = ".metadata"      # DCP's index, written by rank 0 last: a DCP step without it is incomplete
DEEPSPEED_RANK_FILE = "zero_pp_rank_{}_"  # DeepSpeed's per-rank shard files carry this in their names
REFERENCE_DIR = "reference"     # recover_checkpoint/reference/: the KL reference's weights, shared by steps
REFERENCE_PREFIX = f"../{REFERENCE_DIR}/"  # a step manifest's entry for the reference file it needs

# each trained role's directory under the trial's root, holding its recover_checkpoint/ (one more role: one more entry)
ACTOR = RoleName.ACTOR
ROLE_DIRS = {RoleName.ACTOR: "default", RoleName.CRITIC: "critic"}
RECOVER_CHECKPOINT = "recover_checkpoint"
ROLE_PREFIX = "@"  # the actor's manifest names another role's file `@{role}/{file}`: one manifest per step

# a step directory moved out of the way of training on, never deleted on the pointer's word (invariant 2)
DAMAGED = "damaged"          # passed over by loading: kept for inspection
UNCOMMITTED = "uncommitted"  # newer than the pointer: kept until a newer step is committed

EXPORT_DIR = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
# an HF export's file that HF loaders read first (a directory without it is no model to them): on an object
# store it is copied into place last and deleted first, so that an export is whole to a reader or not there
EXPORT_MARKER = "config.json"
TMP_PREFIX = ".tmp."
REPLACED = "replaced"  # the suffix of a directory an exchange on an object store set aside


class ObjectPath(PurePosixPath):
    """A key on an object store (`bucket/prefix/...`), shown as a URL (`s3://bucket/prefix/...`). Its class
    carries the protocol (`object_path(url)` makes one class per protocol): derived paths keep it."""

    protocol = "s3"

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    @property
    def key(self) -> str:
        """The path as the filesystem names it, without the protocol."""
        return PurePosixPath.__str__(self)

    def relative_to(self, *other) -> PurePosixPath:
        """A relative path is a plain one: it names no store."""
        return PurePosixPath(PurePosixPath(self.key).relative_to(*(PurePosixPath(o.key) for o in other)))


StoragePath = Union[Path, ObjectPath]


def is_url(text: str) -> bool:
    return "://" in str(text)


@functools.cache
def _path_class(protocol: str) -> type:
    return type(f"{protocol.capitalize()}Path", (ObjectPath,), {"protocol": protocol})


def object_path(url: str) -> ObjectPath:
    """`s3://bucket/prefix` -> an ObjectPath of protocol s3."""
    protocol, key = url.split("://", 1)
    if not protocol or not key.strip("/"):
        raise ValueError(f"{url!r} is not a URL with a bucket (such as s3://bucket/prefix)")
    return _path_class(protocol)(key.strip("/"))


def as_path(text: str | os.PathLike) -> StoragePath:
    """A path as given by a user or sent to a worker: a URL on an object store, or a local path."""
    return object_path(str(text)) if is_url(str(text)) else Path(text)


@dataclass(frozen=True)
class TrialLayout:
    fileroot: StoragePath
    user: str
    experiment_name: str
    trial_name: str
    local_root: Path | None = None  # logs/ and run.lock when fileroot is on an object store

    @classmethod
    def from_config(cls, config: Config) -> "TrialLayout":
        return cls(as_path(config.cluster.fileroot), config.cluster.user, config.experiment_name, config.trial_name,
                   config.cluster.local_root)

    @property
    def head_root(self) -> Path:
        """Where the logs and the run lock live: the fileroot, unless it is an object store's URL."""
        return self.local_root if isinstance(self.fileroot, ObjectPath) else self.fileroot

    def _inside(self, root: StoragePath, *parts: str) -> StoragePath:
        path = root.joinpath(*parts)
        if ".." in path.relative_to(root).parts:
            raise ValueError(f"path {path} leaves {root}")
        return path

    @property
    def checkpoint_root(self) -> StoragePath:
        return self._inside(self.fileroot, "checkpoints", self.user, self.experiment_name, self.trial_name)

    @property
    def log_root(self) -> Path:
        return self._inside(self.head_root, "logs", self.user, self.experiment_name, self.trial_name)

    @property
    def log_mirror(self) -> ObjectPath | None:
        """With a URL fileroot, where the logs are copied (control/log_mirror.py): where they would be locally."""
        if not isinstance(self.fileroot, ObjectPath):
            return None
        return self._inside(self.fileroot, "logs", self.user, self.experiment_name, self.trial_name)

    @property
    def export_root(self) -> Path:
        return self.export_root_of(ACTOR)

    def export_root_of(self, role: str) -> StoragePath:
        """Where `role`'s HF exports live: the actor's in default/, a critic's in critic/ (as AReaL's)."""
        return self.checkpoint_root / ROLE_DIRS[role]

    @property
    def export_roots(self) -> list[StoragePath]:
        """Every role's export directory, where a cleanup looks for exports never published."""
        return [self.export_root_of(role) for role in ROLE_DIRS]

    @property
    def recover_checkpoint(self) -> Path:
        return self.recover_checkpoint_of(ACTOR)

    def recover_checkpoint_of(self, role: str) -> StoragePath:
        """Where `role`'s parts of the recover steps live; the actor's is `recover_checkpoint`."""
        return self.checkpoint_root / ROLE_DIRS[role] / RECOVER_CHECKPOINT

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
    def lock(self) -> StoragePath:
        """The trial's run lock (checkpoint/trial_lock.py): one run of a trial at a time, whatever its cluster.
        In the bucket on an `s3://` fileroot; with another URL, under `cluster.local_root` (so it keeps apart only
        the drivers that share that directory)."""
        elsewhere = isinstance(self.fileroot, ObjectPath) and self.fileroot.protocol != "s3"
        root = self.head_root if elsewhere else self.fileroot
        return self._inside(root, "checkpoints", self.user, self.experiment_name, self.trial_name, "run.lock")

    def step_dir(self, global_step: int, role: str = ACTOR) -> Path:
        return self.recover_checkpoint_of(role) / f"globalstep{global_step}"

    def export_dir(self, epoch: int, epoch_step: int, global_step: int, role: str = ACTOR) -> StoragePath:
        return self.export_root_of(role) / f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"

    def recover_state_paths(self) -> list[Path]:
        """What clean-restart removes: recover_info/ and each role's recover_checkpoint/ of this trial, nothing more."""
        return [self.recover_info, *(self.recover_checkpoint_of(role) for role in ROLE_DIRS)]


def role_step_dir(step_dir: StoragePath, role: str) -> StoragePath:
    """`role`'s part of the step whose actor directory is `step_dir`: the same name under the role's root, so that
    the parts of a step set aside stay together. ValueError for a name that is no role (a manifest names it)."""
    if role not in ROLE_DIRS:
        raise ValueError(f"{role!r} is not a role ({', '.join(ROLE_DIRS)})")
    return step_dir.parent.parent.parent / ROLE_DIRS[role] / RECOVER_CHECKPOINT / step_dir.name


def step_of(path: Path) -> int | None:
    """The global step a recover step directory holds, from its name (None: not a step directory)."""
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def replaced_aside(final: StoragePath) -> StoragePath:
    """Where an object store's exchange (checkpoint/storage.py) copies the directory it replaces: a temporary
    whose name says which directory to put it back into if the exchange is cut short."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{REPLACED}")


def replaced_final(path: StoragePath) -> StoragePath | None:
    """The directory `path` was set aside from by replaced_aside (None: not such an aside)."""
    m = re.match(rf"^{re.escape(TMP_PREFIX)}(.+)\.{REPLACED}$", path.name)
    return path.with_name(m.group(1)) if m else None


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
    if isinstance(root, Path) and not path.resolve().is_relative_to(root.resolve()):  # an object store has none
        raise ValueError(f"path {relative!r} leads out of the checkpoint directory through a symlink")
    return path
