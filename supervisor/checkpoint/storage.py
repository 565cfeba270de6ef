"""Where checkpoints live: one interface over a local directory tree and an fsspec filesystem (`s3://...`).

Every file operation of checkpoint/ goes through a `Storage`. `LocalStorage` is a POSIX directory (a local disk,
NFS, Lustre): writes are atomic by temporary name, fsync and rename, and a directory is published by one rename.
`FsspecStorage` is an object store, which has no rename: one PUT makes one object appear whole, and a directory
counts as published only once its manifest, written last, is there (checkpoint/store.py). Its calls are retried
with backoff on transient errors (a server that answers 5xx, drops connections or times out) until a budget runs
out (the client's own retries are off, so the budget holds); then they raise `OSError(EIO)`, the storage error the
classifier turns into a skipped save. `check_bucket` is the pre-flight of a run on a URL.

Paths are `pathlib.Path` locally and `layout.ObjectPath` (the key `bucket/prefix/...`, shown with its protocol) on
an object store, so the layout and the store join and name them alike. Credentials and the endpoint come the standard
way (AWS_* variables or ~/.aws files; AWS_ENDPOINT_URL for an S3-compatible store), never from the config.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Callable, Protocol, TypeVar

from supervisor.checkpoint.durable import file_digest, fsync_dir, fsync_tree, publish_dir, tmp_name, write_atomic
from supervisor.checkpoint.layout import ObjectPath, StoragePath, replaced_aside
from supervisor.config import Config

T = TypeVar("T")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
MIN_TIMEOUT_SECS = 30.0  # one connection's or read's bound on a store (a part of a large upload takes seconds)
# errors retrying cannot cure: the object is not there, the credentials are refused, the call is wrong
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
              ValueError, TypeError)


class StoreUnavailable(OSError):
    """A store call still failing when its retries ran out: a storage error, never a sign of a damaged checkpoint."""


class Storage(Protocol):
    """What checkpoint/ does with files. Paths are those of this storage (see `storage_for`)."""

    renames: bool  # True: directories are published by an atomic rename; False: by a manifest written last

    def exists(self, path: StoragePath) -> bool: ...
    def is_file(self, path: StoragePath) -> bool: ...
    def is_dir(self, path: StoragePath) -> bool: ...
    def iterdir(self, path: StoragePath) -> list[StoragePath]:
        """The entries directly under `path` (files and directories); [] when there is none."""
    def files(self, path: StoragePath) -> list[StoragePath]:
        """Every file under `path`, at any depth."""
    def size(self, path: StoragePath) -> int:
        """The size of a file; FileNotFoundError when there is no file (a directory is none)."""
    def digest(self, path: StoragePath) -> str:
        """sha256 of the file's bytes."""
    def read_bytes(self, path: StoragePath) -> bytes: ...
    def write_bytes(self, path: StoragePath, data: bytes) -> None:
        """Write a file inside a directory not yet published (no atomicity needed)."""
    def write_atomic(self, path: StoragePath, data: bytes) -> None:
        """Replace a file so that a reader sees the old bytes or the new ones, never a mix."""
    def mkdir(self, path: StoragePath) -> None:
        """Make `path` (and its parents) a directory; nothing on an object store, where prefixes need no making."""
    def remove(self, path: StoragePath, first: str | None = None) -> None:
        """Delete a file or a directory tree; nothing when it is not there. `first`, a file under it, is deleted
        before the rest (on an object store; a local tree goes in one rmtree)."""
    def rename(self, src: StoragePath, dst: StoragePath, last: str | None = None) -> None:
        """Move a file or directory tree (on an object store: copy, then delete; `last`, the file that makes the
        tree whole to its readers, is copied after every other and deleted before them)."""
    def publish_dir(self, tmp: StoragePath, final: StoragePath, last: str | None = None) -> None:
        """Make a fully written directory visible under its final name; `final` must not exist."""
    def exchange(self, a: StoragePath, b: StoragePath, last: str | None = None) -> None:
        """Swap two directories: a reader finds one of them at `b`, never a mix (with rename: never none; on an
        object store, a directory that has `last` is whole)."""
    def upload(self, local: Path, names: list[str], remote: StoragePath) -> None:
        """Copy the files `names` (relative paths) from the local directory `local` into `remote`."""
    def download(self, remote: StoragePath, local: Path) -> None:
        """Copy the directory tree `remote` into the local directory `local`."""
    def download_file(self, remote: StoragePath, local: Path) -> None: ...


