"""Auto-restart inside one job, on a shared multi-node Ray cluster: every recovery ends bit-identical."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import (AS_SHIPPED_SPARES, CONFIG, MEMORY_TIER, SHORT, Trial, curve, data_as, job_env, kill_session, metrics,
                     log_tail, relaunch, start_relaunch, status_json)

from supervisor.cluster.drains import POLL_SECS
from supervisor.testing.local_cluster import NODE_DEATH_SECS

pytestmark = pytest.mark.e2e


def run_with_fault(cluster, trial: Trial, tmp_path, fault: str, *extra: str):
    env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    return relaunch("run", str(CONFIG), *SHORT, *trial.overrides, *extra, "--address", cluster.address, env=env)


def assert_recovered_exactly(trial: Trial, reference: Trial, restarts: int = 1):
    stats = trial.stats()
    assert [s["global_step"] for s in stats] == list(range(24))
    assert metrics(stats) == metrics(reference.stats())
    assert trial.final_checksum() == reference.final_checksum()
    st = status_json(trial)
    assert st["restarts"] == restarts and st["state"] == "done"
    if restarts:  # the engines were resynced after the last failure (to the step the restart resumed from,
        # which under load may be -1: a background save not yet committed when the failure came)
        last_failure = trial.events("failure")[-1]["time"]
        assert any(e["time"] > last_failure for e in trial.events("resync"))


def test_retries_exhausted_stops_with_one_clear_line(cluster, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "TrainWorker.train.enter:kill:step=3:rank=0,TrainWorker.train.enter:kill:step=8:rank=1",
                       "recover.retries=1")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "retries exhausted (1/1)" in last and "worker_died" in last
    assert trial.events("gave_up")
    st = status_json(trial)
    assert st["restarts"] == 1 and st["state"] == "gave_up" and st["last_valid"]["global_step"] == 4


@pytest.mark.quick
def test_an_engine_that_cannot_be_built_fails_the_first_start_at_once_naming_why(cluster, trial, tmp_path):
    """A worker's constructor that raises at the job's first start is its config or node, not bad luck: the job
    stops at once with the error (once started, the same fault is a counted restart)."""
    r = run_with_fault(cluster, trial, tmp_path, "RolloutWorker.__init__.enter:enospc")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "RolloutWorker[0] failed to start: OSError: [Errno 28] No space left on device" in last, last
    assert [e["cause"] for e in trial.events("failure")] == ["start_failed"]
    st = status_json(trial)
    assert st["restarts"] == 0 and st["state"] == "failed"


@pytest.mark.quick
def test_a_run_whose_lock_another_run_took_over_stops_and_says_so(cluster, trial, tmp_path):
    """Its heartbeat late past the lease (a store outage, a frozen head), a run's lock was taken over: within a
    heartbeat it stops, naming the new holder, whose lock it leaves alone, so that two runs never write one trial."""
    proc = start_relaunch("run", str(CONFIG), *SHORT, "total_train_epochs=40", *trial.overrides,
                          "recover.spare_workers=0", "--address", cluster.address, env=job_env(),
                          log=tmp_path / "job.log")
    try:
        trial.wait_for_step(1, proc)
        lock = trial.root / "run.lock"
        holder = {**json.loads(lock.read_text()), "host": "elsewhere", "pid": 42, "token": "other"}
        lock.write_text(json.dumps(holder))
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    last = (tmp_path / "job.log").read_text().strip().splitlines()[-1]
    # said by the driver's heartbeat or by the Supervisor's check before a commit, whichever came first
    assert last.startswith("relaunch: failed: ") and \
        f"{lock} is no longer held by this run: it is held by pid 42 on elsewhere" in last, last
    assert json.loads(lock.read_text())["token"] == "other"
    assert trial.stats()[-1]["global_step"] < 40 * 12 - 1  # stopped, not finished


@pytest.mark.quick
def test_user_code_error_fails_fast_with_its_traceback(cluster, trial):
    r = relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "reward.fn=tests.e2e.faulty_reward:reward",
                 "--address", cluster.address)
    assert r.returncode == 1
    assert "KeyError" in r.stderr and "faulty_reward.py" in r.stderr
    assert not trial.events("restart")


@pytest.mark.quick
def test_dead_node_is_replaced_by_the_spare(cluster, reference, trial, tmp_path):
    """Both ranks' node killed mid-run; the warm spares (one per rank, on the other node) are their memory-tier
    buddies (linked from step 2 on): each takes its rank's place with the state it holds, no step trained
    again, and the run ends bit-identical to the reference, whose prompts this job reads from a Parquet file."""
    env = job_env({"RELAUNCH_FAULT": "step.begin:wait_spares:step=2", "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *SHORT, AS_SHIPPED_SPARES, MEMORY_TIER, data_as("parquet", tmp_path),
                          *trial.overrides, "--address", cluster.address, env=env, log=tmp_path / "job.log")
    try:
        trial.wait_for_step(6, proc)
        train_node = trial.events("loaded")[-1]["nodes"][0]
        killed = time.time()
        cluster.kill_node(cluster.node_of(train_node))
        assert proc.wait(timeout=300) == 0, log_tail(tmp_path / "job.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.add_node()
    # what the kill caused (a start that failed before it, e.g. its rendezvous port taken on a busy machine,
    # is not its doing)
    failure = [e for e in trial.events("failure") if e["time"] > killed][0]
    assert failure["node"] == train_node
    assert train_node not in trial.events("loaded")[-1]["nodes"]
    # the warm spares (recover.spare_workers auto: one per rank here) were on the other node and served both,
    # each with its rank's state from memory
    assert [(e["taken"], e["cold"]) for e in trial.events("spares") if e["action"] == "taken"][-1] == (2, 0)
    buddies = [e["nodes"] for e in trial.events("buddies") if e["time"] < killed][-1]
    assert set(buddies) == {"0", "1"} and train_node not in buddies.values()
    recovery = [e for e in trial.events("recovery") if e["time"] > killed][0]
    assert (recovery["source"], recovery["replayed_steps"]) == ("memory", 0), recovery
    stats = trial.stats()
    assert curve(stats) == curve(reference.stats())
    assert trial.final_weights() == reference.final_weights()
    # one node lost is one incident: its engine, if it held one, is seen dead while the group is repaired
    assert len([e for e in trial.events("restart") if e["time"] > killed]) == 1


def test_a_spare_lost_with_its_node_is_skipped_and_the_next_restart_is_served_by_the_refill(
        cluster, reference, trial, tmp_path):
    """The pool's spare is placed away from the ranks; its node is killed (the job waits at step 12 until Ray has
    marked it dead: a spare still warming on a node not yet seen dead is taken, and its death fails the regroup);
    the next rank death starts that rank again cold (the dead spare skipped), the other rank keeping its process;
    the refilled spare then takes the place of the rank killed after that."""
    faults = ("step.begin:pause:step=12,TrainWorker.train.enter:kill:step=14:rank=1,"
              "TrainWorker.train.enter:kill:step=21:rank=0")
    env = job_env({"RELAUNCH_FAULT": faults, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "recover.spare_workers=1",
                          "--address", cluster.address, env=env, log=tmp_path / "job.log")
    added = False
    try:
        deadline = time.time() + 300
        while not (trial.events("spares")[1:] and trial.events("loaded")) and time.time() < deadline:
            assert proc.poll() is None, log_tail(tmp_path / "job.log")
            time.sleep(0.2)
        refilled = trial.events("spares")[1]  # as the group starts: the memory tier links to it from step 0
        spare_node, train_nodes = refilled["nodes"][0], trial.events("loaded")[0]["nodes"]
        assert refilled["action"] == "refilled" and refilled["pool"] == 1 and spare_node not in train_nodes
        assert all(r["global_step"] < 12 for r in trial.stats())  # the node dies before the first rank does
        cluster.kill_node(cluster.node_of(spare_node))
        cluster.add_node()
        added = True
        time.sleep(NODE_DEATH_SECS)
        (tmp_path / "go").touch()
        assert proc.wait(timeout=400) == 0, log_tail(tmp_path / "job.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        if not added:
            cluster.add_node()
    spares = trial.events("spares")
    assert [(e["taken"], e["cold"]) for e in spares if e["action"] == "taken"] == [(0, 2), (0, 1), (1, 0)]
    assert [e["kept"] for e in trial.events("loaded")] == [[], [0], [1]]
    assert [e["pool"] for e in spares if e["action"] == "refilled"] == [1, 1, 1]  # refilled after each start
    train_failures = [e["cause"] for e in trial.events("failure") if e["group"] == "train"]
    # two rank kills, two restarts; a death seen again while its own repair runs is part of that incident: a
    # `repair` event, no retry spent (seen once in a CI run: three worker_died for two kills)
    assert set(train_failures) == {"worker_died"} and len(trial.events("restart")) == 2
    assert len(train_failures) == 2 + len(trial.events("repair"))
    assert curve(trial.stats()) == curve(reference.stats())
    assert trial.final_weights() == reference.final_weights()
    st = status_json(trial)
    assert st["state"] == "done" and st["restarts"] == 2  # the two rank kills; the spare's death costs none


@pytest.mark.quick
def test_disk_full_during_a_save_skips_it_and_trains_on(cluster, reference, trial, tmp_path):
    # a real ENOSPC inside DCP's writer on one rank: DCP raises CheckpointException on every rank; then, at
    # step 14, rank 0 alone fails before its upload starts (as it begins its part): the save is skipped on
    # every rank, and the next one pairs up (recover.write_mode auto: fsdp writes in the background)
    r = run_with_fault(cluster, trial, tmp_path,
                       "dcp_write:enospc:step=9:rank=1,TrainWorker.begin_save.enter:enospc:step=14:rank=0")
    assert r.returncode == 0, r.stdout + r.stderr
    failed = trial.events("save_failed")
    assert [(e["global_step"], e["what"]) for e in failed] == [(9, "background save"), (14, "save")]
    assert all("No space left" in e["error"] for e in failed)
    assert [e["global_step"] for e in trial.events("commit")] == [4, 19, 23]
    assert_recovered_exactly(trial, reference, restarts=0)


def test_disk_full_with_stop_ends_cleanly_keeping_the_last_valid_checkpoint(cluster, trial, tmp_path):
    r = run_with_fault(cluster, trial, tmp_path, "after_shards:enospc:step=9:rank=1", "recover.on_save_error=stop",
                       "recover.write_mode=sync")
    assert r.returncode == 1
    assert "No space left" in r.stderr.strip().splitlines()[-1]
    st = status_json(trial)
    assert st["last_valid"]["global_step"] == 4 and st["checkpoint_error"] is None
    assert not [p for p in (trial.root / "default" / "recover_checkpoint").iterdir() if p.name.startswith(".tmp")]


# Interruption points of the exactness matrix (issue 5), each as the fault that kills the whole job there
# (its driver and its embedded Ray cluster); test_any_moment.py breaks single workers at every point.
MATRIX = {
    "mid-rollout": "step.rolled_out:killjob:step=3",
    "mid-save": "after_shards:killjob:step=9:rank=1",
    "mid-update, at an epoch's first step": "TrainWorker.train.enter:killjob:step=12:rank=0",
    "right-after-commit": "step.saved:killjob:step=14",
    "mid-update, the last step": "TrainWorker.train.enter:killjob:step=23:rank=1",
}
# Where each interruption resumes: the last commit before it (commits every 5 steps and every epoch).
RESUMED_FROM = [-1, -1, 4, 11, 14, 19]
# Synchronous saves: a step is committed when its save returns, so every resume point is exact. One retry: a
# whole-job kill is no restart (the job is gone), and no job of these tests loses more than one rank.
MATRIX_JOB = [*SHORT, "recover.freq_epochs=1", "recover.retries=1", "recover.backoff_secs=0",
              "recover.write_mode=sync"]


# Ray's own words when the local Ray a job starts for itself did not come up within its raylet's fixed 30 s
RAY_START_TIMED_OUT = "The current node timed out during startup"


def run_until_done(trial: Trial, tmp_path, faults: list[str], job: list[str], kills: int,
                   extra_env: dict | None = None) -> list[int]:
    """Run the job again after every whole-job kill, until it finishes; the exit codes of the runs."""
    from supervisor.testing.local_cluster import short_tmp

    env = job_env({"RELAUNCH_FAULT": ",".join(faults), "RELAUNCH_FAULT_DIR": str(tmp_path), **(extra_env or {})})
    codes = []
    for attempt in range(kills + 4):
        env["RAY_TMPDIR"] = str(short_tmp("rlm"))
        log = tmp_path / f"run{attempt}.log"
        proc = start_relaunch("run", str(CONFIG), *job, *trial.overrides, env=env, log=log)
        code = proc.wait(timeout=600)
        kill_session(proc.pid)  # nothing of a killed job may linger
        if code not in (0, -9) and RAY_START_TIMED_OUT in log.read_text():
            continue  # the job's own Ray never started (its raylet's fixed 30 s, on two loaded cores): not a run
        codes.append(code)
        if code == 0:
            break
    assert codes == [-9] * kills + [0], log_tail(log)
    return codes


def test_the_whole_job_killed_at_every_interruption_point_and_rerun(reference, trial, tmp_path):
    run_until_done(trial, tmp_path, list(MATRIX.values()), MATRIX_JOB, kills=len(MATRIX))
    assert [e["global_step"] for e in trial.events("loaded")] == RESUMED_FROM
    assert_recovered_exactly(trial, reference, restarts=0)


def test_background_saves_in_flight_are_never_published_by_a_kill(reference, trial, tmp_path):
    """Recover saves written in the background (the default on fsdp), killed before they are durable: the
    whole job while step 9's is written, then the writer thread of one rank mid-write at step 19. Each
    resume starts from the save committed before (4, then 14). An HF export every step: the steps trained
    again are exported again, and on CPU (exact) each keeps the export already published (the struck step's may
    have been published before the kill, unlogged). The trackers
    (TensorBoard, W&B offline) follow both: one tracker run across the rerun, the same rows as stats.jsonl, steps
    15-19 given once."""
    faults = ["background_write:killjob:step=9:rank=0", "background_write:kill:step=19:rank=1"]
    run_until_done(trial, tmp_path, faults, [*MATRIX_JOB[:-1], "recover.write_mode=async", "saver.freq_steps=1",
                                             "logging.trackers=[tensorboard,wandb]"], kills=1,
                   extra_env={"WANDB_MODE": "offline"})
    assert [e["global_step"] for e in trial.events("loaded")] == [-1, 4, 14]
    commits = [e for e in trial.events("commit")]
    assert all(e["background"] for e in commits) and [e["global_step"] for e in commits][-1] == 23
    assert_recovered_exactly(trial, reference, restarts=1)
    exports = trial.events("export")
    first = {}
    for e in exports:
        first.setdefault(e["global_step"], e)
    assert sorted(first) == list(range(24))
    # a step's export is published once; a step trained again keeps it. The export of the step a kill struck
    # in may have been published before the kill and logged never: its first event is then a `kept`
    published = [e["global_step"] for e in exports if e["outcome"] == "published"]
    assert len(published) == len(set(published)) and set(first) - set(published) <= {9, 19}, published
    assert all(e["outcome"] == "kept" for e in exports if first[e["global_step"]] is not e)
    again = {e["global_step"] for e in exports if e["outcome"] == "kept"}
    assert again and again <= set(range(5, 10)) | set(range(15, 20))  # only steps trained again
    assert_trackers_hold_the_stats(trial)


def assert_trackers_hold_the_stats(trial: Trial) -> None:
    """TensorBoard's scalars and the offline W&B run, read back from disk, are stats.jsonl's rows; the
    restart is a marker at the step that was in flight."""
    from tracker_files import tensorboard_notes, tensorboard_rows, wandb_runs

    stats = {r["global_step"]: {k: v for k, v in r.items() if k != "global_step" and not isinstance(v, bool)
                                and isinstance(v, (int, float))} for r in trial.stats()}
    restart_step = trial.events("failure")[-1]["global_step"]
    trackers = trial.logs / "trackers"

    def strip_markers(rows: dict[int, dict]) -> dict[int, dict]:
        return {s: {k: v for k, v in row.items() if not k.startswith("events/")} for s, row in rows.items()}

    board = tensorboard_rows(trackers / "tensorboard")
    assert sorted(board) == list(range(24))
    for step, row in strip_markers(board).items():  # TensorBoard keeps float32
        assert row == pytest.approx(stats[step], rel=1e-6), step
    assert board[restart_step]["events/restart"] == 1
    assert any(n.startswith("restart 1 of") for n in tensorboard_notes(trackers / "tensorboard")[restart_step])

    runs = wandb_runs(trackers)
    assert len(runs) == 2 and len({run_id for run_id, _ in runs}) == 1  # two Supervisor lives, one run
    history: dict[int, dict] = {}  # as `wandb sync` leaves the run: a step at or below the last one is dropped
    for _, rows in runs:
        history.update({step: row for step, row in rows.items() if step > max(history, default=-1)})
    assert strip_markers(history) == stats
    assert history[restart_step]["events/restart"] == 1


def _strip_newer_keys(step_dir: Path) -> None:
    """Make a checkpoint look written by an older relaunch: drop keys a newer version adds, fix the manifest."""
    import torch

    from supervisor.checkpoint.durable import file_digest

    edits = {"meta/step_info.json": ["steps_per_epoch"], "meta/saver_info.json": ["configured"],
             "meta/evaluator_info.json": ["freq", "configured"], "meta/checkpoint_info.json": ["configured"]}
    for name, keys in edits.items():
        data = json.loads((step_dir / name).read_text())
        for k in keys:
            data.pop(k, None)
        (step_dir / name).write_text(json.dumps(data))
    for rng in step_dir.glob("rng_rank*.pt"):
        state = torch.load(rng, weights_only=True)
        state.pop("numpy")
        torch.save(state, rng)
        edits[rng.name] = []
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in edits:
        f = step_dir / name
        manifest["files"][name] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_without_the_newer_keys_still_loads(cluster, reference, trial):
    first = relaunch("run", str(CONFIG), "total_train_epochs=1", *trial.overrides, "--address", cluster.address)
    assert first.returncode == 0, first.stderr
    _strip_newer_keys(trial.root / "default" / "recover_checkpoint" / "globalstep11")
    r = relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "--address", cluster.address)
    assert r.returncode == 0, r.stdout + r.stderr
    warnings = " | ".join(e["message"] for e in trial.events("warning"))
    assert "steps_per_epoch" in warnings and "evaluator_info.json has no frequency state" in warnings
    assert "numpy" in trial.events("loaded")[-1]["missing_state"] and "lacks numpy" in warnings
    assert trial.final_weights() == reference.final_weights()  # none of the missing keys changes the math


def test_elastic_resume_from_two_trainworkers_to_one_and_back(cluster, trial):
    checksums = {}
    for epochs, workers in ((1, 2), (2, 1), (3, 2)):
        r = relaunch("run", str(CONFIG), f"total_train_epochs={epochs}", f"cluster.n_train_workers={workers}",
                     *trial.overrides, "--address", cluster.address)
        assert r.returncode == 0, r.stdout + r.stderr
        loaded = trial.events("loaded")[-1]
        assert len(loaded["nodes"]) == workers
        if epochs > 1:
            resync = [e for e in trial.events("resync") if e["time"] > loaded["time"]][0]
            # DCP resharded the weights exactly: the engines got the very weights that were checkpointed
            assert loaded["global_step"] == 12 * (epochs - 1) - 1
            assert (resync["version"], resync["checksum"]) == (loaded["global_step"] + 1,
                                                              checksums[loaded["global_step"]])
        commit = trial.events("commit")[-1]
        assert commit["world_size"] == workers
        checksums[commit["global_step"]] = commit["weights_checksum"]
    stats = trial.stats()
    assert [s["global_step"] for s in stats] == list(range(36))
    means = [sum(s["reward"] for s in stats[i:i + 6]) / 6 for i in (6, 12, 18, 24)]
    assert min(means[1:]) > means[0] - 0.15, means  # continuous across both changes: no collapse, no restart


def test_a_trainGroup_that_does_not_fit_shrinks_when_allowed(cluster, trial):
    # 4 ranks of 2 CPUs do not fit this cluster (head 1 CPU, two 3-CPU nodes, and the engine takes 2 of one);
    # recover.min_train_workers=1 lets the TrainGroup start with what fits: one rank of 2 CPUs.
    r = relaunch("run", str(CONFIG), "total_train_epochs=1", "cluster.n_train_workers=4", "cluster.cpus_per_worker=2",
                 "recover.min_train_workers=1", "recover.capacity_timeout_secs=5", *trial.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout + r.stderr
    shrink = trial.events("shrink")
    assert shrink and shrink[0]["wanted"] == 4 and shrink[0]["world_size"] < 4
    assert trial.events("commit")[-1]["world_size"] == shrink[0]["world_size"]
    assert [s["global_step"] for s in trial.stats()] == list(range(12))

    # without min_train_workers the same run stops with a clear line naming the missing resources
    r = relaunch("run", str(CONFIG), "total_train_epochs=1", "cluster.n_train_workers=4", "cluster.cpus_per_worker=2",
                 "recover.capacity_timeout_secs=5", "trial_name=noshrink", *trial.overrides,
                 "--address", cluster.address)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "did not offer 4 x {'CPU': 2" in last and "capacity_timeout_secs" in last


def drain(cluster, node_id: str, deadline_secs: int) -> None:
    """A preemption notice, as the autoscaler v2 or KubeRay gives one, by hand: `ray drain-node`."""
    r = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                        "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                        "--reason-message", "spot instance reclaimed (test)",
                        "--deadline-remaining-seconds", str(deadline_secs)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def wait_paused(tmp_path: Path, proc, index: int) -> None:
    """Until the job waits at its `index`-th armed fault point, a `pause` at step.begin (RELAUNCH_FAULT_DIR is
    tmp_path; touching `go` lets it go)."""
    deadline = time.time() + 300
    while not (tmp_path / f"fired-{index}-step.begin").exists():
        assert time.time() < deadline and proc.poll() is None, log_tail(tmp_path / "job.log")
        time.sleep(0.1)


def drain_while_paused(cluster, trial: Trial, tmp_path: Path, proc, index: int, node_id: str) -> None:
    """`node_id` drained (30 s) while the job waits at its `index`-th fault point; the job let go once its drain
    watch may poll again (at most once a POLL_SECS, the last time before the pause), and waited for until the
    next `preemption` event says the node's work moved."""
    before = len(trial.events("preemption"))
    drain(cluster, node_id, 30)
    time.sleep(max(0.0, (tmp_path / f"fired-{index}-step.begin").stat().st_mtime + POLL_SECS - time.time()))
    (tmp_path / "go").touch()
    deadline = time.time() + 60
    while len(trial.events("preemption")) == before:
        assert time.time() < deadline and proc.poll() is None, log_tail(tmp_path / "job.log")
        time.sleep(0.2)


