"""The walking skeleton, end to end, with the embedded local Ray a user gets from `relaunch run`."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import CONFIG, SHORT, Trial, job_env, metrics, relaunch, start_relaunch, status_json
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from supervisor.testing.local_cluster import short_tmp

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def default_run(cluster, tmp_path_factory) -> Trial:
    """The default job, run once as a user runs it, with no address: beside another Ray cluster on this
    machine (the suite's, whose address file a plain ray.init() would join), it starts a Ray of its own.
    The tests below read it, the last one cleans it."""
    from ray._private.utils import read_ray_address, write_ray_address

    # Set the trap in a temp dir of the job's own (the other xdist worker's clusters rewrite the shared one):
    # Ray's address file there names the suite's cluster, as a session's earlier Ray would leave it.
    ray_dir = short_tmp("job") / "ray"
    ray_dir.mkdir()
    write_ray_address(cluster.address, str(ray_dir))
    assert read_ray_address(str(ray_dir)) == cluster.address
    trial = Trial(tmp_path_factory.mktemp("default") / "runs")
    r = relaunch("run", str(CONFIG), *trial.overrides, env=job_env({"RAY_TMPDIR": str(ray_dir.parent)}))
    assert r.returncode == 0, r.stdout + r.stderr
    return trial


@pytest.mark.quick
def test_default_job_learns_and_exports_loadable_models(default_run: Trial):
    trial = default_run
    stats = trial.stats()
    assert [s["global_step"] for s in stats] == list(range(60))
    first = sum(s["reward"] for s in stats[:10]) / 10
    last = sum(s["reward"] for s in stats[-10:]) / 10
    assert first < 0.25 and last > 0.5, (first, last)

    newest = trial.exports()[-1]
    assert newest.name == "epoch4epochstep11globalstep59"
    model = AutoModelForCausalLM.from_pretrained(newest)
    tok = AutoTokenizer.from_pretrained(newest)
    ids = tok("<s> 3 8 =", return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).strip() in [str(d) for d in range(10)]

    st = status_json(trial)
    assert st["last_valid"]["global_step"] == 59 and st["restarts"] == 0
    assert st["experiment_name"] == "tiny-grpo" and st["trial_name"] == "trial0"
    assert [e["event"] for e in st["events"]][-1] == "done"


@pytest.mark.quick
def test_every_step_accounts_the_peak_memory_of_each_actor_kind(default_run: Trial):
    machine_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    kinds = ("train", "engine", "supervisor")  # no spare: the embedded Ray has no room for one
    for row in default_run.stats():
        assert all(0.05 < row[f"mem/{kind}_peak_gb"] < machine_gb for kind in kinds), row
    st = status_json(default_run)
    assert set(st["memory"]) == set(kinds)
    text = relaunch("status", str(CONFIG), *default_run.overrides).stdout
    assert "memory     peak train" in text


@pytest.mark.quick
def test_export_then_clean_restart_starts_fresh_and_keeps_exports(default_run: Trial, tmp_path):
    trial = default_run
    # `relaunch export` turns the recover checkpoint into the same safetensors the Saver wrote
    step_dir = trial.root / "default" / "recover_checkpoint" / "globalstep59"
    out = tmp_path / "hf"
    r = relaunch("export", str(step_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr
    mine, saver = load_file(out / "model.safetensors"), load_file(trial.exports()[-1] / "model.safetensors")
    assert mine.keys() == saver.keys() and all(torch.equal(mine[k], saver[k]) for k in mine)
    assert AutoTokenizer.from_pretrained(out).convert_ids_to_tokens([4, 11]) == ["0", "7"]
    assert relaunch("export", str(tmp_path), "--out", str(tmp_path / "x")).returncode == 2

    exports = trial.exports()
    dry = relaunch("clean-restart", str(CONFIG), *trial.overrides, "--dry-run")
    assert dry.returncode == 0 and "recover_info" in dry.stdout and (trial.root / "recover_info").exists()
    no_yes = relaunch("clean-restart", str(CONFIG), *trial.overrides)
    assert no_yes.returncode == 2 and (trial.root / "recover_info").exists()
    r = relaunch("clean-restart", str(CONFIG), *trial.overrides, "--yes")
    assert r.returncode == 0, r.stderr
    assert not (trial.root / "recover_info").exists()
    assert not (trial.root / "default" / "recover_checkpoint").exists()
    assert trial.exports() == exports and (trial.logs / "stats.jsonl").exists()
    assert status_json(trial)["last_valid"] is None

    r = relaunch("run", str(CONFIG), "total_train_epochs=1", *trial.overrides)
    assert r.returncode == 0, r.stderr
    assert trial.events("loaded")[-1]["global_step"] == -1  # started at step 0
    assert [s["global_step"] for s in trial.stats()] == list(range(12))


def test_two_runs_of_one_trial_at_once_one_runs_the_other_touches_nothing(reference, trial, tmp_path):
    """Two embedded runs started together (each would start a Ray of its own): one takes the trial's lock and
    ends exactly as the uninterrupted reference; the other exits 2 at once, naming the holder."""
    args = ("run", str(CONFIG), *SHORT, "recover.spare_workers=0", *trial.overrides)
    procs = [start_relaunch(*args, env=job_env(), log=tmp_path / f"run{i}.log") for i in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    assert sorted(codes) == [0, 2], codes
    winner, loser = (procs[0], procs[1]) if codes[0] == 0 else (procs[1], procs[0])
    lines = (tmp_path / f"run{procs.index(loser)}.log").read_text().splitlines()
    assert lines == [f"relaunch: error: trial is already running: {trial.root / 'run.lock'} is held by pid "
                     f"{winner.pid} on {socket.gethostname()}" + lines[0].split(socket.gethostname(), 1)[1]]
    assert len({e["job"] for e in trial.events("start")}) == 1
    assert metrics(trial.stats()) == metrics(reference.stats())
    assert trial.final_checksum() == reference.final_checksum()
    assert not (trial.root / "run.lock").exists()  # released at the end


def test_ctrl_c_is_told_truthfully_and_the_rerun_says_where_it_resumed(reference, trial, tmp_path):
    """SIGTERM while the job starts (Ray starting): exit 143, the lock released, nothing run. Then Ctrl-C as a
    terminal sends it (SIGINT to the driver's whole process group): exit 130, no Ray line about
    retries that never happen, `status` says interrupted with the step kept, and the rerun says where it
    resumed and ends exactly as the uninterrupted reference."""
    args = ("run", str(CONFIG), *SHORT, "recover.spare_workers=0", *trial.overrides)
    # first SIGTERM while it starts (its own Ray starting): a stop like any other
    starting = start_relaunch(*args, env=job_env(), log=tmp_path / "starting.log")
    while not (trial.root / "run.lock").exists():
        assert starting.poll() is None, (tmp_path / "starting.log").read_text()[-2000:]
        time.sleep(0.02)
    starting.send_signal(signal.SIGTERM)
    assert starting.wait(timeout=60) == 143, (tmp_path / "starting.log").read_text()[-2000:]
    assert (tmp_path / "starting.log").read_text().splitlines()[-1] == (
        "relaunch: stopped by SIGTERM while starting, before any step; the last valid checkpoint is kept and the "
        "same command resumes")
    assert not (trial.root / "run.lock").exists() and not trial.stats()
    log = tmp_path / "first.log"
    proc = start_relaunch(*args, env=job_env(), log=log)
    trial.wait_for_step(7, proc)
    while not trial.events("commit"):  # step 4's background save (steps of 0.1 s can outrun it)
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    kept = trial.events("commit")[-1]["global_step"]
    out = log.read_text()
    assert "retries remaining" not in out and "will be retried" not in out, out
    assert out.splitlines()[-1] == (f"relaunch: interrupted; the last valid checkpoint (global step {kept}) is kept, "
                                    "the next run resumes after it")
    st = status_json(trial)
    assert (st["state"], st["last_valid"]["global_step"]) == ("interrupted", kept)

    r = relaunch(*args)
    assert r.returncode == 0, r.stderr
    assert f"relaunch: resumed from global step {kept} (" in r.stderr
    assert metrics(trial.stats()) == metrics(reference.stats())
    assert trial.final_checksum() == reference.final_checksum()


def test_a_reward_module_in_the_directory_the_job_starts_from_is_imported(cluster, tmp_path):
    """`reward.fn=myreward:reward` from a directory outside the repository holding myreward.py, through the
    `relaunch` script as a user types it: embedded, and joining a cluster with --address (on the built-in
    engine: vLLM's start, twice, is not what this is about)."""
    (tmp_path / "myreward.py").write_text("def reward(prompt, completion, row):\n    return 0.25\n")
    script = Path(sys.executable).parent / "relaunch"
    for i, where in enumerate(([], ["--address", cluster.address])):
        t = Trial(tmp_path / f"runs{i}")
        r = subprocess.run([str(script), "run", "total_train_epochs=1", "recover.spare_workers=0",
                            "reward.fn=myreward:reward", "rollout.engine=hf", *t.overrides, *where],
                           cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert [s["reward"] for s in t.stats()] == [0.25] * 12
