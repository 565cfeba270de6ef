"""Recover checkpoints: publish, validate, select the last valid one, prune. The only writer of recover_info/.

One directory per step, `recover_checkpoint/globalstep{G}/`, self-contained: DCP shards of model,
optimizer and scheduler, every rank's RNG file, the six recover_info files of that same step in `meta/`,
and `manifest.json` (written last) with the size and sha256 of every file. A step directory is built under
a temporary name and renamed when complete. The commit point is the atomic replace of
`recover_info/checkpoint_info.json`, which lists the published steps; recover_info/ mirrors the newest.

Loading reads everything from the selected step directory, never from the mirror, so a crash between the
two cannot mix steps. No recover_info/ at all means a fresh start (`relaunch clean-restart`), unless published
step directories show that it went missing: then nothing is deleted and the run stops naming it. Only prune
deletes a published step directory, after a newer one is committed: whatever the pointer says, a directory in
the way is moved aside (invariant 2).
"""
from __future__ import annotations

import errno
import json
import pickle
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.checkpoint.durable import (
    file_digest,
    load_plain_pickle,
    publish_dir,
    tmp_name,
    write_atomic,
)
from supervisor.checkpoint.layout import (
    CHECKPOINT_INFO,
    DAMAGED,
    DCP_METADATA,
    MANIFEST,
    META,
    RECOVER_INFO_FILES,
    REFERENCE_PREFIX,
    TMP_PREFIX,
    UNCOMMITTED,
    TrialLayout,
    aside_dir,
    inside,
    step_of,
    step_of_reference,
    step_set_aside,
)
from supervisor.config import Backend
from supervisor.testing.fault_points import fault_point

SCHEMA_VERSION = 1


class CheckpointError(RuntimeError):
    """No valid checkpoint can be loaded although one was committed; never a silent fresh start."""


@dataclass
class Checkpoint:
    """A validated, published recover checkpoint and the metadata of its step."""

    global_step: int
    path: Path
    manifest: dict
    infos: dict  # file name in RECOVER_INFO_FILES -> its content

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])


def compatibility_error(manifest: dict, backend: str, n_train_workers: int) -> str | None:
    """Why this run cannot load a checkpoint at all (another engine's format, a DeepSpeed world size it
    cannot reshard), or None. Checkpoints older than the `engine` field were written by fsdp."""
    engine = manifest.get("engine", "fsdp")
    if engine != backend:
        return (f"written by actor.backend {engine}, but this run has actor.backend {backend}; "
                f"set actor.backend={engine} to resume it, or `relaunch clean-restart CONFIG` to start fresh")
    world_size = int(manifest.get("world_size", n_train_workers))
    if engine == Backend.DEEPSPEED and world_size != n_train_workers:
        return (f"a DeepSpeed checkpoint of {world_size} ranks cannot be loaded by cluster.n_train_workers = "
                f"{n_train_workers}; set cluster.n_train_workers={world_size} to resume it")
    return None


@dataclass
class LoadResult:
    checkpoint: Checkpoint | None
    fallbacks: list[str] = field(default_factory=list)   # why newer checkpoints were skipped


def _encode_info(name: str, content) -> bytes:
    if name.endswith(".pkl"):
        return pickle.dumps(content, protocol=4)
    return (json.dumps(content, indent=1, sort_keys=True) + "\n").encode()


def _decode_info(name: str, data: bytes):
    return load_plain_pickle(data) if name.endswith(".pkl") else json.loads(data)


