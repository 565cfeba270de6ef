"""Recover checkpoints: publish, validate, select the last valid one, prune. The only writer of recover_info/.

One directory per step, `recover_checkpoint/globalstep{G}/`, self-contained: DCP shards of model,
optimizer and scheduler, every rank's RNG file, the six recover_info files of that same step in `meta/`,
and `manifest.json` (written last) with the size and sha256 of every file. A step directory is built under
a temporary name and renamed when complete. The commit point is the atomic replace of
`recover_info/checkpoint_info.json`, which lists the published steps; recover_info/ mirrors the newest.

On an object store (checkpoint/storage.py), which has no rename, the ranks write straight into the step
directory and it counts as published only once its manifest, written last, is there; the partial directory of an
interrupted upload is a temporary, cleaned up like the others and never loaded.

Loading reads everything from the selected step directory, never from the mirror, so a crash between the
two cannot mix steps. No recover_info/ at all means a fresh start (`relaunch clean-restart`), unless published
step directories show that it went missing: then nothing is deleted and the run stops naming it. Only prune
deletes a published step directory, after a newer one is committed: whatever the pointer says, a directory in
the way is moved aside (invariant 2).
"""
from __future__ import annotations

import errno
import hashlib
import json
import pickle
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.checkpoint.durable import load_plain_pickle, tmp_name
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
    StoragePath,
    TrialLayout,
    aside_dir,
    inside,
    step_of,
    step_of_reference,
    step_set_aside,
)
from supervisor.checkpoint.exports import export_temporaries, restore_cut_short
from supervisor.checkpoint.storage import LocalStorage, Storage, StoreUnavailable, storage_for
from supervisor.config import Backend
from supervisor.testing.fault_points import fault_point

SCHEMA_VERSION = 1


class CheckpointError(RuntimeError):
    """No valid checkpoint can be loaded although one was committed; never a silent fresh start."""


@dataclass
class Checkpoint:
    """A validated, published recover checkpoint and the metadata of its step."""

    global_step: int
    path: StoragePath
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