@pytest.mark.quick
def test_a_drained_node_costs_nothing_and_a_sigterm_stops_the_run_saved_for_the_same_command_to_resume(
        cluster, reference, trial, tmp_path):
    """The job as shipped. While it is paused as step 6 begins, both ranks' node gets a preemption notice (`ray
    drain-node`, 30 s); at the boundary after step 6 each rank hands its place to the spare holding its copy of that
    step, and the node is killed once the job says so: the node's loss is nothing to the job (no failure, no retry
    spent, no step trained again). While it is paused as step 13 begins, the driver gets SIGTERM: it exits 143
    within recover.term_grace_secs with step 13 saved, and the same command resumes after it. Bit-identical."""
    env = job_env({"RELAUNCH_FAULT": "step.begin:wait_spares:step=2,step.begin:pause:step=6,step.begin:pause:step=13",
                   "RELAUNCH_FAULT_DIR": str(tmp_path)})
    command = ("run", str(CONFIG), *SHORT, AS_SHIPPED_SPARES, MEMORY_TIER, *trial.overrides, "--address",
               cluster.address)
    proc = start_relaunch(*command, env=env, log=tmp_path / "job.log")
    added = False
    try:
        wait_paused(tmp_path, proc, 1)  # as step 6 begins
        train_node = trial.events("loaded")[-1]["nodes"][0]
        drain_while_paused(cluster, trial, tmp_path, proc, 1, train_node)
        cluster.kill_node(cluster.node_of(train_node))
        wait_paused(tmp_path, proc, 2)  # as step 13 begins
        proc.send_signal(signal.SIGTERM)
        termed = time.monotonic()
        while "[relaunch] SIGTERM: stopping" not in (tmp_path / "job.log").read_text():  # the driver has it
            assert time.monotonic() < termed + 30 and proc.poll() is None, log_tail(tmp_path / "job.log")
            time.sleep(0.1)
        time.sleep(1.0)  # and the Supervisor: told by the driver's thread as the signal was noted
        (tmp_path / "go").touch()
        assert proc.wait(timeout=60) == 143, log_tail(tmp_path / "job.log")
        stopped_in = time.monotonic() - termed
        cluster.add_node()
        added = True
    finally:
        if proc.poll() is None:
            proc.kill()
        if not added:
            cluster.add_node()
    preemption, = trial.events("preemption")
    assert (preemption["node"], preemption["global_step"], preemption["ranks"], preemption["fallback"]) == \
        (train_node, 6, [0, 1], None)
    assert train_node not in preemption["to"] and preemption["secs"] < 20
    assert not trial.events("failure") and not trial.events("restart")
    recovery, = trial.events("recovery")
    assert (recovery["cause"], recovery["source"], recovery["replayed_steps"], recovery["global_step"]) == \
        ("preemption", "memory", 0, 7)
    # the ranks' digests of their parts, taken before they moved and after, matched: the weights were not gathered
    assert "the moved ranks hold what they held: every rank's digest of its part matches" in \
        (tmp_path / "job.log").read_text()

    interrupted, = trial.events("interrupted")
    assert (interrupted["signal"], interrupted["global_step"], trial.stats()[-1]["global_step"]) == ("SIGTERM", 13, 13)
    assert stopped_in < 25 + 10, stopped_in  # recover.term_grace_secs, and Ray's shutdown
    last = (tmp_path / "job.log").read_text().strip().splitlines()[-1]
    assert last == "relaunch: stopped by SIGTERM after global step 13 (saved at global step 13); the same command " \
                   "resumes", last
    assert not (trial.root / "run.lock").exists()  # the trial's lock released: the same command may run now

    r = relaunch(*command)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert trial.events("loaded")[-1]["global_step"] == 13  # nothing trained again
    assert_recovered_exactly(trial, reference, restarts=0)


