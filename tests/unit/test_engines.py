"""Pure pieces behind the engines: the reference schedule, GRPO's KL term, which checkpoint an engine can
load, reference file retention, and the config rules that keep a DeepSpeed or KL run restorable."""
import pytest
import torch

from supervisor.checkpoint.layout import TrialLayout, reference_file
from supervisor.checkpoint.store import RecoverStore, compatibility_error
from supervisor.config import DEFAULT_CONFIG, Backend, ConfigError, load_config
from workers.engines.reference import reference_step
from workers.engines.base import update_order
from workers.grpo import clipped_policy_loss, kl_penalty, policy_loss, token_logprobs


@pytest.mark.parametrize("step, every, expected", [
    (0, None, None), (100, None, None),     # never refreshed: the initial policy
    (0, 10, None), (8, 10, None),           # before the first refresh
    (9, 10, 9), (14, 10, 9), (19, 10, 19),  # refreshed after steps 9, 19, ...
    (0, 1, 0), (5, 1, 5),
])
def test_reference_step_is_the_last_refresh_at_or_before_a_step(step, every, expected):
    assert reference_step(step, every) == expected


def test_kl_penalty_is_zero_for_the_same_policy_and_positive_otherwise():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
    mask = torch.tensor([[0, 1, 1, 1]])
    assert kl_penalty(logp, logp, mask) == 0
    assert kl_penalty(logp, logp + 0.1, mask) > 0 and kl_penalty(logp, logp - 0.1, mask) > 0
    assert kl_penalty(logp, logp + 5.0, torch.zeros_like(mask)) == 0  # only generated tokens count


def test_policy_loss_is_minus_advantage_times_logprob_over_generated_tokens():
    logits = torch.zeros(1, 3, 4)  # uniform: log p = -log 4 for every token
    loss = policy_loss(logits, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 0, 1]]), torch.tensor([2.0]))
    assert torch.isclose(loss, torch.tensor(2.0) * torch.log(torch.tensor(4.0)))


def test_ppos_clipped_surrogate_is_grpos_loss_on_policy_and_stops_pushing_past_the_clip():
    torch.manual_seed(0)
    logits, ids = torch.randn(4, 5, 7, requires_grad=True), torch.randint(0, 7, (4, 5))
    mask, adv = torch.tensor([[0, 0, 1, 1, 1]] * 4), torch.tensor([1.0, -1.0, 0.5, 0.0])
    old = token_logprobs(logits, ids).detach()
    # on policy (ratio 1): GRPO's gradient (its value is -A's token mean), nothing clipped
    loss, clipped = clipped_policy_loss(logits, ids, mask, adv, old, 0.2)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad(policy_loss(logits, ids, mask, adv), logits)
    assert torch.allclose(grad, expected) and torch.isclose(loss, -adv.mean()) and clipped == 0
    # a policy that already moved past 1 + clip where the advantage is positive (and below 1 - clip where it is
    # negative) gets no gradient there: the clipped term is the larger loss, and it is constant
    moved = old - torch.tensor([[1.0], [-1.0], [0.0], [0.0]])  # rows 0, 1 past the clip in their advantage's way
    loss, clipped = clipped_policy_loss(logits, ids, mask, adv, moved, 0.2)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[:2].abs().sum() == 0 and grad[2].abs().sum() > 0 and clipped == 0.5
    # past the clip against its advantage's way (a token made likelier whose advantage is negative): not clipped,
    # its gradient pulls it back; clip_frac counts only the tokens whose gradient the clip stopped
    back = old - torch.tensor([[-1.0], [1.0], [0.0], [0.0]])
    loss, clipped = clipped_policy_loss(logits, ids, mask, adv, back, 0.2)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() > 0 and clipped == 0


def test_a_passes_order_is_a_function_of_seed_step_and_pass_alone():
    order = update_order(1, 7, 0, 32)
    assert sorted(order.tolist()) == list(range(32)) and torch.equal(order, update_order(1, 7, 0, 32))
    assert not torch.equal(order, update_order(1, 7, 1, 32)) and not torch.equal(order, update_order(1, 8, 0, 32))


