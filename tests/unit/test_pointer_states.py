"""Invariant 2: no state of the commit pointer (checkpoint_info.json) or of storage deletes a published checkpoint.

A step directory holding a manifest was published; whatever the pointer says (missing, unreadable, older than
the directories), neither the cleanup after a failed save nor the cleanup at load may delete it. A directory in
the way of training on is moved aside; one set aside as uncommitted is deleted only once a newer one is committed.
"""
from __future__ import annotations

import json
import shutil

import pytest
from test_recovery import commit

from supervisor.checkpoint.layout import MANIFEST, TrialLayout
from supervisor.checkpoint.store import RecoverStore
from supervisor.config import load_config
from supervisor.control.coordinator import CheckpointCoordinator
from supervisor.control.events import EventLog

POINTER = "checkpoint_info.json"


def break_pointer(store: RecoverStore, state: str) -> None:
    pointer = store.layout.recover_info / POINTER
    if state == "missing":
        pointer.unlink()
    elif state == "unreadable":
        pointer.write_text("{")
    elif state == "stale":  # names step 4 while step 9 is published (a restored backup, a crash before the replace)
        pointer.write_text(json.dumps(json.loads((store.layout.step_dir(4) / "meta" / POINTER).read_text())))
    elif state == "no recover_info":
        shutil.rmtree(store.layout.recover_info)


def manifests(store: RecoverStore) -> dict[int, int]:
    """step -> how many directories under recover_checkpoint/ hold a manifest of that step, wherever they are."""
    found: dict[int, int] = {}
    for m in store.layout.recover_checkpoint.glob(f"*/{MANIFEST}"):
        step = json.loads(m.read_text())["global_step"]
        found[step] = found.get(step, 0) + 1
    return found


@pytest.fixture
def store(tmp_path):
    return RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)


@pytest.fixture
def coordinator(tmp_path):
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "recover.mode=on", "recover.freq_steps=5"])
    layout = TrialLayout.from_config(config)
    return CheckpointCoordinator(config, layout, EventLog(layout.events_log))


@pytest.mark.parametrize("state", ["missing", "unreadable", "stale", "no recover_info"])
def test_the_cleanup_after_a_failed_save_deletes_no_published_checkpoint(coordinator, state):
    store = coordinator.store
    commit(store, 4)
    commit(store, 9)
    break_pointer(store, state)
    failed = store.staging_dir(14)  # the save that failed on storage
    removed = coordinator.discard_failed_save()
    assert removed == [failed] and not failed.exists()
    assert store.published_steps() == [4, 9]  # untouched, under their own names


@pytest.mark.parametrize("state", ["missing", "unreadable", "stale"])
def test_the_cleanup_at_load_deletes_no_published_checkpoint(store, state):
    commit(store, 4)
    commit(store, 9)
    break_pointer(store, state)
    loaded = store.load_latest().checkpoint.global_step
    assert loaded == (4 if state == "stale" else 9)
    store.remove_leftovers(loaded)
    assert manifests(store) == {4: 1, 9: 1}
    assert store.published_steps()[-1] == loaded


def test_a_damaged_newest_behind_an_unreadable_pointer_is_kept_aside(store):
    commit(store, 4)
    newest = commit(store, 9)
    (newest / "rng_rank0.pt").write_bytes(b"x")
    break_pointer(store, "unreadable")  # nothing says whether step 9 was committed: it may have been
    assert store.load_latest().checkpoint.global_step == 4
    store.remove_leftovers(4)
    assert store.published_steps() == [4] and manifests(store) == {4: 1, 9: 1}
    assert [p.name.split(".")[:2] for p in store.layout.recover_checkpoint.glob("damaged.*")] == \
        [["damaged", "globalstep9"]]


def test_a_step_set_aside_behind_a_stale_pointer_goes_only_once_a_newer_one_is_committed(store):
    commit(store, 4)
    commit(store, 9)
    break_pointer(store, "stale")
    store.remove_leftovers(store.load_latest().checkpoint.global_step)
    commit(store, 9)  # the step trained again: its directory is free for the new commit
    assert store.published_steps() == [4, 9] and manifests(store) == {4: 1, 9: 2}
    commit(store, 14)
    assert store.published_steps() == [9, 14] and manifests(store) == {9: 1, 14: 1}


def test_a_lone_first_step_without_recover_info_is_kept_until_a_newer_commit(store):
    commit(store, 4)
    shutil.rmtree(store.layout.recover_info)  # killed between the very first publish and its commit
    assert store.load_latest().checkpoint is None  # a fresh start
    store.remove_leftovers(None)
    assert store.published_steps() == [] and manifests(store) == {4: 1}
    commit(store, 4)
    commit(store, 9)
    assert manifests(store) == {4: 1, 9: 1}


def test_retention_never_counts_a_directory_set_aside(store):
    for step in (4, 9):
        commit(store, step)
    break_pointer(store, "stale")
    store.remove_leftovers(store.load_latest().checkpoint.global_step)
    commit(store, 5)
    assert store.published_steps() == [4, 5] and manifests(store) == {4: 1, 5: 1, 9: 1}
