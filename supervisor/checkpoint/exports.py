"""HF exports: publishing one, replacing a replayed step's, and their retention.

A step trained again after a rollback writes its export again. Resume is bitwise on CPU with the same world size,
but not after an elastic resume or on GPU, so the export already published for that step may hold the abandoned
timeline's weights: it is kept only when its digest equals the new one's, and otherwise replaced in one atomic
exchange of the two directories (checkpoint/storage.py: Linux renameat2 RENAME_EXCHANGE), so that a reader finds
the old export or the new one, never none and never a mix. An object store has no rename: there an export is
copied into place object by object with its `config.json` (EXPORT_MARKER) last, and deleted with it first, so an
HF loader finds a whole export or none (on a replacement, for a moment, none); a directory without it is partial:
never counted by retention, deleted at the next start or failed save (RecoverStore.temporaries). A replacement
there first copies the old export aside (layout.replaced_aside); cut short before the new one is whole in
place, it is undone before that cleanup: the old export is put back (restore_cut_short).
"""
from __future__ import annotations

import enum
import hashlib

from supervisor.checkpoint.layout import (EXPORT_DIR, EXPORT_MARKER, TMP_PREFIX, StoragePath, replaced_aside,
                                          replaced_final)
from supervisor.checkpoint.storage import Storage


class ExportOutcome(enum.Enum):
    PUBLISHED = "published"  # the step's first export
    KEPT = "kept"            # a replayed step's, equal to the one published: the new copy is dropped
    REPLACED = "replaced"    # a replayed step's, with other weights: exchanged for the published one


def tree_digest(fs: Storage, directory: StoragePath) -> str:
    """sha256 over every file of a directory, names and contents."""
    h = hashlib.sha256()
    for f in sorted(fs.files(directory), key=lambda p: str(p.relative_to(directory))):
        h.update(f"{f.relative_to(directory)}\0{fs.digest(f)}\0".encode())
    return h.hexdigest()


def publish_export(fs: Storage, tmp: StoragePath, final: StoragePath) -> ExportOutcome:
    """Make the fully written export `tmp` the one at `final`."""
    settle(fs, final)
    if not fs.exists(final):
        fs.publish_dir(tmp, final, last=EXPORT_MARKER)
        return ExportOutcome.PUBLISHED
    if tree_digest(fs, tmp) == tree_digest(fs, final):
        fs.remove(tmp)
        return ExportOutcome.KEPT
    fs.exchange(tmp, final, last=EXPORT_MARKER)
    fs.remove(tmp)  # the old export, now under the temporary name
    return ExportOutcome.REPLACED


def prune_exports(fs: Storage, root: StoragePath, keep: int) -> None:
    """Delete all but the newest `keep` published exports under `root`."""
    exports = sorted(whole_exports(fs, root), key=lambda p: int(EXPORT_DIR.match(p.name).group(3)))
    for old in exports[:-keep]:
        settle(fs, old)  # its aside, if a replacement left one, first: it must not come back
        fs.remove(old, first=EXPORT_MARKER)


def whole_exports(fs: Storage, root: StoragePath) -> list[StoragePath]:
    """The published exports under `root` (on an object store, those with their EXPORT_MARKER)."""
    return [p for p in fs.iterdir(root) if EXPORT_DIR.match(p.name) and fs.is_dir(p)
            and (fs.renames or fs.is_file(p / EXPORT_MARKER))]


def restore_cut_short(fs: Storage, root: StoragePath) -> list[StoragePath]:
    """On an object store: settle every export a replacement set aside (`settle`); the exports put back."""
    finals = [replaced_final(p) for p in fs.iterdir(root)]
    return [final for final in finals if final is not None and settle(fs, final)]


def settle(fs: Storage, final: StoragePath) -> bool:
    """On an object store: the old export a replacement of `final` set aside goes back into place when `final`
    is partial or gone (the replacement was cut short), and is deleted otherwise; whether it went back. Done
    before `final` is replaced again or pruned, so that an aside is never overwritten nor outlives its export."""
    aside = replaced_aside(final)
    if fs.renames or not fs.is_file(aside / EXPORT_MARKER):
        return False  # none (a partial aside is a temporary like the others)
    if fs.is_file(final / EXPORT_MARKER):
        fs.remove(aside, first=EXPORT_MARKER)
        return False
    fs.remove(final)
    fs.rename(aside, final, last=EXPORT_MARKER)
    return True


def export_temporaries(fs: Storage, root: StoragePath) -> list[StoragePath]:
    """Exports never published: written under a temporary name, or (on an object store) left without their
    marker by a copy into place or a deletion cut short."""
    entries = fs.iterdir(root)
    return [p for p in entries if p.name.startswith(TMP_PREFIX)] + [
        p for p in entries if not fs.renames and EXPORT_DIR.match(p.name) and not fs.is_file(p / EXPORT_MARKER)]
