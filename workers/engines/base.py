"""The one interface the TrainWorker drives, whatever the engine (a role's `backend`: fsdp | deepspeed).

An engine owns one rank's share of its role's model (workers/roles.py: the policy, or a critic's value model), its
optimizer, LR scheduler, RNGs and (the policy's, with `actor.kl_coef`) the reference policy. The file names it
writes into a recover step directory are its own business: `save` returns them, so the worker can report their
sizes and digests without knowing the format.
"""
from __future__ import annotations

import datetime
import importlib
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from supervisor.config import Backend, Config
from workers.memory_tier import Slot, StateLayout
from workers.roles import Role, actor

ENGINES = {Backend.FSDP: "workers.engines.fsdp:FSDPEngine",
           Backend.DEEPSPEED: "workers.engines.deepspeed:DeepSpeedEngine"}


class TrainEngine(Protocol):
    MEMORY_TIER: bool  # whether it is also a MemoryTier: rolls back and rejoins in place (fsdp), or not (deepspeed)

    def train_step(self, batch: dict, global_step: int) -> dict:
        """One optimizer step on this rank's shard of the batch; returns loss, grad_norm, lr (and kl)."""

    def values(self, batch: dict) -> torch.Tensor:
        """Collective, a value model's engine only: its value of the state before every token of this rank's shard
        ([rows, sequence - 1], as workers/ppo.py lays them), computed in the shard's micro-batches before the
        step's updates: what GAE estimates the step's advantages with, and the value loss's `old_values`."""

    def logprobs(self, batch: dict) -> dict[str, torch.Tensor]:
        """Collective, the policy's engine only: the log-probability of every token of this rank's shard after the
        first ([rows, sequence - 1]), under the policy before the step's updates (`logp`: given back to
        train_step as `old_logp`, it is not computed again) and under the reference policy where there is one
        (`ref_logp`): PPO's KL penalty in the rewards (workers/ppo.py) is estimated from the two."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full weights on CPU on rank 0 (every rank calls it; the others may get nothing)."""

    def weight_params(self) -> list[tuple[str, torch.Size]]:
        """The parameters streamed to the engines, in order: names (a tied weight once) and full shapes."""

    def full_param(self, index: int) -> torch.Tensor | None:
        """Collective: parameter `index` of weight_params(), whole on rank 0 (every rank calls it, in the same
        order; the others may get nothing)."""

    def weight_shard(self, index: int) -> tuple[int, torch.Tensor]:
        """This rank's contiguous part of parameter `index` of weight_params(), flattened: (its first element,
        the elements). The ranks' parts cover the parameter exactly once; no rank waits for another."""

    def placed_part(self, index: int) -> tuple[int, torch.Tensor]:
        """Collective where the engine gathers: the part of parameter `index` this rank vouches for when what the
        ranks wrote is checked (weight_sync.mismatched), placed by the sharding itself rather than by
        weight_shard's arithmetic: (its first element, the elements). Together the ranks' parts cover it."""

    def save(self, directory: Path, global_step: int) -> list[str]:
        """Collective: this step's recover state into `directory`; returns the paths (relative to it)
        this rank wrote, so that together the ranks report every file exactly once."""

    def load(self, directory: Path, global_step: int, same_world_size: bool) -> list[str]:
        """Collective: restore a recover step directory; returns the names of state it lacked."""

    def export_hf(self, directory: Path, full_state: dict[str, torch.Tensor]) -> None:
        """Rank 0 only: a HuggingFace directory (safetensors, config.json, tokenizer files)."""


class BackgroundSave(Protocol):
    """What an engine of config.ASYNC_SAVE_BACKENDS adds: a recover save written in the background, in two
    halves, so that a storage error on one rank skips the save on every rank before any upload starts."""

    def save_local(self, directory: Path, global_step: int) -> list[str]:
        """This rank's files of the save that need no peer, written now; returns their paths (relative)."""

    def save_async(self, directory: Path, global_step: int) -> Future:
        """Collective: returns once this rank's state is staged in CPU memory; a future of the shard files it
        writes in the background, done when they are durable."""


