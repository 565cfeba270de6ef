"""actor.backend deepspeed (ZeRO-2 and ZeRO-3) with a KL reference policy, on real multi-node Ray clusters
(and, last, the same reference policy on fsdp).

Per stage, two jobs on one shared cluster: the default job uninterrupted, and the same job with a rank
SIGKILLed mid-update and, later, the whole job killed while a rank hangs, then rerun. Every other
check (reference file, export, zero_to_fp32, the other backend) reads those runs' outputs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from harness import CONFIG, MEMORY_TIER, Trial, job_env, kill_session, log_tail, relaunch, start_relaunch, status_json
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

# The default job (60 steps, recover every 5) on DeepSpeed, with a KL term whose reference is refreshed
# after steps 9, 19, ..., 59; recover checkpoints at steps 4, 9, 14, ...
DEEPSPEED = ["actor.backend=deepspeed", "actor.kl_coef=0.05", "actor.ref_update_steps=10"]
RANK_KILL_STEP, JOB_KILL_STEP = 17, 26   # resume from step 14 (ref of step 9), then from 24 (ref of step 19)


def curve(stats: list[dict]) -> list[tuple]:
    return [(r["global_step"], r["reward"], r["loss"], r["grad_norm"], r["kl"]) for r in stats]


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def stage(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def uninterrupted(cluster, stage, tmp_path_factory) -> Trial:
    t = Trial(tmp_path_factory.mktemp(f"zero{stage}") / "runs")
    r = relaunch("run", str(CONFIG), *DEEPSPEED, f"actor.zero_stage={stage}", "recover.spare_workers=0", *t.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return t


@pytest.fixture(scope="module")
def interrupted(cluster, stage, tmp_path_factory) -> Trial:
    """A rank killed mid-update (restarted inside the job); later a rank hangs at step JOB_KILL_STEP and the
    whole job is killed (its driver, and with it every actor it owns) and run again."""
    tmp = tmp_path_factory.mktemp(f"zero{stage}-broken")
    t = Trial(tmp / "runs")
    env = job_env({"RELAUNCH_FAULT": f"TrainWorker.train.enter:kill:step={RANK_KILL_STEP}:rank=1,"
                                     f"TrainWorker.train.enter:hang:step={JOB_KILL_STEP}:rank=0",
                   "RELAUNCH_FAULT_DIR": str(tmp)})
    # two retries: the rank kill's, and one if the dying Supervisor sees the job kill's ranks die first
    args = ["run", str(CONFIG), *DEEPSPEED, f"actor.zero_stage={stage}", "recover.backoff_secs=0",
            "recover.retries=2", *t.overrides, "--address", cluster.address]
    proc = start_relaunch(*args, env=env, log=tmp / "run0.log")
    try:
        t.wait_for_step(JOB_KILL_STEP - 1, proc)  # the step before the hang: step 24's commit is behind it
        deadline = time.time() + 120
        while not list(tmp.glob("fired-1-*")):  # and the rank hangs (else the rerun would hang there)
            assert proc.poll() is None and time.time() < deadline, log_tail(tmp / "run0.log")
            time.sleep(0.1)
    finally:
        kill_session(proc.pid)
        proc.wait()
    r = relaunch(*args, env=env)  # every fault has fired once: the rerun goes to the end
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return t


def test_the_default_job_learns_on_deepspeed(uninterrupted):
    stats = uninterrupted.stats()
    assert [s["global_step"] for s in stats] == list(range(60))
    first, last = (sum(s["reward"] for s in part) / 10 for part in (stats[:10], stats[-10:]))
    assert last > first + 0.3, (first, last)
    evals = [s["eval/reward"] for s in stats if "eval/reward" in s]
    assert evals[-1] > evals[0] + 0.2, evals
    # the reference is the policy right after each refresh (steps 9, 19, ...), and falls behind it in between
    assert [s["global_step"] for s in stats if s["kl"] == 0] == list(range(0, 60, 10))
    saves = [s for s in stats if "ckpt/bytes" in s]
    assert [s["global_step"] for s in saves] == list(range(4, 60, 5))
    assert all(s["ckpt/bytes"] > 0 and s["ckpt/MBps"] > 0 and s["time/saving"] > 0 for s in saves)


def test_a_killed_rank_and_a_killed_job_end_bit_identical(interrupted, uninterrupted):
    failures = [(e["global_step"], e["cause"]) for e in interrupted.events("failure")]
    # the rank kill; the job kill may also be seen by the dying Supervisor (Ray ends the job's ranks first)
    assert failures[0] == (RANK_KILL_STEP, "worker_died") and all(step == JOB_KILL_STEP for step, _ in failures[1:])
    first_job = interrupted.events("start")[0]["job"]
    restarts = [e["cause"] for e in interrupted.events("restart") if e["job"] == first_job]
    assert restarts[0] == "worker_died" and len(restarts) <= 2, restarts  # the slack: the job kill, seen or not
    assert [e["global_step"] for e in interrupted.events("loaded")] == [-1, 14, 24]
    assert curve(interrupted.stats()) == curve(uninterrupted.stats())  # kl included: the reference came back exactly
    assert interrupted.final_weights() == uninterrupted.final_weights()
    st = status_json(interrupted)
    assert st["state"] == "done" and st["restarts"] == 0  # the rerun: every fault fired in the first job


def test_the_reference_is_written_only_on_its_update_steps(interrupted, uninterrupted):
    for trial in (uninterrupted, interrupted):
        recover = trial.root / "default" / "recover_checkpoint"
        # keep_last 2 leaves steps 54 and 59, which need the references of steps 49 and 59; older ones are pruned
        assert sorted(p.name for p in (recover / "reference").iterdir()) == \
            ["ref_globalstep49.safetensors", "ref_globalstep59.safetensors"]
        manifest = json.loads((recover / "globalstep54" / "manifest.json").read_text())
        assert "../reference/ref_globalstep49.safetensors" in manifest["files"]
        ref49 = recover / "reference" / "ref_globalstep49.safetensors"
        assert ref49.stat().st_mtime_ns < (recover / "globalstep54" / "manifest.json").stat().st_mtime_ns
        ds = recover / "globalstep59"
        assert (ds / "latest").read_text() == "global_step59" and (ds / "global_step59").is_dir()
        assert sorted(p.name for p in ds.glob("*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]  # data state: meta/
    for name in ("ref_globalstep49.safetensors", "ref_globalstep59.safetensors"):
        a = uninterrupted.root / "default" / "recover_checkpoint" / "reference" / name
        b = interrupted.root / "default" / "recover_checkpoint" / "reference" / name
        assert a.read_bytes() == b.read_bytes()


def test_export_and_zero_to_fp32_read_the_deepspeed_checkpoint(uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step_dir = uninterrupted.root / "default" / "recover_checkpoint" / "globalstep59"
    out = tmp_path / "hf"
    r = relaunch("export", str(step_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr
    exported = load_file(out / "model.safetensors")
    saver = load_file(uninterrupted.exports()[-1] / "model.safetensors")  # the job's own export of step 59
    assert exported.keys() == saver.keys() and all(torch.equal(exported[k], saver[k]) for k in saver)
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    ids = tok("7 3 =", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=1, do_sample=False)
    assert tok.decode(generated[0, -1:]).strip() in [str(d) for d in range(10)]
    # DeepSpeed's own script, as it wrote it into our step directory, reads the step directory as it is
    fp32 = tmp_path / "fp32"
    # (its --safe_serialization refuses the tied embedding, so the torch format)
    z = subprocess.run([sys.executable, str(step_dir / "zero_to_fp32.py"), str(step_dir), str(fp32)],
                       capture_output=True, text=True, timeout=300)
    assert z.returncode == 0, z.stderr[-2000:]
    merged = torch.load(next(fp32.glob("*.bin")), weights_only=True)
    assert all(torch.equal(merged[k], saver[k]) for k in saver)
    # the checkpoint tools read it too: verify against the export, inspect names the engine and the reference
    assert relaunch("verify", str(out), "--against", str(step_dir)).returncode == 0
    inspected = relaunch("inspect", str(step_dir))
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    assert "valid        yes" in inspected.stdout and "MISSING" not in inspected.stdout


def test_a_deepspeed_checkpoint_given_to_fsdp_stops_with_exit_2(cluster, uninterrupted):
    before = sorted(p.name for p in (uninterrupted.root / "default" / "recover_checkpoint").iterdir())
    r = relaunch("run", str(CONFIG), *DEEPSPEED, "actor.backend=fsdp",
                 *uninterrupted.overrides, "--address", cluster.address)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "written by actor.backend deepspeed, but this run has actor.backend fsdp" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in (uninterrupted.root / "default" / "recover_checkpoint").iterdir()) == before


def test_the_fsdp_engine_restores_its_reference_exactly(cluster, tmp_path):
    """The KL reference on fsdp: a rank killed between two refreshes resumes bit-identical (kl included)."""
    job = ["total_train_epochs=2", "actor.kl_coef=0.05", "actor.ref_update_steps=10", "recover.backoff_secs=0"]
    trials = {}
    for name, fault in (("whole", None), ("killed", f"TrainWorker.train.enter:kill:step={RANK_KILL_STEP}:rank=1")):
        trials[name] = t = Trial(tmp_path / name / "runs")
        env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)} if fault else None)
        r = relaunch("run", str(CONFIG), *job, *t.overrides, "--address", cluster.address, env=env)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    whole, killed = trials["whole"], trials["killed"]
    assert [e["global_step"] for e in killed.events("loaded")] == [-1, 14]
    assert [s["global_step"] for s in whole.stats() if s["kl"] == 0] == [0, 10, 20]
    assert curve(killed.stats()) == curve(whole.stats())
    assert killed.final_weights() == whole.final_weights()


def test_a_rank_replaced_from_memory_rebuilds_the_initial_policy_as_its_reference(cluster, tmp_path):
    """GRPO's KL term against the initial policy (no refresh) on fsdp has the memory tier: rank 1 killed in step 7's
    update is replaced from its peer's copy by a new process, which builds the reference from the config as every
    rank did; nothing trained again, and the run ends bit-identical to the uninterrupted one, kl included."""
    job = ["total_train_epochs=1", "actor.kl_coef=0.05", MEMORY_TIER, "recover.backoff_secs=0"]
    trials = {}
    for name, fault in (("whole", None), ("killed", "TrainWorker.train.enter:kill:step=7:rank=1")):
        trials[name] = t = Trial(tmp_path / name / "runs")
        env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)} if fault else None)
        r = relaunch("run", str(CONFIG), *job, *t.overrides, "--address", cluster.address, env=env)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    whole, killed = trials["whole"], trials["killed"]
    recovery, = killed.events("recovery")
    assert (recovery["source"], recovery["loaded_step"], recovery["replayed_steps"]) == ("memory", 6, 0), recovery
    assert all(s["kl"] > 0 for s in whole.stats()[1:])  # the policy moved away from its reference
    assert curve(killed.stats()) == curve(whole.stats())
    assert killed.final_weights() == whole.final_weights()
