"""The Supervisor's own recoverable state, and its round trip through the recover_info files. Pure.

All of it belongs to one step: where the run is (StepInfo), the counters of the Saver, the
RecoverHandler and the Evaluator frequency controls, and (PPO with the KL penalty in its rewards) the KL
coefficient for the next step. Reading is forgiving of older checkpoints: a key
that a newer version writes but an older one lacks gets a sensible default and a warning, never a
KeyError. The frequencies themselves are recorded for information only; the config in force wins.
"""
from __future__ import annotations

from dataclasses import dataclass

from supervisor.checkpoint.layout import (
    CHECKPOINT_INFO,
    DATALOADER_INFO,
    EVALUATOR_INFO,
    KL_CTL_INFO,
    SAVER_INFO,
    STATS_LOGGER_INFO,
    STEP_INFO,
)
from supervisor.checkpoint.store import SCHEMA_VERSION
from supervisor.config import Config
from supervisor.control.freq import FreqCtl
from supervisor.control.step_info import StepInfo
from workers.ppo import KLCoefficient

# recover_info file -> the RunState frequency control it carries
CONTROLS = {SAVER_INFO: "saver", EVALUATOR_INFO: "evaluator", CHECKPOINT_INFO: "recover"}


class IncompatibleCheckpoint(ValueError):
    pass


@dataclass
class RunState:
    step: StepInfo
    saver: FreqCtl
    recover: FreqCtl
    evaluator: FreqCtl
    kl: KLCoefficient | None = None  # critic.kl_in_reward: the coefficient the next step's rewards use

    @classmethod
    def fresh(cls, config: Config, steps_per_epoch: int) -> "RunState":
        c = config.critic
        kl = KLCoefficient(config.actor.kl_coef, c.kl_target, c.kl_horizon) if c and c.kl_in_reward else None
        return cls(StepInfo.before_start(steps_per_epoch), FreqCtl.from_config(config.saver),
                   FreqCtl.from_config(config.recover), FreqCtl.from_config(config.evaluator), kl)

    def to_infos(self, dataloader_state: dict) -> dict:
        """Contents of the recover_info files for this step (checkpoint_info.json is completed on commit)."""
        def ctl(c: FreqCtl) -> dict:
            return {"schema_version": SCHEMA_VERSION, "freq": c.state_dict(),
                    "configured": c.configured()}

        return {
            STEP_INFO: {"schema_version": SCHEMA_VERSION, **self.step.to_dict()},
            SAVER_INFO: ctl(self.saver),
            EVALUATOR_INFO: ctl(self.evaluator),
            CHECKPOINT_INFO: ctl(self.recover),
            STATS_LOGGER_INFO: {"schema_version": SCHEMA_VERSION, "commit_step": self.step.global_step},
            DATALOADER_INFO: dataloader_state,
            **({KL_CTL_INFO: {"schema_version": SCHEMA_VERSION, "kl_coef": self.kl.value, "target": self.kl.target,
                              "horizon": self.kl.horizon}} if self.kl is not None else {}),
        }

    @classmethod
    def from_infos(cls, infos: dict, config: Config, steps_per_epoch: int) -> tuple["RunState", list[str]]:
        """The state a checkpoint holds, and warnings about what it lacked or what the config changed."""
        warnings = []
        state = cls.fresh(config, steps_per_epoch)
        raw = dict(infos[STEP_INFO])
        if "steps_per_epoch" not in raw:
            warnings.append("step_info.json has no steps_per_epoch; using the data's")
            raw["steps_per_epoch"] = steps_per_epoch
        try:
            state.step = StepInfo.from_dict(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise IncompatibleCheckpoint(f"step_info.json lacks {e}") from e
        if state.step.steps_per_epoch != steps_per_epoch:
            raise IncompatibleCheckpoint(f"saved with {state.step.steps_per_epoch} steps per epoch, the data now "
                                         f"gives {steps_per_epoch}")
        for name, attr in CONTROLS.items():
            info, ctl = infos.get(name, {}), getattr(state, attr)
            saved = info.get("freq")
            if saved is None:
                warnings.append(f"{name} has no frequency state; its counters start at zero")
            else:
                missing = [k for k in ("epochs_since", "steps_since", "secs_since") if k not in saved]
                if missing:
                    warnings.append(f"{name} lacks {', '.join(missing)}; defaulting to zero")
                ctl.load_state_dict(saved)
            configured = info.get("configured")
            now = ctl.configured()
            if configured is not None and configured != now:
                warnings.append(f"{name}: the config's frequencies {now} differ from the checkpoint's {configured}; "
                                f"the config wins")
        if state.kl is not None and state.kl.target is not None:  # adaptive: state (a fixed one is the config's)
            saved = infos.get(KL_CTL_INFO, {}).get("kl_coef")
            if saved is None:
                warnings.append(f"{KL_CTL_INFO} is missing: the KL penalty's coefficient starts again at "
                                f"actor.kl_coef = {state.kl.value}")
            else:
                state.kl = KLCoefficient(saved, state.kl.target, state.kl.horizon)  # the config's target wins
        loader = infos.get(DATALOADER_INFO, {})
        expected = state.step.next()
        if (loader.get("epoch"), loader.get("epoch_step")) != (expected.epoch, expected.epoch_step):
            if "epoch" in loader:
                raise IncompatibleCheckpoint(f"dataloader_info.pkl is at {loader.get('epoch')}/"
                                             f"{loader.get('epoch_step')}, step_info says {expected.epoch}/"
                                             f"{expected.epoch_step}")
            warnings.append("dataloader_info.pkl has no position; using step_info.json's next step")
        return state, warnings