def test_a_pass_makes_exactly_mini_batches_updates_whatever_the_rows():
    from types import SimpleNamespace

    from workers.engines.base import EngineBase
    from workers.roles import actor

    for rows, mini in ((6, 4), (5, 4), (32, 3), (8, 8)):
        config = load_config(DEFAULT_CONFIG, [f"actor.mini_batches={mini}", "actor.ppo_epochs=2"])
        engine = SimpleNamespace(config=config, role=actor(config), section=config.actor)
        batch = {"input_ids": torch.zeros(rows, 4, dtype=torch.long), "attention_mask": torch.ones(rows, 4),
                 "response_mask": torch.ones(rows, 4), "advantages": torch.zeros(rows),
                 "old_logp": torch.zeros(rows, 3)}  # the policy's, asked before the step (logprobs)
        updates = EngineBase.updates(engine, None, batch, 3)
        sizes = [len(u["input_ids"]) for u in updates]
        assert len(updates) == 2 * mini and max(sizes) - min(sizes) <= 1 and sum(sizes) == 2 * rows


def test_several_updates_a_step_are_checked():
    assert load_config(DEFAULT_CONFIG, ["actor.ppo_epochs=2", "actor.mini_batches=32"]).actor.mini_batches == 32
    with pytest.raises(ConfigError, match="actor.mini_batches = 33 is more than a rank's 32 samples"):
        load_config(DEFAULT_CONFIG, ["actor.mini_batches=33"])
    with pytest.raises(ConfigError, match="need actor.backend fsdp"):
        load_config(DEFAULT_CONFIG, ["actor.ppo_epochs=2", "actor.backend=deepspeed"])


@pytest.mark.parametrize("manifest, backend, n, fragment", [
    ({"engine": "fsdp", "world_size": 2}, "fsdp", 2, None),
    ({"world_size": 2}, "fsdp", 2, None),  # written before the engine was recorded: fsdp
    ({"engine": "fsdp", "world_size": 2}, "fsdp", 1, None),  # DCP reshards
    ({"engine": "deepspeed", "world_size": 2}, "deepspeed", 2, None),
    ({"engine": "deepspeed", "world_size": 2}, "fsdp", 2, "written by actor.backend deepspeed, but this run has "
                                                          "actor.backend fsdp"),
    ({"engine": "fsdp", "world_size": 2}, "deepspeed", 2, "written by actor.backend fsdp, but this run has "
                                                          "actor.backend deepspeed"),
    ({"world_size": 2}, "deepspeed", 2, "actor.backend fsdp"),
    ({"engine": "deepspeed", "world_size": 2}, "deepspeed", 4, "cluster.n_train_workers = 4"),
])
def test_compatibility_of_a_checkpoint_with_the_run(manifest, backend, n, fragment):
    problem = compatibility_error(manifest, backend, n)
    assert problem is None if fragment is None else fragment in problem


@pytest.mark.parametrize("manifest, backend, n, fragment", [
    ({"engine": "fsdp", "world_size": 2, "roles": {"critic": {"engine": "fsdp", "world_size": 2}}}, "fsdp", 4, None),
    ({"engine": "fsdp", "world_size": 2}, "fsdp", 2, "has no critic's part (written by a job without a `critic`"),
    ({"engine": "fsdp", "world_size": 2, "roles": {"critic": {"engine": "fsdp", "world_size": 2}}}, "deepspeed", 2,
     "written by critic.backend fsdp, but this run has critic.backend deepspeed"),
    ({"engine": "fsdp", "world_size": 2, "roles": {"critic": {"engine": "deepspeed", "world_size": 2}}},
     "deepspeed", 4, "cannot be loaded by critic.n_workers = 4; set critic.n_workers=2"),
])
def test_compatibility_of_a_checkpoints_critic_part_with_the_run(manifest, backend, n, fragment):
    problem = compatibility_error(manifest, backend, n, "critic", "critic.n_workers")
    assert problem is None if fragment is None else fragment in problem


def test_deepspeed_and_its_stages_are_accepted():
    c = load_config(DEFAULT_CONFIG, ["actor.backend=deepspeed", "actor.zero_stage=3"])
    assert c.actor.backend is Backend.DEEPSPEED and c.actor.zero_stage == 3


