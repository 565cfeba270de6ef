"""The recover store on its own: publish protocol, validation, fallback, retention, crash points."""
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from supervisor.checkpoint.durable import UnsafePickleError, file_digest, load_plain_pickle
from supervisor.checkpoint.layout import RECOVER_INFO_FILES, TrialLayout
from supervisor.checkpoint.store import CheckpointError, RecoverStore


def infos(step: int) -> dict:
    return {
        "step_info.json": {"epoch": 0, "epoch_step": step, "global_step": step, "steps_per_epoch": 100},
        "saver_info.json": {"freq": {}}, "evaluator_info.json": {"freq": {}},
        "stats_logger_info.json": {"commit_step": step},
        "dataloader_info.pkl": {"epoch": 0, "epoch_step": step + 1},
    }


def commit(store: RecoverStore, step: int) -> Path:
    staging = store.staging_dir(step)
    files = {}
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng_rank0.pt", "rng_rank1.pt"):
        f = staging / name
        f.write_bytes(pickle.dumps(Metadata({}), protocol=4) if name == ".metadata"
                      else f"{name} of step {step}".encode() * 10)
        files[f.name] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    path = store.commit(staging, step, 2, "hash", files, infos(step))
    store.wait_for_pruning()
    return path


@pytest.fixture
def store(tmp_path):
    return RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)


def test_nothing_committed_means_fresh_start(store):
    assert store.load_latest().checkpoint is None


def test_commit_publishes_step_dir_and_recover_info(store):
    commit(store, 4)
    lay = store.layout
    assert sorted(p.name for p in lay.recover_info.iterdir()) == sorted(RECOVER_INFO_FILES)
    ck = store.load_latest().checkpoint
    assert ck.global_step == 4 and ck.infos["step_info.json"]["global_step"] == 4
    assert ck.infos["dataloader_info.pkl"] == {"epoch": 0, "epoch_step": 5}


def test_retention_keeps_last_two_and_prunes_only_after_publish(store):
    for step in (4, 9, 14):
        commit(store, step)
    assert store.published_steps() == [9, 14]
    assert store.load_latest().checkpoint.global_step == 14


