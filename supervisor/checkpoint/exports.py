"""HF exports on disk: publishing one, replacing a replayed step's, and their retention.

A step trained again after a rollback writes its export again. Resume is bitwise on CPU with the same world size,
but not after an elastic resume or on GPU, so the export already published for that step may hold the abandoned
timeline's weights: it is kept only when its digest equals the new one's, and otherwise replaced in one atomic
exchange of the two directories (Linux renameat2 RENAME_EXCHANGE), so that a reader finds the old export or the
new one, never none and never a mix.
"""
from __future__ import annotations

import ctypes
import enum
import errno
import hashlib
import os
import shutil
from pathlib import Path

from supervisor.checkpoint.durable import file_digest, fsync_dir, fsync_tree, publish_dir, tmp_name
from supervisor.checkpoint.layout import EXPORT_DIR

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_libc = ctypes.CDLL(None, use_errno=True)


class ExportOutcome(enum.Enum):
    PUBLISHED = "published"  # the step's first export
    KEPT = "kept"            # a replayed step's, equal to the one published: the new copy is dropped
    REPLACED = "replaced"    # a replayed step's, with other weights: exchanged for the published one


def tree_digest(directory: Path) -> str:
    """sha256 over every file of a directory, names and contents."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(directory)}\0{file_digest(f)}\0".encode())
    return h.hexdigest()


def publish_export(tmp: Path, final: Path) -> ExportOutcome:
    """Make the fully written export `tmp` the one at `final`."""
    if not final.exists():
        publish_dir(tmp, final)
        return ExportOutcome.PUBLISHED
    if tree_digest(tmp) == tree_digest(final):
        shutil.rmtree(tmp)
        return ExportOutcome.KEPT
    fsync_tree(tmp)
    _exchange(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(tmp)  # the old export, now under the temporary name
    return ExportOutcome.REPLACED


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories atomically. A file system without the exchange (some network ones) gets the old
    one moved aside and the new one renamed in: a moment without an export, never a mix."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), str(a), None, str(b))
    aside = tmp_name(b)
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def prune_exports(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` published exports under `root`."""
    exports = sorted((p for p in root.iterdir() if p.is_dir() and EXPORT_DIR.match(p.name)),
                     key=lambda p: int(EXPORT_DIR.match(p.name).group(3)))
    for old in exports[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
