"""Recover checkpoints: publish, validate, select the last valid one, prune. The only writer of recover_info/.

One directory per step, `recover_checkpoint/globalstep{G}/`, self-contained: DCP shards of model,
optimizer and scheduler, every rank's RNG file, the recover_info files of that same step in `meta/`,
and `manifest.json` (written last) with the size and sha256 of every file. A step directory is built under
a temporary name and renamed when complete. The commit point is the atomic replace of
`recover_info/checkpoint_info.json`, which lists the published steps; recover_info/ mirrors the newest.

Another trained role (PPO's critic) writes its part of a step into its own step directory of the same name under
its root (layout.ROLE_DIRS). It is published before the actor's manifest is written, which names its files
(`@critic/...`): the actor's step directory publishes the whole step, one commit for every role. A role's step
directory that no published actor step goes with was never part of a step (a save cut short before the actor's
publish, or a prune after the actor's delete): a temporary.

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
    ACTOR,
    CHECKPOINT_INFO,
    DAMAGED,
    DCP_METADATA,
    MANIFEST,
    META,
    OPTIONAL_INFO_FILES,
    RECOVER_INFO_FILES,
    REFERENCE_PREFIX,
    ROLE_DIRS,
    ROLE_PREFIX,
    TMP_PREFIX,
    UNCOMMITTED,
    StoragePath,
    TrialLayout,
    aside_dir,
    inside,
    role_step_dir,
    step_of,
    step_of_reference,
    step_set_aside,
)
from supervisor.checkpoint.exports import export_temporaries, restore_cut_short
from supervisor.checkpoint.storage import LocalStorage, Storage, StoreUnavailable, storage_for
from supervisor.config import Backend
from supervisor.testing.fault_points import fault_point

SCHEMA_VERSION = 1
ROLES = tuple(role for role in ROLE_DIRS if role != ACTOR)  # the roles whose parts the actor's manifest names


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

    def role_path(self, role: str = ACTOR) -> StoragePath:
        """Where `role`'s part of this step lies (the actor's: the step directory itself)."""
        return self.path if role == ACTOR else role_step_dir(self.path, role)

    def role_world_size(self, role: str = ACTOR) -> int | None:
        """How many ranks saved `role`'s part; None when the step has none (a GRPO step read by a PPO run)."""
        if role == ACTOR:
            return self.world_size
        part = self.manifest.get("roles", {}).get(role)
        return None if part is None else int(part["world_size"])


@dataclass(frozen=True)
class RolePart:
    """Another role's part of a recover save (the critic's), as its ranks wrote it."""

    staging: StoragePath     # RecoverStore.staging_dir(step, role)
    files: dict[str, dict]   # each file its ranks wrote -> its {size, sha256}
    world_size: int
    engine: str = "fsdp"


def compatibility_error(manifest: dict, backend: str, n_train_workers: int, role: str = ACTOR,
                        workers_key: str = "cluster.n_train_workers") -> str | None:
    """Why this run cannot load `role`'s part of a checkpoint at all (none there, another engine's format, a
    DeepSpeed world size it cannot reshard), or None. Checkpoints older than the `engine` field were written by
    fsdp. `workers_key`: the key that sets the role's ranks, for the message."""
    part = manifest if role == ACTOR else manifest.get("roles", {}).get(role)
    if part is None:
        return (f"has no {role}'s part (written by a job without a `{role}` section); remove the section to resume "
                f"it, or `relaunch clean-restart CONFIG` to start fresh")
    engine = part.get("engine", "fsdp")
    if engine != backend:
        return (f"written by {role}.backend {engine}, but this run has {role}.backend {backend}; "
                f"set {role}.backend={engine} to resume it, or `relaunch clean-restart CONFIG` to start fresh")
    world_size = int(part.get("world_size", n_train_workers))
    if engine == Backend.DEEPSPEED and world_size != n_train_workers:
        return (f"a DeepSpeed checkpoint of {world_size} ranks cannot be loaded by {workers_key} = "
                f"{n_train_workers}; set {workers_key}={world_size} to resume it")
    return None


