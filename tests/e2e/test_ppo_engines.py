"""The engines' side of PPO with a critic (issue 40, before its groups are wired), in one process (a gloo group of
one rank, real FSDP and DeepSpeed, real transformers models). The critic: a value model trained by the same engines
as the policy, with values for GAE, a clipped value loss that learns the returns, a recover checkpoint and a
memory-tier copy that restore it exactly, and an HF export that transformers loads as a value model. The policy:
its log-probabilities (and the reference's) asked before a step, for the KL penalty in the rewards, and a token's
advantage (GAE's) in its loss."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from test_async_save import batch

from supervisor.config import DEFAULT_CONFIG, CriticConfig, load_config
from supervisor.testing.local_cluster import free_port
from workers.memory_tier import Slot
from workers.ppo import gae, token_rewards

pytestmark = pytest.mark.e2e

CONFIG = load_config(DEFAULT_CONFIG, ["recover.mode=on", "recover.write_mode=sync"])
BACKENDS = ["fsdp"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])


def actor_engine(*overrides: str):
    from workers.engines.base import make_engine

    config = load_config(DEFAULT_CONFIG, ["recover.mode=on", "recover.write_mode=sync", *overrides])
    return make_engine(config, 0, 1, "127.0.0.1", free_port())


def critic_engine(backend: str = "fsdp", config=CONFIG, **section):
    from workers.engines.base import make_engine
    from workers.roles import critic

    return make_engine(config, 0, 1, "127.0.0.1", free_port(), role=critic(CriticConfig(backend=backend, **section)))


@pytest.fixture
def leave_group():
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def with_targets(engine, step: int) -> dict:
    """`batch(step)` with what the critic trains on: the values it starts the step with, and the returns of an
    outcome reward of 1 for rows whose first token is even (GAE with gamma = lambda = 1: the reward itself)."""
    b = batch(step)
    values = engine.values(b)
    rewards = token_rewards((b["input_ids"][:, 0] % 2 == 0).float(), b["response_mask"])
    return b | {"old_values": values, "returns": gae(rewards, values, b["response_mask"], 1.0, 1.0)[1]}


def generated(values: torch.Tensor, b: dict) -> torch.Tensor:
    return values[b["response_mask"][:, 1:] > 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_critic_learns_the_returns_with_the_policy_engines(backend, leave_group):
    engine = critic_engine(backend, lr=1e-2)
    fixed = with_targets(engine, 0)
    first = engine.train_step(fixed, 0)
    assert first["vf_clip_frac"] == 0.0  # the first update starts at the old values: nothing to clip
    for step in range(1, 30):
        last = engine.train_step(with_targets(engine, 0), step)
    assert last["loss"] < 0.1 * first["loss"]
    assert torch.allclose(generated(engine.values(fixed), fixed), generated(fixed["returns"], fixed), atol=0.1)


def test_the_value_clip_decides_the_later_updates_of_a_step(leave_group):
    """The clip's arithmetic is tests/unit/test_ppo.py's; here, that the engine applies the role's value_clip to the
    values the step started with: four updates of a tiny clip, each after the first clipped on most tokens (the
    default clip, 0.2, clips none of them at this lr)."""
    engine = critic_engine(value_clip=1e-4, ppo_epochs=4)
    assert engine.train_step(with_targets(engine, 0), 0)["vf_clip_frac"] > 0.5


def test_a_critic_of_the_users_model_keeps_its_body_and_has_no_dropout(tmp_path, leave_group):
    """From an HF directory: the body is the model's, the value head new (seeded), and nothing is dropped, so the
    values GAE is given are the ones the first update starts from (nothing to clip)."""
    from workers.model import build_model, build_tokenizer, save_model_dir

    tokenizer = build_tokenizer(CONFIG.model)
    policy = build_model(CONFIG.model, tokenizer, CONFIG.seed)
    save_model_dir(policy, tokenizer, CONFIG.model, tmp_path)
    config = load_config(DEFAULT_CONFIG, ["recover.mode=on", "recover.write_mode=sync", f"model.path={tmp_path}"])
    engine = critic_engine(config=config)
    assert [m.p for m in engine.model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0]
    assert torch.equal(engine.full_state_dict()["model.embed_tokens.weight"], policy.model.embed_tokens.weight)
    b = with_targets(engine, 0)
    assert torch.equal(engine.values(b), b["old_values"])
    assert engine.train_step(b, 0)["vf_clip_frac"] == 0.0


def test_a_critic_restores_exactly_from_its_recover_checkpoint_and_its_memory_copy(tmp_path, leave_group):
    engine = critic_engine()
    engine.train_step(with_targets(engine, 0), 0)
    files = engine.save(tmp_path, 0)
    slot = Slot(torch.zeros(engine.memory_layout.numel))
    engine.stage_memory(slot, 0)
    at_save = {k: v.clone() for k, v in engine.full_state_dict().items()}
    probe = batch(5)
    values = engine.values(probe)
    engine.train_step(with_targets(engine, 1), 1)
    assert not torch.equal(engine.values(probe), values)
    engine.load_memory(slot.flat, slot.meta)
    assert torch.equal(engine.values(probe), values)
    dist.destroy_process_group()
    fresh = critic_engine()  # a new rank: the same init, then the checkpoint
    assert ".metadata" in files and fresh.load(tmp_path, 0, same_world_size=True) == []
    assert all(torch.equal(v, at_save[k]) for k, v in fresh.full_state_dict().items())
    assert torch.equal(fresh.values(probe), values)


def test_a_critics_export_loads_as_a_value_model_with_its_values(tmp_path, leave_group):
    from transformers import AutoModelForTokenClassification

    from workers.model import forward_logits
    from workers.ppo import token_values

    engine = critic_engine()
    engine.train_step(with_targets(engine, 0), 0)
    engine.export_hf(tmp_path, engine.full_state_dict())
    model = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert model.config.num_labels == 1
    probe = batch(5)
    with torch.no_grad():
        loaded = token_values(forward_logits(model, probe["input_ids"], probe["attention_mask"]))
    assert torch.allclose(loaded, engine.values(probe), atol=1e-6)


def trained(engine, b: dict) -> tuple[dict, dict]:
    figures = engine.train_step(b, 0)
    weights = engine.full_state_dict()
    dist.destroy_process_group()
    return figures, weights


def test_a_tokens_advantage_trains_the_policy_as_its_rows_does_where_they_are_the_same(leave_group):
    """GAE gives each token its own advantage ([rows, sequence - 1]); where every token of a row has the row's,
    the update is GRPO's, bit for bit."""
    b = batch(0)
    rows = trained(actor_engine(), b)
    tokens = trained(actor_engine(), b | {"advantages": b["advantages"].unsqueeze(1).expand(-1, 5).contiguous()})
    assert rows[0] == tokens[0]
    assert all(torch.equal(rows[1][k], tokens[1][k]) for k in rows[1])