@pytest.mark.parametrize("overrides, keys", [
    (["actor.zero_stage=4"], ["actor.zero_stage"]),
    (["actor.backend=deepspeed", "recover.min_train_workers=1"], ["recover.min_train_workers", "actor.backend"]),
    (["actor.kl_coef=0.1", "actor.ref_update_steps=7"], ["actor.ref_update_steps", "recover.freq_steps"]),
    (["actor.kl_coef=0.1", "actor.ref_update_steps=10", "recover.freq_steps=null", "recover.freq_epochs=1"],
     ["actor.ref_update_steps", "recover.freq_steps"]),
])
def test_configs_that_cannot_be_restored_exactly_are_rejected_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, overrides)
    assert all(k in str(e.value) for k in keys) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["actor.kl_coef=0.1", "actor.ref_update_steps=10"],  # recover every 5 steps: every refresh is saved
    ["actor.kl_coef=0.1"],                               # the reference never changes
    ["actor.kl_coef=0.1", "actor.ref_update_steps=7", "recover.mode=off"],
    ["actor.backend=deepspeed", "recover.min_train_workers=2"],
])
def test_restorable_reference_and_engine_configs_are_accepted(overrides):
    load_config(DEFAULT_CONFIG, overrides)


def test_reference_files_are_pruned_once_no_kept_step_needs_them(tmp_path):
    from supervisor.checkpoint.durable import file_digest

    store = RecoverStore(TrialLayout(tmp_path, "u", "exp", "t0"), keep_last=2)
    infos = {"step_info.json": {}, "saver_info.json": {}, "evaluator_info.json": {},
             "stats_logger_info.json": {}, "dataloader_info.pkl": {}}
    for step in (4, 9, 14, 19, 24):
        staging = store.staging_dir(step)
        ref_step = reference_step(step, 10)
        files = {}
        if ref_step is not None:
            ref = reference_file(staging.parent, ref_step)
            if not ref.exists():  # written only on the step where it changes
                ref.parent.mkdir(exist_ok=True)
                ref.write_bytes(b"weights of step %d" % ref_step)
            files[f"../reference/{ref.name}"] = {"size": ref.stat().st_size, "sha256": file_digest(ref)}
        store.commit(staging, step, 2, "hash", files, infos, engine="deepspeed")
        store.wait_for_pruning()
    assert store.published_steps() == [19, 24]
    assert sorted(p.name for p in (store.layout.recover_checkpoint / "reference").iterdir()) == \
        ["ref_globalstep19.safetensors"]
    ck = store.load_latest().checkpoint
    assert ck.global_step == 24 and ck.manifest["engine"] == "deepspeed"


def test_deepspeed_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match="actor.backend: deepspeed is not installed"):
        load_config(DEFAULT_CONFIG, ["actor.backend=deepspeed"])
    load_config(DEFAULT_CONFIG, ["actor.backend=fsdp"])


def test_the_engines_able_to_save_in_the_background_are_exactly_those_config_lists():
    import inspect

    from supervisor.config import ASYNC_SAVE_BACKENDS
    from workers.engines.base import BackgroundSave, engine_class

    def implements(cls) -> bool:
        methods = [m for m in vars(BackgroundSave) if not m.startswith("_")]
        return all(callable(getattr(cls, m, None)) and
                   list(inspect.signature(getattr(cls, m)).parameters) ==
                   list(inspect.signature(getattr(BackgroundSave, m)).parameters) for m in methods)

    assert {b for b in Backend if implements(engine_class(b))} == set(ASYNC_SAVE_BACKENDS)


def test_the_engines_with_a_memory_tier_are_exactly_those_that_implement_it():
    import inspect

    from workers.engines.base import MemoryTier, engine_class

    def implements(cls) -> bool:
        methods = [m for m in vars(MemoryTier) if not m.startswith("_") and callable(vars(MemoryTier)[m])]
        return all(callable(getattr(cls, m, None)) and
                   list(inspect.signature(getattr(cls, m)).parameters) ==
                   list(inspect.signature(getattr(MemoryTier, m)).parameters) for m in methods)

    assert {b for b in Backend if engine_class(b).MEMORY_TIER} == {b for b in Backend if implements(engine_class(b))}
    assert engine_class(Backend.FSDP).MEMORY_TIER and not engine_class(Backend.DEEPSPEED).MEMORY_TIER
