"""A rank's files on the store: where a rank writes a step (or an export), and how they get there.

The engines write with their own libraries (DCP, DeepSpeed, safetensors), which write local files. On a local
fileroot the rank writes straight into the step directory, as ever. On an object store it writes into a private
directory on its own node's disk, hashes what it wrote there, and uploads its files itself, object by object
(retried, checkpoint/storage.py): nothing is staged through the head node, and the local copy is gone once the
upload is over (a rank killed mid-upload leaves its copy behind: the next rank to open one on that node deletes
the copies whose owner is gone, as its flock tells). Loading is the reverse: the rank downloads the step directory (and the reference weights beside
it) into a private directory and loads from there; the tools (`relaunch export`, `verify`, `inspect`) do the same
with a URL they are given (`readable`).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from supervisor.checkpoint.layout import MANIFEST, REFERENCE_DIR, ROLE_DIRS, StoragePath, as_path, role_step_dir
from supervisor.checkpoint.storage import LocalStorage, Storage, storage_for
from supervisor.testing.fault_points import fault_point


PREFIX = "relaunch-rank-"


def remove_orphans() -> None:
    """Delete the private copies, on this node's disk, whose owner is gone (killed mid-upload or load). An owner
    holds a flock on its copy as long as it lives; the kernel lets go of it with the process, whatever its pid
    namespace (a pid would be judged in this one only: a rank in another container would look dead). A copy
    still under its first name is deleted only once it is a minute old: it is being locked, or never was."""
    root = Path(tempfile.gettempdir())
    for leftover in [*root.glob(f"{PREFIX}*"), *root.glob(f".{PREFIX}*")]:
        try:
            if leftover.name.startswith(".") and time.time() - leftover.stat().st_mtime < 60:
                continue
            fd = os.open(leftover, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # gone meanwhile, or not a directory
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(leftover, ignore_errors=True)
        except OSError:  # its owner lives (or this filesystem has no flock: then nothing is ever taken for dead)
            pass
        finally:
            os.close(fd)


def private_dir() -> tuple[Path, int]:
    """A new private directory, and the descriptor that holds its flock: made under another name and renamed
    once locked, so that no `remove_orphans` finds it unlocked."""
    made = Path(tempfile.mkdtemp(prefix=f".{PREFIX}"))
    fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
    with contextlib.suppress(OSError):  # no flock on this filesystem (some NFS mounts): no copy is taken for dead
        fcntl.flock(fd, fcntl.LOCK_EX)
    final = made.with_name(made.name[1:])
    os.rename(made, final)
    return final, fd


class RankDir:
    """One directory of the store (a step directory, an export) as a rank sees it: `local` is where it reads and
    writes. Close it when done (a context manager)."""

    def __init__(self, url: str, retry_secs: float):
        self.remote: StoragePath = as_path(url)
        self.fs: Storage = storage_for(self.remote, retry_secs)
        self._tmp: Path | None = None
        if isinstance(self.fs, LocalStorage):
            self.local = self.remote
        else:  # a private tree that mirrors the store's last three levels: the reference directory sits beside the
            # step's, and another role's part of the step where the step's manifest says (layout.role_step_dir)
            remove_orphans()
            self._tmp, self._held = private_dir()
            self.local = self._tmp.joinpath(*self.remote.parts[-3:])
            self.local.mkdir(parents=True)

    @property
    def staged(self) -> bool:
        """Whether files written into `local` still have to be uploaded."""
        return self._tmp is not None

    def upload(self, names: list[str], global_step: int | None = None, rank: int | None = None,
               role: str | None = None) -> None:
        """Upload the files `names` (relative to `local`) and, on a step, the reference weights written beside
        it. The `after_object` fault point fires once the first object is in the store."""
        if not self.staged:
            return
        for i, name in enumerate(names):
            self.fs.upload(self.local, [name], self.remote)
            if i == 0:
                fault_point("after_object", step=global_step, rank=rank, role=role)
        reference = self.local.parent / REFERENCE_DIR
        if reference.is_dir():
            names = [str(p.relative_to(reference)) for p in reference.rglob("*") if p.is_file()]
            self.fs.upload(reference, names, self.remote.parent / REFERENCE_DIR)

    def upload_all(self) -> None:
        """Upload every file written into `local` (an HF export)."""
        self.upload([str(p.relative_to(self.local)) for p in self.local.rglob("*") if p.is_file()])

    def fetch(self, roles: bool = False) -> Path:
        """The directory, readable locally: on an object store, downloaded with the reference weights beside it,
        and with `roles` (a tool that checks a whole step) the other roles' parts its manifest names."""
        if self.staged:
            self.fs.download(self.remote, self.local)
            reference = self.remote.parent / REFERENCE_DIR
            if self.fs.is_dir(reference):
                self.fs.download(reference, self.local.parent / REFERENCE_DIR)
            manifest = self.local / MANIFEST
            for role in json.loads(manifest.read_text()).get("roles", {}) if roles and manifest.is_file() else ():
                if role in ROLE_DIRS:  # another name is damage, which the manifest's check reports
                    self.fs.download(role_step_dir(self.remote, role), role_step_dir(self.local, role))
        return self.local

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            os.close(self._held)
            self._tmp = None

    def __enter__(self) -> "RankDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def readable(path: str, retry_secs: float = 60.0) -> Iterator[Path]:
    """A checkpoint or export named by a path or a URL (s3://...), as a local directory while the block runs: a
    URL's objects are downloaded into a private temporary directory, removed afterwards."""
    with RankDir(path, retry_secs) as directory:
        yield directory.fetch(roles=True)