FILES = ["__1_0.distcp", ".metadata", "rng_rank0.pt", "meta/step_info.json", "meta/dataloader_info.pkl",
         "meta/checkpoint_info.json", "manifest.json"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "garbage"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_newest_falls_back_to_previous(store, damage, name):
    commit(store, 4)
    newest = commit(store, 9)
    target = newest / name
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text("{not json")  # a rewrite of the wrong size and content
    store = RecoverStore(store.layout, keep_last=2)  # a later process: it trusts no hash it did not compute
    result = store.load_latest()
    assert result.checkpoint.global_step == 4
    assert str(target) in result.fallbacks[0]
    store.remove_leftovers(4)
    assert store.published_steps() == [4]  # the damaged one is moved aside, not deleted
    assert any(p.name.startswith("damaged.globalstep9") for p in store.layout.recover_checkpoint.iterdir())


def test_damaged_metadata_file_falls_back(store):
    commit(store, 4)
    newest = commit(store, 9)
    (newest / "meta" / "dataloader_info.pkl").write_bytes(b"garbage")
    assert store.load_latest().checkpoint.global_step == 4


class _Payload:
    """Unpickling this runs a shell command; a checkpoint copied from elsewhere could hold it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_payload_in_dcp_metadata_with_matching_manifest_is_refused_and_falls_back(store, tmp_path):
    commit(store, 4)
    newest = commit(store, 9)
    marker = tmp_path / "executed"
    (newest / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": (newest / ".metadata").stat().st_size,
                                      "sha256": file_digest(newest / ".metadata")}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    result = store.load_latest()
    assert result.checkpoint.global_step == 4
    assert ".metadata" in result.fallbacks[0] and "posix.system" in result.fallbacks[0]
    assert not marker.exists()


def test_none_valid_stops_naming_the_file_and_clean_restart(store):
    only = commit(store, 4)
    (only / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError) as e:
        store.load_latest()
    assert "__0_0.distcp" in str(e.value) and "clean-restart" in str(e.value)


def test_damaged_pointer_still_finds_the_newest_valid(store):
    commit(store, 4)
    commit(store, 9)
    (store.layout.recover_info / "checkpoint_info.json").write_text("{")
    assert store.load_latest().checkpoint.global_step == 9


def test_uncommitted_and_temporary_dirs_are_leftovers(store):
    commit(store, 4)
    staging = store.staging_dir(9)  # an interrupted save
    (store.layout.recover_checkpoint / "globalstep9").mkdir()  # published dir but no commit pointer
    assert store.load_latest().checkpoint.global_step == 4
    removed, set_aside = store.remove_leftovers(4)
    assert removed == [staging] and not staging.exists()
    assert set_aside == [store.layout.step_dir(9)]  # out of the way of step 9's replay, not deleted
    assert store.published_steps() == [4]


def test_restricted_unpickler_refuses_code(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(UnsafePickleError):
        load_plain_pickle(pickle.dumps({"state": Evil()}))
    assert not marker.exists()
    assert load_plain_pickle(pickle.dumps({"a": [1, 2.0, "x", (3,)]})) == {"a": [1, 2.0, "x", (3,)]}


def test_evil_dataloader_pickle_in_a_checkpoint_is_damage_not_execution(store, tmp_path):
    commit(store, 4)
    newest = commit(store, 9)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (newest / "meta" / "dataloader_info.pkl").write_bytes(pickle.dumps(Evil()))
    # even with the manifest updated to match, the pickle is refused
    import json
    m = json.loads((newest / "manifest.json").read_text())
    f = newest / "meta" / "dataloader_info.pkl"
    m["files"]["meta/dataloader_info.pkl"] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    (newest / "manifest.json").write_text(json.dumps(m))
    assert store.load_latest().checkpoint.global_step == 4
    assert not marker.exists()


CRASH_POINTS = ["before_manifest", "before_publish", "after_publish"] + \
    [f"after_{n}" for n in RECOVER_INFO_FILES if n != "checkpoint_info.json"] + ["after_commit"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_every_write_leaves_old_or_new_never_a_mix(tmp_path, point):
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]
        from pathlib import Path
        from test_recovery import commit
        from supervisor.checkpoint.layout import TrialLayout
        from supervisor.checkpoint.store import RecoverStore
        store = RecoverStore(TrialLayout(Path({str(tmp_path)!r}), "u", "exp", "t0"), keep_last=2)
        commit(store, 4)
        commit(store, 9)
    """)
    env = dict(os.environ, RELAUNCH_FAULT=f"{point}:kill:step=9", RELAUNCH_FAULT_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    store = RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)
    ck = store.load_latest().checkpoint
    expected = 9 if point == "after_commit" else 4
    assert ck.global_step == expected
    assert {ck.infos[n]["global_step"] for n in ("step_info.json", "checkpoint_info.json")} == {expected}
    assert ck.infos["dataloader_info.pkl"]["epoch_step"] == expected + 1
    store.remove_leftovers(ck.global_step)
    assert store.published_steps()[-1] == expected
    assert not [p for p in store.layout.recover_checkpoint.iterdir() if p.name.startswith(".tmp.")]


