"""A recover step with a critic (PPO): its part in `critic/recover_checkpoint/globalstep{G}/`, named by the actor's
manifest, so that one commit covers both roles; validation, fallback, retention, leftovers and clean-restart treat
the two directories as one step. A GRPO step (no critic) is as before."""
import hashlib
import json
import os
import pickle
import shutil

import pytest
from test_recovery import _Payload, infos
from torch.distributed.checkpoint.metadata import Metadata

from supervisor.checkpoint import store as store_module
from supervisor.checkpoint.layout import MANIFEST, TrialLayout, as_path
from supervisor.checkpoint.storage import LocalStorage
from supervisor.checkpoint.store import SCHEMA_VERSION, RecoverStore, RolePart

ACTOR_RANKS, CRITIC_RANKS = 2, 3


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A fresh directory on each storage: a local path, or a prefix of the S3 server's bucket."""
    if request.param == "local":
        return tmp_path
    return as_path(request.getfixturevalue("s3_server").url(tmp_path.name))


@pytest.fixture
def store(tmp_path):
    return RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_part(store: RecoverStore, step: int, role: str, ranks: int):
    """What a role's ranks do: write their shards and RNG files into the role's staging directory, and report them."""
    staging = store.staging_dir(step, role)
    files = {}
    names = [f"__{r}_0.distcp" for r in range(ranks)] + [f"rng_rank{r}.pt" for r in range(ranks)] + [".metadata"]
    for name in names:
        data = pickle.dumps(Metadata({}), protocol=4) if name == ".metadata" else f"{role} {name} {step}".encode() * 10
        store.fs.write_bytes(staging / name, data)
        files[name] = {"size": len(data), "sha256": sha(data)}
    return staging, files


def commit(store: RecoverStore, step: int, critic: bool = True):
    staging, files = write_part(store, step, "actor", ACTOR_RANKS)
    roles = None
    if critic:
        critic_staging, critic_files = write_part(store, step, "critic", CRITIC_RANKS)
        roles = {"critic": RolePart(critic_staging, critic_files, CRITIC_RANKS, "fsdp")}
    path = store.commit(staging, step, ACTOR_RANKS, "hash", files, infos(step), roles=roles)
    store.wait_for_pruning()
    return path


def names(store: RecoverStore, role: str) -> list[str]:
    return sorted(p.name for p in store.fs.iterdir(store.layout.recover_checkpoint_of(role)))


def manifest(store: RecoverStore, step: int) -> dict:
    return json.loads(store.fs.read_bytes(store.layout.step_dir(step) / MANIFEST))


def test_a_step_with_a_critic_is_one_checkpoint_of_two_directories(root):
    store = RecoverStore(TrialLayout(root, "u", "exp", "t0"), keep_last=2)
    commit(store, 4)
    lay = store.layout
    assert str(lay.step_dir(4, "critic")).endswith("/checkpoints/u/exp/t0/critic/recover_checkpoint/globalstep4")
    assert names(store, "critic") == ["globalstep4"]  # published, no temporary left
    m = manifest(store, 4)
    assert m["roles"] == {"critic": {"world_size": CRITIC_RANKS, "engine": "fsdp"}}
    critic_files = [f"__{r}_0.distcp" for r in range(CRITIC_RANKS)] + [f"rng_rank{r}.pt" for r in range(CRITIC_RANKS)]
    assert sorted(n for n in m["files"] if n.startswith("@")) == sorted(
        f"@critic/{n}" for n in critic_files + [".metadata"])
    ck = RecoverStore(lay, keep_last=2).load_latest().checkpoint  # a later process: every file hashed
    assert ck.global_step == 4 and ck.role_path() == lay.step_dir(4) and ck.role_world_size() == ACTOR_RANKS
    assert ck.role_path("critic") == lay.step_dir(4, "critic") and ck.role_world_size("critic") == CRITIC_RANKS
    if not store.fs.renames:  # the object store's critic directory is written in place: never written into again
        with pytest.raises(FileExistsError):
            store.staging_dir(4, "critic")