def read_checkpoint(path: StoragePath, trusted: dict | None = None, storage: Storage | None = None) -> Checkpoint:
    """Check every file of a step directory against its manifest and read its metadata through the safe
    unpicklers (a manifest rewritten to match a pickle payload is still refused); raise naming the bad file.
    With `trusted` (the manifest this process wrote when it committed the step, or checked when it hashed it) and
    a manifest on disk equal to it, files are checked by size only: their hashes were computed by this process."""
    fs = storage or storage_for(path)
    step = step_of(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(fs.read_bytes(manifest_path))
        files = manifest["files"]
        if int(manifest["global_step"]) != step:
            raise ValueError(f"says step {manifest['global_step']}")
    except StoreUnavailable:
        raise  # the store is down: nothing is known about the checkpoint
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from e
    for name, expect in sorted(files.items()):
        f = _entry_path(path, name)
        if (size := _size(fs, f)) is None:
            raise CheckpointError(f"{f}: missing")
        if size != expect["size"]:
            raise CheckpointError(f"{f}: size {size}, expected {expect['size']}")
        if manifest != trusted and fs.digest(f) != expect["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch")
    if fs.is_file(path / DCP_METADATA):
        _check_dcp(fs, path, entries=manifest != trusted)
    infos = {}
    for name in RECOVER_INFO_FILES:
        try:
            infos[name] = _decode_info(name, fs.read_bytes(path / META / name))
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any decoding failure means "damaged", reported with its file
            raise CheckpointError(f"{path / META / name}: cannot load ({e})") from e
    return Checkpoint(step, path, manifest, infos)


def _size(fs: Storage, path: StoragePath) -> int | None:
    """The size of a file, None when there is none (one request on an object store)."""
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None


def _check_dcp(fs: Storage, path: StoragePath, entries: bool) -> None:
    """DCP's metadata loads without running code (and, on local storage with `entries`, so does every non-tensor
    entry). On an object store only `.metadata` is fetched: the shards, checked by digest above, load through the
    same safe reader on the ranks."""
    from supervisor.checkpoint.safe_load import check_dcp  # torch: imported only where a checkpoint is read

    try:
        if isinstance(fs, LocalStorage):
            check_dcp(path, entries=entries)
            return
        with tempfile.TemporaryDirectory(prefix="relaunch-meta-") as tmp:
            fs.download_file(path / DCP_METADATA, Path(tmp) / DCP_METADATA)
            check_dcp(Path(tmp), entries=False)
    except StoreUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - refused or unreadable metadata or entry: the checkpoint is damaged
        raise CheckpointError(f"{path / DCP_METADATA}: cannot load ({e})") from e


def _entry_path(step_dir: StoragePath, name: str) -> StoragePath:
    """The file a manifest entry names: inside the step directory, or (REFERENCE_PREFIX) inside the reference
    directory beside it; anything else (absolute, `..`, a symlink out) is a damaged checkpoint."""
    try:
        if name.startswith(REFERENCE_PREFIX):
            return inside(step_dir.parent / REFERENCE_PREFIX.split("/")[1], name[len(REFERENCE_PREFIX):])
        return inside(step_dir, name)
    except ValueError as e:
        raise CheckpointError(f"{step_dir / MANIFEST}: {e}") from e


class RecoverStore:
    def __init__(self, layout: TrialLayout, keep_last: int, storage: Storage | None = None):
        self.layout = layout
        self.keep_last = keep_last
        self.fs = storage or storage_for(layout.checkpoint_root)
        self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prune")
        self._trusted: dict[int, dict] = {}  # step -> manifest, for the steps this process committed or hashed

    # ---- writing -------------------------------------------------------------------------------
    def staging_dir(self, global_step: int) -> StoragePath:
        """A fresh temporary directory where the TrainWorkers write this step's shards. On an object store, the
        step directory itself (there is no rename to publish it): the leftover of an upload of this step that
        failed is removed first, and a published one is never written into."""
        final = self.layout.step_dir(global_step)
        if not self.fs.renames:
            if self.fs.exists(final / MANIFEST):
                raise FileExistsError(errno.EEXIST, "a published step directory is never written into", str(final))
            self.fs.remove(final)
            return final
        self.fs.mkdir(self.layout.recover_checkpoint)
        path = tmp_name(final)
        path.mkdir()
        return path

    def commit(self, staging: StoragePath, global_step: int, world_size: int, config_hash: str,
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
        self.fs.mkdir(staging / META)
        for name in RECOVER_INFO_FILES:
            data = _encode_info(name, infos[name])
            self.fs.write_bytes(staging / META / name, data)
            files[f"{META}/{name}"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        missing = [n for n, f in files.items() if _size(self.fs, staging / n) != f["size"]]
        if missing:  # e.g. a fileroot that is not shared by every node: a failed save, not a damaged checkpoint
            raise OSError(errno.EIO, f"ranks reported files that are not there (or not whole): {missing[:3]} "
                                     f"(is cluster.fileroot on storage every node sees?)", str(staging))
        fault_point("before_manifest", step=global_step)
        manifest = {"schema_version": SCHEMA_VERSION, "global_step": global_step, "world_size": world_size,
                    "config_hash": config_hash, "engine": engine, "files": files}
        self.fs.write_bytes(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fault_point("before_publish", step=global_step)
        if staging != final:  # an object store's step directory is published by its manifest, written just now
            self.fs.publish_dir(staging, final)
        self._trusted[global_step] = json.loads(json.dumps(manifest))
        fault_point("after_publish", step=global_step)
        self._write_recover_info(infos, global_step)
        fault_point("after_commit", step=global_step)
        self._pruner.submit(self.prune, global_step)
        return final

    def _write_recover_info(self, infos: dict, global_step: int) -> None:
        info_dir = self.layout.recover_info
        if self.fs.renames and not self.fs.exists(info_dir):
            # First commit: the directory appears complete, in one rename.
            tmp = tmp_name(info_dir)
            tmp.mkdir(parents=True)
            for name in RECOVER_INFO_FILES:
                self.fs.write_bytes(tmp / name, _encode_info(name, infos[name]))
            self.fs.publish_dir(tmp, info_dir)
            return
        # Later commits (every commit on an object store): the mirror files first, the commit pointer last.
        for name in RECOVER_INFO_FILES:
            if name != CHECKPOINT_INFO:
                self.fs.write_atomic(info_dir / name, _encode_info(name, infos[name]))
                fault_point(f"after_{name}", step=global_step)
        self.fs.write_atomic(info_dir / CHECKPOINT_INFO, _encode_info(CHECKPOINT_INFO, infos[CHECKPOINT_INFO]))

    def prune(self, newest: int) -> list[int]:
        """Delete published steps beyond `keep_last`, oldest first, and steps set aside as uncommitted that are
        older than `newest`: only ever after a newer one is committed."""
        steps = [s for s in self.published_steps() if s <= newest]
        doomed = steps[: max(0, len(steps) - self.keep_last)]
        for step in doomed:
            fault_point("during_prune", step=step)
            self._remove_step(self.layout.step_dir(step))
        for aside, step in self._uncommitted():
            if step < newest:
                self.fs.remove(aside)
        self._prune_references()
        return doomed

    def _remove_step(self, step_dir: StoragePath) -> None:
        """Delete a published step directory; on an object store its manifest first, so that a delete cut short
        leaves a partial directory (a temporary), never a published step that lacks objects."""
        if not self.fs.renames:
            self.fs.remove(step_dir / MANIFEST)
        self.fs.remove(step_dir)

    def _uncommitted(self) -> list[tuple[StoragePath, int]]:
        """The step directories set aside as uncommitted, with their steps."""
        found = [(p, step_set_aside(p, UNCOMMITTED)) for p in self.fs.iterdir(self.layout.recover_checkpoint)]
        return [(p, step) for p, step in found if step is not None]

    def _prune_references(self) -> None:
        """Delete reference policy files older than the oldest one a published (or uncommitted) step still names."""
        ref_dir = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        needed = []
        kept = [self.layout.step_dir(step) for step in self.published_steps()] + [p for p, _ in self._uncommitted()]
        for step_dir in kept:
            try:
                files = json.loads(self.fs.read_bytes(step_dir / MANIFEST))["files"]
            except (OSError, ValueError, KeyError):
                return  # a step being pruned or damaged: keep everything, try again after the next commit
            needed += [step_of_reference(n) for n in files if n.startswith(REFERENCE_PREFIX)]
        if not needed:
            return
        for p in self.fs.iterdir(ref_dir):
            if step_of_reference(p.name) is not None and step_of_reference(p.name) < min(needed):
                self.fs.remove(p)

    def wait_for_pruning(self) -> None:
        self._pruner.submit(lambda: None).result()

    # ---- reading -------------------------------------------------------------------------------
    def published_steps(self) -> list[int]:
        """Steps whose directory is published: renamed into place, or on an object store, holding its manifest."""
        steps = [(p, s) for p in self.fs.iterdir(self.layout.recover_checkpoint) if (s := step_of(p)) is not None]
        return sorted(s for p, s in steps if (self.fs.is_dir(p) if self.fs.renames else self.fs.is_file(p / MANIFEST)))

    def _partial_steps(self) -> list[StoragePath]:
        """On an object store: step directories without a manifest, left by an upload that never finished."""
        if self.fs.renames:
            return []
        published = set(self.published_steps())
        return [p for p in self.fs.iterdir(self.layout.recover_checkpoint)
                if (s := step_of(p)) is not None and s not in published]

    def orphaned_steps(self) -> list[int]:
        """Published step directories that recover_info/ (absent) must once have committed. The one way a
        step directory exists before the first recover_info/ is a crash between the first publish and the
        first commit: a lone step whose own checkpoint_info lists no other step. Anything else was committed."""
        steps = self.published_steps()
        if len(steps) != 1:
            return steps
        try:
            info = json.loads(self.fs.read_bytes(self.layout.step_dir(steps[0]) / META / CHECKPOINT_INFO))
            first = info["published"] == [steps[0]]
        except (OSError, ValueError, KeyError, TypeError):
            first = False  # unreadable: not provably the first one; keep it and stop
        return [] if first else steps

    def has_recover_state(self) -> bool:
        return self.fs.exists(self.layout.recover_info)

    def committed_step(self) -> int | None:
        """The step recover_info/checkpoint_info.json points at, or None when unreadable."""
        try:
            data = json.loads(self.fs.read_bytes(self.layout.recover_info / CHECKPOINT_INFO))
            return int(data["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def validate(self, step: int) -> Checkpoint:
        """Validate a published step; one this process committed or hashed already is checked by size only
        (a restarted Supervisor loads the same step twice: to report its failure, then for the new TrainGroup)."""
        checkpoint = read_checkpoint(self.layout.step_dir(step), trusted=self._trusted.get(step), storage=self.fs)
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
    def recover_state(self) -> list[StoragePath]:
        """What `relaunch clean-restart` removes, of what is there: recover_info/ and recover_checkpoint/."""
        return [p for p in self.layout.recover_state_paths()
                if self.fs.exists(p) or (isinstance(p, Path) and p.is_symlink())]

    def temporaries(self) -> list[StoragePath]:
        """Temporary directories of interrupted saves and HF exports (and, on an object store, step directories
        an upload left without a manifest and exports without their marker): never published, so never loaded."""
        found = self._partial_steps() + export_temporaries(self.fs, self.layout.export_root)
        reference = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        for root in (self.layout.recover_checkpoint, self.layout.checkpoint_root, reference, self.layout.recover_info):
            found += [p for p in self.fs.iterdir(root) if p.name.startswith(TMP_PREFIX)]
        return found

    def remove_temporaries(self, spare: tuple[StoragePath, ...] = ()) -> list[StoragePath]:
        """Delete the temporaries but for `spare` (directories of background saves and exports still being
        written). Touches no step directory, whatever the pointer says: what a failed save leaves behind. An
        export whose replacement was cut short is restored first (exports.restore_cut_short)."""
        restore_cut_short(self.fs, self.layout.export_root)
        removed = [p for p in self.temporaries() if p not in spare]
        for p in removed:
            self.fs.remove(p)
        return removed

    def remove_leftovers(self, keep_step: int | None) -> tuple[list[StoragePath], list[StoragePath]]:
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
            self.fs.rename(p, aside_dir(p, DAMAGED if tried else UNCOMMITTED, tag))
        return removed, set_aside

    def restore_mirror(self, checkpoint: Checkpoint) -> None:
        """Rewrite recover_info/ from a loaded step directory (after a crash or a fallback)."""
        for name in RECOVER_INFO_FILES:
            current = self.layout.recover_info / name
            data = _encode_info(name, checkpoint.infos[name])
            if not self.fs.is_file(current) or self.fs.read_bytes(current) != data:
                self.fs.write_atomic(current, data)