@dataclass
class LoadResult:
    checkpoint: Checkpoint | None
    fallbacks: list[str] = field(default_factory=list)   # why newer checkpoints were skipped


def _encode_info(name: str, content) -> bytes:
    if name.endswith(".pkl"):
        return pickle.dumps(content, protocol=4)
    return (json.dumps(content, indent=1, sort_keys=True) + "\n").encode()


def _info_files(infos: dict) -> tuple[str, ...]:
    """The recover_info files of a step: every required one, and the optional ones its state has."""
    return (*RECOVER_INFO_FILES, *(n for n in OPTIONAL_INFO_FILES if n in infos))


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
        dcp_dirs = [path] + [role_step_dir(path, role) for role in manifest.get("roles", {})]
    except StoreUnavailable:
        raise  # the store is down: nothing is known about the checkpoint
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from e
    for name, expect in sorted(files.items()):
        f = entry_path(path, name)
        if (size := _size(fs, f)) is None:
            raise CheckpointError(f"{f}: missing")
        if size != expect["size"]:
            raise CheckpointError(f"{f}: size {size}, expected {expect['size']}")
        if manifest != trusted and fs.digest(f) != expect["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch")
    for directory in dcp_dirs:
        if fs.is_file(directory / DCP_METADATA):
            _check_dcp(fs, directory, entries=manifest != trusted)
    infos = {}
    for name in (*RECOVER_INFO_FILES, *(n for n in OPTIONAL_INFO_FILES if f"{META}/{n}" in manifest["files"])):
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