def test_the_log_probabilities_given_to_a_step_of_one_update_leave_it_on_policy(leave_group):
    """With one update a step the loss is GRPO's on-policy one, whatever the step asked before it."""
    b = batch(0)
    engine = actor_engine()
    given = trained(engine, b | {"old_logp": engine.logprobs(b)["logp"]})
    plain = trained(actor_engine(), b)
    assert given[0] == plain[0] and "clip_frac" not in given[0]
    assert all(torch.equal(given[1][k], plain[1][k]) for k in given[1])


def test_the_log_probabilities_asked_before_a_step_are_the_ones_its_updates_are_clipped_to(leave_group):
    """A PPO step asks the policy for its log-probabilities (and the reference's) before its updates, for the KL
    penalty in the rewards; given back to train_step, they are the step's old ones, not computed again."""
    overrides = ("actor.ppo_epochs=2", "actor.mini_batches=2", "actor.kl_coef=0.1")
    b = batch(0)
    engine = actor_engine(*overrides)
    asked = engine.logprobs(b)
    assert asked["logp"].shape == asked["ref_logp"].shape == (8, 5)
    assert torch.equal(asked["logp"], asked["ref_logp"])  # the reference is the initial policy
    given = trained(engine, b | {"old_logp": asked["logp"]})
    computed = trained(actor_engine(*overrides), b)
    assert given[0] == computed[0] and "clip_frac" in given[0]
    assert all(torch.equal(given[1][k], computed[1][k]) for k in given[1])
