"""How users meet the product: Ray Jobs against a `ray start` cluster, live status, demo and plots."""
from __future__ import annotations

import getpass
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import (CONFIG, DEFAULT_JOB, REPO, RayStartCluster, Trial, job_env, kill_session, log_tail, relaunch,
                     status_json)

from supervisor.testing.local_cluster import free_port, short_tmp
from supervisor.testing.processes import command_line, kill_all

pytestmark = pytest.mark.e2e


@pytest.fixture
def ray_start_cluster():
    c = RayStartCluster()
    try:
        yield c
    finally:
        c.shutdown()


def test_submitted_job_survives_a_node_kill(ray_start_cluster, trial):
    from ray.job_submission import JobStatus

    c = ray_start_cluster
    node_a = c.add_worker()  # the only place the TrainGroup fits until the spare joins
    # the default job as shipped, on vLLM (60 steps), long enough to ask the live Supervisor and kill a node mid-run
    # the restart after the kill waits for the spare's node to join (its `ray start` may be tried again: 30 s each)
    r = relaunch("submit", str(DEFAULT_JOB.relative_to(REPO)), *trial.overrides, "recover.capacity_timeout_secs=300",
                 "--address", c.jobs_address, env=c.env)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[1]
    assert "ray job logs --follow" in r.stdout

    client = c.jobs_client()
    deadline = time.time() + 300
    while not (trial.stats() and trial.stats()[-1]["global_step"] >= 6):
        # what the job printed and where it stands, for a run that does not get there (once: 300 s on a loaded CI)
        assert time.time() < deadline, f"the job did not reach step 6: {[e['event'] for e in trial.events()]}\n" + \
            client.get_job_logs(job_id)[-3000:]
        assert client.get_job_status(job_id) in (JobStatus.PENDING, JobStatus.RUNNING), \
            client.get_job_logs(job_id)[-3000:]
        time.sleep(0.3)
    # the node is killed as soon as the job is past step 6, before anything slow: CI's two loaded cores once took
    # the job from step 6 to step 42 while `relaunch status` started. The spare is added only after the live
    # Supervisor has answered: the repair waits for it (recover.capacity_timeout_secs), so the job cannot end first
    assert client.get_job_status(job_id) == JobStatus.RUNNING
    c.kill(node_a)
    while not trial.events("failure"):
        assert time.time() < deadline, "the node's loss was not detected"
        time.sleep(0.3)
    st = status_json(trial, "--address", c.gcs_address, env=c.env)
    live = st["live"]
    assert live, st["live_error"]
    assert live["phase"] and live["global_step"] >= 6 and live["restarts"] >= 1, live  # (an engine there: replaced)
    c.add_worker()  # the spare
    while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.time() < deadline + 300
        time.sleep(0.5)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, client.get_job_logs(job_id)[-3000:]
    st = status_json(trial)
    assert st["restarts"] >= 1 and st["state"] == "done" and st["last_valid"]["global_step"] == 59
    assert trial.events("failure")[0]["cause"] in ("worker_died", "engine_died")


