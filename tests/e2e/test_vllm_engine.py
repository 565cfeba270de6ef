"""vLLM as the rollout engine: in a spawned process (no Ray), its weights in place and read back and its seeded
sampling (one engine serves those tests: vLLM's import and start cost ~20 s); then a job on the shared cluster
whose vLLM engine is killed, loses its node and hangs, whose ranks and engines are SIGKILLed or SIGSTOPped at
seeded random moments, and which ends bit-identical to an uninterrupted vLLM run."""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import random
import time

import pytest
import torch

from harness import CONFIG, REPO, Trial, job_env, log_tail, relaunch, start_relaunch, status_json
from test_any_moment import assert_exact, end, signal_monkey

from supervisor.config import load_config
from supervisor.testing.processes import command_line, process_tree
from workers.generate import Sampling, encode_prompt, generate, sample_seed
from workers.model import build_model, build_tokenizer
from workers.weight_sync import local_digest
from workers.vllm_engine import _LOADED, _the_model

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (./dev.sh installs it on CPU)")]

VLLM = ["rollout.engine=vllm"]  # the default job as shipped (CONFIG is it on the built-in engine)
PROMPTS = ["3 8 =", "1 =", "9 9 9 9 =", "0 4 =", "7 =", "5 5 5 =", "2 6 =", "8 1 1 ="] * 2


