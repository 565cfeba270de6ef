"""A trained group's role, as its engine sees it: the policy (the actor, always) or a value model (the critic of
PPO with GAE). A role names its section of the config and whether its
model is a value model; the engine, its sharding, optimizer, micro-batches, checkpoints and memory-tier copies are
the same for either, and what the updates minimise follows the model (EngineBase._loss)."""
from __future__ import annotations

from dataclasses import dataclass

from supervisor.config import Config, CriticConfig, RoleName, TrainConfig


@dataclass(frozen=True)
class Role:
    name: RoleName
    section: TrainConfig  # its section of the config: engine, optimizer, updates
    value: bool = False   # a value model (one output per token) instead of the language model


def actor(config: Config) -> Role:
    return Role(RoleName.ACTOR, config.actor)


def critic(section: CriticConfig) -> Role:
    return Role(RoleName.CRITIC, section, value=True)


def of(config: Config, name: RoleName) -> Role:
    """The role called `name` among the config's trained groups (Config.trained): a TrainWorker is told its name."""
    name = RoleName(name)  # a plain "critic" too
    return critic(config.trained[name]) if name is RoleName.CRITIC else actor(config)