class LocalStorage:
    """A POSIX directory tree: today's behaviour, byte for byte (checkpoint/durable.py does the writing)."""

    renames = True

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def iterdir(self, path: Path) -> list[Path]:
        return list(path.iterdir()) if path.is_dir() else []

    def files(self, path: Path) -> list[Path]:
        return [p for p in path.rglob("*") if p.is_file()]

    def size(self, path: Path) -> int:
        if path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "a directory, not a file", str(path))
        return path.stat().st_size

    def digest(self, path: Path) -> str:
        return file_digest(path)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def write_bytes(self, path: Path, data: bytes) -> None:
        path.write_bytes(data)

    def write_atomic(self, path: Path, data: bytes) -> None:
        write_atomic(path, data)

    def mkdir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def remove(self, path: Path, first: str | None = None) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def rename(self, src: Path, dst: Path, last: str | None = None) -> None:
        src.rename(dst)

    def publish_dir(self, tmp: Path, final: Path, last: str | None = None) -> None:
        publish_dir(tmp, final)

    def exchange(self, a: Path, b: Path, last: str | None = None) -> None:
        """Linux renameat2 RENAME_EXCHANGE. A file system without it (some network ones) gets the old one moved
        aside and the new one renamed in: a moment without a directory, never a mix."""
        fsync_tree(a)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, os.strerror(err), str(a), None, str(b))
            aside = tmp_name(b)
            os.rename(b, aside)
            os.rename(a, b)
            os.rename(aside, a)
        fsync_dir(b.parent)

    def upload(self, local: Path, names: list[str], remote: Path) -> None:
        if local != remote:
            for name in names:
                (remote / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local / name, remote / name)

    def download(self, remote: Path, local: Path) -> None:
        shutil.copytree(remote, local, dirs_exist_ok=True)

    def download_file(self, remote: Path, local: Path) -> None:
        shutil.copyfile(remote, local)


