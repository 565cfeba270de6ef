"""The storage interface on both implementations (the same test bodies), and the recover store on a real S3 server
(moto's, over HTTP through s3fs): the commit protocol without rename, fault points inside an upload, retries."""
import errno
import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from supervisor.checkpoint.layout import MANIFEST, RECOVER_INFO_FILES, ObjectPath, TrialLayout, as_path
from supervisor.checkpoint.storage import FsspecStorage, LocalStorage, storage_for
from supervisor.checkpoint.store import RecoverStore
from supervisor.checkpoint.transfer import RankDir
from test_recovery import infos

UNIT = Path(__file__).parent


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A fresh directory on each storage: a local path, or a prefix of the S3 server's bucket."""
    if request.param == "local":
        return tmp_path
    server = request.getfixturevalue("s3_server")
    return as_path(server.url(tmp_path.name))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_written_read_listed_moved_and_removed(root, tmp_path):
    fs = storage_for(root)
    fs.mkdir(root / "d" / "sub")
    fs.mkdir(root / "g")
    fs.write_bytes(root / "d" / "a.bin", b"a" * 1000)
    fs.write_atomic(root / "d" / "sub" / "b.json", b"old")
    fs.write_atomic(root / "d" / "sub" / "b.json", b"new")
    assert fs.read_bytes(root / "d" / "sub" / "b.json") == b"new"
    assert (fs.size(root / "d" / "a.bin"), fs.digest(root / "d" / "a.bin")) == (1000, sha(b"a" * 1000))
    assert fs.is_file(root / "d" / "a.bin") and not fs.is_dir(root / "d" / "a.bin")
    assert fs.is_dir(root / "d" / "sub") and not fs.is_file(root / "d" / "sub")
    assert sorted(p.name for p in fs.iterdir(root / "d")) == ["a.bin", "sub"]
    assert fs.iterdir(root / "nothing") == [] and not fs.exists(root / "nothing")
    assert sorted(str(p.relative_to(root / "d")) for p in fs.files(root / "d")) == ["a.bin", "sub/b.json"]
    fs.rename(root / "d", root / "e")
    assert not fs.exists(root / "d") and fs.read_bytes(root / "e" / "sub" / "b.json") == b"new"
    fs.write_bytes(root / "g" / "c.bin", b"c")
    with pytest.raises(OSError):  # a published directory is never replaced
        fs.publish_dir(root / "g", root / "e")
    assert fs.read_bytes(root / "g" / "c.bin") == b"c" and not fs.exists(root / "e" / "c.bin")
    local = tmp_path / "local"
    fs.download(root / "e", local)
    assert (local / "sub" / "b.json").read_bytes() == b"new"
    fs.upload(local, ["a.bin", "sub/b.json"], root / "f")
    assert fs.digest(root / "f" / "a.bin") == sha(b"a" * 1000)
    fs.remove(root / "e")
    fs.remove(root / "f" / "a.bin")
    assert not fs.exists(root / "e") and [p.name for p in fs.iterdir(root / "f")] == ["sub"]


def test_paths_on_a_store_print_as_urls_and_name_keys_relative():
    p = as_path("s3://bucket/prefix/") / "checkpoints" / "globalstep5"
    assert isinstance(p, ObjectPath) and str(p) == "s3://bucket/prefix/checkpoints/globalstep5"
    assert p.key == "bucket/prefix/checkpoints/globalstep5" and p.name == "globalstep5"
    assert str(p.relative_to(as_path("s3://bucket/prefix"))) == "checkpoints/globalstep5"
    assert str(as_path("gs://b/x").parent) == "gs://b" and as_path("/tmp/x") == Path("/tmp/x")


def shard_bytes(name: str, step: int) -> bytes:
    return pickle.dumps(Metadata({}), protocol=4) if name == ".metadata" else f"{name} of step {step}".encode() * 10


SHARDS = ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng_rank0.pt", "rng_rank1.pt")


