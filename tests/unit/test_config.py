import subprocess
import sys

import pytest

from supervisor.config import DEFAULT_CONFIG, ConfigError, RecoverMode, RolloutEngine, load_config


def test_default_config_loads_and_resolves_shipped_paths():
    c = load_config()
    assert c.experiment_name == "tiny-grpo"
    assert c.data.path.is_file() and c.data.path.is_absolute()
    assert c.cluster.fileroot.is_absolute()


@pytest.mark.parametrize("override, check", [
    ("saver.freq_steps=5", lambda c: c.saver.freq_steps == 5),
    ("recover.mode=off", lambda c: c.recover.mode is RecoverMode.OFF),
    ("recover.mode=on", lambda c: c.recover.mode is RecoverMode.ON),
    ("recover.freq_secs=null", lambda c: c.recover.freq_secs is None),
    ("cluster.n_train_workers=4", lambda c: c.cluster.n_train_workers == 4),
    ("actor.lr=1e-4", lambda c: c.actor.lr == 1e-4),
    ("trial_name=42", lambda c: c.trial_name == "42"),  # a name, though YAML reads a number
    ("experiment_name=2026", lambda c: c.experiment_name == "2026"),
    ("cluster.gpus_per_engine=1", lambda c: c.cluster.gpus_per_engine == 1),
])
def test_dotted_overrides(override, check):
    assert check(load_config(DEFAULT_CONFIG, [override]))