def test_a_grpo_step_is_written_as_before(store):
    path = commit(store, 4, critic=False)
    files = {str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": sha(f.read_bytes())}
             for f in path.rglob("*") if f.is_file() and f.name != MANIFEST}
    expected = {"schema_version": SCHEMA_VERSION, "global_step": 4, "world_size": ACTOR_RANKS, "config_hash": "hash",
                "engine": "fsdp", "files": files}
    assert (path / MANIFEST).read_bytes() == json.dumps(expected, indent=1, sort_keys=True).encode()
    assert sorted(p.name for p in store.layout.checkpoint_root.iterdir()) == ["default", "recover_info"]
    ck = store.load_latest().checkpoint
    assert ck.global_step == 4 and ck.role_world_size("critic") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", ["__2_0.distcp", "rng_rank1.pt", ".metadata"])
def test_a_damaged_critic_file_falls_back_to_the_previous_step(store, damage, name):
    commit(store, 4)
    commit(store, 9)
    target = store.layout.step_dir(9, "critic") / name
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        target.unlink()
    result = RecoverStore(store.layout, keep_last=2).load_latest()  # a later process: it trusts no hash
    assert result.checkpoint.global_step == 4
    why = {"truncate": "size", "flip": "checksum mismatch", "delete": "missing"}[damage]
    assert result.fallbacks[0].startswith(f"{target}: {why}")
    _, set_aside = store.remove_leftovers(4)
    assert set_aside == [store.layout.step_dir(9, "critic"), store.layout.step_dir(9)]  # the step's parts together
    assert store.published_steps() == [4]
    aside = [n for n in names(store, "critic") if n.startswith("damaged.")]
    assert len(aside) == 1 and aside[0] in names(store, "actor")  # kept, under the same name as the actor's


def test_a_pickle_payload_in_the_critics_dcp_metadata_is_refused_even_with_a_matching_manifest(store, tmp_path):
    commit(store, 4)
    commit(store, 9)
    marker = tmp_path / "executed"
    metadata = store.layout.step_dir(9, "critic") / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    m = manifest(store, 9)
    m["files"]["@critic/.metadata"] = {"size": metadata.stat().st_size, "sha256": sha(metadata.read_bytes())}
    (store.layout.step_dir(9) / MANIFEST).write_text(json.dumps(m))
    result = RecoverStore(store.layout, keep_last=2).load_latest()
    assert result.checkpoint.global_step == 4
    assert result.fallbacks[0].startswith(f"{metadata}: cannot load") and not marker.exists()


@pytest.mark.parametrize("entry", ["@critic/../../../default/recover_checkpoint/globalstep4/__0_0.distcp",
                                   "@critic//etc/hostname", "@nosuchrole/__0_0.distcp"])
def test_a_role_entry_that_leaves_the_roles_step_directory_is_damage(store, entry):
    commit(store, 4)
    commit(store, 9)
    m = manifest(store, 9)
    m["files"][entry] = m["files"]["@critic/__0_0.distcp"]
    (store.layout.step_dir(9) / MANIFEST).write_text(json.dumps(m))
    result = RecoverStore(store.layout, keep_last=2).load_latest()
    assert result.checkpoint.global_step == 4
    assert "manifest.json" in result.fallbacks[0] and ("not inside" in result.fallbacks[0]
                                                       or "'nosuchrole' is not a role" in result.fallbacks[0])


def test_prune_deletes_a_steps_critic_after_its_actor_directory(store, monkeypatch):
    removed = []
    real = LocalStorage.remove
    monkeypatch.setattr(LocalStorage, "remove", lambda self, p, first=None: removed.append(p) or real(self, p, first))
    for step in (4, 9, 14, 19):
        commit(store, step)
    assert store.published_steps() == [14, 19]
    assert names(store, "critic") == ["globalstep14", "globalstep19"]
    for step in (4, 9):
        assert removed.index(store.layout.step_dir(step)) < removed.index(store.layout.step_dir(step, "critic"))