def rank_save(store: RecoverStore, step: int) -> tuple:
    """What the ranks do: write their files locally and upload them (checkpoint/transfer.py)."""
    staging = store.staging_dir(step)
    with RankDir(str(staging), retry_secs=5) as target:
        for name in SHARDS:
            (target.local / name).write_bytes(shard_bytes(name, step))
        target.upload(list(SHARDS), step, rank=0)
    return staging, {n: {"size": len(shard_bytes(n, step)), "sha256": sha(shard_bytes(n, step))} for n in SHARDS}


def commit(store: RecoverStore, step: int):
    staging, files = rank_save(store, step)
    path = store.commit(staging, step, 2, "hash", files, infos(step))
    store.wait_for_pruning()
    return path


def trial(root) -> TrialLayout:
    return TrialLayout(root, "u", "exp", "t0")


def test_commit_load_fallback_and_retention(root):
    store = RecoverStore(trial(root), keep_last=2)
    for step in (3, 6, 9):
        commit(store, step)
    assert store.published_steps() == [6, 9] and store.committed_step() == 9
    ck = store.load_latest().checkpoint
    assert ck.global_step == 9 and ck.infos["dataloader_info.pkl"]["epoch_step"] == 10
    store.fs.write_bytes(store.layout.step_dir(9) / "__1_0.distcp", b"torn")  # damaged after the fact
    result = RecoverStore(trial(root), keep_last=2).load_latest()
    assert result.checkpoint.global_step == 6 and "globalstep9/__1_0.distcp: size 4" in result.fallbacks[0]


# inside a rank's upload, before the manifest, before the recover_info mirror, before the pointer (test_recovery.py
# has every point on local storage)
CRASH_POINTS = ["after_object", "before_manifest", "after_publish", f"after_{RECOVER_INFO_FILES[-1]}"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_an_upload_killed_at_any_object_leaves_the_previous_checkpoint_loading(s3_server, tmp_path, point):
    root = as_path(s3_server.url(tmp_path.name))
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(UNIT)!r}, {str(UNIT.parents[1])!r}]
        from test_storage import commit, trial
        from supervisor.checkpoint.layout import as_path
        from supervisor.checkpoint.store import RecoverStore
        store = RecoverStore(trial(as_path({str(root)!r})), keep_last=2)
        commit(store, 4)
        commit(store, 9)
    """)
    env = dict(os.environ, RELAUNCH_FAULT=f"{point}:kill:step=9", RELAUNCH_FAULT_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    store = RecoverStore(trial(root), keep_last=2)
    ck = store.load_latest().checkpoint
    assert ck.global_step == 4
    assert {ck.infos[n]["global_step"] for n in ("step_info.json", "checkpoint_info.json")} == {4}
    removed, set_aside = store.remove_leftovers(ck.global_step)
    step9 = store.layout.step_dir(9)
    assert (removed, set_aside) == (([step9], []) if point in ("after_object", "before_manifest") else ([], [step9]))
    assert store.published_steps() == [4] and not store.fs.exists(step9)
    commit(store, 9)  # the step is saved again over the cleaned-up place
    assert store.load_latest().checkpoint.global_step == 9


def test_a_server_down_for_a_while_is_survived_by_retries(s3_server, tmp_path):
    fs = FsspecStorage("s3", retry_secs=20)
    path = as_path(s3_server.url(tmp_path.name)) / "x.bin"
    fs.write_bytes(path, b"before")
    s3_server.down()
    try:
        threading = __import__("threading")
        threading.Timer(2.0, s3_server.up).start()
        started = time.monotonic()
        fs.write_atomic(path, b"after")
    finally:
        s3_server.up()
    assert fs.read_bytes(path) == b"after" and fs.retries >= 1 and time.monotonic() - started >= 1.5


def test_a_store_that_takes_the_connection_and_never_answers_fails_a_write_within_its_bounds(monkeypatch):
    """botocore waits for a PUT's `100 Continue` outside its read timeout: without that wait turned off, this
    write hung for good."""
    import socket
    import threading

    from supervisor.checkpoint.storage import filesystem

    server, held = socket.socket(), []
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(16)], daemon=True).start()
    for name, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}"),
                        ("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    fs = FsspecStorage("s3", retry_secs=1, fs=filesystem("s3", timeout=2))
    started = time.monotonic()
    with pytest.raises(OSError, match="write failed after"):
        fs.write_bytes(as_path("s3://relaunch/x/run.lock"), b"{}")
    assert time.monotonic() - started < 15
    server.close()


def test_a_delete_that_left_objects_behind_without_an_error_is_retried(s3_server, tmp_path):
    """S3's bulk delete answers 200 with per-key errors, which s3fs drops: a delete is checked, and retried."""
    fs = FsspecStorage("s3", retry_secs=10)
    root = as_path(s3_server.url(tmp_path.name)) / "globalstep4"
    for name in ("a.distcp", "b.distcp", "manifest.json"):
        fs.write_bytes(root / name, b"x")
    real, calls = fs.fs.rm, []

    def drops_a_key(key, recursive=False):
        calls.append(key)
        if len(calls) == 1:  # the first delete "succeeds" but for one key
            real([k for k in fs.fs.find(key) if not k.endswith("b.distcp")])
        else:
            real(key, recursive=recursive)

    fs.fs.rm = drops_a_key
    fs.remove(root)
    assert fs.files(root) == [] and len(calls) == 2 and fs.retries == 1


