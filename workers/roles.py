"""A trained group's role, as its engine sees it: the policy (the actor, always) or a value model (the critic of
PPO with GAE, issue 40; not yet driven by the pipeline). A role names its section of the config and whether its
model is a value model; the engine, its sharding, optimizer, micro-batches, checkpoints and memory-tier copies are
the same for either, and what the updates minimise follows the model (EngineBase._loss)."""
from __future__ import annotations

from dataclasses import dataclass

from supervisor.config import Config, CriticConfig, TrainConfig


@dataclass(frozen=True)
class Role:
    name: str            # "actor" | "critic"
    section: TrainConfig  # its section of the config: engine, optimizer, updates
    value: bool = False   # a value model (one output per token) instead of the language model


def actor(config: Config) -> Role:
    return Role("actor", config.actor)


def critic(section: CriticConfig) -> Role:
    return Role("critic", section, value=True)
