"""PPO with a critic, end to end on the shared cluster (the suite's short job with a `critic` section, as
configs/tiny_ppo.yaml): a critic's group trains beside the policy every step, both are checkpointed under one
commit (default/ and critic/ recover checkpoints). The memory tier holds both groups' copies: a critic rank's
death or hang is repaired from memory, the critic's spare taking its place while every other rank of both groups
rolls back in place, and an actor rank's likewise, nothing trained again. From disk (recover.memory=off), a critic
rank's death restarts the critic's group alone while the actor's ranks keep their processes and load the same
step; an actor rank's death later reloads both. Each run ends bit-identical to an uninterrupted PPO run."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import time

import pytest

from harness import (CONFIG, MEMORY_TIER, REPO, SHORT, Trial, job_env, kill_session, log_tail, metrics, relaunch,
                     start_relaunch)
from test_any_moment import assert_exact, end, supervisor_monkey
from test_faults import assert_recovered_exactly, drain_while_paused, restore_workers, wait_paused

from workers.ppo import KLCoefficient

pytestmark = pytest.mark.e2e

PPO = ["critic.lr=0.01"]


@pytest.fixture(scope="module")
def ppo_reference(cluster, tmp_path_factory) -> Trial:
    """An uninterrupted PPO run of the short job."""
    t = Trial(tmp_path_factory.mktemp("ppo-reference") / "runs")
    r = relaunch("run", str(CONFIG), *SHORT, *PPO, "recover.spare_workers=0", *t.overrides, "--address",
                 cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return t


def test_a_ppo_job_trains_its_critic_beside_the_policy_and_commits_both_at_once(ppo_reference, reference):
    stats = ppo_reference.stats()
    assert [r["global_step"] for r in stats] == list(range(24))
    assert all({"critic/loss", "critic/grad_norm", "critic/vf_clip_frac"} <= set(r) for r in stats)
    first, last = (sum(r["reward"] for r in rows) / len(rows) for rows in (stats[:4], stats[-4:]))
    assert last > first + 0.2, (first, last)  # it learns the task
    grpo = reference.stats()
    assert metrics(stats) != metrics(grpo)  # not GRPO's advantages
    # the goal, on the short job too: PPO's greedy reward at the end at least GRPO's (0.73 and 0.47 here)
    assert stats[-1]["eval/reward"] >= grpo[-1]["eval/reward"], (stats[-1]["eval/reward"], grpo[-1]["eval/reward"])
    published = sorted(int(p.name.removeprefix("globalstep"))
                       for p in (ppo_reference.root / "default" / "recover_checkpoint").glob("globalstep*"))
    critic = sorted(int(p.name.removeprefix("globalstep"))
                    for p in (ppo_reference.root / "critic" / "recover_checkpoint").glob("globalstep*"))
    assert published == critic == [19, 23]  # keep_last 2, for both groups
    manifest = json.loads((ppo_reference.root / "default" / "recover_checkpoint" / "globalstep23" /
                           "manifest.json").read_text())
    assert manifest["roles"]["critic"]["world_size"] == 2
    critic_files = [name for name in manifest["files"] if name.startswith("@critic/")]
    assert "@critic/.metadata" in critic_files and len(critic_files) > 2
    # the critic's HF export beside the policy's, on the same steps (saver.freq_epochs 1: the end of each epoch)
    exports = ppo_reference.events("export")
    assert [e["global_step"] for e in exports if e.get("group") == "critic"] == \
        [e["global_step"] for e in exports if "group" not in e] == [11, 23]
    from transformers import AutoModelForTokenClassification

    value_model = AutoModelForTokenClassification.from_pretrained(ppo_reference.root / "critic" /
                                                                  "epoch1epochstep11globalstep23")
    assert value_model.config.num_labels == 1


def test_from_memory_a_critic_ranks_death_and_hang_and_an_actor_ranks_death_train_nothing_again(
        cluster, ppo_reference, trial, tmp_path):
    """One warm spare per group, the memory tier as shipped (each pool's spare holds its group's copies from the
    job's start). Killed as it trains step 3, before the first checkpoint and while the spares still warm, critic
    rank 1 is replaced by the critic's spare, which held its copy of step 2; critic rank 0 and both actor ranks roll
    back to step 2 in place, each from its own copy. Killed as it trains step 8, actor rank 1 is replaced by the
    actor's spare and both critic ranks roll back in place. SIGSTOPped as it trains step 13, critic rank 0 hangs the
    critic's step: it is killed as the culprit, and a new process in its bundle loads the copy its peer (the former
    spare) holds: the cluster's 7 CPUs have no room for a refilled spare while the taken spares' bundles stay
    reserved. Killed together as they train step 17, actor rank 1 and critic rank 0 (a node's loss would take a rank
    of each) are one repair: the actor's failure is seen, the critic's ranks are asked too, and each group's lost
    rank takes its copy of step 16 from its peer, in a free bundle or its own. Each repair is from memory, no
    completed step is trained again, and the run is bit-identical to an uninterrupted one."""
    fault = ",".join(["TrainWorker.train.enter:kill:step=3:rank=1:role=critic",
                      "TrainWorker.train.enter:kill:step=8:rank=1",
                      "TrainWorker.train.enter:stop:step=13:rank=0:role=critic",
                      "TrainWorker.train.enter:kill:step=17:rank=1",
                      "TrainWorker.train.enter:kill:step=17:rank=0:role=critic"])
    env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    r = relaunch("run", str(CONFIG), *SHORT, *PPO, "recover.spare_workers=1", MEMORY_TIER, "recover.retries=4",
                 "recover.step_timeout_secs=15", *trial.overrides, "--address", cluster.address, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [(f["cause"], f["group"], f["global_step"]) for f in trial.events("failure")] == [
        ("worker_died", "critic", 3), ("worker_died", "train", 8), ("hang", "critic", 13), ("worker_died", "train", 17)]
    loaded = [(e["global_step"], e["source"], e["kept"], e["critic_kept"]) for e in trial.events("loaded")]
    assert loaded == [(-1, "disk", [], []), (2, "memory", [0, 1], [0]), (7, "memory", [0], [0, 1]),
                      (12, "memory", [0, 1], [1]), (16, "memory", [0], [1])], loaded
    recoveries = trial.events("recovery")
    assert [(e["global_step"], e["source"], e["loaded_step"], e["replayed_steps"]) for e in recoveries] == [
        (3, "memory", 2, 0), (8, "memory", 7, 0), (13, "memory", 12, 0), (17, "memory", 16, 0)], \
        (recoveries, trial.events("warning"))
    taken = [(e.get("group", "train"), e["taken"]) for e in trial.events("spares") if e["action"] == "taken"]
    assert taken[-5:] == [("critic", 1), ("train", 1), ("critic", 0), ("train", 0), ("critic", 0)], taken
    first_commit = trial.events("commit")[0]["time"]  # the critic's ranks linked before the first step
    assert any(set(e["nodes"]) == {"0", "1"} for e in trial.events("buddies")
               if e.get("group") == "critic" and e["time"] < first_commit), trial.events("buddies")
    assert_recovered_exactly(trial, ppo_reference, restarts=4)


def test_a_drained_node_with_critic_ranks_hands_them_to_the_critics_spares_and_costs_nothing(
        cluster, ppo_reference, trial, tmp_path):
    """Two warm spares per group, on a worker node added for them (the pools are full and warm as step 2 begins).
    Paused as step 6 begins, the node of critic rank 0 gets a preemption notice (`ray drain-node`, 30 s): at the
    boundary after step 6 each rank there, the critic's and any actor's, hands its place to the spare holding its
    copy of that step, the spares there are retired, and the node is killed once the job says so. Nothing fails, no
    retry is spent, nothing is trained again, bit-identical."""
    env = job_env({"RELAUNCH_FAULT": "step.begin:wait_spares:step=2,step.begin:pause:step=6",
                   "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *SHORT, *PPO, "recover.spare_workers=2", MEMORY_TIER,
                          *trial.overrides, "--address", cluster.address, env=env, log=tmp_path / "job.log")
    workers, drained = {n.node_id for n in cluster.workers}, []
    try:
        deadline = time.time() + 300
        while not trial.events("loaded"):
            assert time.time() < deadline and proc.poll() is None, log_tail(tmp_path / "job.log")
            time.sleep(0.2)
        cluster.add_node()  # the room for the spares (wait_spares, as step 2 begins)
        wait_paused(tmp_path, proc, 1)  # as step 6 begins
        loaded = trial.events("loaded")[-1]
        node = loaded["critic_nodes"][0]
        drained.append(node)
        drain_while_paused(cluster, trial, tmp_path, proc, 1, node)
        cluster.kill_node(cluster.node_of(node))
        assert proc.wait(timeout=300) == 0, log_tail(tmp_path / "job.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        restore_workers(cluster, workers, drained)
    preemption, = trial.events("preemption")
    moved = lambda nodes: [rank for rank, n in enumerate(nodes) if n == node]  # noqa: E731
    assert (preemption["node"], preemption["global_step"], preemption["fallback"]) == (node, 6, None), preemption
    assert (preemption["ranks"], preemption["critic_ranks"]) == (moved(loaded["nodes"]), moved(loaded["critic_nodes"]))
    assert node not in preemption["critic_to"] + preemption["to"]
    after = trial.events("loaded")[-1]
    assert node not in after["nodes"] + after["critic_nodes"] and after["source"] == "memory", after
    assert not trial.events("failure") and not trial.events("restart")
    recovery, = trial.events("recovery")
    assert (recovery["cause"], recovery["source"], recovery["replayed_steps"], recovery["global_step"]) == \
        ("preemption", "memory", 0, 7)
    assert_recovered_exactly(trial, ppo_reference, restarts=0)


def test_from_disk_a_critic_ranks_fault_repairs_the_critic_alone_and_an_actor_ranks_both_and_the_run_is_exact(
        cluster, ppo_reference, trial, tmp_path):
    """One warm spare per group (`recover.spare_workers=1`: the shared cluster's 7 CPUs hold 2 + 2 ranks, the
    engine, and one spare each). Killed as it trains step 2, before the first checkpoint, critic rank 0 takes every
    group with it: the actor's ranks took step 2's update and there is nothing to load them back to. Killed as it
    trains step 6 (the pools warm from step 4), critic rank 1 is replaced by the critic's warm spare; critic rank 0
    and the actor's ranks keep their processes (the actor's took step 6's update) and all load step 4. SIGSTOPped
    as it trains step 10, critic rank 0 hangs the step: it is killed as the culprit critic rank 1 waits on, the
    critic's refilled spare or a new process takes its place, and critic rank 1 keeps its process; step 9 is
    loaded. Killed as it trains step 15, actor rank 0 is replaced by the actor's warm spare; the critic's ranks load
    step 14 in place. The memory tier is off: every repair is from disk and says so. One retry each,
    bit-identical."""
    fault = ",".join(["TrainWorker.train.enter:kill:step=2:rank=0:role=critic", "step.begin:wait_spares:step=4",
                      "TrainWorker.train.enter:kill:step=6:rank=1:role=critic",
                      "TrainWorker.train.enter:stop:step=10:rank=0:role=critic",
                      "TrainWorker.train.enter:kill:step=15:rank=0"])
    env = job_env({"RELAUNCH_FAULT": fault, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    r = relaunch("run", str(CONFIG), *SHORT, *PPO, "recover.spare_workers=1", "recover.memory=off", "recover.retries=4",
                 "recover.step_timeout_secs=15", *trial.overrides, "--address", cluster.address, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    failures = trial.events("failure")
    assert [(f["cause"], f["group"], f["actor"], f["global_step"]) for f in failures] == [
        ("worker_died", "critic", "TrainWorker[critic rank 0]", 2),
        ("worker_died", "critic", "TrainWorker[critic rank 1]", 6),
        ("hang", "critic", "TrainWorker[critic rank 0]", 10),
        ("worker_died", "train", "TrainWorker[rank 0]", 15)]
    start, after_first, after_death, after_hang, after_actor = trial.events("loaded")
    assert (after_first["global_step"], after_first["kept"], after_first["critic_kept"]) == (-1, [], [])
    # no actor rank restarted; the critic's survivor kept its process too
    assert (after_death["global_step"], after_death["kept"], after_death["critic_kept"]) == (4, [0, 1], [0])
    assert (after_hang["global_step"], after_hang["kept"], after_hang["critic_kept"]) == (9, [0, 1], [1])
    assert (after_actor["global_step"], after_actor["kept"], after_actor["critic_kept"]) == (14, [1], [0, 1])
    taken = [(e.get("group", "train"), e["taken"], e["cold"]) for e in trial.events("spares") if e["action"] == "taken"]
    # step 6 from the critic's warm spare; step 10's from the refilled pool where the cluster had room, else cold
    assert taken[-3] == ("critic", 1, 0) and taken[-1] == ("train", 1, 0), taken
    assert taken[-2][0] == "critic" and taken[-2][1] + taken[-2][2] == 1, taken
    assert [e["reason"] for e in trial.events("recovery")] == ["recover.memory is off"] * 4
    assert "the actor's ranks start again too: no checkpoint yet" in r.stderr + r.stdout
    assert_recovered_exactly(trial, ppo_reference, restarts=4)


KL_IN_REWARD = ["actor.kl_coef=0.05", "critic.kl_in_reward=true", "critic.kl_target=0.001", "critic.kl_horizon=100"]


def test_the_adaptive_kl_coefficient_in_the_rewards_is_restored_with_its_step(cluster, trial, tmp_path_factory):
    """critic.kl_in_reward with an adaptive controller: each step's rewards weigh the KL to the reference with the
    coefficient the previous steps moved (a short horizon, so it moves up to 13% a step), saved with each
    checkpoint. From disk (recover.memory=off), a critic rank killed as it trains step 6 (every group starts
    again: a KL reference is not kept in place) loads step 4 with its coefficient, and the run ends bit-identical
    to an uninterrupted one: every stats field (`kl`, `kl_coef` among them) and the final weights."""
    clean = Trial(tmp_path_factory.mktemp("ppo-kl-reference") / "runs")
    r = relaunch("run", str(CONFIG), *SHORT, *PPO, *KL_IN_REWARD, "recover.spare_workers=0", *clean.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stats = clean.stats()
    coefs = [row["kl_coef"] for row in stats]
    # each step's coefficient is the controller's answer to the step before (8 x 8 samples a step)
    following = [KLCoefficient(c, 0.001, 100).after(row["kl"], 64).value for c, row in zip(coefs, stats)]
    assert coefs[0] == 0.05 and coefs[1:] == pytest.approx(following[:-1], rel=1e-12), (coefs, following)
    assert len(set(coefs)) > 10  # it moves, each step by up to 0.2 x 64 / 100
    saved = json.loads((clean.root / "recover_info" / "kl_ctl_info.json").read_text())
    assert saved == {"schema_version": saved["schema_version"], "kl_coef": pytest.approx(following[-1], rel=1e-12),
                     "target": 0.001, "horizon": 100}  # the next step's, after the last

    env = job_env({"RELAUNCH_FAULT": "TrainWorker.train.enter:kill:step=6:rank=1:role=critic",
                   "RELAUNCH_FAULT_DIR": str(tmp_path_factory.mktemp("ppo-kl-faults"))})
    r = relaunch("run", str(CONFIG), *SHORT, *PPO, *KL_IN_REWARD, "recover.spare_workers=0", "recover.memory=off",
                 *trial.overrides, "--address", cluster.address, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [e["global_step"] for e in trial.events("loaded")] == [-1, 4]
    assert "a survivor's KL reference may be newer" in r.stdout + r.stderr
    assert_recovered_exactly(trial, clean, restarts=1)


# The chaos job: two engines (so that one dies alone), commits every 5 steps and every epoch (4, 9, 11, 14, 19, 23),
# no spares (on fsdp each group's two ranks hold each other's copies; DeepSpeed recovers from disk), a hang seen
# within 15 s. Its node is lost as step 14 begins, the whole job killed as step 19 begins.
CHAOS = [*SHORT, *PPO, "cluster.n_rollout_workers=2", "recover.spare_workers=0", "recover.freq_epochs=1",
         "recover.backoff_secs=0", "recover.step_timeout_secs=15", "recover.start_timeout_secs=60"]
CHAOS_BACKENDS = {"fsdp": [MEMORY_TIER], "deepspeed": ["actor.backend=deepspeed", "critic.backend=deepspeed"]}
NODE_LOST_STEP, JOB_KILLED_STEP = 14, 19


def critic_export(trial: Trial, step: int = 23) -> bytes:
    return next((trial.root / "critic").glob(f"epoch*globalstep{step}")).joinpath("model.safetensors").read_bytes()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("backend", [
    "fsdp", pytest.param("deepspeed", marks=pytest.mark.skipif(not importlib.util.find_spec("deepspeed"),
                                                               reason="deepspeed is not installed"))])
def test_seeded_random_chaos_in_both_groups_a_lost_node_and_a_killed_job_end_bit_identical(
        backend, cluster, ppo_reference, trial, tmp_path):
    """Issue 40's exactness at moments nobody chose: three SIGKILLs or SIGSTOPs (two on DeepSpeed) of random actor
    ranks, critic ranks, engines and the Supervisor, drawn by a seeded monkey in the job's first 12 steps; then, as step 14
    begins, the worker node of a random rank is lost (its raylet and every process on it) and a new node joins in
    its place; then, as step 19 begins, the whole job is killed (its driver, and with it the Supervisor and every
    actor it owns) and the same command run again, which resumes from the last commit. The run ends bit-identical
    to an uninterrupted PPO run on the same backend: every stats field of both groups, the policy's and the
    critic's final weights. RELAUNCH_CHAOS_SEED=N reproduces a schedule."""
    import ray

    seed = int(os.environ.get("RELAUNCH_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"chaos seed {seed} (rerun with RELAUNCH_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    reference = ppo_reference
    if backend == "deepspeed":
        reference = Trial(tmp_path / "reference")
        r = relaunch("run", str(CONFIG), *SHORT, *PPO, *CHAOS_BACKENDS[backend], "recover.spare_workers=0",
                     *reference.overrides, "--address", cluster.address)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    pauses = [f"step.begin:pause:step={NODE_LOST_STEP}", f"step.begin:pause:step={JOB_KILLED_STEP}"]
    env = job_env({"RELAUNCH_FAULT": ",".join(pauses), "RELAUNCH_FAULT_DIR": str(tmp_path)})
    signals = 3 if backend == "fsdp" else 2  # a DeepSpeed repair is from disk, each a cold start of its group
    args = ["run", str(CONFIG), *CHAOS, *CHAOS_BACKENDS[backend], f"recover.retries={signals + 1}", *trial.overrides,
            "--address", cluster.address]
    proc = start_relaunch(*args, env=env, log=tmp_path / "job.log")
    workers, stopped, done, lost = {n.node_id for n in cluster.workers}, [], [], None
    ray.init(address=cluster.address, namespace="relaunch", logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        # a tiny step takes ~0.5 s: a pause of 0.2-1.5 s lands in any phase of one, or of a repair, and the next
        # signal comes a step or two after a repair, within the 12 steps
        done = supervisor_monkey(trial, proc, rng, signals, (0.2, 1.5), stopped, before_step=NODE_LOST_STEP - 2)
        wait_paused(tmp_path, proc, 0)
        loaded = trial.events("loaded")[-1]
        lost = rng.choice(sorted({*loaded["nodes"], *loaded["critic_nodes"]} & workers))
        monkeyed = len(trial.events("failure"))  # the monkey's (a process it broke may have run on that node)
        cluster.kill_node(cluster.node_of(lost))
        cluster.add_node()  # its replacement, as a cluster's autoscaler would bring
        (tmp_path / "go").touch()
        wait_paused(tmp_path, proc, 1)
        kill_session(proc.pid)  # the whole job
        proc.wait()
    finally:
        ray.shutdown()
        end(proc, stopped)
        restore_workers(cluster, workers, [])
    r = relaunch(*args, env=env)  # every fault has fired: the same command runs to the end
    assert r.returncode == 0, f"seed {seed}, faults {done}\n" + r.stdout[-3000:] + r.stderr[-3000:]
    assert len(done) >= 2, f"seed {seed}: the monkey had no time for {done}"
    after = trial.events("failure")[monkeyed:]
    assert after and (after[0]["node"], after[0]["global_step"]) == (lost, NODE_LOST_STEP), (lost, after)
    # the rerun starts from the last commit before step 19: step 14's
    assert trial.events("loaded")[-1]["global_step"] == NODE_LOST_STEP, trial.events("loaded")
    assert_exact(trial, reference, len(done) + 1)
    # at most one restart per fault in the first job (status counts the rerun's, which had none)
    first_job = trial.events("start")[0]["job"]
    restarts = [e["cause"] for e in trial.events("restart") if e["job"] == first_job]
    assert restarts and len(restarts) <= len(done) + 1, (restarts, done)
    assert trial.final_weights() == reference.final_weights()
    assert critic_export(trial) == critic_export(reference)