def test_a_server_that_stays_down_fails_the_write_as_a_storage_error_within_the_budget(s3_server, tmp_path):
    """The budget holds: the client's own retries (botocore's take up to ~15 s on a 503) are off."""
    fs = FsspecStorage("s3", retry_secs=3)
    s3_server.down()
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as e:
            fs.write_bytes(as_path(s3_server.url(tmp_path.name)) / "x.bin", b"x")
    finally:
        s3_server.up()
    assert e.value.errno == errno.EIO and "write failed after" in str(e.value) and "x.bin" in str(e.value)
    assert time.monotonic() - started < 4


def test_a_partial_step_on_the_store_is_a_temporary_never_published(s3_server, tmp_path):
    store = RecoverStore(trial(as_path(s3_server.url(tmp_path.name))), keep_last=2)
    commit(store, 4)
    staging, _ = rank_save(store, 9)  # every shard uploaded, but no manifest: the Supervisor never committed it
    assert staging == store.layout.step_dir(9) and store.published_steps() == [4]
    assert store.temporaries() == [staging] and store.load_latest().checkpoint.global_step == 4
    assert not store.fs.exists(store.layout.step_dir(4) / "nothing") and store.fs.is_file(
        store.layout.step_dir(4) / MANIFEST)


def test_a_url_fileroot_is_checked_before_anything_starts(tmp_path):
    from supervisor.config import ConfigError, load_config

    config = load_config(None, ["cluster.fileroot=s3://bucket/runs/", f"cluster.local_root={tmp_path}"])
    layout = TrialLayout.from_config(config)
    assert str(layout.checkpoint_root).startswith("s3://bucket/runs/checkpoints/")
    assert layout.log_root.is_relative_to(tmp_path) and layout.lock == layout.checkpoint_root / "run.lock"
    with pytest.raises(ConfigError, match="^cluster.fileroot: s3:// names no bucket"):
        load_config(None, ["cluster.fileroot=s3://"])
    with pytest.raises(ConfigError, match="^cluster.fileroot: nosuchfs:// cannot be used here"):
        load_config(None, ["cluster.fileroot=nosuchfs://b/x"])


def test_the_local_storage_is_the_default_for_a_path(tmp_path):
    assert isinstance(storage_for(tmp_path), LocalStorage)


def test_inspect_status_and_clean_restart_take_a_bucket(s3_server, tmp_path):
    from click.testing import CliRunner

    from supervisor.cli import main
    from supervisor.config import load_config
    from supervisor.tools.status import trial_status

    overrides = [f"cluster.fileroot={s3_server.url(tmp_path.name)}", f"cluster.local_root={tmp_path}"]
    config = load_config(None, overrides)
    store = RecoverStore(TrialLayout.from_config(config), keep_last=2)
    commit(store, 4)
    step_dir = store.layout.step_dir(4)
    r = CliRunner().invoke(main, ["inspect", str(step_dir)])
    assert r.exit_code == 0 and "valid        yes" in r.output and "global step  4" in r.output, r.output
    assert trial_status(config)["last_valid"] == {"global_step": 4, "epoch": 0, "epoch_step": 4,
                                                  "path": str(step_dir)}
    r = CliRunner().invoke(main, ["clean-restart", *overrides, "--yes"])
    assert r.exit_code == 0, r.output
    assert store.recover_state() == [] and not store.fs.exists(store.layout.recover_info)