def entry_path(step_dir: StoragePath, name: str) -> StoragePath:
    """The file a manifest entry names: inside the step directory, (REFERENCE_PREFIX) inside the reference
    directory beside it, or (ROLE_PREFIX) inside the role's step directory; anything else (absolute, `..`, a
    symlink out, no role) is a damaged checkpoint."""
    try:
        if name.startswith(REFERENCE_PREFIX):
            return inside(step_dir.parent / REFERENCE_PREFIX.split("/")[1], name[len(REFERENCE_PREFIX):])
        if name.startswith(ROLE_PREFIX):
            role, _, rest = name[len(ROLE_PREFIX):].partition("/")
            return inside(role_step_dir(step_dir, role), rest)
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
    def staging_dir(self, global_step: int, role: str = ACTOR) -> StoragePath:
        """A fresh temporary directory where `role`'s TrainWorkers write this step's shards. On an object store,
        the role's step directory itself (there is no rename to publish it): the leftover of an upload of this step
        that failed is removed first, and a published step's is never written into."""
        final = self.layout.step_dir(global_step, role)
        if not self.fs.renames:
            if self.fs.exists(self.layout.step_dir(global_step) / MANIFEST):
                raise FileExistsError(errno.EEXIST, "a published step directory is never written into", str(final))
            self.fs.remove(final)
            return final
        self.fs.mkdir(final.parent)
        path = tmp_name(final)
        path.mkdir()
        return path

    def commit(self, staging: StoragePath, global_step: int, world_size: int, config_hash: str,
               shard_files: dict[str, dict], infos: dict, engine: str = "fsdp",
               roles: dict[str, RolePart] | None = None) -> Path:
        """Publish a fully written staging directory as the last valid checkpoint of `global_step`.

        `shard_files` maps each file the ranks wrote to its {size, sha256}; `infos` holds the contents
        of every recover_info file; checkpoint_info.json's is completed here with the commit record. `roles`: the
        other roles' parts of the step, each checked and published into its step directory before the actor's
        manifest, which names their files and records their world sizes and engines.
        """
        roles = roles or {}
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
        for name in _info_files(infos):
            data = _encode_info(name, infos[name])
            self.fs.write_bytes(staging / META / name, data)
            files[f"{META}/{name}"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self._check_whole(staging, files)
        for part in roles.values():
            self._check_whole(part.staging, part.files)
        for role, part in roles.items():
            if part.staging != (role_final := self.layout.step_dir(global_step, role)):
                self.fs.publish_dir(part.staging, role_final)
            files.update({f"{ROLE_PREFIX}{role}/{name}": entry for name, entry in part.files.items()})
        fault_point("before_manifest", step=global_step)
        manifest = {"schema_version": SCHEMA_VERSION, "global_step": global_step, "world_size": world_size,
                    "config_hash": config_hash, "engine": engine, "files": files}
        if roles:
            manifest["roles"] = {role: {"world_size": p.world_size, "engine": p.engine} for role, p in roles.items()}
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

    def _check_whole(self, directory: StoragePath, files: dict[str, dict]) -> None:
        """Every file the ranks reported is there, whole: else (e.g. a fileroot that is not shared by every node)
        a failed save, not a damaged checkpoint."""
        missing = [n for n, f in files.items() if _size(self.fs, directory / n) != f["size"]]
        if missing:
            raise OSError(errno.EIO, f"ranks reported files that are not there (or not whole): {missing[:3]} "
                                     f"(is cluster.fileroot on storage every node sees?)", str(directory))

    def _write_recover_info(self, infos: dict, global_step: int) -> None:
        info_dir = self.layout.recover_info
        if self.fs.renames and not self.fs.exists(info_dir):
            # First commit: the directory appears complete, in one rename.
            tmp = tmp_name(info_dir)
            tmp.mkdir(parents=True)
            for name in _info_files(infos):
                self.fs.write_bytes(tmp / name, _encode_info(name, infos[name]))
            self.fs.publish_dir(tmp, info_dir)
            return
        # Later commits (every commit on an object store): the mirror files first, the commit pointer last.
        for name in _info_files(infos):
            if name != CHECKPOINT_INFO:
                self.fs.write_atomic(info_dir / name, _encode_info(name, infos[name]))
                fault_point(f"after_{name}", step=global_step)
        self._drop_stale_infos(infos)
        self.fs.write_atomic(info_dir / CHECKPOINT_INFO, _encode_info(CHECKPOINT_INFO, infos[CHECKPOINT_INFO]))

    def _drop_stale_infos(self, infos: dict) -> None:
        """An optional recover_info file that the step lacks is another step's (a job that had the state, or a
        fallback past the steps that have it): removed, so that the mirror is the step's."""
        for name in OPTIONAL_INFO_FILES:
            if name not in infos and self.fs.is_file(self.layout.recover_info / name):
                self.fs.remove(self.layout.recover_info / name)

    def prune(self, newest: int) -> list[int]:
        """Delete published steps beyond `keep_last`, oldest first, and steps set aside as uncommitted that are
        older than `newest`: only ever after a newer one is committed."""
        steps = [s for s in self.published_steps() if s <= newest]
        doomed = steps[: max(0, len(steps) - self.keep_last)]
        for step in doomed:
            fault_point("during_prune", step=step)
            self._remove_step(step)
        for aside, step in self._uncommitted():
            if step < newest:
                self.fs.remove(aside)
        self._prune_references()
        return doomed

    def _remove_step(self, step: int) -> None:
        """Delete a published step: the actor's directory (on an object store its manifest first), then the other
        roles'. A delete cut short leaves a partial actor directory (a temporary on an object store) or role
        directories no published step goes with (temporaries), never a published step that lacks a file: the
        roles first could leave a published actor step naming deleted files."""
        step_dir = self.layout.step_dir(step)
        if not self.fs.renames:
            self.fs.remove(step_dir / MANIFEST)
        self.fs.remove(step_dir)
        for role in ROLES:
            self.fs.remove(self.layout.step_dir(step, role))

    def _recover_roots(self) -> list[StoragePath]:
        return [self.layout.recover_checkpoint_of(role) for role in ROLE_DIRS]

    def _uncommitted(self) -> list[tuple[StoragePath, int]]:
        """The step directories of every role set aside as uncommitted, with their steps."""
        found = [(p, step_set_aside(p, UNCOMMITTED)) for root in self._recover_roots() for p in self.fs.iterdir(root)]
        return [(p, step) for p, step in found if step is not None]

    def _prune_references(self) -> None:
        """Delete reference policy files older than the oldest one a published (or uncommitted) step still names."""
        ref_dir = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        needed = []
        kept = [self.layout.step_dir(step) for step in self.published_steps()] + [
            p for p, _ in self._uncommitted() if p.parent == self.layout.recover_checkpoint]  # the actor's manifests
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
        """Step directories of no published step: on an object store, the actor's without a manifest (an upload
        that never finished); on any storage, another role's whose actor step is not published."""
        published = set(self.published_steps())
        roots = [self.layout.recover_checkpoint_of(role) for role in ROLES]
        if not self.fs.renames:
            roots.insert(0, self.layout.recover_checkpoint)
        return [p for root in roots for p in self.fs.iterdir(root)
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
        an upload left without a manifest and exports without their marker; another role's step directories that
        no published actor step goes with): never published, so never loaded."""
        found = self._partial_steps()
        found += [p for root in self.layout.export_roots for p in export_temporaries(self.fs, root)]
        reference = self.layout.recover_checkpoint / REFERENCE_PREFIX.split("/")[1]
        for root in (*self._recover_roots(), self.layout.checkpoint_root, reference, self.layout.recover_info):
            found += [p for p in self.fs.iterdir(root) if p.name.startswith(TMP_PREFIX)]
        return found

    def remove_temporaries(self, spare: tuple[StoragePath, ...] = ()) -> list[StoragePath]:
        """Delete the temporaries but for `spare` (directories of background saves and exports still being
        written). Touches no published step, whatever the pointer says: what a failed save leaves behind. An
        export whose replacement was cut short is restored first (exports.restore_cut_short)."""
        for root in self.layout.export_roots:
            restore_cut_short(self.fs, root)
        removed = [p for p in self.temporaries() if p not in spare]
        for p in removed:
            self.fs.remove(p)
        return removed

    def remove_leftovers(self, keep_step: int | None) -> tuple[list[StoragePath], list[StoragePath]]:
        """Clean up before training on from the loaded `keep_step` (None: a fresh start): (temporaries removed,
        step directories set aside). A step newer than `keep_step` is in the way of the steps trained again, but
        may have been committed (the pointer can be stale, unreadable or gone), so its directories (the actor's and
        the other roles') are moved aside, never deleted: as `damaged.` when loading passed over it, as
        `uncommitted.` when the pointer did not name it (prune deletes those once a newer step is committed)."""
        committed = self.committed_step()
        removed = self.remove_temporaries()
        tag = uuid.uuid4().hex[:8]
        set_aside = []
        for step in [s for s in self.published_steps() if keep_step is None or s > keep_step]:
            tried = keep_step is not None and (committed is None or step <= committed)
            # the other roles' parts first, with the same tag: cut short, this leaves a published actor step that
            # lacks files (passed over by loading, kept), never a role's part alone (a temporary, deleted)
            parts = [p for role in ROLES if self.fs.exists(p := self.layout.step_dir(step, role))]
            for p in parts + [self.layout.step_dir(step)]:
                self.fs.rename(p, aside_dir(p, DAMAGED if tried else UNCOMMITTED, tag))
                set_aside.append(p)
        return removed, set_aside

    def restore_mirror(self, checkpoint: Checkpoint) -> None:
        """Rewrite recover_info/ from a loaded step directory (after a crash or a fallback)."""
        for name in _info_files(checkpoint.infos):
            current = self.layout.recover_info / name
            data = _encode_info(name, checkpoint.infos[name])
            if not self.fs.is_file(current) or self.fs.read_bytes(current) != data:
                self.fs.write_atomic(current, data)
        self._drop_stale_infos(checkpoint.infos)
