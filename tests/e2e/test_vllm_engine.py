"""vLLM as the rollout engine: in a spawned process (no Ray), its weights in place and read back and its seeded
sampling (one engine serves those tests: vLLM's import and start cost ~20 s); then a job on the shared cluster
whose vLLM engine is killed, loses its node and hangs, and ends bit-identical to an uninterrupted vLLM run."""
from __future__ import annotations

import importlib.util
import multiprocessing
import time

import pytest
import torch

from conftest import CONFIG, SHORT, Trial, job_env, relaunch, start_relaunch, status_json
from test_faults import assert_recovered_exactly

from supervisor.config import load_config
from supervisor.testing.processes import command_line, process_tree
from workers.generate import encode_prompt, generate, sample_seed
from workers.model import build_model, build_tokenizer
from workers.vllm_engine import _LOADED, _the_model

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (./dev.sh installs it on CPU)")]

VLLM_TINY = ["rollout.engine=vllm", "model.hidden_size=128", "model.intermediate_size=256", "model.num_heads=4"]
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

        config = load_config(None, VLLM_TINY + ["data.max_new_tokens=6"])
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
    before = engine.generate(encoded, [0] * 8, 6, 1.0, greedy=True)
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
    assert engine.generate(encoded, [0] * 8, 6, 1.0, greedy=True) != before
    engine.load(model.state_dict().items())
    assert engine.generate(encoded, [0] * 8, 6, 1.0, greedy=True) == before
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
    whole = engine.generate(encoded, seeds, 6, 1.0, greedy=False)
    assert len(set(map(tuple, whole))) > 4  # sampled, not all alike
    reversed_half = engine.generate(encoded[:5][::-1], seeds[:5][::-1], 6, 1.0, greedy=False)
    alone = engine.generate(encoded[7:8], seeds[7:8], 6, 1.0, greedy=False)
    assert reversed_half[::-1] == whole[:5] and alone == whole[7:8]


def test_vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt(child):
    child.apply(vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt)


def vllm_holds_the_configured_lengths_and_refuses_a_longer_prompt():
    from workers.errors import UserCodeError

    config, tokenizer, model, engine = parts()
    assert engine.llm.llm_engine.model_config.max_model_len == config.data.max_sequence_tokens == 32 + 6
    engine.load(model.state_dict().items())
    with pytest.raises(UserCodeError, match="data.max_prompt_tokens = 32: a prompt of the dataset is 33 tokens"):
        engine.generate([[4] * 33], [0], 6, 1.0, greedy=True)
    # the longest prompt draws its max_new_tokens in full (vLLM stops a sequence at max_model_len)
    eos, tokenizer.eos_token = tokenizer.eos_token, None
    try:
        assert [len(c) for c in engine.generate([[4] * 32], [0], 6, 1.0, greedy=False)] == [6]
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


def engines_by_node(cluster) -> dict:
    """How many RolloutWorkers each worker node runs (Ray titles an actor's process ray::{class})."""
    return {node: sum(" ".join(command_line(pid)).startswith("ray::RolloutWorker")
                      for pid in process_tree(node.all_processes["raylet"][0].process.pid))
            for node in cluster.workers}


@pytest.mark.quick
@pytest.mark.timeout(900)
def test_a_killed_a_hung_and_a_lost_vllm_engine_are_replaced_and_refitted_and_the_run_is_exact(cluster, trial,
                                                                                               tmp_path):
    """Two engines (the first takes the head node's one CPU, the second a worker node's). An engine's actor killed
    at step 3, the worker node that runs an engine killed after step 8 (a node joins again after the job, as in
    test_faults), a generate hung at step 14: each time the engines lost are replaced, alone or with the ranks
    the node held, refitted and checked before they serve, and the run ends bit-identical."""
    job = [*VLLM_TINY, "cluster.n_rollout_workers=2", "recover.step_timeout_secs=20"]  # a hang is seen after 20 s
    reference = Trial(tmp_path / "reference")
    r = relaunch("run", str(CONFIG), *SHORT, *job, "recover.spare_workers=0", *reference.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    faults = "RolloutWorker.generate.enter:kill:step=3,RolloutWorker.generate.enter:hang:step=14"
    env = job_env({"RELAUNCH_FAULT": faults, "RELAUNCH_FAULT_DIR": str(tmp_path)})
    proc = start_relaunch("run", str(CONFIG), *SHORT, *trial.overrides, *job, "--address", cluster.address,
                          env=env, log=tmp_path / "job.log")
    killed = None
    try:
        trial.wait_for_step(8, proc)
        node, engines = max(engines_by_node(cluster).items(), key=lambda item: item[1])
        assert engines >= 1
        killed = time.time()
        cluster.kill_node(node)
        assert proc.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if killed is not None:
            cluster.add_node()
    # one restart per fault: the kill, the node (one incident, whatever else the node held) and the hang
    assert_recovered_exactly(trial, reference, restarts=3)
    before, after = ([e for e in trial.events("failure") if (e["time"] > killed) == later] for later in (False, True))
    assert [(e["cause"], e["group"]) for e in before] == [("engine_died", "rollout")]
    assert after[0]["node"] == node.node_id and ("hang", "rollout") == (after[-1]["cause"], after[-1]["group"])
    assert [e["what"] for e in trial.events("restart") if e["time"] < killed] == ["restart_engines"]
    # after the node's loss: the engine replaced, then refitted (pushed to) and checked before the next rollout
    replaced = [e for e in trial.events() if e["time"] > killed and e["event"] in ("engines_restarted", "resync")]
    assert replaced[0]["event"] == "engines_restarted" and len(replaced[0]["replaced"]) == engines
    assert (replaced[1]["event"], replaced[1]["engines"], replaced[1]["pushed"]) == ("resync", 2, engines)
    # every rollout came from an engine that held the trainer's weights, digest included
    assert not [e for e in trial.events("failure") if e["cause"] in ("stale_weights", "internal_error")]
    assert status_json(trial)["state"] == "done"