def test_a_write_to_a_bucket_that_does_not_exist_is_a_storage_error(s3_server):
    from supervisor.control.classify import FaultKind, classify

    with pytest.raises(OSError) as e:
        storage_for(as_path("s3://no-such-bucket/runs")).write_bytes(as_path("s3://no-such-bucket/runs/x"), b"x")
    assert e.value.errno == errno.EIO and "no such bucket" in str(e.value)
    assert classify(e.value).kind is FaultKind.STORAGE_ERROR


def test_a_lookup_during_an_outage_waits_it_out_rather_than_answering_nothing_is_there(s3_server, tmp_path):
    """fsspec's own isfile answers False on any error: a published step would look missing, and a resume would
    fall back past it."""
    import threading

    fs = FsspecStorage("s3", retry_secs=20)
    manifest = as_path(s3_server.url(tmp_path.name)) / MANIFEST
    fs.write_bytes(manifest, b"{}")
    s3_server.down()
    threading.Timer(2.0, s3_server.up).start()
    try:
        assert fs.is_file(manifest) and fs.exists(manifest) and not fs.is_dir(manifest)
    finally:
        s3_server.up()


def test_a_store_that_stays_down_at_load_is_a_storage_error_not_a_damaged_checkpoint(s3_server, tmp_path):
    from supervisor.checkpoint.storage import StoreUnavailable

    layout = trial(as_path(s3_server.url(tmp_path.name)))
    commit(RecoverStore(layout, keep_last=2), 4)
    store = RecoverStore(layout, keep_last=2, storage=FsspecStorage("s3", retry_secs=1))
    s3_server.down()
    try:
        with pytest.raises(StoreUnavailable):
            store.validate(4)
    finally:
        s3_server.up()
    assert RecoverStore(layout, keep_last=2).load_latest().checkpoint.global_step == 4


def relaunch(*args: str):
    from click.testing import CliRunner

    from supervisor.cli import main

    return CliRunner().invoke(main, list(args))


def free_port() -> int:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_run_on_a_bucket_that_is_not_there_stops_in_one_line_creating_nothing(s3_server, tmp_path, command):
    r = relaunch(command, "cluster.fileroot=s3://no-such-bucket/runs", f"cluster.local_root={tmp_path / 'head'}")
    assert (r.exit_code, r.output) == (2, "relaunch: error: cluster.fileroot: s3://no-such-bucket/runs: no such "
                                          "bucket no-such-bucket\n")
    assert list(tmp_path.iterdir()) == []