class FsspecStorage:
    """An fsspec filesystem (S3 through s3fs, GCS through gcsfs, ...). Every call is retried with backoff on
    transient errors for at most `retry_secs`; then it raises OSError(EIO) naming the path and the last error."""

    renames = False

    def __init__(self, protocol: str, retry_secs: float, fs=None):
        self.protocol, self.retry_secs = protocol, retry_secs
        # a store that does not answer is given up on within a connection's and a read's timeout (not botocore's
        # 60 s, each retried by s3fs), and then retried here within the budget
        self.fs = fs if fs is not None else filesystem(protocol, timeout=max(retry_secs, MIN_TIMEOUT_SECS))
        self.retries = 0  # transient errors retried so far, for the tests and the benchmark

    def _call(self, what: str, path: ObjectPath, fn: Callable[[], T], writes: bool = False) -> T:
        """`fn()`, retried; `what` names it in the error. A write (`writes`) that finds nothing to write into
        fails at once as a storage error: the bucket is not there."""
        deadline, delay, attempt = time.monotonic() + self.retry_secs, 0.2, 0
        while True:
            attempt += 1
            try:
                return fn()
            except FileNotFoundError as e:
                if writes:
                    raise OSError(errno.EIO, f"{what} failed: no such bucket ({e})", str(path)) from e
                raise
            except _PERMANENT:
                raise
            except Exception as e:  # noqa: BLE001 - s3fs/aiohttp/botocore errors: transient until the budget is spent
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailable(errno.EIO, f"{what} failed after {attempt} attempts in {self.retry_secs:g} s "
                                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                                  str(path)) from e
                self.retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _info(self, path: ObjectPath) -> dict | None:
        """What the store says about `path`, None when nothing is there. (fsspec's own isfile answers False on
        any error: during an outage a published step would look missing.)"""
        def info() -> dict | None:
            try:
                return self.fs.info(path.key)
            except FileNotFoundError:
                return None
        return self._call("info", path, info)

    def exists(self, path: ObjectPath) -> bool:
        return self._info(path) is not None

    def is_file(self, path: ObjectPath) -> bool:
        return (self._info(path) or {}).get("type") == "file"

    def is_dir(self, path: ObjectPath) -> bool:
        return (self._info(path) or {}).get("type") == "directory"

    def iterdir(self, path: ObjectPath) -> list[ObjectPath]:
        def ls() -> list[str]:
            try:
                return self.fs.ls(path.key, detail=False)
            except FileNotFoundError:
                return []
        cls = type(path)
        return [cls(name) for name in self._call("ls", path, ls) if PurePosixPath(name) != PurePosixPath(path.key)]

    def files(self, path: ObjectPath) -> list[ObjectPath]:
        return [type(path)(name) for name in self._call("find", path, lambda: self.fs.find(path.key))]

    def size(self, path: ObjectPath) -> int:
        info = self._info(path)
        if info is None or info["type"] != "file":
            raise FileNotFoundError(errno.ENOENT, "a directory, not an object", str(path))
        return int(info["size"])

    def digest(self, path: ObjectPath) -> str:
        def sha256() -> str:
            h = hashlib.sha256()
            # ranges of 64 MiB, no read-ahead: few requests per object, each read once
            with self.fs.open(path.key, "rb", block_size=64 << 20, cache_type="none") as f:
                for block in iter(lambda: f.read(64 << 20), b""):
                    h.update(block)
            return h.hexdigest()
        return self._call("read", path, sha256)

    def read_bytes(self, path: ObjectPath) -> bytes:
        return self._call("read", path, lambda: self.fs.cat_file(path.key))

    def write_bytes(self, path: ObjectPath, data: bytes) -> None:
        self._call("write", path, lambda: self.fs.pipe_file(path.key, data), writes=True)

    def write_atomic(self, path: ObjectPath, data: bytes) -> None:
        self.write_bytes(path, data)  # one PUT: the object appears whole, or the old one stays

    def mkdir(self, path: ObjectPath) -> None:
        pass

    def remove(self, path: ObjectPath, first: str | None = None) -> None:
        """Delete `path`; `first`, a file under it, before the rest."""
        def rm(key: str) -> None:
            try:
                self.fs.rm(key, recursive=True)
            except FileNotFoundError:
                pass
            if left := self.fs.find(key):  # s3fs's bulk delete ignores the errors of single keys: look
                raise OSError(errno.EIO, f"{len(left)} objects left after a delete, {left[0]} first", key)
        if first is not None:
            self._call("delete", path / first, lambda: rm((path / first).key))
        self._call("delete", path, lambda: rm(path.key))

    def rename(self, src: ObjectPath, dst: ObjectPath, last: str | None = None) -> None:
        # copied object by object (a retry resumes where the last attempt stopped), `last` after every other
        for f in sorted(self.files(src), key=lambda f: str(f.relative_to(src)) == last):
            target = dst / f.relative_to(src)
            self._call("copy", f, lambda: self.fs.copy(f.key, target.key), writes=True)
        self.remove(src, first=last)

    def publish_dir(self, tmp: ObjectPath, final: ObjectPath, last: str | None = None) -> None:
        if self.exists(final):
            raise FileExistsError(errno.EEXIST, "a published directory is never replaced", str(final))
        self.rename(tmp, final, last)

    def exchange(self, a: ObjectPath, b: ObjectPath, last: str | None = None) -> None:
        aside = replaced_aside(b)  # named so that a cut-short exchange can be undone (exports.restore_cut_short)
        self.rename(b, aside, last)
        self.rename(a, b, last)
        self.rename(aside, a, last)

    def upload(self, local: Path, names: list[str], remote: ObjectPath) -> None:
        for name in names:  # one object at a time, each retried alone
            target = remote / name
            self._call("upload", target, lambda: self.fs.put_file(str(local / name), target.key), writes=True)

    def download(self, remote: ObjectPath, local: Path) -> None:
        files = self.files(remote)
        if not files:  # as copytree of a directory that is not there
            raise FileNotFoundError(errno.ENOENT, "nothing there", str(remote))
        for f in files:
            target = local / f.relative_to(remote)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.download_file(f, target)

    def download_file(self, remote: ObjectPath, local: Path) -> None:
        self._call("download", remote, lambda: self.fs.get_file(remote.key, str(local)))