@pytest.fixture(scope="module")
def child():
    """One spawned process serves these tests with one vLLM engine (its import and start cost ~20 s): vLLM sets
    up torch.distributed, binds the threads and makes torch.set_num_threads a no-op for its whole process, none
    of which may reach the tests that this pytest worker runs next. An assertion in it fails the test here."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield pool


_PARTS = None


def parts():
    """In the child: the config, tokenizer, model and engine, built at its first test."""
    global _PARTS
    if _PARTS is None:
        from workers.vllm_engine import VllmEngine

        config = load_config(None, VLLM + ["data.max_new_tokens=6"])
        tokenizer = build_tokenizer(config.model)
        model = build_model(config.model, tokenizer, config.seed).eval()
        _PARTS = config, tokenizer, model, VllmEngine(config, tokenizer, 0)
    return _PARTS


def shapes(model):
    return [list(p.shape) for _, p in model.named_parameters()]


def test_weights_reach_vllm_in_place_and_read_back_bitwise(child):
    child.apply(weights_reach_vllm_in_place_and_read_back_bitwise)


def weights_reach_vllm_in_place_and_read_back_bitwise():
    config, tokenizer, model, engine = parts()
    names = [n for n, _ in model.named_parameters()]
    engine.load(model.state_dict().items())
    for name, mine, served in zip(names, model.parameters(), engine.loaded(names, shapes(model))):
        assert torch.equal(mine, served), name
    # the tied lm_head (untied by vLLM's reload_weights, on GPU) was fed by its own name: it holds the embedding too
    embed = model.get_input_embeddings().weight
    assert torch.equal(engine.loaded(["lm_head.weight"], [list(embed.shape)])[0], embed)
    encoded = [encode_prompt(tokenizer, p) for p in PROMPTS[:8]]
    before = engine.generate(encoded, [0] * 8, 6, Sampling(), greedy=True)
    # the greedy completions of the built-in engine on the same weights
    reference = generate(model, tokenizer, PROMPTS[:8], list(range(8)), seed=1, step=0, max_new_tokens=6, greedy=True)
    width = reference["input_ids"].shape[1] - reference["response_mask"].sum(1).max()
    assert before == [row[width:][m[width:].bool()].tolist()
                      for row, m in zip(reference["input_ids"], reference["response_mask"])]
    # new weights: what vLLM serves and computes with changes with them (its prefix cache emptied)
    changed = {n: p.detach() * 1.5 for n, p in model.state_dict().items()}
    engine.load(changed.items())
    for name, served in zip(names, engine.loaded(names, shapes(model))):
        assert torch.equal(changed[name], served), name
    assert engine.generate(encoded, [0] * 8, 6, Sampling(), greedy=True) != before
    engine.load(model.state_dict().items())
    assert engine.generate(encoded, [0] * 8, 6, Sampling(), greedy=True) == before
    # what is read back is vLLM's own memory, not what was fed to it: a change there shows
    qkv = engine.llm.collective_rpc(_the_model)[0].get_submodule("model.layers.0.self_attn.qkv_proj")
    getattr(qkv, _LOADED if hasattr(qkv, _LOADED) else "weight")[0, 0] += 1.0
    k = names.index("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(engine.loaded(names, shapes(model))[k], model.get_parameter(names[k]))


def test_a_samples_tokens_depend_on_its_seed_not_on_its_batch(child):
    child.apply(a_samples_tokens_depend_on_its_seed_not_on_its_batch)


def a_samples_tokens_depend_on_its_seed_not_on_its_batch():
    config, tokenizer, model, engine = parts()
    engine.load(model.state_dict().items())
    encoded = [encode_prompt(tokenizer, p) for p in PROMPTS]
    seeds = [sample_seed(config.seed, 3, s) for s in range(len(PROMPTS))]
    whole = engine.generate(encoded, seeds, 6, Sampling(), greedy=False)
    assert len(set(map(tuple, whole))) > 4  # sampled, not all alike
    reversed_half = engine.generate(encoded[:5][::-1], seeds[:5][::-1], 6, Sampling(), greedy=False)
    alone = engine.generate(encoded[7:8], seeds[7:8], 6, Sampling(), greedy=False)
    assert reversed_half[::-1] == whole[:5] and alone == whole[7:8]
    # rollout.top_k, top_p and stop reach vLLM: one token left to draw from is the greedy one, whatever the seed;
    # a stop token id or string ends a completion with the token that completed it
    greedy = engine.generate(encoded, seeds, 6, Sampling(), greedy=True)
    assert engine.generate(encoded, seeds, 6, Sampling(top_k=1), greedy=False) == greedy
    assert engine.generate(encoded, seeds, 6, Sampling(top_p=1e-6), greedy=False) == greedy
    four = tokenizer.convert_tokens_to_ids("4")
    cut = [c[:c.index(four) + 1] if four in c else c for c in whole]
    assert cut != whole and engine.generate(encoded, seeds, 6, Sampling(stop_token_ids=(four,)), greedy=False) == cut
    assert engine.generate(encoded, seeds, 6, Sampling(stop_strings=("4",)), greedy=False) == cut


def test_vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt(child):
    child.apply(vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt)


def vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt():
    from workers.errors import UserCodeError

    config, tokenizer, model, engine = parts()
    assert engine.llm.llm_engine.model_config.max_model_len == config.data.max_sequence_tokens == 32 + 6
    engine.load(model.state_dict().items())
    with pytest.raises(UserCodeError, match="data.max_prompt_tokens = 32: a prompt of the dataset is 33 tokens"):
        engine.generate([[4] * 33], [0], 6, Sampling(), greedy=True)
    # the longest prompt draws its max_new_tokens in full (vLLM stops a sequence at max_model_len)
    eos, tokenizer.eos_token = tokenizer.eos_token, None
    try:
        assert [len(c) for c in engine.generate([[4] * 32], [0], 6, Sampling(), greedy=False)] == [6]
    finally:
        tokenizer.eos_token = eos


def test_an_engine_core_that_died_ends_the_process_and_nothing_else_does():
    from vllm.v1.engine.exceptions import EngineDeadError

    from workers.vllm_engine import _or_exit

    exits = []

    def dead():
        raise EngineDeadError()

    _or_exit(dead, exit=exits.append)
    assert exits == [1]
    with pytest.raises(ValueError):  # any other error is the caller's to classify
        _or_exit(lambda: int("x"), exit=exits.append)
    assert exits == [1] and _or_exit(lambda: 7, exit=exits.append) == 7


@pytest.mark.timeout(600)
def test_bf16_engines_serve_the_trainers_weights_rounded_and_a_replayed_run_is_exact(cluster, trial, tmp_path):
    """rollout.dtype bf16 (vLLM's dtype; the sync casts the trainer's fp32 weights): a rank SIGSTOPped in step 7
    is a hang, the TrainGroup restarts from step 4's save, the engines are resynced in bf16 and the steps replayed
    give the uninterrupted bf16 run's figures and weights."""
    job = [*VLLM, "rollout.dtype=bf16", "total_train_epochs=1", "recover.step_timeout_secs=10"]
    reference = Trial(tmp_path / "reference")
    r = relaunch("run", str(CONFIG), *job, *reference.overrides, "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    env = job_env({"RELAUNCH_FAULT": "TrainWorker.train.enter:stop:step=7:rank=1", "RELAUNCH_FAULT_DIR": str(tmp_path)})
    r = relaunch("run", str(CONFIG), *job, *trial.overrides, "--address", cluster.address, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_exact(trial, reference, 1, steps=12)
    (recovery,) = trial.events("recovery")
    assert (recovery["cause"], recovery["source"], recovery["loaded_step"]) == ("hang", "disk", 4)
    # what the engines held after the first sync: the initial weights rounded to bf16, by the engines' own digest
    config = load_config(CONFIG, job)
    initial = build_model(config.model, build_tokenizer(config.model), config.seed)
    bf16 = local_digest([p.detach().to(torch.bfloat16) for p in initial.parameters()], torch.bfloat16,
                        config.rollout.weight_bucket_mb * 2**20)
    assert [e["checksum"] for e in trial.events("resync")][0] == bf16


def engine_processes(cluster) -> int:
    """How many RolloutWorker processes (engines and spare engines) the worker nodes run (Ray titles an actor's
    process ray::{class})."""
    return sum(" ".join(command_line(pid)).startswith("ray::RolloutWorker")
               for node in cluster.workers for pid in process_tree(node.all_processes["raylet"][0].process.pid))


def serving_workers(progress: dict) -> list[dict]:
    """The ranks and the engines the live Supervisor trains and serves with (not the spares), with their pids."""
    return [w for w in progress["workers"] if w["pid"]]


@pytest.mark.quick
@pytest.mark.timeout(900)
def test_a_killed_a_hung_and_a_lost_vllm_engine_are_replaced_and_refitted_and_the_run_is_exact(cluster, trial,
                                                                                               tmp_path):
    """Two engines (the first takes the head node's one CPU, the second a worker node's) and a warm spare engine.
    Engine 1's actor killed at step 3 (replaced by the spare, on engine 1's cores), the worker node that runs an engine killed after
    step 8 (a node joins again after the job, as in test_faults), a generate hung at step 14, then, from step 16,
    two seeded random SIGKILLs or SIGSTOPs of ranks or engines at random moments: each time the engines lost are
    replaced, alone or with the ranks lost beside them, refitted and checked before they serve, the run ends
    bit-identical, and no engine process is left. RELAUNCH_CHAOS_SEED=N reproduces the random part."""
    seed = int(os.environ.get("RELAUNCH_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"chaos seed {seed} (rerun with RELAUNCH_CHAOS_SEED={seed})")
    # three epochs (36 steps): after the hang at 14, room for the monkey's faults to land mid-run
    job = [*VLLM, "total_train_epochs=3", "cluster.n_rollout_workers=2",
           "recover.step_timeout_secs=10"]  # a hang is seen after 10 s
    reference = Trial(tmp_path / "reference")
    r = relaunch("run", str(CONFIG), *job, "recover.spare_workers=0", *reference.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    faults = "RolloutWorker.generate.enter:kill:step=3:rank=1,RolloutWorker.generate.enter:hang:step=14"
    env = job_env({"RELAUNCH_FAULT": faults, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *trial.overrides, *job, "rollout.spare_engines=1",
                          "recover.retries=5", "--address", cluster.address, env=env, log=tmp_path / "job.log")
    killed, stopped, done = None, [], []
    import ray

    ray.init(address=cluster.address, namespace="relaunch", logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        trial.wait_for_step(0, proc)
        supervisor = ray.get_actor("tiny-grpo/trial0", namespace="relaunch")
        progress = lambda: ray.get(supervisor.progress.remote(), timeout=10)  # noqa: E731
        trial.wait_for_step(8, proc)
        # the spare (started as engine 2) took engine 1's cores with its place: no two engines share a core
        cores = [os.sched_getaffinity(w["pid"]) for w in progress()["workers"]
                 if w["name"].startswith("RolloutWorker")]
        assert len(cores) == 2 and (len(os.sched_getaffinity(0)) < 2 or not cores[0] & cores[1]), cores
        serving = progress()["rollout_nodes"]  # the engines' nodes (not the spare's)
        node, engines = max(((n, serving.count(n.node_id)) for n in cluster.workers), key=lambda item: item[1])
        assert engines >= 1
        killed = time.time()
        cluster.kill_node(node)
        trial.wait_for_step(16, proc)  # past the hang at 14
        monkey = time.time()
        # a tiny step takes ~0.3 s: a pause of 0.2-1.5 s lands in any phase of one, or of a repair. vLLM's engine
        # core runs in the engine's process: the one process to break in an engine.
        done = signal_monkey(progress, proc, random.Random(seed), 2, serving_workers, (0.2, 1.5), stopped)
        assert proc.wait(timeout=600) == 0, f"seed {seed}, {done}: " + log_tail(tmp_path / "job.log")
    finally:
        ray.shutdown()
        end(proc, stopped)
        if killed is not None:
            cluster.add_node()
    # at most one restart per fault: the kill, the node (one incident, whatever else the node held), the hang, and
    # the monkey's (one of which may land in another's repair)
    assert_exact(trial, reference, 3 + len(done), steps=36)
    assert status_json(trial)["restarts"] >= 3
    before, after = ([e for e in trial.events("failure") if (e["time"] > killed) == later] for later in (False, True))
    assert [(e["cause"], e["group"]) for e in before] == [("engine_died", "rollout")]
    assert after[0]["node"] == node.node_id
    assert ("hang", "rollout", 14) in [(e["cause"], e["group"], e["global_step"]) for e in after]
    # the monkey's first fault came with 20 steps to go: it was seen and repaired (a later one may end with the job)
    assert done and [e for e in after if e["time"] > monkey], f"seed {seed}: {done}"
    assert [e["what"] for e in trial.events("restart") if e["time"] < killed] == ["restart_engines"]
    # the spare engine, started after step 0, took the killed engine's place (up or still starting: not cold)
    refilled = [e for e in trial.events("spares") if e.get("kind") == "engine"]
    assert refilled[0]["started"] == 1 and refilled[0]["time"] < before[0]["time"]
    assert [e["from_spares"] for e in trial.events("engines_restarted") if e["time"] < killed] == [1]
    # after the node's loss: the engine replaced, then refitted (pushed to) and checked before the next rollout
    replaced = [e for e in trial.events() if e["time"] > killed and e["event"] in ("engines_restarted", "resync")]
    assert replaced[0]["event"] == "engines_restarted" and len(replaced[0]["replaced"]) == engines
    # pushed to: every replaced engine, and the survivor too when a rank lost with the node rolled the weights back
    assert (replaced[1]["event"], replaced[1]["engines"]) == ("resync", 2) and engines <= replaced[1]["pushed"] <= 2
    deadline = time.monotonic() + 10  # the engines and the spare are killed as the job ends; their processes exit
    while engine_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engine_processes(cluster) == 0