def read_checkpoint(path: Path, trusted: dict | None = None) -> Checkpoint:
    """Check every file of a step directory against its manifest and read its metadata through the safe
    unpicklers (a manifest rewritten to match a pickle payload is still refused); raise naming the bad file.
    With `trusted` (the manifest this process wrote when it committed the step, or checked when it hashed it) and
    a manifest on disk equal to it, files are checked by size only: their hashes were computed by this process."""
    step = step_of(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_bytes())
        files = manifest["files"]
        if int(manifest["global_step"]) != step:
            raise ValueError(f"says step {manifest['global_step']}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from e
    for name, expect in sorted(files.items()):
        f = _entry_path(path, name)
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != expect["size"]:
            raise CheckpointError(f"{f}: size {f.stat().st_size}, expected {expect['size']}")
        if manifest != trusted and file_digest(f) != expect["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch")
    if (path / DCP_METADATA).is_file():
        from supervisor.checkpoint.safe_load import check_dcp  # torch: imported only where a checkpoint is read

        try:
            check_dcp(path, entries=manifest != trusted)
        except Exception as e:  # noqa: BLE001 - refused or unreadable metadata or entry: the checkpoint is damaged
            raise CheckpointError(f"{path / '.metadata'}: cannot load ({e})") from e
    infos = {}
    for name in RECOVER_INFO_FILES:
        try:
            infos[name] = _decode_info(name, (path / META / name).read_bytes())
        except Exception as e:  # noqa: BLE001 - any decoding failure means "damaged", reported with its file
            raise CheckpointError(f"{path / META / name}: cannot load ({e})") from e
    return Checkpoint(step, path, manifest, infos)


def _entry_path(step_dir: Path, name: str) -> Path:
    """The file a manifest entry names: inside the step directory, or (REFERENCE_PREFIX) inside the reference
    directory beside it; anything else (absolute, `..`, a symlink out) is a damaged checkpoint."""
    try:
        if name.startswith(REFERENCE_PREFIX):
            return inside(step_dir.parent / REFERENCE_PREFIX.split("/")[1], name[len(REFERENCE_PREFIX):])
        return inside(step_dir, name)
    except ValueError as e:
        raise CheckpointError(f"{step_dir / MANIFEST}: {e}") from e


class RecoverStore:
    def __init__(self, layout: TrialLayout, keep_last: int):
        self.layout = layout
        self.keep_last = keep_last
        self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prune")
        self._trusted: dict[int, dict] = {}  # step -> manifest, for the steps this process committed or hashed

    # ---- writing -------------------------------------------------------------------------------
    def staging_dir(self, global_step: int) -> Path:
        """A fresh temporary directory where the TrainWorkers write this step's shards."""
        self.layout.recover_checkpoint.mkdir(parents=True, exist_ok=True)
        path = tmp_name(self.layout.step_dir(global_step))
        path.mkdir()
        return path

    def commit(self, staging: Path, global_step: int, world_size: int, config_hash: str,
               shard_files: dict[str, dict], infos: dict, engine: str = "fsdp") -> Path:
        """Publish a fully written staging directory as the last valid checkpoint of `global_step`.

        `shard_files` maps each file the ranks wrote to its {size, sha256}; `infos` holds the contents
        of every recover_info file; checkpoint_info.json's is completed here with the commit record.
        """
        final = self.layout.step_dir(global_step)
        rel_path = str(final.relative_to(self.layout.checkpoint_root))
        previous = self.published_steps()
        infos = dict(infos)
        infos[CHECKPOINT_INFO] = {
            **infos.get(CHECKPOINT_INFO, {}), "schema_version": SCHEMA_VERSION, "global_step": global_step,
            "path": rel_path,
            "world_size": world_size, "config_hash": config_hash,
            "published": sorted(set(previous) | {global_step}),
        }
        files = dict(shard_files)
        (staging / META).mkdir(exist_ok=True)
        for name in RECOVER_INFO_FILES:
            data = _encode_info(name, infos[name])
            (staging / META / name).write_bytes(data)
            files[f"{META}/{name}"] = {"size": len(data), "sha256": file_digest(staging / META / name)}
        missing = [n for n in files if not (staging / n).is_file()]
        if missing:  # e.g. a fileroot that is not shared by every node: a failed save, not a damaged checkpoint
            raise OSError(errno.EIO, f"ranks reported files that are not there: {missing[:3]} "
                                     f"(is cluster.fileroot on storage every node sees?)", str(staging))
        fault_point("before_manifest", step=global_step)
        manifest = {"schema_version": SCHEMA_VERSION, "global_step": global_step, "world_size": world_size,
                    "config_hash": config_hash, "engine": engine, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        fault_point("before_publish", step=global_step)
        publish_dir(staging, final)
        self._trusted[global_step] = json.loads(json.dumps(manifest))
        fault_point("after_publish", step=global_step)
        self._write_recover_info(infos, global_step)
        fault_point("after_commit", step=global_step)
        self._pruner.submit(self.prune, global_step)
        return final

    def _write_recover_info(self, infos: dict, global_step: int) -> None:
        info_dir = self.layout.recover_info
        if not info_dir.exists():
            # First commit: the directory appears complete, in one rename.
            tmp = tmp_name(info_dir)
            tmp.mkdir(parents=True)
            for name in RECOVER_INFO_FILES:
                (tmp / name).write_bytes(_encode_info(name, infos[name]))
            publish_dir(tmp, info_dir)
            return
        # Later commits: the mirror files first, the commit pointer last.
        for name in RECOVER_INFO_FILES:
            if name != CHECKPOINT_INFO:
                write_atomic(info_dir / name, _encode_info(name, infos[name]))
                fault_point(f"after_{name}", step=global_step)
        write_atomic(info_dir / CHECKPOINT_INFO, _encode_info(CHECKPOINT_INFO,
                                                                      infos[CHECKPOINT_INFO]))

    def prune(self, newest: int) -> list[int]:
        """Delete published steps beyond `keep_last`, oldest first, and steps set aside as uncommitted that are
        older than `newest`: only ever after a newer one is committed."""
        steps = [s for s in self.published_steps() if s <= newest]
        doomed = steps[: max(0, len(steps) - self.keep_last)]
        for step in doomed:
            fault_point("during_prune", step=step)
            shutil.rmtree(self.layout.step_dir(step), ignore_errors=True)
        for aside, step in self._uncommitted():
            if step < newest:
                shutil.rmtree(aside, ignore_errors=True)
        self._prune_references()
        return doomed

    def _uncommitted(self) -> list[tuple[Path, int]]:
        """The step directories set aside as uncommitted, with their steps."""
        root = self.layout.recover_checkpoint
        found = [(p, step_set_aside(p, UNCOMMITTED)) for p in root.iterdir()] if root.is_dir() else []
        return [(p, step) for p, step in found if step is not None]

    def _prune_references(self) -> None:
        """Delete reference policy files older than the oldest one a published (or uncommitted) step still names."""
        ref_dir = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        needed = []
        kept = [self.layout.step_dir(step) for step in self.published_steps()] + [p for p, _ in self._uncommitted()]
        for step_dir in kept:
            try:
                files = json.loads((step_dir / MANIFEST).read_bytes())["files"]
            except (OSError, ValueError, KeyError):
                return  # a step being pruned or damaged: keep everything, try again after the next commit
            needed += [step_of_reference(n) for n in files if n.startswith(REFERENCE_PREFIX)]
        if not ref_dir.is_dir() or not needed:
            return
        for p in ref_dir.iterdir():
            if step_of_reference(p.name) is not None and step_of_reference(p.name) < min(needed):
                p.unlink(missing_ok=True)

    def wait_for_pruning(self) -> None:
        self._pruner.submit(lambda: None).result()

    # ---- reading -------------------------------------------------------------------------------
    def published_steps(self) -> list[int]:
        root = self.layout.recover_checkpoint
        if not root.is_dir():
            return []
        return sorted(s for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None)

    def orphaned_steps(self) -> list[int]:
        """Published step directories that recover_info/ (absent) must once have committed. The one way a
        step directory exists before the first recover_info/ is a crash between the first publish and the
        first commit: a lone step whose own checkpoint_info lists no other step. Anything else was committed."""
        steps = self.published_steps()
        if len(steps) != 1:
            return steps
        try:
            info = json.loads((self.layout.step_dir(steps[0]) / META / "checkpoint_info.json").read_bytes())
            first = info["published"] == [steps[0]]
        except (OSError, ValueError, KeyError, TypeError):
            first = False  # unreadable: not provably the first one; keep it and stop
        return [] if first else steps

    def has_recover_state(self) -> bool:
        return self.layout.recover_info.exists()

    def committed_step(self) -> int | None:
        """The step recover_info/checkpoint_info.json points at, or None when unreadable."""
        try:
            data = json.loads((self.layout.recover_info / CHECKPOINT_INFO).read_bytes())
            return int(data["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def validate(self, step: int) -> Checkpoint:
        """Validate a published step; one this process committed or hashed already is checked by size only
        (a restarted Supervisor loads the same step twice: to report its failure, then for the new TrainGroup)."""
        checkpoint = read_checkpoint(self.layout.step_dir(step), trusted=self._trusted.get(step))
        self._trusted[step] = checkpoint.manifest
        return checkpoint

    def load_latest(self) -> LoadResult:
        """The newest valid committed checkpoint, falling back to older ones; None when none was committed."""
        if not self.has_recover_state():
            orphans = self.orphaned_steps()
            if orphans:
                raise CheckpointError(
                    f"{self.layout.recover_info}: missing, but {self.layout.recover_checkpoint} holds published "
                    f"checkpoints of steps {orphans}; restore recover_info/ (a partial copy? a wrong "
                    f"cluster.fileroot?) to resume, or run `relaunch clean-restart CONFIG` to start fresh")
            return LoadResult(None)
        committed = self.committed_step()
        steps = self.published_steps()
        if committed is not None:
            steps = [s for s in steps if s <= committed]  # newer directories were never committed
        fallbacks = []
        if committed is not None and committed not in steps:
            fallbacks.append(f"{self.layout.step_dir(committed)}: committed checkpoint is missing")
        for step in reversed(steps):
            try:
                return LoadResult(self.validate(step), fallbacks)
            except CheckpointError as e:
                fallbacks.append(str(e))
        if not steps and committed is None and not fallbacks:
            fallbacks.append(f"{self.layout.recover_info / 'checkpoint_info.json'}: unreadable")
        raise CheckpointError(
            f"no valid recover checkpoint: {fallbacks[0] if fallbacks else 'none found'}; "
            f"run `relaunch clean-restart CONFIG` to start fresh"
        )

    # ---- housekeeping --------------------------------------------------------------------------
    def temporaries(self) -> list[Path]:
        """Temporary directories of interrupted saves and HF exports: never published, so never a checkpoint."""
        found = []
        reference = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        for root in (self.layout.recover_checkpoint, self.layout.export_root, self.layout.checkpoint_root, reference,
                     self.layout.recover_info):
            if root.is_dir():
                found += [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
        return found

    def remove_temporaries(self, spare: tuple[Path, ...] = ()) -> list[Path]:
        """Delete the temporaries but for `spare` (directories of background saves and exports still being
        written). Touches no step directory, whatever the pointer says: what a failed save leaves behind."""
        removed = [p for p in self.temporaries() if p not in spare]
        for p in removed:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return removed

    def remove_leftovers(self, keep_step: int | None) -> tuple[list[Path], list[Path]]:
        """Clean up before training on from the loaded `keep_step` (None: a fresh start): (temporaries removed,
        step directories set aside). A step directory newer than `keep_step` is in the way of the steps trained
        again, but may have been committed (the pointer can be stale, unreadable or gone), so it is moved aside,
        never deleted: as `damaged.` when loading passed over it, as `uncommitted.` when the pointer did not
        name it (prune deletes those once a newer step is committed)."""
        committed = self.committed_step()
        removed = self.remove_temporaries()
        set_aside = [self.layout.step_dir(s) for s in self.published_steps() if keep_step is None or s > keep_step]
        tag = uuid.uuid4().hex[:8]
        for p in set_aside:
            tried = keep_step is not None and (committed is None or step_of(p) <= committed)
            p.rename(aside_dir(p, DAMAGED if tried else UNCOMMITTED, tag))
        return removed, set_aside

    def restore_mirror(self, checkpoint: Checkpoint) -> None:
        """Rewrite recover_info/ from a loaded step directory (after a crash or a fallback)."""
        for name in RECOVER_INFO_FILES:
            current = self.layout.recover_info / name
            data = _encode_info(name, checkpoint.infos[name])
            if not current.is_file() or current.read_bytes() != data:
                write_atomic(current, data)