def test_demo_runs_to_its_end_and_plots(tmp_path):
    """Beside a real Ray cluster's address file, which the demo leaves as it found it."""
    fileroot = tmp_path / "runs"
    ray_tmp = short_tmp("dem")
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("10.1.2.3:6379")
    r = relaunch("demo", f"cluster.fileroot={fileroot}", env=job_env({"RAY_TMPDIR": str(ray_tmp)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[demo] timeline:" in r.stdout
    # the killed node's rank is replaced from memory: the spares on the other node held its copies from their
    # start, and nothing completed is trained again
    assert "fault detected" in r.stdout and "TrainGroup rejoined on node" in r.stdout, r.stdout[-3000:]
    assert "0 completed steps trained again (from memory)" in r.stdout
    assert "engines resynced to weights version" in r.stdout and "job finished at step 59" in r.stdout
    assert "cluster shut down" in r.stdout
    assert (ray_tmp / "ray" / "ray_current_cluster").read_text() == "10.1.2.3:6379"

    trial_name = next((fileroot / "logs").glob("*/tiny-grpo/demo-*")).name
    plot = fileroot / "logs" / getpass.getuser() / "tiny-grpo" / trial_name / "curves.png"
    assert r.stdout.splitlines()[-1] == f"[demo] reward and loss per step, the fault and the restart marked: {plot}"
    assert plot.stat().st_size > 10_000
    out = tmp_path / "curves.png"
    r = relaunch("plot", str(CONFIG), f"cluster.fileroot={fileroot}", f"trial_name={trial_name}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    from PIL import Image

    with Image.open(out) as img:
        assert img.format == "PNG" and img.size[0] > 500 and img.size[1] > 300


@pytest.mark.quick
def test_plot_without_a_run_is_a_clear_error(tmp_path):
    r = relaunch("plot", str(CONFIG), f"cluster.fileroot={tmp_path}", "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "stats.jsonl" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.quick
def test_gpu_example_config_passes_validation(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from supervisor.config import Backend, load_config

    # Stand-in for the real model directory the example names: any HF directory with config.json.
    model_dir = tmp_path / "model"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(model_dir)
    cfg = load_config(REPO / "examples" / "gpu" / "qwen2.5-0.5b-grpo.yaml", [f"model.path={model_dir}"])
    assert cfg.cluster.gpus_per_worker >= 1 and cfg.cluster.n_train_workers >= 8
    assert cfg.actor.backend is Backend.FSDP and cfg.recover.mode.enabled
    r = relaunch("run", str(REPO / "examples" / "gpu" / "qwen2.5-0.5b-grpo.yaml"))
    assert r.returncode == 2 and "model.path" in r.stderr  # the example's model is not on this machine


def documented_recipe() -> str:
    """The bash block of docs/cli.md's cluster section, as a user copies it."""
    text = (REPO / "docs" / "cli.md").read_text()
    section = text[text.index("## Ray Jobs on a cluster of your own"):]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def free_ports_from(n: int = 3) -> int:
    """A port P with P .. P + n - 1 all free (the recipe derives its agents' ports from one)."""
    while True:
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def test_the_documented_cluster_recipe_runs_as_written(tmp_path):
    """docs/cli.md's commands as written, but for their ports, the fileroot and a one-epoch job; in a shell whose
    HOME has no Ray token yet and no RAY_AUTH_MODE, as a user's starts. The job succeeds, and the last command
    stops every process of that cluster (the test kills only what its own session left, and expects nothing)."""
    gcs, jobs, agents = free_port(), free_port(), free_ports_from()
    ports = "GCS=6379 JOBS=8265 AGENTS=52365"
    assert ports in documented_recipe()
    script = (documented_recipe().replace(ports, f"GCS={gcs} JOBS={jobs} AGENTS={agents}")
              .replace("$PWD/runs", str(tmp_path / "runs"))
              .replace("configs/tiny_grpo.yaml", "configs/tiny_grpo.yaml total_train_epochs=1"))
    home = tmp_path / "home"
    home.mkdir()
    env = dict(job_env(), HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_AUTH_MODE", None)
    log = tmp_path / "recipe.log"
    proc = subprocess.Popen(["bash", "-e", "-c", script + "wait\n"], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    def of_this_cluster() -> list[int]:
        return [pid for pid in psutil.pids() if f":{gcs}" in " ".join(command_line(pid))]

    try:
        assert proc.wait(timeout=900) == 0, log_tail(log)
        out = log.read_text()
        assert "SUCCEEDED" in out and "state      done" in out, out[-3000:]
        assert (home / ".ray" / "auth_token").is_file()
        deadline = time.time() + 30
        while of_this_cluster() and time.time() < deadline:
            time.sleep(0.5)
        assert of_this_cluster() == [], "the documented kill left processes of the cluster running"
    finally:
        kill_session(proc.pid)
        kill_all(of_this_cluster())
    trial = Trial(tmp_path / "runs")
    assert [s["global_step"] for s in trial.stats()] == list(range(12))