def test_a_store_that_cannot_be_reached_stops_a_run_in_seconds_naming_the_url_not_the_secret(s3_server, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    url = s3_server.url(tmp_path.name)
    started = time.monotonic()
    r = relaunch("run", f"cluster.fileroot={url}", f"cluster.local_root={tmp_path / 'head'}")
    assert r.exit_code == 2 and time.monotonic() - started < 10
    assert r.output.startswith(f"relaunch: error: cluster.fileroot: {url}: cannot reach the store: info failed after ")
    assert "Could not connect to the endpoint URL" in r.output and len(r.output.splitlines()) == 1
    assert "s3cr3t" not in r.output and list(tmp_path.iterdir()) == []


def test_a_run_without_credentials_stops_in_one_line(s3_server, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    r = relaunch("run", f"cluster.fileroot={s3_server.url('x')}", f"cluster.local_root={tmp_path / 'head'}")
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1
    assert "cluster.fileroot: s3://relaunch/x: cannot reach the store" in r.output
    assert "Unable to locate credentials" in r.output and list(tmp_path.iterdir()) == []


def test_the_driver_of_a_run_on_a_missing_bucket_exits_2_with_one_line(s3_server, tmp_path):
    """As `relaunch submit`'s entrypoint runs it on the head node: `python -m supervisor run ...`."""
    r = subprocess.run([sys.executable, "-m", "supervisor", "run", "cluster.fileroot=s3://no-such-bucket/runs",
                        f"cluster.local_root={tmp_path / 'head'}"], cwd=UNIT.parents[1], capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "relaunch: error: cluster.fileroot: s3://no-such-bucket/runs: no such bucket no-such-bucket\n"
    assert list(tmp_path.iterdir()) == []


def test_a_store_going_down_at_a_named_request_fails_that_request_and_the_rest(s3_server, tmp_path):
    fs = FsspecStorage("s3", retry_secs=1)
    root = as_path(s3_server.url(tmp_path.name))
    s3_server.down_at("/globalstep9/")
    try:
        fs.write_bytes(root / "globalstep4" / "a", b"a")
        with pytest.raises(OSError):
            fs.write_bytes(root / "globalstep9" / "a", b"a")
        with pytest.raises(OSError):
            fs.read_bytes(root / "globalstep4" / "a")
    finally:
        s3_server.up()
    assert fs.read_bytes(root / "globalstep4" / "a") == b"a" and not fs.exists(root / "globalstep9" / "a")


def test_a_failed_save_cleans_up_what_it_can_and_a_store_still_down_is_no_fault(s3_server, tmp_path, monkeypatch):
    """The outage that failed a save may outlast the cleanup's retries: its leftovers are a temporary, never
    loaded, removed at the next failed save or start (it once raised out of the fault handler: an internal error).
    The cleanup gives up within its second's budget, not a second save's 10 s (it once held the step up 10 s more):
    told by its budget and the attempts it made (at most three in a second; six in 10 s), which, unlike its time,
    no load on the machine adds to (CI's two busy cores once took 9 s over it)."""
    from supervisor.config import load_config
    from supervisor.control import coordinator as coordinator_module
    from supervisor.control.coordinator import CheckpointCoordinator
    from supervisor.control.events import EventLog

    cleanup_stores, real_storage_for = [], coordinator_module.storage_for

    def storage_for(path, retry_secs=60.0):
        cleanup_stores.append(real_storage_for(path, retry_secs))
        return cleanup_stores[-1]

    config = load_config(None, [f"cluster.fileroot={s3_server.url(tmp_path.name)}", f"cluster.local_root={tmp_path}",
                                "recover.step_timeout_secs=20"])
    layout = TrialLayout.from_config(config)
    coordinator = CheckpointCoordinator(config, layout, EventLog(layout.events_log))
    partial, _ = rank_save(coordinator.store, 9)
    s3_server.down()
    try:
        monkeypatch.setattr(coordinator_module, "storage_for", storage_for)
        assert coordinator.discard_failed_save() == []
        # one call, given up on within its second: at most two retries (a 10 s budget allows five)
        assert [store.retry_secs for store in cleanup_stores] == [coordinator_module.CLEANUP_RETRY_SECS]
        assert cleanup_stores[0].retries <= 2
    finally:
        s3_server.up()
    assert coordinator.discard_failed_save() == [partial] and not coordinator.fs.exists(partial)


@pytest.mark.parametrize("command", [["inspect"], ["export", "--out", "hf"], ["verify", "--against", "hf"]])
def test_the_tools_name_the_url_that_holds_no_checkpoint(s3_server, tmp_path, command):
    url = s3_server.url(f"{tmp_path.name}/globalstep4")
    r = relaunch(command[0], url, *command[1:])
    assert (r.exit_code, r.output) == (2, f"relaunch: error: {url}: nothing there\n")


@pytest.mark.parametrize("command", [["status"], ["clean-restart", "--yes"], ["inspect"]])
def test_the_tools_on_a_store_that_cannot_be_reached_say_so_in_one_line(s3_server, tmp_path, monkeypatch, command):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    url = s3_server.url(tmp_path.name)
    args = [url] if command[0] == "inspect" else [f"cluster.fileroot={url}", f"cluster.local_root={tmp_path}"]
    r = relaunch(command[0], *args, *command[1:])
    where = "" if command[0] == "inspect" else "cluster.fileroot: "
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1
    assert r.output.startswith(f"relaunch: error: {where}{url}: cannot reach the store: ")


def test_a_rank_opening_its_copy_deletes_those_of_ranks_killed_mid_upload(s3_server, tmp_path, monkeypatch):
    """A rank SIGKILLed during an upload leaves its private copy on the node's disk; the next copy opened there
    deletes it, and leaves a live process's alone, even one whose pid means nothing here (another container's)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    orphan, live = tmp_path / "relaunch-rank-x1", tmp_path / "relaunch-rank-x2"
    for d in (orphan, live):
        (d / "globalstep19").mkdir(parents=True)
        (d / "globalstep19" / "rng_rank1.pt").write_bytes(b"half")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(live)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with RankDir(s3_server.url(tmp_path.name) + "/globalstep24", retry_secs=5) as target:
            assert target.local.relative_to(tmp_path).parts[0].startswith("relaunch-rank-")  # the store's tree within
            assert not orphan.exists() and live.exists()
            with RankDir(s3_server.url(tmp_path.name) + "/globalstep25", retry_secs=5):  # one process, two copies
                assert target.local.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def test_an_export_on_an_object_store_is_whole_to_a_reader_or_not_there(s3_server, tmp_path):
    """Published, then replaced by another timeline's weights, object by object: after every copy and delete, a
    reader who finds the export's config.json finds every file of one export (never a mix, never half)."""
    from supervisor.checkpoint import exports

    fs = storage_for(as_path(s3_server.url(tmp_path.name)), retry_secs=5)
    root = as_path(s3_server.url(tmp_path.name)) / "checkpoint"
    final = root / "epoch0epochstep3globalstep3"
    files = ("config.json", "model-00001.safetensors", "model-00002.safetensors")

    def write(name: str, weights: bytes):
        for f in files:
            fs.write_bytes(root / name / f, b"{}" if f == "config.json" else weights)
        return root / name

    seen = []

    def reader() -> None:
        try:
            seen.append(tuple(fs.read_bytes(final / f) for f in files[1:]) if fs.is_file(final / "config.json")
                        else None)
        except FileNotFoundError:
            seen.append("half there")

    for name in ("copy", "rm"):
        real = getattr(fs.fs, name)

        def watched(*args, real=real, **kwargs):
            result = real(*args, **kwargs)
            reader()
            return result

        setattr(fs.fs, name, watched)
    assert exports.publish_export(fs, write(".tmp.a", b"old"), final) is exports.ExportOutcome.PUBLISHED
    assert exports.publish_export(fs, write(".tmp.b", b"new"), final) is exports.ExportOutcome.REPLACED
    assert set(seen) <= {None, (b"old", b"old"), (b"new", b"new")} and seen[-1] == (b"new", b"new")
    assert [p.name for p in fs.iterdir(root)] == [final.name]


def test_a_second_replacement_after_one_cut_short_never_publishes_a_mix(s3_server, tmp_path):
    """A replacement cut short with no cleanup after it (the store was down for it), then the step exported again
    and cut short too: the second first settles the first's aside, so the next start finds one whole export."""
    from supervisor.checkpoint import exports

    layout = trial(as_path(s3_server.url(tmp_path.name)))
    store = RecoverStore(layout, keep_last=2)
    root, final = layout.export_root, layout.export_dir(0, 3, 3)
    files = ("config.json", "m1.safetensors", "m2.safetensors")
    for name, weights in ((final, b"old"), (root / ".tmp.new1", b"new1"), (root / ".tmp.new2", b"new2")):
        for f in files:
            store.fs.write_bytes(name / f, b"{}" if f == "config.json" else weights)
    real = store.fs.fs.copy
    for tmp, cut in ((".tmp.new1", 4), (".tmp.new2", 2)):  # into place, after its first object; then sooner
        calls = []

        def copy(*args, cut=cut, calls=calls, **kwargs):
            real(*args, **kwargs)
            calls.append(args)
            if len(calls) == cut:
                raise Cut()

        store.fs.fs.copy = copy
        with pytest.raises(Cut):
            exports.publish_export(store.fs, root / tmp, final)
    store.fs.fs.copy = real
    store.remove_temporaries()  # the next start
    weights = {store.fs.read_bytes(final / f) for f in files[1:]}
    assert store.fs.is_file(final / "config.json") and len(weights) == 1, weights
    assert [p.name for p in store.fs.iterdir(root)] == [final.name]


def test_an_export_copy_cut_short_on_an_object_store_is_partial_never_kept(s3_server, tmp_path):
    """A copy into place that stops after some objects leaves an export without its config.json: retention does
    not count it, and it is a temporary the next start deletes."""
    from supervisor.checkpoint import exports

    layout = trial(as_path(s3_server.url(tmp_path.name)))
    store = RecoverStore(layout, keep_last=2)
    for g in (8, 9):
        for f in ("config.json", "model.safetensors"):
            store.fs.write_bytes(layout.export_dir(0, g, g) / f, b"w%d" % g)
    partial = layout.export_dir(0, 10, 10)
    store.fs.write_bytes(partial / "model.safetensors", b"w10")  # config.json never copied
    exports.prune_exports(store.fs, layout.export_root, keep=2)
    assert [p.name for p in exports.whole_exports(store.fs, layout.export_root)] == [
        layout.export_dir(0, g, g).name for g in (8, 9)]
    assert store.temporaries() == [partial]
    store.remove_temporaries()
    assert not store.fs.exists(partial) and store.fs.exists(layout.export_dir(0, 8, 8))


class Cut(BaseException):
    """The process died here (not an error the store's retries would catch)."""


def test_an_export_replacement_cut_short_at_any_object_leaves_a_whole_export_after_the_next_start(s3_server,
                                                                                                 tmp_path):
    """A replacement on an object store copies the old export aside, the new one into place and the old one to the
    new one's temporary name, object by object. Cut short after any copy or delete, the next start's cleanup leaves
    the step with one whole export (old or new) and no temporary."""
    from supervisor.checkpoint import exports

    files = ("config.json", "model-00001.safetensors", "model-00002.safetensors")
    cuts = 1
    while True:
        layout = trial(as_path(s3_server.url(f"{tmp_path.name}-{cuts}")))
        store = RecoverStore(layout, keep_last=2)
        root, final = layout.export_root, layout.export_dir(0, 3, 3)
        for name, weights in ((final, b"old"), (root / ".tmp.new", b"new")):
            for f in files:
                store.fs.write_bytes(name / f, b"{}" if f == "config.json" else weights)
        calls = 0

        def cut_after(real):
            def call(*args, **kwargs):
                nonlocal calls
                result = real(*args, **kwargs)
                calls += 1
                if calls == cuts:
                    raise Cut()
                return result
            return call

        fs_copy, fs_rm = store.fs.fs.copy, store.fs.fs.rm
        store.fs.fs.copy, store.fs.fs.rm = cut_after(fs_copy), cut_after(fs_rm)
        try:
            exports.publish_export(store.fs, root / ".tmp.new", final)
            finished = True
        except Cut:
            finished = False
        store.fs.fs.copy, store.fs.fs.rm = fs_copy, fs_rm
        store.remove_temporaries()  # the next start
        weights = {store.fs.read_bytes(final / f) for f in files[1:]}
        assert store.fs.is_file(final / "config.json") and weights in ({b"old"}, {b"new"}), (cuts, weights)
        assert [p.name for p in store.fs.iterdir(root)] == [final.name], cuts
        if finished:
            assert weights == {b"new"}
            break
        cuts += 1
    assert calls == cuts - 1 == 16  # the exchange's copies and deletes, each cut once


def test_the_logs_reach_the_bucket_after_a_commit_and_at_the_end_and_status_reads_them_there(s3_server, tmp_path):
    """With a URL fileroot the logs are appended on the head's disk and copied whole to the bucket, where they would
    be under a local fileroot; a store that is down makes one warning, and the next copy catches up."""
    from supervisor.control.events import Event, EventLog, StatsLog, read_jsonl
    from supervisor.control.log_mirror import LogMirror, read_log

    layout = TrialLayout(as_path(s3_server.url(tmp_path.name)), "u", "exp", "t0", local_root=tmp_path / "head")
    assert str(layout.log_mirror) == s3_server.url(tmp_path.name) + "/logs/u/exp/t0"
    layout.log_root.mkdir(parents=True)
    events, stats = EventLog(layout.events_log), StatsLog(layout.stats_log)
    mirror = LogMirror(layout, events, retry_secs=1)
    events.listeners.append(mirror.on_event)
    stats.append({"global_step": 0, "reward": 0.5})
    events.emit(Event.COMMIT, global_step=0)
    mirror._copier.submit(lambda: None).result()  # the background copy is done
    assert mirror.fs.read_bytes(layout.log_mirror / "stats.jsonl") == layout.stats_log.read_bytes()
    s3_server.down()
    try:
        stats.append({"global_step": 1, "reward": 0.7})
        events.emit(Event.COMMIT, global_step=1)
        events.emit(Event.COMMIT, global_step=1)
        mirror._copier.submit(lambda: None).result()
    finally:
        s3_server.up()
    assert [e["event"] for e in read_jsonl(layout.events_log)].count(Event.WARNING) == 1
    events.emit(Event.COMMIT, global_step=1)  # the store is back: this copy catches up
    mirror._copier.submit(lambda: None).result()
    events.emit(Event.DONE)  # copied before emit returns
    head_copy = {p.name: p.read_bytes() for p in layout.log_root.iterdir()}
    for p in layout.log_root.iterdir():
        p.unlink()  # a user with the bucket alone
    assert read_log(layout, "stats.jsonl") == [{"global_step": 0, "reward": 0.5}, {"global_step": 1, "reward": 0.7}]
    assert [e["event"] for e in read_log(layout, "events.jsonl")][-1] == Event.DONE
    assert {n: mirror.fs.read_bytes(layout.log_mirror / n) for n in head_copy} == head_copy


def test_a_run_interrupted_by_ctrl_c_says_so_in_the_buckets_copy_of_its_logs(s3_server, tmp_path):
    """The driver writes `interrupted` itself (the Supervisor is gone by then), and copies the logs once more."""
    from supervisor.control.events import Event, EventLog
    from supervisor.control.log_mirror import read_log
    from supervisor.progress import RunProgress

    layout = TrialLayout(as_path(s3_server.url(tmp_path.name)), "u", "exp", "t0", local_root=tmp_path / "head")
    layout.log_root.mkdir(parents=True)
    EventLog(layout.events_log, job="j1").emit(Event.COMMIT, global_step=4)
    progress = RunProgress(layout, "j1")
    progress.interrupted()
    progress.close()
    elsewhere = TrialLayout(as_path(s3_server.url(tmp_path.name)), "u", "exp", "t0", local_root=tmp_path / "other")
    assert [(e["event"], e["global_step"]) for e in read_log(elsewhere, "events.jsonl")] == [
        ("commit", 4), ("interrupted", 4)]


def test_a_run_from_another_head_is_refused_by_the_lock_in_the_bucket(s3_server, tmp_path):
    """Two heads that share only the bucket: while one holds the trial, `relaunch run` on the other (a local_root
    of its own) exits 2 naming the lock in the bucket, before it starts anything."""
    from supervisor.checkpoint.trial_lock import trial_lock
    from supervisor.config import DEFAULT_CONFIG, load_config

    url = s3_server.url(tmp_path.name)
    held = trial_lock(TrialLayout.from_config(load_config(DEFAULT_CONFIG, [f"cluster.fileroot={url}"])))
    held.acquire()
    try:
        r = subprocess.run([sys.executable, "-m", "supervisor", "run", str(DEFAULT_CONFIG), f"cluster.fileroot={url}",
                            f"cluster.local_root={tmp_path / 'other-head'}"], capture_output=True, text=True)
    finally:
        held.release()
    assert r.returncode == 2 and r.stderr.startswith(f"relaunch: error: trial is already running: {url}/checkpoints/")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "other-head").exists()