def test_a_critic_left_by_a_prune_cut_short_is_a_temporary(store):
    commit(store, 4)
    commit(store, 9)
    shutil.rmtree(store.layout.step_dir(4))  # the prune of step 4 killed between the actor's delete and the critic's
    assert store.temporaries() == [store.layout.step_dir(4, "critic")]
    assert store.load_latest().checkpoint.global_step == 9
    assert store.remove_leftovers(9) == ([store.layout.step_dir(4, "critic")], [])
    assert names(store, "critic") == ["globalstep9"]


class Crash(BaseException):
    """The Supervisor died here (nothing catches it)."""


def crash_at(monkeypatch, point: str) -> None:
    def fault_point(name, **kwargs):
        if name == point:
            raise Crash(name)
    monkeypatch.setattr(store_module, "fault_point", fault_point)


def crashed_committing_9(root, monkeypatch, point: str) -> RecoverStore:
    """A store with step 4 committed, whose commit of step 9 the Supervisor died in at `point`."""
    store = RecoverStore(TrialLayout(root, "u", "exp", "t0"), keep_last=2)
    commit(store, 4)
    crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        commit(store, 9)
    monkeypatch.undo()
    return store


def test_a_crash_after_the_critics_publish_before_the_actors_leaves_a_temporary(root, monkeypatch):
    store = crashed_committing_9(root, monkeypatch, "before_manifest")
    critic9 = store.layout.step_dir(9, "critic")
    assert store.fs.is_file(critic9 / "__0_0.distcp")  # the critic's part is in place, the actor's is not
    restarted = RecoverStore(store.layout, keep_last=2)
    assert restarted.load_latest().checkpoint.global_step == 4
    removed, set_aside = restarted.remove_leftovers(4)
    assert critic9 in removed and set_aside == [] and names(restarted, "critic") == ["globalstep4"]
    commit(restarted, 9)  # the step trained again
    ck = RecoverStore(store.layout, keep_last=2).load_latest().checkpoint
    assert ck.global_step == 9 and ck.role_world_size("critic") == CRITIC_RANKS


def test_a_crash_between_the_publish_and_the_commit_sets_both_parts_aside_until_a_newer_commit(root, monkeypatch):
    store = crashed_committing_9(root, monkeypatch, "after_publish")
    restarted = RecoverStore(store.layout, keep_last=2)
    assert restarted.load_latest().checkpoint.global_step == 4  # the pointer never named step 9
    _, set_aside = restarted.remove_leftovers(4)
    assert set_aside == [store.layout.step_dir(9, "critic"), store.layout.step_dir(9)]
    aside = [n for n in names(restarted, "critic") if n.startswith("uncommitted.globalstep9.")]
    assert len(aside) == 1 and aside[0] in names(restarted, "actor")
    commit(restarted, 9)  # the step trained again: its directories are free
    assert names(restarted, "critic") == sorted(["globalstep4", "globalstep9", aside[0]])
    commit(restarted, 14)  # a newer commit: the uncommitted parts go
    assert names(restarted, "critic") == ["globalstep14", "globalstep9"]
    assert restarted.load_latest().checkpoint.global_step == 14


def test_an_interrupted_critic_save_is_a_temporary_but_for_a_save_in_flight(store):
    commit(store, 4)
    staging, _ = write_part(store, 9, "critic", CRITIC_RANKS)
    assert staging.parent == store.layout.recover_checkpoint_of("critic") and staging.name.startswith(".tmp.")
    assert store.remove_temporaries(spare=(staging,)) == [] and staging.exists()
    assert store.remove_leftovers(4) == ([staging], []) and not staging.exists()


