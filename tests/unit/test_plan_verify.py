"""`relaunch plan` (pure schedule, and the CLI on the shipped configs) and verify's tensor comparison."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from supervisor.config import Config, Frequency, load_config
from supervisor.tools.plan import GPU_WHAT_RAN, built_shape, fire_steps, make_plan, param_count
from supervisor.tools.rank_memory import rank_memory
from supervisor.tools.verify import compare

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("freq, expected", [
    (Frequency(freq_steps=5), [4, 9, 14, 19, 24, 29]),
    (Frequency(freq_epochs=1), [11, 23]),
    (Frequency(freq_epochs=1, freq_steps=5), [4, 9, 11, 14, 19, 23, 24, 29]),  # independent counters
    (Frequency(freq_steps=50), []),
    (Frequency(freq_secs=600), []),
])
def test_fire_steps_follow_the_supervisors_frequency_control(freq, expected):
    assert fire_steps(freq, steps_per_epoch=12, total_steps=30) == expected


def test_plan_warns_about_a_time_only_schedule_and_a_handful_of_steps():
    config = Config.model_validate({"total_train_epochs": 3, "data": {"batch_size": 64},
                                    "recover": {"mode": "on", "freq_secs": 600}})
    plan = make_plan(config, dataset_size=100)
    assert "steps      1 per epoch x 3 epochs = 3 (global steps 0-2)" in plan.lines
    assert any("recover.freq_secs=600 is its only trigger" in w for w in plan.warnings)
    assert any("only 3 steps" in w for w in plan.warnings)


def test_plan_warns_about_a_schedule_beyond_the_run():
    config = Config.model_validate({"total_train_epochs": 2, "saver": {"freq_epochs": 5}})
    plan = make_plan(config, dataset_size=100)
    assert any(w.startswith("saver never fires: every 5 epochs") for w in plan.warnings)
    assert not any("only" in w for w in plan.warnings)  # 12 steps is not a handful


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_plan_of_the_gpu_example_reports_its_steps_and_schedule_without_a_cluster_or_the_model():
    r = plan_cli("examples/gpu/qwen2.5-0.5b-grpo.yaml")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "steps      6 per epoch x 20 epochs = 120 (global steps 0-119)" in out
    assert "TrainGroup 8 x {CPU: 4, GPU: 1} (nccl), engines 2 x {CPU: 4, GPU: 1}; in all 40 CPUs, 10 GPUs" in out
    assert "recover    after steps 9, 19, 29, 39, ..., 109, 119 (12 times), and whenever 600 s" in out
    assert "saver      after steps 29, 59, 89, 119 (4 times)" in out
    assert "evaluator  after steps 29, 59, 89, 119 (4 times)" in out
    assert ("spares     none (recover.spare_workers=auto idles no GPU; set it to N to keep N, each holding "
            "{CPU: 4, GPU: 1} and the unsharded fp32 model from model.path (its size unknown here: no config.json "
            "on this machine))") in out
    # no spare: the ranks hold each other's copies, and a dead rank's new process loads its peer's
    assert ("memory     auto: each rank's state, its shards of the weights and of AdamW's two moments, is kept twice "
            "in its own memory and twice in a peer rank's (another node's where one runs), after every step; a new "
            "process takes a dead rank's place with the copy its peer gives it") in out
    assert [w for w in out.splitlines() if w.startswith("warning:")] == [
        f"warning: {GPU_WHAT_RAN}",
        "warning: model.path /models/Qwen2.5-0.5B-Instruct is not on this machine: every node must have it"]


def test_plan_of_the_default_job_shows_its_spares_and_no_gpu_warning():
    r = plan_cli("configs/tiny_grpo.yaml")
    assert r.returncode == 0, r.stderr
    assert ("spares     up to 2 (auto: one per rank as far as the cluster has room beside the TrainGroup and the "
            "engines; counted when the job starts), each on a node that runs no rank when one has room, each "
            "holding {CPU: 1} and the unsharded fp32 model built from the config (75k parameters, ~0.3 MiB of host "
            "memory), imports done, in no process group") in r.stdout
    assert "GPU paths" not in r.stdout


@pytest.mark.parametrize("model", [{}, {"tokenizer": "bpe", "vocab_size": 4096, "hidden_size": 128,
                                        "intermediate_size": 352, "num_layers": 3, "num_heads": 4,
                                        "num_kv_heads": 2}])
def test_the_spares_memory_estimate_counts_the_built_models_parameters(model):
    from transformers import AutoModelForCausalLM

    from workers.model import model_config

    class Tok:  # the built model's config needs only the tokenizer's size and special ids
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return built_shape(config)["vocab_size"]

    config = Config.model_validate({"model": model})
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(model_config(config.model, Tok()))
    assert param_count(built_shape(config)) == sum(p.numel() for p in built.parameters())


def test_plan_predicts_a_ranks_peak_from_its_parts_and_what_a_holder_keeps():
    """The ~100M job as shipped (the parts benchmarks/step.py measured within 3%), then each knob's part."""
    r = plan_cli("configs/grpo_100m.yaml")
    assert r.returncode == 0, r.stderr
    assert ("rank peak  ~5.37 GB at a rank's peak (process 0.47, training state 1.03, memory tier's two slots 1.55, "
            "engine weights mapped 0.52, background save and HF export 1.81); a memory-tier holder keeps 1.55 GB for "
            "each rank it covers, so a node running k ranks and holding the copies of j needs about k x 5.37 GB + "
            "j x 1.55 GB") in r.stdout
    shipped = load_config(REPO / "configs/grpo_100m.yaml", [])
    params = param_count(built_shape(shipped))

    def parts(*overrides: str) -> dict:
        config = load_config(REPO / "configs/grpo_100m.yaml", list(overrides))
        return rank_memory(config, built_shape(config), config.memory_tier_off(None) is None).parts

    assert parts()["training state"] == 16 * params / 2 and parts()["memory tier's two slots"] == 24 * params / 2
    assert parts("recover.memory=off")["memory tier's two slots"] == 0
    assert parts()["KL reference"] == 0 and parts("actor.kl_coef=0.1")["KL reference"] == 4 * params
    assert parts("actor.micro_batch_size=4")["unsharded gradients of micro-batches"] == 4 * params
    assert parts("actor.micro_batch_size=32")["unsharded gradients of micro-batches"] == 0  # one pass a rank
    zero = [parts("actor.backend=deepspeed", f"actor.zero_stage={z}")["training state"] for z in (1, 2, 3)]
    assert zero == sorted(zero, reverse=True) and zero[2] == pytest.approx(20 * params / 2)  # + the fp32 master
    long = parts("data.max_new_tokens=512")
    assert long["activations"] > parts("data.max_new_tokens=512", "actor.gradient_checkpointing=true")["activations"]
    assert plan_cli("examples/gpu/qwen2.5-0.5b-grpo.yaml").stdout.count("rank peak  not predicted for GPU ranks") == 1