def test_drains_of_the_spares_node_then_of_a_node_with_the_ranks_and_an_engine_cost_the_run_nothing(
        cluster, reference, trial, tmp_path):
    """Five engines and two ranks fill the cluster (so the ranks' node carries an engine too, or each rank's node
    two if Ray splits them), with three warm spares wanted and no room for them. A third worker node is added: the
    spares fill it and hold the ranks' memory-tier copies. Paused as step 4 begins, the spares' node gets a
    preemption notice (`ray drain-node`, 30 s): the spares are retired at the boundary, refilled after the next
    step on a fourth node, and the drained node is killed once the job says so. Paused as step 8 begins, the
    ranks' node (with its engines) gets one: each rank there hands its place to the spare holding its copy of
    step 8, spares not taking a rank's place are released to make room, the engines are replaced in it, and that
    node is killed too. Nothing fails, no retry is spent, nothing is trained again, bit-identical."""
    env = job_env({"RELAUNCH_FAULT": "step.begin:wait_spares:step=2,step.begin:pause:step=4,"
                                     "step.begin:wait_spares:step=6,step.begin:pause:step=8",
                   "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *SHORT, "cluster.n_rollout_workers=5", "recover.spare_workers=3",
                          MEMORY_TIER, *trial.overrides, "--address", cluster.address, env=env,
                          log=tmp_path / "job.log")
    workers = {n.node_id for n in cluster.workers}
    drained = []
    try:
        deadline = time.time() + 300
        while not trial.events("loaded"):
            assert time.time() < deadline and proc.poll() is None, log_tail(tmp_path / "job.log")
            time.sleep(0.2)
        spares_node = cluster.add_node().node_id  # the only room for the spares (wait_spares, as step 2 begins)
        wait_paused(tmp_path, proc, 1)  # as step 4 begins
        refill_node = cluster.add_node().node_id  # the room the retired spares come back to
        drained.append(spares_node)
        drain_while_paused(cluster, trial, tmp_path, proc, 1, spares_node)
        cluster.kill_node(cluster.node_of(spares_node))

        wait_paused(tmp_path, proc, 3)  # as step 8 begins
        rank_nodes = trial.events("loaded")[-1]["nodes"]
        ranks_node = rank_nodes[0]
        drained.append(ranks_node)
        drain_while_paused(cluster, trial, tmp_path, proc, 3, ranks_node)
        cluster.kill_node(cluster.node_of(ranks_node))
        assert proc.wait(timeout=300) == 0, log_tail(tmp_path / "job.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        restore_workers(cluster, workers, drained)
    spares_drain, ranks_drain = trial.events("preemption")
    assert (spares_drain["node"], spares_drain["ranks"], spares_drain["engines"], spares_drain["fallback"]) == \
        (spares_node, [], [], None)
    assert len(spares_drain["spares"]) == 3, spares_drain
    refills = [e for e in trial.events("spares") if e["action"] == "refilled" and e["time"] > spares_drain["time"]]
    assert refills and all(set(e["nodes"]) == {refill_node} for e in refills), refills  # after the step, elsewhere

    ranks = [r for r, n in enumerate(rank_nodes) if n == ranks_node]
    assert (ranks_drain["node"], ranks_drain["global_step"], ranks_drain["ranks"], ranks_drain["fallback"]) == \
        (ranks_node, 8, ranks, None)
    # the node was full: its ranks and engines filled its 3 CPUs; their replacements fill the spares' node
    assert len(ranks_drain["engines"]) == 3 - len(ranks) and set(ranks_drain["to"]) == {refill_node}, ranks_drain
    replaced, = trial.events("engines_restarted")  # by new engines, where spares that took no rank's place were
    assert replaced["replaced"] == ranks_drain["engines"]
    released = [e for e in trial.events("spares") if e["action"] == "released"]
    assert len(released) == 1 and released[0]["pool"] == len(ranks), released  # the adopters were kept
    assert not trial.events("failure") and not trial.events("restart")
    recovery = trial.events("recovery")[-1]
    assert (recovery["cause"], recovery["source"], recovery["replayed_steps"], recovery["global_step"]) == \
        ("preemption", "memory", 0, 9)
    assert "the moved ranks hold what they held: every rank's digest of its part matches" in \
        (tmp_path / "job.log").read_text()
    assert_recovered_exactly(trial, reference, restarts=0)


def restore_workers(cluster, workers: set[str], drained: list[str]) -> None:
    """The shared cluster as the next test expects it, whatever happened: as many worker nodes as before, none of
    them draining (nodes this test drained are killed; those it added beyond the count go too)."""
    for node in list(cluster.workers):
        if node.node_id in drained:
            cluster.kill_node(node)
    while len(cluster.workers) > len(workers):
        cluster.kill_node(next(n for n in reversed(cluster.workers) if n.node_id not in workers))
    while len(cluster.workers) < len(workers):
        cluster.add_node()


def test_a_node_with_a_rank_and_an_engine_is_one_incident_and_one_retry(cluster, reference, trial, tmp_path):
    """Five engines and two ranks fill the cluster, so the node of a rank carries an engine too. Every engine
    hangs in step 6's rollout, so the node's death is seen first on its engine (the engines are restarted) and
    then on its rank, while the engines are resynced: one incident, one retry (recover.retries=1 suffices)."""
    hangs = ["RolloutWorker.generate.enter:hang:step=6"] * 5
    env = job_env({"RELAUNCH_FAULT": ",".join(hangs), "RELAUNCH_FAULT_DIR": str(tmp_path)})
    # no time window: only the node, which Ray has dead by the time the rank's death is seen, makes it one incident
    proc = start_relaunch("run", str(CONFIG), *SHORT, "cluster.n_rollout_workers=5", "recover.spare_workers=0",
                          "recover.retries=1", "recover.incident_secs=0", *trial.overrides, "--address",
                          cluster.address, env=env,
                          log=tmp_path / "job.log")
    added = False
    try:
        deadline = time.time() + 300
        while len(list(tmp_path.glob("fired-*"))) < len(hangs):  # every engine is in step 6's rollout
            assert proc.poll() is None and time.time() < deadline, log_tail(tmp_path / "job.log")
            time.sleep(0.2)
        train_node = trial.events("loaded")[0]["nodes"][0]
        cluster.kill_node(cluster.node_of(train_node))
        cluster.add_node()  # room for the replacements: the cluster had none to spare
        added = True
        assert proc.wait(timeout=400) == 0, log_tail(tmp_path / "job.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        if not added:
            cluster.add_node()
    failures = trial.events("failure")
    assert (failures[0]["cause"], failures[0]["node"]) == ("engine_died", train_node)
    assert any(e["cause"] == "worker_died" and e["node"] == train_node and e["node_lost"] for e in failures[1:])
    assert [e["what"] for e in trial.events("restart")] == ["restart_engines"]
    assert [e["what"] for e in trial.events("repair")] == ["restart_train_group"]
    assert_recovered_exactly(trial, reference, restarts=1)


def test_dead_ranks_are_replaced_from_memory_and_no_completed_step_is_trained_again(cluster, reference, trial,
                                                                                     tmp_path):
    """The memory tier (recover.memory auto, two warm spares, each the buddy of one rank on the other node):
    rank 1 killed as step 5 starts training, rank 0 killed after its optimizer step of step 10 (rank 1, which
    took it too, rolls back in place), rank 1 killed after step 16's commit (its copy may or may not have
    landed: the step is restored with what it still owed, or trained again as the step in flight), and rank 0
    SIGSTOPped as step 21 starts training (a hang: the stopped rank is the culprit rank 1 waits on; it is killed
    and rank 1 rolls back in place). Each repair whose lost rank had a buddy on another node comes from memory
    and trains no completed step again; the others come from disk; the run ends bit-identical."""
    faults = ",".join(["step.begin:wait_spares:step=2", "TrainWorker.train.enter:kill:step=5:rank=1",
                       "TrainWorker.train.exit:kill:step=10:rank=0", "step.begin:wait_spares:step=13",
                       "step.trained:kill_rank:step=16", "step.begin:wait_spares:step=19",
                       "TrainWorker.train.enter:stop:step=21:rank=0"])
    r = run_with_fault(cluster, trial, tmp_path, faults, "recover.spare_workers=2", MEMORY_TIER, "recover.retries=4",
                       "recover.step_timeout_secs=15")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recoveries = trial.events("recovery")
    assert [(e["source"], e["global_step"], e["replayed_steps"], e["loaded_step"]) for e in recoveries[:2]] == \
        [("memory", 5, 0, 4), ("memory", 10, 0, 9)]
    # after two adoptions both ranks may share a node (where the spares were); a rank is held from memory only
    # if a spare on another node was its buddy when it died
    failures = trial.events("failure")
    assert [(e["cause"], e["global_step"]) for e in failures] == \
        [("worker_died", 5), ("worker_died", 10), ("worker_died", 16), ("hang", 21)]
    for failure, recovery, rank, loaded in zip(failures[2:], recoveries[2:], ("1", "0"), ((15, 16), (20,))):
        buddies = [e["nodes"] for e in trial.events("buddies") if e["time"] < failure["time"]][-1]
        if rank in buddies:
            assert (recovery["source"], recovery["replayed_steps"]) == ("memory", 0)
            assert recovery["loaded_step"] in loaded
        else:
            assert recovery["source"] == "disk"
    assert [e["global_step"] for e in recoveries[2:]] == [16, 21]
    assert [e["source"] for e in trial.events("loaded")] == ["disk"] + [e["source"] for e in recoveries]
    assert [(e["taken"], e["cold"]) for e in trial.events("spares") if e["action"] == "taken"][1:3] == [(1, 0)] * 2
    assert_recovered_exactly(trial, reference, restarts=4)


class BucketTrial(Trial):
    """A trial whose fileroot is a prefix of the S3 server's bucket; its logs and lock in a local directory."""

    def __init__(self, url: str, local_root: Path):
        super().__init__(local_root)
        self.url = url

    @property
    def overrides(self) -> list[str]:
        return [f"cluster.fileroot={self.url}", f"cluster.local_root={self.fileroot}"]


@pytest.mark.quick
def test_the_default_job_on_an_s3_bucket_survives_an_outage_a_lost_node_and_a_killed_rank_bit_identical(
        cluster, s3_server, reference, tmp_path):
    """cluster.fileroot on moto's S3 server, over HTTP through s3fs; every node's disk is its own (LocalCluster)
    and the bucket is the only storage they share. The store goes down at the first object of step 9's background
    save and stays down past every retry (the ranks' and then the Supervisor's cleanup's): that save is skipped
    and training goes on. Back up, the next save commits. The ranks' node is then lost with its disk: the ranks
    started again on the other node load the last commit from the bucket. A rank killed later restarts the
    TrainGroup from the bucket again, and the run ends as the local uninterrupted one did, with nothing
    unpublished left in the bucket and nothing of a checkpoint left on any node's disk."""
    from supervisor.checkpoint.layout import TrialLayout, as_path
    from supervisor.checkpoint.store import RecoverStore

    trial = BucketTrial(s3_server.url(tmp_path.name), tmp_path / "head")
    trial.fileroot.mkdir()
    env = job_env({"RELAUNCH_FAULT": "TrainWorker.train.enter:kill:step=20:rank=1", "RELAUNCH_FAULT_DIR": str(tmp_path)})
    # from disk: the bucket is what this job tests (memory off); retries for 6 s (half the step timeout)
    s3_server.down_at("/globalstep9/rng_rank")
    proc = None
    try:
        proc = start_relaunch("run", str(CONFIG), *SHORT, *trial.overrides, "recover.memory=off",
                              "recover.step_timeout_secs=12", "--address", cluster.address, env=env,
                              log=tmp_path / "job.log")
        deadline = time.time() + 300
        while not trial.events("save_failed") and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        s3_server.up()
        while 14 not in [e["global_step"] for e in trial.events("commit")] and proc.poll() is None:
            time.sleep(0.1)  # step 14's save committed (the first after the outage), then the ranks' node is lost
        train_node = trial.events("loaded")[-1]["nodes"][0]
        lost = time.time()
        cluster.kill_node(cluster.node_of(train_node))
        assert proc.wait(timeout=300) == 0, log_tail(tmp_path / "job.log")
    finally:
        s3_server.up()
        if proc is not None and proc.poll() is None:
            proc.kill()
        if len(cluster.workers) < 2:
            cluster.add_node()
    # skipped: step 9's save, and the epoch's HF export (step 11) if it began before the store was back up
    skipped = trial.events("save_failed")
    got = [(e["global_step"], e["what"], e["action"]) for e in skipped]
    assert got[0] == (9, "background save", "skip") and got[1:] in ([], [(11, "background export", "skip")]), got
    assert all("upload failed after" in e["error"] for e in skipped) and not trial.events("gave_up")
    commits = [e["global_step"] for e in trial.events("commit")]
    assert 9 not in commits and commits[:2] == [4, 14]  # the save after the outage commits
    # each restart loads the last step committed before its failure, from the bucket; the first on other nodes
    assert [f["node"] for f in trial.events("failure") if f["time"] > lost][:1] == [train_node]
    loaded = trial.events("loaded")
    assert [(e["global_step"], e["source"]) for e in loaded] == [(-1, "disk")] + [
        (max(c["global_step"] for c in trial.events("commit") if c["time"] < r["time"]), "disk")
        for r in trial.events("restart")]
    assert train_node not in loaded[1]["nodes"]
    assert all(e["path"].startswith(trial.url + "/checkpoints/") for e in trial.events("commit"))
    assert_recovered_exactly(trial, reference, restarts=2)
    store = RecoverStore(TrialLayout(as_path(trial.url), trial.root.parts[-3], "tiny-grpo", "trial0"), keep_last=2)
    assert store.published_steps() == sorted(set(commits))[-2:]
    assert store.temporaries() == [] and not store.fs.exists(store.layout.lock)  # the lock released
    # the ranks' private copies (written before an upload, downloaded for a load) are gone from every node's disk
    assert [p for disk in cluster.disks.values() for p in disk.glob("relaunch-rank-*")] == []
    # a user with the bucket alone (another machine: a local_root of its own) reads the run's status from it
    elsewhere = relaunch("status", str(CONFIG), f"cluster.fileroot={trial.url}",
                         f"cluster.local_root={tmp_path / 'elsewhere'}", "--json")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert {k: v for k, v in json.loads(elsewhere.stdout).items() if k in ("state", "restarts", "last_step")} == {
        "state": "done", "restarts": 2, "last_step": trial.stats()[-1]}


@pytest.mark.quick
def test_a_rank_killed_in_the_first_steps_of_the_job_as_shipped_is_recovered_from_memory(cluster, reference, trial,
                                                                                       tmp_path):
    """The default job as shipped, nobody waiting for the spares: the pool starts with the TrainGroup and its
    spares hold the ranks' copies from their start, before they are warm, so a rank SIGKILLed as step 2 trains
    (then the other as step 5 does) is replaced from memory, no completed step trained again, bit-identical to
    the reference, whose prompts this job reads from a directory saved by HF datasets."""
    faults = "TrainWorker.train.enter:kill:step=2:rank=1,TrainWorker.train.enter:kill:step=5:rank=0"
    r = run_with_fault(cluster, trial, tmp_path, faults, AS_SHIPPED_SPARES, MEMORY_TIER, data_as("saved", tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recoveries = trial.events("recovery")
    assert [(e["global_step"], e["source"], e["replayed_steps"]) for e in recoveries] == \
        [(2, "memory", 0), (5, "memory", 0)], recoveries
    # the first link was made before the first step: every step's copy was held
    buddies = trial.events("buddies")
    assert buddies and buddies[0]["time"] < min(e["time"] for e in trial.events("commit"))
    assert_recovered_exactly(trial, reference, restarts=2)


def test_without_spares_the_ranks_hold_each_other_and_a_dead_one_is_replaced_from_its_peer_memory(
        cluster, reference, trial, tmp_path):
    """No warm spare (recover.spare_workers 0), the memory tier as shipped: each rank holds the other's copies (a
    peer). Rank 1 SIGKILLed as step 1 trains, rank 0 after its optimizer step of step 8 (rank 1 rolls back in
    place), and rank 1 SIGSTOPped as step 14 trains (a hang: it is killed as the culprit): each time a new process
    takes the lost rank's place with the copy its peer gives it, no completed step is trained again, and the run
    ends bit-identical."""
    faults = ",".join(["TrainWorker.train.enter:kill:step=1:rank=1", "TrainWorker.train.exit:kill:step=8:rank=0",
                       "TrainWorker.train.enter:stop:step=14:rank=1"])
    r = run_with_fault(cluster, trial, tmp_path, faults, MEMORY_TIER, "recover.retries=3",
                       "recover.step_timeout_secs=15")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [(e["cause"], e["global_step"]) for e in trial.events("failure")] == \
        [("worker_died", 1), ("worker_died", 8), ("hang", 14)]
    recoveries = trial.events("recovery")
    assert [(e["global_step"], e["source"], e["loaded_step"], e["replayed_steps"]) for e in recoveries] == \
        [(1, "memory", 0, 0), (8, "memory", 7, 0), (14, "memory", 13, 0)], (recoveries, trial.events("buddies"),
                                                                            trial.events("warning"))
    # linked before the first step, each rank to the other
    buddies = trial.events("buddies")
    assert buddies[0]["time"] < trial.events("commit")[0]["time"] and set(buddies[0]["nodes"]) == {"0", "1"}
    assert [e["kept"] for e in trial.events("loaded")] == [[], [0], [1], [0]]
    assert not trial.events("spares")
    assert_recovered_exactly(trial, reference, restarts=3)


def test_a_frozen_holder_is_dropped_and_a_copy_that_never_landed_rolls_back_past_a_committed_step(
        cluster, reference, trial, tmp_path):
    """Two spares, a recover save every step (written in the step). The spare asked to hold rank 0's copies is
    SIGSTOPped as it is asked, before the first step: it is dropped from the pool after one LINK_SECS (not one per
    step), rank 1 is linked meanwhile to the other and rank 0 joins it at the next step. Rank 1's copy of step 7
    then never leaves it (its sender hangs) while step 7 commits, and rank 1 is SIGKILLed as step 8's rollouts
    end: its buddy holds step 6 whole, not 7, so the run rolls back from memory to step 6 and trains step 7 again,
    whose published checkpoint stands (it is not written again: a published step directory never is)."""
    faults = ",".join(["TrainWorker.hold.enter:stop:rank=0", "memory_send:hang:step=7:rank=1",
                       "step.rolled_out:kill_rank:step=8"])
    r = run_with_fault(cluster, trial, tmp_path, faults, "recover.spare_workers=2", MEMORY_TIER, "recover.freq_steps=1",
                       "recover.write_mode=sync")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    dropped = [e for e in trial.events("warning") if "failed while linking" in e["message"]]
    assert len(dropped) == 1 and "dropped from the spare pool" in dropped[0]["message"], trial.events("warning")
    # its LINK_SECS fell before the first step, not on a step's copy (which includes the links made after it)
    assert dropped[0]["time"] < trial.events("commit")[0]["time"]
    assert max(r["time/memory_stage"] for r in trial.stats()) < 20
    recoveries = trial.events("recovery")
    assert [(e["global_step"], e["source"], e["loaded_step"], e["replayed_steps"]) for e in recoveries] == \
        [(8, "memory", 6, 1)], recoveries
    committed = [e["global_step"] for e in trial.events("commit")]
    assert committed == sorted(set(committed)) and 7 in committed  # step 7 committed once, before the fault
    assert_recovered_exactly(trial, reference, restarts=1)
