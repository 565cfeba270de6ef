"""Every benchmark runs in its quick mode, so that none of them rots: it prints its table and its JSON."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from harness import REPO, job_env

pytestmark = pytest.mark.e2e


def bench(name: str, *args: str, tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    try:
        r = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--quick", "--json", str(out), *args],
                           cwd=REPO, env=job_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True,
                           timeout=480)
    except subprocess.TimeoutExpired as e:  # what it printed so far (bytes, whatever `text`) says where it stood
        printed = [(b or b"").decode(errors="replace")[-4000:] for b in (e.stdout, e.stderr)]
        pytest.fail(f"{name} did not end in {e.timeout:g} s:\n" + "\n".join(printed))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text()) | {"stdout": r.stdout}


@pytest.mark.quick
def test_generation_benchmark(tmp_path):
    figures = bench("generation", tmp_path=tmp_path)
    assert figures["rows"] and all(row["same_tokens"] for row in figures["rows"])
    assert "speed-up" in figures["stdout"]


def test_recovery_benchmark(cluster, tmp_path):
    figures = bench("recovery", "--address", cluster.address, tmp_path=tmp_path)
    rec = figures["recovery"]
    # timed to the killed step (quick: step 10), through the steps trained again
    assert figures["identical"] and rec["global_step"] == 10 and rec["total"] > rec["lost"] > 0
    assert rec["replayed_steps"] == 10 - rec["loaded_step"] - 1 and rec["source"] == "disk"
    # side by side: the other rank keeps its process; the killed one starts cold without spares, and comes from
    # the pool with two
    runs = [(r["spare_workers"], r["ranks_from_spares"], r["cold_ranks"], r["kept_ranks"]) for r in figures["runs"]]
    assert runs == [(0, 0, 1, 1), (2, 1, 0, 1)]
    assert "fault -> killed step completed" in figures["stdout"]


def test_ppo_benchmark(cluster, tmp_path):
    """PPO beside GRPO on the tiny job, rank 1 of each group killed at step 8 with one warm spare per group: both
    recover from memory (the benchmark's default source, the tier as shipped), exactly, timed to the killed step,
    nothing trained again; an actor rank's kill takes the actor's spare and keeps the other actor rank and both
    critic ranks, a critic rank's takes the critic's spare and keeps the other critic rank and both actor ranks."""
    figures = bench("ppo", "--address", cluster.address, tmp_path=tmp_path)
    actor, critic = figures["kills"]["PPO, actor rank"], figures["kills"]["PPO, critic rank"]
    assert (actor["group"], critic["group"]) == ("train", "critic")
    for kill in (actor, critic):
        rec = kill["recovery"]
        assert kill["identical"] and rec["global_step"] == 8 and rec["total"] > rec["lost"] > 0
        assert (rec["source"], rec["loaded_step"], kill["replayed_steps"]) == ("memory", 7, 0), rec
    assert (actor["ranks_from_spares"], actor["kept_ranks"], actor["critic_from_spares"], actor["critic_kept"]) == \
        (1, 1, 0, 2)
    assert (critic["ranks_from_spares"], critic["kept_ranks"], critic["critic_from_spares"], critic["critic_kept"]) \
        == (0, 2, 1, 1)
    assert figures["clean"]["PPO"]["period"] > 0 and figures["critic_over_actor"] > 0
    assert "critic rank's kill / actor rank's" in figures["stdout"]


def test_save_benchmark(tmp_path):
    figures = bench("save", "--dir", str(tmp_path), tmp_path=tmp_path)
    assert figures["bytes"] > 0 and 0 < figures["async_steady_blocked_secs"] <= figures["async_steady_total_secs"]
    assert "sync save bandwidth / raw" in figures["stdout"]


def test_store_benchmark(tmp_path):
    figures = bench("store", tmp_path=tmp_path)
    local, s3 = figures["local disk"], figures["S3 (moto, HTTP)"]
    # the same state; DCP's .metadata records the directory it was written into, whose name's length differs
    assert local["bytes"] > 0 and abs(local["bytes"] - s3["bytes"]) < 256
    assert 0 < s3["blocked_secs"] <= s3["total_secs"]
    assert s3["load_secs"] > 0 and "step while it is written" in figures["stdout"]


def test_reward_benchmark(tmp_path):
    """A 50 ms reward service scored for a step's 64 samples one at a time and 16 at once, every reward back in
    order (the benchmark checks it)."""
    figures = bench("reward", tmp_path=tmp_path)
    assert {n: r["most_in_flight"] for n, r in figures["runs"].items()} == {"1": 1, "16": 16}
    assert all(r["secs"] > 0 for r in figures["runs"].values()) and "speed-up over concurrency 1" in figures["stdout"]


def test_baselines_benchmark(cluster, tmp_path):
    """relaunch from memory and from disk, Ray Train and torchrun each recover from the same kill, at a step drawn
    from the first ones (1 to 8; the seed here draws step 1, the earliest), timed to the killed step, each with
    the step it loaded; relaunch with its memory tier as shipped (nobody waiting for its spares) from memory,
    nothing trained again, and so without spares (its ranks holding each other's copies). A system that does not recover, or relaunch's tier that does not serve, fails the
    benchmark (bench asserts exit 0)."""
    figures = bench("baselines", "--address", cluster.address, "--seed", "2", tmp_path=tmp_path)
    [kill_at] = figures["kill_at_steps"]
    assert kill_at == 1 and figures["seed"] == 2
    rows = {r["system"].split(" ")[0] + (r["system"].split(" ")[1] if r["system"].startswith("relaunch") else ""): r
            for r in figures["rows"]}
    assert set(rows) == {"relaunch(memory)", "relaunch(peers)", "relaunch(disk)", "Ray", "torchrun"}
    assert not [r for r in rows.values() if "error" in r], figures["stdout"][-3000:]
    for row in rows.values():
        assert row["kill_at_step"] == kill_at
        assert row["recovery_secs"] > 0 and row["median_step_secs"] > 0
        assert row["cost_secs"] == row["recovery_secs"] - row["median_step_secs"]
        assert row["replayed_steps"] == kill_at - row["loaded_step"] - 1
    # torchrun's loop checkpoints synchronously before each step: it loads the step before the killed one; the
    # memory tier holds the step before the killed one too, and trains nothing again
    assert rows["torchrun"]["loaded_step"] == kill_at - 1
    for name in ("relaunch(memory)", "relaunch(peers)"):  # without spares too: the ranks hold each other's copies
        assert (rows[name]["loaded_step"], rows[name]["replayed_steps"]) == (kill_at - 1, 0)
        assert rows[name]["breakdown"]["global_step"] == kill_at and rows[name]["breakdown"]["source"] == "memory"
    # the kill's own clock, not an earlier fault point's
    for name in ("relaunch(memory)", "relaunch(peers)", "relaunch(disk)"):
        assert abs(rows[name]["recovery_secs"] - rows[name]["breakdown"]["total"]) < 1.0, rows[name]
    assert "kill -> killed step done" in figures["stdout"] and "--seed" in figures["stdout"]


def test_memory_tier_benchmark(cluster, tmp_path):
    """The tiny job with the memory tier and without, side by side: a step figure for each, the tier's two parts
    on the step, and the buddies it linked (the benchmark refuses a run whose tier never linked)."""
    figures = bench("memory_tier", "--address", cluster.address, tmp_path=tmp_path)
    assert figures["size"] == "tiny" and figures["steps_with_tier"] == figures["steps_without"] == 10
    assert figures["step_with_tier"] > 0 and figures["step_without"] > 0 and figures["memory_stage"] > 0
    assert set(figures["buddies"]) == {"0", "1"}
    assert "the tier's cost" in figures["stdout"]


def test_goodput_benchmark(cluster, tmp_path):
    figures = bench("goodput", "--address", cluster.address, tmp_path=tmp_path)
    assert figures["faults"] >= 1 and figures["restarts"] >= 1 and figures["steps"] == 24
    assert figures["failures"].get("worker_died", 0) >= 1
    assert 0 < figures["goodput"] < 1
    assert "goodput" in figures["stdout"]


def test_overhead_benchmark(cluster, tmp_path):
    figures = bench("overhead", "--address", cluster.address, tmp_path=tmp_path)
    # 12 steps; the first has no period (from the previous row's write) and is left out of both
    assert figures["steps"] == 11 and figures["bare_step_secs"][0] > 0 and figures["supervisor_step_secs"][0] > 0
    assert "Supervisor overhead" in figures["stdout"]


def test_step_benchmark(tmp_path):
    """Tiny, one epoch: every phase of the step has a figure, and each actor kind's peak memory."""
    run = bench("step", tmp_path=tmp_path)["runs"][0]
    assert run["size"] == "tiny" and run["steps"] == 11
    assert run["median"]["train"] > 0 and run["mean"]["push"] > 0 and run["mean"]["save"] > 0
    assert 0 < run["outside_share_mean"] < 1
    assert all(run["memory_gb"][k] > 0 for k in ("train", "engine", "supervisor"))
    assert 0.85 < run["memory_gb"]["train"] / run["planned_train_gb"] < 1.15  # plan's prediction of a rank's peak


def test_weight_sync_benchmark(cluster, tmp_path):
    """The object-store push, the stream and the shared-memory writes side by side; after each kind of sync the
    engine holds the trainer's weights bitwise, and the two kinds give the same digest."""
    figures = bench("weight_sync", "--address", cluster.address, tmp_path=tmp_path)
    labels = [row[0] for row in figures["rows"]]
    assert labels[1:8] == ["object-store push (before)", "stream (after)", "shared memory (after, same host)",
                           "memcpy of the same bytes", "speed-up stream / object store",
                           "speed-up shared memory / object store", "bandwidth / memcpy: object store, stream, shared"]
    assert figures["stream_equals_trainer"] and figures["shared_equals_trainer"] and figures["digests_agree"]
    assert figures["bytes"] > 0 and figures["stream_secs"] > 0 and figures["shared_secs"] > 0
    assert figures["object_store_secs"] > 0
    assert "speed-up shared memory / object store" in figures["stdout"]


def test_drain_benchmark(tmp_path):
    """The ranks' node lost after step 8, killed and then drained before it is killed, side by side on a cluster of
    the benchmark's own: both from memory with nothing trained again; the drained one sees no failure and spends
    no retry, and its figures start at the notice (no detection). Then Ray Train's preemption path, drained 20 s
    ahead and killed at the deadline."""
    figures = bench("recovery", "--drain", tmp_path=tmp_path)
    killed, drained = figures["runs"]["killed"], figures["runs"]["drained, then killed"]
    assert killed["failures"] >= 1 and (killed["retries"], killed["recovery"]["cause"]) == (1, "worker_died")
    assert (drained["failures"], drained["retries"], drained["recovery"]["cause"]) == (0, 0, "preemption")
    assert drained["preemption"]["ranks"] == [0, 1] and drained["preemption"]["fallback"] is None
    for run in (killed, drained):
        assert (run["recovery"]["source"], run["recovery"]["replayed_steps"]) == ("memory", 0) and run["identical"]
    assert drained["recovery"]["detection"] == 0 < killed["recovery"]["detection"]
    assert "lost beyond one steady step" in figures["stdout"]
    # Ray Train's own preemption path beside it, on the same cluster: its loop is told (get_preemption_info),
    # trains on until the deadline, and its group restarts whole from the last checkpoint once the node went
    ray_train = figures["ray_train"]
    assert ray_train["system"].startswith("Ray Train") and ray_train["notice_seen_secs"] is not None
    assert ray_train["steps_before_the_node_went"] >= 1 and ray_train["total"] > ray_train["lost"] > 0
    assert ray_train["replayed_steps"] >= 0 and "restart at the deadline" in figures["stdout"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (./dev.sh installs it)")
def test_engine_kill_benchmark(cluster, tmp_path):
    """An engine SIGKILLed at step 6, the built-in engine and vLLM with a warm spare side by side: each timed to
    the killed step (the event's clock agrees with the kill's marker), nothing trained again, and vLLM's engine
    taken from the spare."""
    figures = bench("recovery", "--engine-kill", "--address", cluster.address, tmp_path=tmp_path)
    runs = {r["engine"]: r for r in figures["runs"]}
    assert list(runs) == ["hf", "vllm, warm spare"] and figures["size"] == "tiny"
    for run in runs.values():
        rec = run["recovery"]
        assert (rec["cause"], rec["global_step"], rec["replayed_steps"]) == ("engine_died", 6, 0)
        # lost = total - one steady step: a spare engine's repair costs about a step, so its `lost` may be below 0
        assert rec["total"] > 0 and rec["lost"] == pytest.approx(rec["total"] - rec["steady_step"], abs=0.01), rec
        assert abs(run["kill_to_done_secs"] - rec["total"]) < 1.0, rec
    assert [r["from_spares"] for r in runs.values()] == [0, 1]
    assert "lost beyond one steady step" in figures["stdout"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (./dev.sh installs it)")
def test_engines_benchmark(tmp_path):
    """Both engines at tiny: generation, and the weight sync (for vLLM into its model and read back) with its
    bandwidth beside a memcpy of the same bytes."""
    rows = bench("engines", tmp_path=tmp_path)["rows"]
    assert [(r["size"], r["engine"]) for r in rows] == [("tiny", "hf"), ("tiny", "vllm")]
    for row in rows:
        assert row["tokens_per_sec"] > 0 and row["weight_bytes"] > 0
        assert 0 < row["sync_secs"] and 0 < row["sync_gbps"] and 0 < row["memcpy_gbps"]
        assert row["share_of_memcpy"] == row["sync_gbps"] / row["memcpy_gbps"] > 0
    assert rows[1]["reload_secs"] > 0 and rows[1]["digest_secs"] > 0


@pytest.mark.quick
def test_gpu_benchmark_report_of_the_recorded_h200_run(tmp_path):
    """benchmarks/gpu.py needs a GPU to run; its report and plot are drawn here from the run docs/ records."""
    r = subprocess.run([sys.executable, "benchmarks/gpu.py", "--from", "docs/gpu-h200.json", "--plot",
                        str(tmp_path / "gpu.png")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NVIDIA H200" in r.stdout and "weight sync in place (CUDA IPC)" in r.stdout
    assert (tmp_path / "gpu.png").stat().st_size > 10_000