class MemoryTier(Protocol):
    """What an engine with MEMORY_TIER adds (workers/memory_tier.py): its recover state copied into memory after
    every step, restored from such a copy, and the process group re-formed around the built model, so that the
    ranks that survived a dead one keep their processes."""

    memory_layout: StateLayout  # where this rank's tensors lie in a slot

    def stage_memory(self, slot: Slot, global_step: int) -> None:
        """This rank's state after the optimizer step of `global_step`, into `slot` (its flat and its meta)."""

    def load_memory(self, flat: torch.Tensor, meta: dict) -> None:
        """Restore a slot's state (this rank's own, or the one of the rank this process replaces)."""

    def rejoin(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """Collective (with the others' rejoin and the replacements' setup): leave the old process group and join
        a new one as the same rank, the built model and optimizer kept; what a step cut short left is dropped."""


def even_part(flat: torch.Tensor, rank: int, world_size: int) -> tuple[int, torch.Tensor]:
    """Rank `rank`'s share of a tensor every rank holds whole: a weight_shard when nothing is sharded."""
    start, end = flat.numel() * rank // world_size, flat.numel() * (rank + 1) // world_size
    return start, flat[start:end]


class EngineBase:
    """What every engine shares: its place in the group, its role, the tokenizer, the KL reference policy, the
    role's loss on this rank's shard, the loss averaged over the ranks, and the HuggingFace export. Each engine
    adds its own sharding, optimizer step, checkpoint format and parameter gathering."""

    def __init__(self, config: Config, rank: int, world_size: int, device: torch.device, tokenizer,
                 role: Role | None = None):
        """`role`: the actor's by default."""
        from workers.engines.reference import ReferencePolicy

        role = role or actor(config)
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.tokenizer, self.role, self.section = tokenizer, role, role.section
        self.reference = ReferencePolicy(config, tokenizer, device) \
            if not role.value and config.actor.kl_coef else None
        # the KL term in the policy's loss (GRPO's), unless PPO's rewards carry it (critic.kl_in_reward)
        self.kl_in_loss = self.reference is not None and not (config.critic and config.critic.kl_in_reward)

    def _loss(self, model: torch.nn.Module, batch: dict,
              tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """The role's loss of `model` on this rank's shard of the batch, or on a micro-batch of it as its share of
        the shard's token mean (`tokens`: the shard's generated tokens): the policy's GRPO loss (and its KL term),
        or a value model's clipped value loss against the batch's `returns`, its values held within
        `value_clip` of `old_values` (the values the step's advantages were estimated with: workers/ppo.py)."""
        from workers.engines.reference import grpo_loss
        from workers.model import forward_logits
        from workers.ppo import token_values, value_loss

        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        if not self.role.value:  # one update a step is on-policy, whatever the step asked before it (logprobs)
            several = self.section.updates_per_step > 1
            return grpo_loss(forward_logits(model, ids, mask), batch, self.device,
                             self.reference if self.kl_in_loss else None, tokens,
                             self.section.clip_ratio if several else None)
        loss, clipped = value_loss(token_values(forward_logits(model, ids, mask)),
                                   batch["old_values"].to(self.device), batch["returns"].to(self.device),
                                   batch["response_mask"].to(self.device), self.section.value_clip, tokens)
        return loss, {"vf_clip_frac": float(clipped)}

    @torch.no_grad()
    def _values(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """`values` of `model` (the engine's module)."""
        from workers.ppo import token_values

        return torch.cat([token_values(logits) for logits, _ in self._forward(model, batch)])

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The policy `model`'s log-probability of every token of this rank's shard after the first."""
        from workers.grpo import token_logprobs

        return torch.cat([token_logprobs(logits, ids) for logits, ids in self._forward(model, batch)])

    def _forward(self, model: torch.nn.Module, batch: dict):
        """`model`'s logits on this rank's shard in its micro-batches, each with its input ids (on the device)."""
        from workers.model import forward_logits

        for part in self.micro_batches(batch)[0]:
            ids = part["input_ids"].to(self.device)
            yield forward_logits(model, ids, part["attention_mask"].to(self.device)), ids

    def _token_logprobs(self, model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """`logprobs` of `model` (the engine's module)."""
        out = {"logp": self._logprobs(model, batch)}
        if self.reference is not None:
            out["ref_logp"] = self._logprobs(self.reference.model, batch)
        return out

    def updates(self, model: torch.nn.Module, batch: dict, global_step: int) -> list[dict]:
        """The step's optimizer updates: the whole shard, once (GRPO on-policy, the same arithmetic as ever); or, with
        the role's ppo_epochs / mini_batches, each pass's rows in an order drawn from (seed, step, pass), cut into
        mini-batches; the policy's carry the log-probabilities of the policy that drew them (before any update), a
        value model's the values they came with (`old_values`)."""
        train = self.section
        if train.updates_per_step == 1:
            return [batch]
        if not self.role.value and "old_logp" not in batch:  # else the step asked for them before (`logprobs`)
            batch = dict(batch, old_logp=self._logprobs(model, batch))
        rows, out = len(batch["input_ids"]), []
        for epoch in range(train.ppo_epochs):
            order = update_order(self.config.seed, global_step, epoch, rows)
            out += [{k: v[part.to(v.device)] for k, v in batch.items()}
                    for part in order.tensor_split(train.mini_batches)]  # exactly that many, sizes apart by 1 at most
        return out

    def micro_batches(self, batch: dict) -> tuple[list[dict], torch.Tensor | None]:
        """This rank's shard in the role's `micro_batch_size` rows at a time, and the shard's generated tokens each
        one's loss divides by (so that the gradients add up to the shard's token mean); the whole shard and
        None without micro-batches (the plain token mean, the same arithmetic as ever)."""
        from workers.grpo import response_tokens

        size, rows = self.section.micro_batch_size, len(batch["input_ids"])
        if size is None or size >= rows:
            return [batch], None
        parts = [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]
        return parts, response_tokens(batch["response_mask"]).to(self.device)

    @staticmethod
    def _add_metrics(total: dict, metrics: dict) -> dict:
        """Each micro-batch's share of a per-token mean (the KL term): summed, they are the shard's mean."""
        return {k: total.get(k, 0.0) + v for k, v in metrics.items()}

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        """The loss averaged over every rank's shard (a sum, then a division: gloo has no AVG)."""
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total / self.world_size)

    def export_hf(self, directory: Path, full_state: dict[str, torch.Tensor]) -> None:
        """Rank 0 only: a HuggingFace directory (safetensors, config.json, tokenizer files)."""
        from workers.engines.export import write_hf

        write_hf(self.config.model, self.tokenizer, full_state, directory, self.config.saver.max_shard_size,
                 self.role.value)


def update_order(seed: int, global_step: int, epoch: int, rows: int) -> torch.Tensor:
    """The order of a rank's rows in pass `epoch` of step `global_step`: a function of these alone, so that a resumed
    step makes the same mini-batches with no random state saved (OpenRLHF draws it from an RNG nobody saves)."""
    state = np.random.SeedSequence([seed, global_step, epoch]).generate_state(1, dtype=np.uint64)[0] >> 1
    return torch.randperm(rows, generator=torch.Generator().manual_seed(int(state)))


def init_process_group(config: Config, rank: int, world_size: int, master_addr: str, master_port: int) -> torch.device:
    """Join the group's process group: gloo on CPU; on GPU nccl for CUDA tensors and gloo beside it for CPU ones
    (the loss, the shared sync's hashes, objects), as TorchTitan does. Collectives time out well after a hung
    step does, so the Supervisor decides what a hang is, not gloo or NCCL (as on main since f0af01d)."""
    use_gpu = config.cluster.gpus_per_worker > 0
    if use_gpu:
        torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES shows this actor its own GPU as device 0
    # DeepSpeed (and torchrun-style code) reads the rendezvous from the environment; this actor is one rank.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if use_gpu else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=world_size, timeout=collective_timeout(config))
    return torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")


def collective_timeout(config: Config) -> datetime.timedelta:
    """Well after a hung step is seen (recover.step_timeout_secs): the Supervisor, not gloo, decides what a hang is."""
    return datetime.timedelta(seconds=2 * config.recover.step_timeout_secs + 60)


def lr_scheduler(optimizer, warmup: int):
    """Linear warm-up over `warmup` steps, then constant: the same schedule for every engine."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)


def build_parts(config: Config, role: Role | None = None) -> tuple:
    """What an engine needs that no process group does: the engine's module imported (its seconds of import
    time), the tokenizer and the role's unsharded model (the actor's by default), built exactly as the engine would
    build them itself (seeded by `seed`), so a warm spare's model is the one a cold rank builds."""
    from workers.model import build_model, build_tokenizer

    role = role or actor(config)
    engine_class(role.section.backend)
    tokenizer = build_tokenizer(config.model)
    return tokenizer, build_model(config.model, tokenizer, config.seed, role.value)


def make_engine(config: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                parts: tuple | None = None, role: Role | None = None) -> TrainEngine:
    """Join the process group and build the engine the role's `backend` names (imported only when chosen) for the
    role (the actor's by default), from `parts` (build_parts) when given."""
    role = role or actor(config)
    device = init_process_group(config, rank, world_size, master_addr, master_port)
    tokenizer, model = parts if parts is not None else build_parts(config, role)
    if role.section.gradient_checkpointing:  # activations recomputed in the backward, layer by layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return engine_class(role.section.backend)(config, rank, world_size, device, tokenizer, model, role)


def engine_class(backend: Backend) -> type:
    """The engine class a role's `backend` names, its module imported only now."""
    module, cls = ENGINES[backend].split(":")
    return getattr(importlib.import_module(module), cls)