def filesystem(protocol: str, timeout: float | None = None):
    """fsspec's filesystem for `protocol`. Its client's own retries are off where we know how (S3: botocore's five
    attempts take up to ~15 s on a 503, and s3fs retries a timeout five times more), so that ours, bounded by their
    budget, are the only ones; `timeout` bounds one connection and one read."""
    import fsspec  # imported only when a URL is used

    options = {}
    if protocol in ("s3", "s3a"):
        options["config_kwargs"] = {"retries": {"max_attempts": 1}}
        if timeout is not None:
            options["config_kwargs"].update(connect_timeout=timeout, read_timeout=timeout)
    # no listings cache: other processes (the ranks, a restarted Supervisor) write beside this one; no instance
    # cache: a client reads the AWS variables as they are when it is made
    fs = fsspec.filesystem(protocol, use_listings_cache=False, skip_instance_cache=True, **options)
    if protocol in ("s3", "s3a"):
        from botocore.handlers import add_expect_header

        fs.retries = 1  # s3fs's own loop around each call: one attempt
        # botocore asks a PUT's answer first (Expect: 100-continue) and waits for it outside read_timeout: a
        # store that takes the connection and never answers would hang a write for good
        fs.connect()
        fs.s3.meta.events.unregister("before-call.s3", add_expect_header)
    return fs


def check_bucket(root: ObjectPath, secs: float = 5.0) -> None:
    """Before a run starts: `root`'s bucket is there and the store answers, within about `secs` (else the run
    would find out at its first save, minutes in, and skip every save). Reads only. Raises OSError whose strerror
    says what is wrong (no such bucket, access denied, or the store's last error), never naming a credential."""
    fs = FsspecStorage(root.protocol, secs, filesystem(root.protocol, timeout=secs))
    bucket = type(root)(root.parts[0])
    try:
        found = fs.is_dir(bucket)
    except PermissionError as e:
        raise PermissionError(errno.EACCES, f"access to bucket {bucket.key} denied ({e})", str(root)) from e
    except StoreUnavailable as e:
        raise StoreUnavailable(errno.EIO, f"cannot reach the store: {e.strerror}", str(root)) from e
    if not found:
        raise FileNotFoundError(errno.ENOENT, f"no such bucket {bucket.key}", str(root))


def retry_budget(config: Config) -> float:
    """How long one storage call is retried: within recover.write_timeout_secs, and within half a step timeout,
    so that a store that stays down makes a failed save (skipped), not a hung one."""
    return min(config.recover.write_timeout_secs, config.recover.step_timeout_secs / 2)


def storage_for(path: StoragePath, retry_secs: float = 60.0) -> Storage:
    """The storage a path lives on: an ObjectPath's fsspec filesystem, or the local one."""
    if isinstance(path, ObjectPath):
        return FsspecStorage(path.protocol, retry_secs)
    return LocalStorage()
