"""Durable, atomic file operations and safe loading: the only way relaunch writes or reads its state.

A file is written to a temporary name, fsynced, renamed over its final name, and the directory fsynced,
so a crash leaves the old file or the new one, never a torn mix. A directory is published the same way.
Pickles load through an unpickler that refuses every global: plain data only, nothing that runs code.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import uuid
from pathlib import Path

from supervisor.checkpoint.layout import TMP_PREFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(final: Path) -> Path:
    return final.with_name(f"{TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}")


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a fully written directory visible under its final name in one rename."""
    fsync_tree(tmp)
    os.rename(tmp, final)  # fails if `final` exists: a published directory is never replaced
    fsync_dir(final.parent)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class UnsafePickleError(pickle.UnpicklingError):
    pass


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise UnsafePickleError(f"refusing to load {module}.{name}: only plain data is allowed")


def load_plain_pickle(data: bytes):
    """Unpickle dicts, lists, tuples, strings and numbers only; anything naming a global is refused."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()