def test_plan_says_when_the_trackers_get_their_rows():
    plan = make_plan(Config.model_validate({"logging": {"trackers": ["tensorboard", "wandb"]},
                                            "recover": {"mode": "on", "freq_steps": 5}}), dataset_size=100)
    assert ("trackers   tensorboard, wandb: every stats row once its step is final (at every recover checkpoint "
            "and the end), faults and restarts as markers") in plan.lines
    assert not any(line.startswith("trackers") for line in make_plan(Config(), dataset_size=100).lines)


def test_plan_shows_an_explicit_spare_count_and_none():
    one = make_plan(Config.model_validate({"recover": {"spare_workers": 1}}), dataset_size=100)
    assert any(line.startswith("spares     1, each on a node that runs no rank") for line in one.lines)
    none = make_plan(Config.model_validate({"recover": {"spare_workers": 0}}), dataset_size=100)
    assert "spares     none (recover.spare_workers=0): a restart starts its lost ranks cold" in none.lines


def test_plan_refuses_bad_input_with_one_line():
    r = plan_cli("configs/tiny_grpo.yaml", "data.batch_size=500")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "data.batch_size 500" in r.stderr


def test_compare_names_every_difference():
    a = {"w": torch.zeros(2, 3), "b": torch.ones(3), "only_a": torch.ones(1), "lm_head.weight": torch.ones(2)}
    b = {"w": torch.zeros(2, 3), "b": torch.tensor([1.0, 1.5, 1.0]), "only_b": torch.ones(1)}
    result = compare(a, b, tied=True)
    assert not result.ok and result.compared == 2
    assert result.problems == ["only_a: only in the export", "only_b: missing from the export",
                               "b: max abs difference 0.5 > 0"]
    assert (result.max_diff, result.max_diff_name) == (0.5, "b")
    assert compare({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.bfloat16)}).problems == \
        ["w: dtype torch.float32 != torch.bfloat16"]
    assert compare({"w": torch.ones(2)}, {"w": torch.ones(3)}).problems == ["w: shape (2,) != (3,)"]
    assert compare(a, dict(a)).ok and compare({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-4}, atol=1e-3).ok