def test_sigkill_during_prune_keeps_the_new_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]
        from pathlib import Path
        from test_recovery import commit
        from supervisor.checkpoint.layout import TrialLayout
        from supervisor.checkpoint.store import RecoverStore
        store = RecoverStore(TrialLayout(Path({str(tmp_path)!r}), "u", "exp", "t0"), keep_last=1)
        commit(store, 4)
        commit(store, 9)
    """)
    env = dict(os.environ, RELAUNCH_FAULT="during_prune:kill:step=4", RELAUNCH_FAULT_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    store = RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=1)
    assert store.load_latest().checkpoint.global_step == 9


def test_an_interrupted_hf_export_is_a_leftover(store):
    """The policy's, and a critic's (PPO: its value model's export, in critic/ beside default/)."""
    commit(store, 4)
    torn = [store.layout.export_root_of(role) / ".tmp.epoch0epochstep4globalstep4.abcd1234"
            for role in ("actor", "critic")]
    for directory in torn:
        directory.mkdir(parents=True)
    assert store.remove_leftovers(4) == (torn, []) and not any(d.exists() for d in torn)
    assert store.published_steps() == [4]


def test_stats_are_cut_back_to_the_checkpoint_and_lose_a_torn_line(tmp_path):
    from supervisor.control.events import StatsLog, read_jsonl

    log = StatsLog(tmp_path / "stats.jsonl")
    for step in range(6):
        log.append({"global_step": step})
    with open(log.path, "a") as f:
        f.write('{"global_step": 6, "rew')  # a crash mid-write
    log.truncate_after(3)
    assert [r["global_step"] for r in read_jsonl(log.path)] == [0, 1, 2, 3]
    assert log.path.read_text().endswith("}\n")


def test_a_checkpoint_this_process_committed_is_checked_by_size_not_hashed_again(store, monkeypatch):
    from supervisor.checkpoint.storage import LocalStorage

    commit(store, 4)
    hashed = []
    monkeypatch.setattr(LocalStorage, "digest", lambda self, p: hashed.append(p) or "x")
    assert store.load_latest().checkpoint.global_step == 4 and not hashed
    fresh = RecoverStore(store.layout, keep_last=2)  # another process (a restarted Supervisor) hashes everything
    with pytest.raises(CheckpointError):
        fresh.load_latest()  # every hash is "x" here, so it finds none valid
    assert hashed


def test_a_missing_recover_info_beside_published_steps_stops_and_deletes_nothing(store):
    import shutil

    commit(store, 4)
    commit(store, 9)
    shutil.rmtree(store.layout.recover_info)  # a partial copy, or a wrong path
    with pytest.raises(CheckpointError, match=r"recover_info: missing.*\[4, 9\].*relaunch clean-restart"):
        store.load_latest()
    assert store.published_steps() == [4, 9]


def test_a_crash_between_the_first_publish_and_the_first_commit_is_a_fresh_start(store):
    import shutil

    commit(store, 4)
    shutil.rmtree(store.layout.recover_info)  # as if killed at after_publish of the very first commit
    assert store.load_latest().checkpoint is None
    assert store.remove_leftovers(None) == ([], [store.layout.step_dir(4)])  # set aside until a newer commit


def _rewrite_manifest(step_dir: Path, edit) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest["files"])
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["/etc/hostname", "../../../../outside", "link"])
def test_manifest_paths_out_of_the_step_directory_are_damage(store, tmp_path, name):
    commit(store, 4)
    newest = commit(store, 9)
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 10)
    if name == "link":
        (newest / "link").symlink_to(outside)
    _rewrite_manifest(newest, lambda files: files.__setitem__(name, {"size": 10, "sha256": file_digest(outside)}))
    result = store.load_latest()
    assert result.checkpoint.global_step == 4
    reason = result.fallbacks[0]
    assert "manifest.json" in reason and ("not inside" in reason or "leads out" in reason)


def test_a_pickle_in_a_non_tensor_dcp_entry_falls_back_like_a_bad_metadata(store, tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    commit(store, 4)
    newest = commit(store, 9)
    marker = tmp_path / "executed"
    for f in list(newest.glob("*.distcp")) + [newest / ".metadata"]:
        f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(2)}, "scheduler": {"evil": _Payload(marker)}}, checkpoint_id=str(newest),
                 no_dist=True)

    def refresh(files):
        for name in [n for n in files if n.endswith(".distcp")]:
            del files[name]
        for f in list(newest.glob("*.distcp")) + [newest / ".metadata"]:
            files[f.name] = {"size": f.stat().st_size, "sha256": file_digest(f)}

    _rewrite_manifest(newest, refresh)
    fresh = RecoverStore(store.layout, keep_last=2)  # another process: nothing is trusted
    result = fresh.load_latest()
    assert result.checkpoint.global_step == 4 and "Weights only load failed" in result.fallbacks[0]
    assert not marker.exists()


def test_a_restarted_supervisor_hashes_a_checkpoint_once(store, monkeypatch):
    # on its restart the Supervisor loads the checkpoint (to report the failure at its step), then restarts the
    # TrainGroup, which loads it again: the second load trusts what the first one hashed
    from supervisor.checkpoint.storage import LocalStorage

    commit(store, 4)
    restarted = RecoverStore(store.layout, keep_last=2)
    hashed = []
    monkeypatch.setattr(LocalStorage, "digest", lambda self, p: hashed.append(p) or file_digest(p))
    assert restarted.load_latest().checkpoint.global_step == 4
    files = len(json.loads((store.layout.step_dir(4) / "manifest.json").read_text())["files"])
    assert len(hashed) == files
    assert restarted.load_latest().checkpoint.global_step == 4
    assert len(hashed) == files