@pytest.mark.parametrize("override, names", [
    ("saver.freq_stepz=5", "saver.freq_stepz"),
    ("saver.freq_steps=-1", "saver.freq_steps"),
    ("saver.freq_steps=abc", "saver.freq_steps"),
    ("recover.mode=sometimes", "recover.mode"),
    ("actor.backend=megatron", "actor.backend"),
    ("cluster.n_train_workers=3", "cluster.n_train_workers"),
    ("experiment_name=../escape", "experiment_name"),
    ("data.path=/nonexistent.jsonl", "data.path"),
    ('rollout.stop=[""]', "rollout.stop"),
    ("rollout.stop=[-1]", "rollout.stop"),
    ("seed", "seed"),
])
def test_bad_values_name_the_key(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    assert names in str(e.value)
    assert "\n" not in str(e.value)


def test_a_config_without_a_recover_section_survives_failures_saving_on_the_young_daly_interval(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: {hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 2}\n")
    recover = load_config(path).recover
    assert recover.mode is RecoverMode.ON and recover.secs_auto and recover.retries == 3
    # a cadence given is the only one; recovery on without one (the shipped config's freq_steps removed) is auto
    assert load_config(path, ["recover.freq_epochs=1"]).recover.freq_secs is None
    assert load_config(DEFAULT_CONFIG, ["recover.freq_steps=null"]).recover.secs_auto


def test_yaml_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_resume_hash_ignores_frequencies_but_not_the_model():
    base = load_config().resume_hash()
    assert load_config(DEFAULT_CONFIG, ["saver.freq_steps=3"]).resume_hash() == base
    assert load_config(DEFAULT_CONFIG, ["model.num_layers=3"]).resume_hash() != base
    # a key at its default, given or not (so a key added later changes no trial's hash); the draw's keys matter
    assert load_config(DEFAULT_CONFIG, ["rollout.top_p=1.0", "data.prompt_key=prompt"]).resume_hash() == base
    assert load_config(DEFAULT_CONFIG, ["rollout.top_p=0.9"]).resume_hash() != base
    assert load_config(DEFAULT_CONFIG, ["rollout.stop=[2]"]).resume_hash() != base
    # how the job runs, not what it computes: the reward's threads and bound, the engines' memory and spares
    assert load_config(DEFAULT_CONFIG, ["reward.concurrency=4", "reward.timeout_secs=30",
                                        "rollout.spare_engines=1"]).resume_hash() == base
    # the engines' dtype as resolved: auto after a bf16 actor is bf16 said outright, and fp32 said is the default
    bf16 = load_config(DEFAULT_CONFIG, ["rollout.dtype=bf16"]).resume_hash()
    assert bf16 != base and load_config(DEFAULT_CONFIG, ["rollout.dtype=fp32"]).resume_hash() == base
    assert load_config(DEFAULT_CONFIG, ["actor.dtype=bf16"]).resume_hash() == \
        load_config(DEFAULT_CONFIG, ["actor.dtype=bf16", "rollout.dtype=bf16"]).resume_hash() != bf16


def test_cli_bad_key_exits_2_with_one_line_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "supervisor", "run", str(DEFAULT_CONFIG), "saver.freq_stepz=5"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "saver.freq_stepz" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_clean_restart_refuses_a_recover_path_that_leads_outside_the_trial(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    root = tmp_path / "runs" / "checkpoints" / "u" / "tiny-grpo" / "trial0"
    root.mkdir(parents=True)
    (root / "recover_info").symlink_to(outside)
    r = subprocess.run([sys.executable, "-m", "supervisor", "clean-restart", str(DEFAULT_CONFIG),
                        f"cluster.fileroot={tmp_path / 'runs'}", "cluster.user=u", "--yes"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "refusing" in r.stderr
    assert (outside / "keep.txt").read_text() == "mine"


def test_every_config_field_is_documented():
    from pydantic import BaseModel

    from supervisor import config

    models = [m for m in vars(config).values()
              if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == config.__name__]
    assert len(models) >= 10
    undocumented = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items() if not f.description]
    assert undocumented == []


def test_a_model_vllm_cannot_run_is_refused_naming_the_keys():
    """vLLM's CPU attention supports head sizes 32, 64, 80, ...: a head size of 16 fails at the engine's first
    forward, so the config refuses it before anything starts."""
    with pytest.raises(ConfigError, match=r"rollout.engine = vllm .*model.hidden_size / model.num_heads = 64 / 4"):
        load_config(DEFAULT_CONFIG, ["model.num_heads=4"])


def test_cli_refuses_a_model_vllm_cannot_run_with_exit_2_and_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervisor", "run", str(DEFAULT_CONFIG), "model.num_heads=4",
                        f"cluster.fileroot={tmp_path}"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "model.hidden_size / model.num_heads" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_the_default_job_runs_on_vllm_and_the_built_in_engine_is_named_hf_as_in_the_design():
    assert load_config(DEFAULT_CONFIG, []).rollout.engine is RolloutEngine.VLLM
    assert load_config(DEFAULT_CONFIG, ["rollout.engine=hf"]).rollout.engine is RolloutEngine.HF
    assert load_config(DEFAULT_CONFIG, ["rollout.engine=builtin"]).rollout.engine is RolloutEngine.HF
    assert load_config("configs/count_on.yaml", []).rollout.engine is RolloutEngine.HF  # a config that names none
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(DEFAULT_CONFIG, ["rollout.engine=sglang"])


VLLM = ["rollout.engine=vllm"]


@pytest.mark.parametrize("config", ["configs/tiny_grpo.yaml", "configs/count_on.yaml", "configs/grpo_100m.yaml",
                                    "configs/grpo_0.5b.yaml", "configs/tiny_ppo.yaml"])
def test_vllms_max_model_len_is_the_longest_prompt_and_completion_and_every_shipped_config_fits(config):
    from supervisor.config import BUILT_MODEL_CONTEXT

    overrides = [] if "count_on" not in config else ["model.num_heads=2"]  # count_on: the built-in engine's head size
    data = load_config(config, [*VLLM, *overrides, "data.max_prompt_tokens=20"]).data
    assert data.max_sequence_tokens == 20 + data.max_new_tokens <= BUILT_MODEL_CONTEXT


def test_lengths_beyond_a_built_models_context_are_refused_naming_the_keys():
    load_config(DEFAULT_CONFIG, [*VLLM, "data.max_prompt_tokens=60", "data.max_new_tokens=4"])  # 64: fits
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \+ data.max_new_tokens = 60 \+ 5 = 65 tokens do "
                                          r"not fit the built model \(model.path null\)'s context of 64 positions"):
        load_config(DEFAULT_CONFIG, [*VLLM, "data.max_prompt_tokens=60", "data.max_new_tokens=5"])
    load_config(DEFAULT_CONFIG, ["rollout.engine=hf", "data.max_prompt_tokens=60", "data.max_new_tokens=5"])  # no bound


def test_lengths_beyond_a_model_directorys_context_are_refused_with_exit_2_and_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 40}')
    for command in ("run", "plan"):  # plan checks the directory too, when it is on this machine
        r = subprocess.run([sys.executable, "-m", "supervisor", command, str(DEFAULT_CONFIG), "rollout.engine=vllm",
                            f"model.path={model}", "data.max_new_tokens=9", f"cluster.fileroot={tmp_path / 'runs'}"],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert f"32 + 9 = 41 tokens do not fit model.path {model}'s context of 40 positions" in r.stderr
        assert not (tmp_path / "runs").exists()


def test_the_engines_dtype_follows_the_actors_unless_set():
    assert load_config(None, []).engine_dtype == "float32"
    assert load_config(None, ["actor.dtype=bf16"]).engine_dtype == "bfloat16"
    assert load_config(None, ["actor.dtype=bf16", "rollout.dtype=fp32"]).engine_dtype == "float32"
    assert load_config(None, ["rollout.dtype=bf16", "actor.backend=deepspeed"]).engine_dtype == "bfloat16"
    assert load_config(None, ["actor.dtype=bf16", "actor.backend=deepspeed"]).actor.dtype.value == "bf16"


def test_a_critic_section_is_validated_on_its_own_keys():
    """Each trained group's rules name its own keys (configs/tiny_ppo.yaml is the default job with a critic)."""
    from supervisor.config import Config, CriticConfig

    config = Config(critic=CriticConfig(n_workers=4, lr=1e-4))
    assert list(config.trained) == ["actor", "critic"] and config.trained["critic"].lr == 1e-4
    assert (config.workers_of("actor"), config.workers_of("critic")) == (2, 4)
    assert config.workers_of("critic") == 4 and Config(critic=CriticConfig()).workers_of("critic") == 2
    assert config.memory_tier_off() is None and not config.async_recover  # the tier holds both groups' copies
    lone = Config(critic=CriticConfig(n_workers=1))
    assert lone.memory_tier_off({"actor": 2, "critic": 1}) is None
    assert lone.memory_tier_off({"actor": 2, "critic": 0}) == ("the critic's group: one rank and no warm spare: "
                                                         "nothing holds its copies (recover.spare_workers)")
    shipped = load_config("configs/tiny_ppo.yaml")
    assert shipped.critic.lr == 2e-3 and list(shipped.trained) == ["actor", "critic"]
    assert config.resume_hash() != Config().resume_hash()
    assert config.resume_hash() == Config(critic=CriticConfig(n_workers=2, lr=1e-4)).resume_hash()  # a world size
    for overrides, names in [
        (["critic.n_workers=3"], "critic.n_workers = 3"),
        (["critic.ppo_epochs=2", "critic.backend=deepspeed"], "critic.ppo_epochs and critic.mini_batches above 1 "
                                                              "need critic.backend fsdp"),
        (["critic.mini_batches=40"], "critic.mini_batches = 40 is more than a rank's 32 samples"),
        (["critic.value_clip=0"], "critic.value_clip"),
        (["critic.gamma=1.5"], "critic.gamma"),
        (["critic.lr=0.1", "recover.write_mode=async"], "recover.write_mode = async: a job with a critic"),
        (["critic.lr=0.1", "recover.min_train_workers=1"], "recover.min_train_workers: a job with a critic"),
        (["critic.kl_in_reward=true"], "critic.kl_in_reward needs actor.kl_coef > 0"),
        (["critic.kl_target=0.02"], "critic.kl_target adapts the KL penalty in the rewards"),
        (["critic.kl_in_reward=true", "actor.kl_coef=0.1", "critic.kl_horizon=0"], "critic.kl_horizon"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DEFAULT_CONFIG, overrides)
        assert names in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