def test_clean_restart_deletes_the_critics_recover_checkpoint_too(tmp_path):
    from click.testing import CliRunner

    from supervisor.cli import main
    from supervisor.config import load_config

    overrides = [f"cluster.fileroot={tmp_path}"]
    layout = TrialLayout.from_config(load_config(None, overrides))
    store = RecoverStore(layout, keep_last=2)
    assert layout.recover_checkpoint_of("critic") in layout.recover_state_paths()
    commit(store, 4, critic=False)
    assert store.recover_state() == [layout.recover_info, layout.recover_checkpoint]  # no critic: not listed
    commit(store, 9)
    assert store.recover_state() == [layout.recover_info, layout.recover_checkpoint,
                                     layout.recover_checkpoint_of("critic")]
    r = CliRunner().invoke(main, ["clean-restart", *overrides, "--yes"])
    assert r.exit_code == 0, r.output
    assert store.recover_state() == [] and not os.path.exists(layout.recover_checkpoint_of("critic"))
    assert store.load_latest().checkpoint is None


def test_inspect_lists_the_critics_files_where_they_are_and_names_its_part(store):
    """`relaunch inspect` of a PPO step: the critic's files (outside the step directory) with their sizes, not as
    missing, and the critic's part with its world size; a critic file gone shows as missing and the step invalid."""
    from supervisor.tools.inspect_checkpoint import inspect

    path = commit(store, 4)
    valid, report = inspect(path)
    assert valid, report
    assert "@critic/__2_0.distcp" in report and "MISSING" not in report
    assert f"critic part  world size {CRITIC_RANKS}, engine fsdp" in report
    os.remove(store.layout.step_dir(4, "critic") / "__2_0.distcp")
    valid, report = inspect(path)
    assert not valid and any("@critic/__2_0.distcp" in line and "MISSING" in line for line in report.splitlines())


def test_a_tool_reading_a_step_from_the_store_gets_the_critics_part_with_it(root):
    """`relaunch export`, `verify` and `inspect` read a step through `readable`: on an object store the step is
    downloaded into a private tree with the critic's part where the manifest says, so a whole step checks whole."""
    from supervisor.checkpoint.store import read_checkpoint
    from supervisor.checkpoint.transfer import readable

    store = RecoverStore(TrialLayout(root, "u", "exp", "t0"), keep_last=2)
    path = commit(store, 4)
    with readable(str(path), retry_secs=5) as local:
        checkpoint = read_checkpoint(local)
        assert checkpoint.role_world_size("critic") == CRITIC_RANKS
        assert (checkpoint.role_path("critic") / "__2_0.distcp").is_file()


def test_the_kl_coefficient_is_a_step_s_metadata_where_the_job_has_one(store):
    """kl_ctl_info.json (PPO's KL coefficient in the rewards) goes into the step's meta/ under its manifest, and
    into recover_info/; a step is read with it, and a step without it (a job without the penalty) is whole and
    takes it out of recover_info/ (the mirror is its step's), as does a fallback to such a step."""
    staging, files = write_part(store, 4, "actor", ACTOR_RANKS)
    kl = {"schema_version": SCHEMA_VERSION, "kl_coef": 0.07, "target": 0.02, "horizon": 500}
    store.commit(staging, 4, ACTOR_RANKS, "hash", files, infos(4) | {"kl_ctl_info.json": kl})
    mirror = store.layout.recover_info / "kl_ctl_info.json"
    assert json.loads(store.fs.read_bytes(mirror)) == kl
    commit(store, 9, critic=False)
    assert "meta/kl_ctl_info.json" in manifest(store, 4)["files"]
    assert "meta/kl_ctl_info.json" not in manifest(store, 9)["files"]
    assert not store.fs.exists(mirror)
    assert store.validate(4).infos["kl_ctl_info.json"] == kl
    assert "kl_ctl_info.json" not in store.validate(9).infos
    store.restore_mirror(store.validate(4))
    assert json.loads(store.fs.read_bytes(mirror)) == kl
    store.restore_mirror(store.validate(9))
    assert not store.fs.exists(mirror)
