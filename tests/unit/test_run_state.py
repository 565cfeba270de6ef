import pytest

from supervisor.config import load_config
from supervisor.control.policy import train_group_sizes
from supervisor.control.run_state import IncompatibleCheckpoint, RunState
from supervisor.control.step_info import StepInfo


def state_at(step: StepInfo, config) -> dict:
    st = RunState.fresh(config, step.steps_per_epoch)
    st.step = step
    st.saver.check(False, 1.0)
    nxt = step.next()
    return st.to_infos({"epoch": nxt.epoch, "epoch_step": nxt.epoch_step, "dataset_size": 100})


@pytest.fixture
def config():
    return load_config()


def test_round_trip_restores_every_counter(config):
    infos = state_at(StepInfo(1, 3, 15, 12), config)
    state, warnings = RunState.from_infos(infos, config, 12)
    assert warnings == []
    assert state.step == StepInfo(1, 3, 15, 12)
    assert state.saver.steps_since == 1


def test_a_checkpoint_without_the_newer_keys_loads_with_warnings(config):
    infos = state_at(StepInfo(0, 11, 11, 12), config)
    del infos["step_info.json"]["steps_per_epoch"]
    del infos["saver_info.json"]["freq"]["secs_since"]
    del infos["evaluator_info.json"]["freq"]
    for name in ("saver_info.json", "evaluator_info.json", "checkpoint_info.json"):
        del infos[name]["configured"]
    infos["dataloader_info.pkl"] = {}
    state, warnings = RunState.from_infos(infos, config, 12)
    assert state.step == StepInfo(0, 11, 11, 12) and state.step.next() == StepInfo(1, 0, 12, 12)
    text = " | ".join(warnings)
    assert "steps_per_epoch" in text and "secs_since" in text and "evaluator_info.json" in text
    assert "dataloader_info.pkl" in text


def test_changed_frequencies_warn_and_the_config_wins(config):
    infos = state_at(StepInfo(0, 4, 4, 12), config)
    changed = load_config(None, ["recover.freq_steps=2"])
    state, warnings = RunState.from_infos(infos, changed, 12)
    assert state.recover.freq_steps == 2
    assert any("checkpoint_info.json" in w and "config wins" in w for w in warnings)


@pytest.mark.parametrize("damage", ["steps_per_epoch", "dataloader"])
def test_a_checkpoint_that_cannot_fit_this_run_is_refused(config, damage):
    infos = state_at(StepInfo(0, 4, 4, 12), config)
    if damage == "steps_per_epoch":
        with pytest.raises(IncompatibleCheckpoint, match="steps per epoch"):
            RunState.from_infos(infos, config, 6)
    else:
        infos["dataloader_info.pkl"]["epoch_step"] = 9
        with pytest.raises(IncompatibleCheckpoint, match="dataloader_info.pkl"):
            RunState.from_infos(infos, config, 12)


@pytest.mark.parametrize("wanted, minimum, samples, sizes", [
    (2, None, 64, [2]),
    (4, 1, 64, [4, 2, 1]),
    (8, 4, 48, [8, 6, 4]),
    (3, 3, 9, [3]),
])
def test_train_group_sizes_shrink_only_when_allowed(wanted, minimum, samples, sizes):
    assert train_group_sizes(wanted, minimum, samples) == sizes


def test_the_kl_penalty_coefficient_in_ppos_rewards_is_run_state():
    """critic.kl_in_reward: the coefficient the next step weighs the KL with is saved (kl_ctl_info.json) and
    restored, the config's target and horizon winning; a checkpoint without it starts again from actor.kl_coef,
    said; a job without the penalty writes no such file."""
    config = load_config(None, ["critic.lr=0.01", "actor.kl_coef=0.05", "critic.kl_in_reward=true",
                                "critic.kl_target=0.02", "critic.kl_horizon=500"])
    st = RunState.fresh(config, 12)
    assert (st.kl.value, st.kl.target, st.kl.horizon) == (0.05, 0.02, 500)
    st.kl = st.kl.after(kl=0.5, samples=64)  # far above the target: the coefficient grows
    infos = {**state_at(StepInfo(0, 3, 3, 12), config), "kl_ctl_info.json": st.to_infos({})["kl_ctl_info.json"]}
    restored, warnings = RunState.from_infos(infos, config, 12)
    assert warnings == [] and restored.kl == st.kl and restored.kl.value > 0.05
    del infos["kl_ctl_info.json"]
    restored, warnings = RunState.from_infos(infos, config, 12)
    assert restored.kl.value == 0.05 and warnings == [
        "kl_ctl_info.json is missing: the KL penalty's coefficient starts again at actor.kl_coef = 0.05"]
    assert "kl_ctl_info.json" not in state_at(StepInfo(0, 3, 3, 12), load_config(None, ["critic.lr=0.01"]))


def test_a_fixed_kl_coefficient_is_the_configs_at_a_resume():
    """Without critic.kl_target the coefficient never moves: it is config, so a resume takes actor.kl_coef as the
    config now says, whatever the checkpoint recorded."""
    config = load_config(None, ["critic.lr=0.01", "actor.kl_coef=0.05", "critic.kl_in_reward=true"])
    infos = {**state_at(StepInfo(0, 3, 3, 12), config),
             "kl_ctl_info.json": {"schema_version": 1, "kl_coef": 0.2, "target": None, "horizon": 10000}}
    state, warnings = RunState.from_infos(infos, config, 12)
    assert state.kl.value == 0.05 and state.kl.target is None and warnings == []
