"""The DeepSpeed training engine: ZeRO stage 1, 2 or 3 (`actor.zero_stage`) on gloo (CPU) or nccl (GPU).

The optimizer is a plain `torch.optim.AdamW` handed to `deepspeed.initialize` (DeepSpeed's own CPU Adam is a C++ op
built on first use; AdamW needs no build and steps the same way on every rank), with the same LR schedule as the
FSDP engine. With actor.dtype bf16, DeepSpeed's bf16 mode: the module's weights and gradients are bf16
(micro-batches accumulate in fp32) and the optimizer steps fp32 master weights of its own, which the checkpoints
hold; what reads the module (the engines, the in-job HF export, the KL reference's refresh) gets the bf16 weights,
while `relaunch export` of a checkpoint gives the fp32 masters (zero_to_fp32). Recover checkpoints are DeepSpeed's
native format: `save_checkpoint` with tag `global_step{G}` and its `latest` file inside our step directory, which
relaunch publishes atomically (so DeepSpeed's non-atomic `latest` never is the commit point), plus one RNG file per
rank. Loading names the tag explicitly, with weights_only loading (safe_load.deepspeed_files). DeepSpeed's
`zero_to_fp32` reads the step directory as it is.
"""
from __future__ import annotations

import logging
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from supervisor.checkpoint import safe_load
from supervisor.checkpoint.layout import DEEPSPEED_RANK_FILE, deepspeed_tag
from supervisor.config import Config, TrainConfig, TrainDtype
from workers.engines.base import EngineBase, even_part, lr_scheduler
from workers.engines.rng import load_rng, save_rng
from workers.roles import Role


def ds_config(config: Config, train: TrainConfig, world_size: int) -> dict:
    """DeepSpeed's config for a role's section of the config (`train`)."""
    rows = config.data.batch_size * config.data.group_size // world_size
    micro = min(train.micro_batch_size or rows, rows)
    return {  # as many accumulation steps as micro-batches (EngineBase.micro_batches: the last may be short)
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": -(-rows // micro),
        "gradient_clipping": train.grad_clip or 0.0, "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True, "steps_per_print": 2**31, "wall_clock_breakdown": False,
        "bf16": {"enabled": train.dtype is TrainDtype.BF16},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if train.dtype is TrainDtype.BF16 else {}),  # as FSDP2's
    }


