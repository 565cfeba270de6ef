"""Auto-restart inside one job, on a shared multi-node Ray cluster: every recovery ends bit-identical."""
from __future__ import annotations

import pytest

from conftest import CONFIG, SHORT, Trial, curve, job_env, relaunch, start_relaunch, status_json

pytestmark = pytest.mark.e2e


def run_with_fault(cluster, trial: Trial, tmp_path, fault: str, *extra: str):
    env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    return relaunch("run", str(CONFIG), *SHORT, *trial.overrides, *extra, "--address", cluster.address, env=env)


def assert_recovered_exactly(trial: Trial, reference: Trial, restarts: int = 1):
    stats = trial.stats()
    assert [s["global_step"] for s in stats] == list(range(24))
    assert curve(stats) == curve(reference.stats())
    assert trial.final_weights() == reference.final_weights()
    st = status_json(trial)
    assert st["restarts"] == restarts and st["state"] == "done"
    if restarts:
        assert trial.events("resync")[-1]["version"] >= 1  # engines were resynced after the restart


def test_killed_train_worker_restarts_the_group_from_the_last_checkpoint(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "train_step:kill:step=7:rank=1")
    assert r.returncode == 0, r.stdout + r.stderr
    failure = trial.events("failure")[0]
    assert failure["cause"] == "worker_died" and "rank 1" in failure["actor"] and failure["node"]
    assert failure["detect_secs"] < 30
    assert [e["global_step"] for e in trial.events("loaded")] == [-1, 4]  # rolled back to the commit at 4
    assert_recovered_exactly(trial, reference)


def test_killed_rollout_worker_restarts_only_that_engine(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "generate:kill:step=7")
    assert r.returncode == 0, r.stdout + r.stderr
    assert trial.events("failure")[0]["cause"] == "engine_died"
    assert len(trial.events("loaded")) == 1  # the trainers were neither restarted nor rolled back
    assert trial.events("engines_restarted")[0]["replaced"] == ["RolloutWorker[0]"]
    assert trial.events("resync")[-1]["version"] == 7  # the engine got the weights for step 7
    assert_recovered_exactly(trial, reference)


def test_hang_is_detected_by_the_step_timeout(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "train_step:hang:step=7:rank=0", "recover.step_timeout_secs=15")
    assert r.returncode == 0, r.stdout + r.stderr
    failure = trial.events("failure")[0]
    assert failure["cause"] == "hang" and failure["detect_secs"] == 15
    assert_recovered_exactly(trial, reference)


def test_supervisor_death_is_survived_by_rebuilding_from_disk(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "supervisor_step:kill:step=12")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len({e["attempt"] for e in trial.events("start")}) == 2
    assert trial.events("loaded")[-1]["global_step"] == 9
    assert_recovered_exactly(trial, reference)


def test_retries_exhausted_stops_with_one_clear_line(cluster, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "train_step:kill:step=3:rank=0,train_step:kill:step=8:rank=1",
                       "recover.retries=1")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "retries exhausted (1/1)" in last and "worker_died" in last
    assert trial.events("gave_up")
    st = status_json(trial)
    assert st["restarts"] == 1 and st["state"] == "gave_up" and st["last_valid"]["global_step"] == 4


def test_user_code_error_fails_fast_with_its_traceback(cluster, trial):
    r = relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "reward.fn=tests.e2e.faulty_reward:reward",
                 "--address", cluster.address)
    assert r.returncode == 1
    assert "KeyError" in r.stderr and "faulty_reward.py" in r.stderr
    assert not trial.events("restart")


def test_dead_node_is_replaced_by_the_spare(cluster, reference, trial, tmp_path):
    proc = start_relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "--address", cluster.address,
                          env=job_env(), log=tmp_path / "job.log")
    try:
        trial.wait_for_step(6, proc)
        train_node = trial.events("loaded")[0]["nodes"][0]
        cluster.kill_node(cluster.node_of(train_node))
        assert proc.wait(timeout=300) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.add_node()
    failure = trial.events("failure")[0]
    assert failure["node"] == train_node
    assert trial.events("loaded")[-1]["nodes"][0] != train_node
    stats = trial.stats()
    assert curve(stats) == curve(reference.stats())
    assert trial.final_weights() == reference.final_weights()
    assert status_json(trial)["restarts"] >= 1


def test_kill_between_shards_and_publish_reloads_the_previous_checkpoint(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "after_shards:kill:step=9:rank=1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [e["global_step"] for e in trial.events("loaded")] == [-1, 4]
    assert any(".tmp.globalstep9" in p for e in trial.events("cleanup") for p in e["removed"])
    assert_recovered_exactly(trial, reference)


def test_disk_full_during_a_save_skips_it_and_trains_on(cluster, reference, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "after_shards:enospc:step=9:rank=1")
    assert r.returncode == 0, r.stdout + r.stderr
    failed = trial.events("save_failed")
    assert len(failed) == 1 and "No space left" in failed[0]["error"] and failed[0]["global_step"] == 9
    assert 9 not in [e["global_step"] for e in trial.events("commit")]
    assert_recovered_exactly(trial, reference, restarts=0)


def test_disk_full_with_stop_ends_cleanly_keeping_the_last_valid_checkpoint(cluster, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "after_shards:enospc:step=9:rank=1", "recover.on_save_error=stop")
    assert r.returncode == 1
    assert "No space left" in r.stderr.strip().splitlines()[-1]
    st = status_json(trial)
    assert st["last_valid"]["global_step"] == 4 and st["checkpoint_error"] is None
    assert not [p for p in (trial.root / "default" / "recover_checkpoint").iterdir() if p.name.startswith(".tmp")]