class DeepSpeedEngine(EngineBase):
    MEMORY_TIER = False  # deepspeed.comm keeps global group state it cannot re-form in place: recovery is from disk

    def __init__(self, config: Config, rank: int, world_size: int, device: torch.device, tokenizer,
                 model: torch.nn.Module, role: Role | None = None):
        """`tokenizer` and `model` (unsharded, on CPU) come from base.build_parts; `role`: the actor's by default."""
        super().__init__(config, rank, world_size, device, tokenizer, role)
        deepspeed.utils.logger.setLevel(logging.WARNING)
        model = model.to(device)
        train = self.section
        optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler(optimizer, train.warmup_steps),
            config=ds_config(config, train, world_size), dist_init_required=False)
        self.params = list(self.engine.module.parameters())  # in named_parameters' order: what the stream sends

    def train_step(self, batch: dict, global_step: int) -> dict:
        """One optimizer step on this rank's shard of the batch, in micro-batches (DeepSpeed's gradient
        accumulation: it steps at the last); DeepSpeed averages the gradients over the ranks. Each micro-batch's
        loss is already its share of the shard's token mean, so DeepSpeed does not divide it again."""
        self.engine.train()
        lr = self.scheduler.get_last_lr()[0]
        parts, tokens = self.micro_batches(batch)
        loss, metrics = None, {}
        for part in parts:
            part_loss, part_metrics = self._loss(self.engine, part, tokens)
            self.engine.backward(part_loss, scale_wrt_gas=False)
            self.engine.step()
            loss = part_loss.detach() if loss is None else loss + part_loss.detach()
            metrics = self._add_metrics(metrics, part_metrics)
        norm = self.engine.get_global_grad_norm()
        if self.reference is not None and self.reference.refresh_due(global_step):
            self.reference.refresh(self.full_state_dict())
        return {"loss": self._mean_over_ranks(loss), "lr": lr, **metrics,
                "grad_norm": float(norm) if norm is not None else float("nan")}

    def values(self, batch: dict) -> torch.Tensor:
        return self._values(self.engine, batch)

    def logprobs(self, batch: dict) -> dict[str, torch.Tensor]:
        return self._token_logprobs(self.engine, batch)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the full weights on CPU (ZeRO-3 gathers its partitions first)."""
        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.section.zero_stage == 3):
            return {k: v.detach().cpu().clone() for k, v in self.engine.module.state_dict().items()}

    def weight_params(self) -> list[tuple[str, torch.Size]]:
        """ZeRO-3 keeps a partition in `p` and the full shape in `p.ds_shape`."""
        return [(name, getattr(p, "ds_shape", p.shape)) for name, p in self.engine.module.named_parameters()]

    def full_param(self, index: int) -> torch.Tensor | None:
        """ZeRO-1/2 parameters are whole on every rank; ZeRO-3 gathers this one (every rank) and rank 0 copies
        it out before it is partitioned again."""
        p = self.params[index]
        if self.section.zero_stage != 3:
            return p.detach()
        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone() if self.rank == 0 else None

    def placed_part(self, index: int) -> tuple[int, torch.Tensor]:
        """Whole on rank 0 (DeepSpeed's own gather under ZeRO-3), nothing on the others."""
        whole = self.full_param(index)
        return (0, whole) if self.rank == 0 else (0, self.params[index].new_empty(0))

    def weight_shard(self, index: int) -> tuple[int, torch.Tensor]:
        """ZeRO-1/2 parameters are whole on every rank: an even share each. ZeRO-3 keeps rank r's partition of
        the flattened parameter in `p.ds_tensor`, elements from r * its length, the last one padded."""
        p = self.params[index]
        if self.section.zero_stage != 3:
            return even_part(p.detach().reshape(-1), self.rank, self.world_size)
        size = p.ds_tensor.ds_numel
        start = min(self.rank * size, p.ds_numel)
        return start, p.ds_tensor.detach().reshape(-1)[:max(0, min(size, p.ds_numel - start))]

    def save(self, directory: Path, global_step: int) -> list[str]:
        """Collective: DeepSpeed's checkpoint (tag global_step{G}, `latest`) and this rank's RNG file.

        Each rank reports its own `zero_pp_rank_{r}_*` shards and RNG file; rank 0 also the shared files
        (`latest`, ZeRO-1/2's model states, DeepSpeed's zero_to_fp32.py)."""
        tag = deepspeed_tag(global_step)
        self.engine.save_checkpoint(str(directory), tag=tag)
        written = [save_rng(directory, self.rank)]
        dist.barrier()  # every rank's files are on disk before rank 0 lists the shared ones
        mine = DEEPSPEED_RANK_FILE.format(self.rank)
        written += [f"{tag}/{p.name}" for p in (directory / tag).iterdir() if mine in p.name]
        if self.rank == 0:
            written += [str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()
                        and "zero_pp_rank_" not in p.name and not p.name.startswith("rng_rank")]
        if self.reference is not None:
            self.reference.save(directory.parent, global_step, self.rank)
        return written

    def load(self, directory: Path, global_step: int, same_world_size: bool) -> list[str]:
        """Collective: model, optimizer and LR scheduler from the named tag (never from `latest`)."""
        if not same_world_size:
            raise ValueError(f"{directory}: a DeepSpeed checkpoint loads only with the world size it was saved with")
        with safe_load.deepspeed_files():  # a copied checkpoint cannot run code here (DeepSpeed unpickles fully)
            path, _ = self.engine.load_checkpoint(str(directory), tag=deepspeed_tag(global_step),
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{directory / deepspeed_tag(global_step)}: DeepSpeed found no checkpoint")
        if self.reference is not None:
            self.reference.load(directory.parent, global_step)
        return load_rng(directory, self.rank, same_world_size)

