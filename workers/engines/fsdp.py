"""The FSDP2 training engine: one rank's shard of the policy, its optimizer, LR scheduler and RNGs.

The model is built identically on every rank, then each decoder layer and the root are `fully_shard`ed.
Recover checkpoints are DCP (sharded model + optimizer + scheduler; DCP reshards on load) plus one small
RNG file per rank, loaded with weights_only. Full weights are gathered for the inference engines and
for HuggingFace exports.
"""
from __future__ import annotations

import datetime
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from supervisor import safe_dcp
from workers.grpo import policy_loss
from workers.model import build_model, build_tokenizer, forward_logits, model_config, save_model_dir


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": np_state[0], "state": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> list[str]:
    """Restore what the checkpoint has; returns the names it lacked (an older checkpoint), never raises."""
    missing = []
    if "python" in state:
        random.setstate(state["python"])
    else:
        missing.append("python")
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    else:
        missing.append("numpy")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    else:
        missing.append("torch")
    if torch.cuda.is_available():
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            missing.append("cuda")
    return missing


def init_process_group(config, rank: int, world_size: int, master_addr: str, master_port: int) -> torch.device:
    """Join the group's process group: nccl on GPU, gloo on CPU. Collectives time out well after a hung step
    does, so the Supervisor decides what a hang is, not gloo or NCCL."""
    use_gpu = config.cluster.gpus_per_worker > 0
    dist.init_process_group(
        "nccl" if use_gpu else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=2 * config.recover.step_timeout_secs + 60))
    return torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP shards one by one: those transformers never splits across devices, for any
    architecture (LlamaDecoderLayer, GPT2Block, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


class FSDPEngine:
    def __init__(self, config, rank: int, world_size: int, device: torch.device):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.tokenizer = build_tokenizer(config.model)
        model = build_model(config.model, self.tokenizer, config.seed).to(device)
        mesh = init_device_mesh(device.type, (world_size,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        actor = config.actor
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=actor.lr, weight_decay=actor.weight_decay)
        warmup = actor.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on this rank's shard of the batch; gradients are averaged by FSDP."""
        self.model.train()
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        logits = forward_logits(self.model, ids, mask)
        loss = policy_loss(logits, ids, batch["response_mask"].to(self.device), batch["advantages"].to(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float("nan")
        if self.config.actor.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.actor.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG if self.device.type == "cuda" else dist.ReduceOp.SUM)
        if self.device.type != "cuda":
            loss_avg /= self.world_size  # gloo has no AVG
        return {"loss": float(loss_avg), "grad_norm": grad_norm, "lr": lr}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank must call it; every rank gets the full weights on CPU."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, directory: Path) -> None:
        """Collective: this rank's DCP shards and RNG file into `directory` (shared by all ranks)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()},
                 checkpoint_id=str(directory))
        torch.save(rng_state(), directory / f"rng_rank{self.rank}.pt")

    def load(self, directory: Path, same_world_size: bool) -> list[str]:
        """Collective: load a DCP checkpoint (resharding if the world size changed); returns RNG gaps."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}
        safe_dcp.load(state, directory)  # a copied checkpoint cannot run code here
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng_file = directory / f"rng_rank{self.rank}.pt"
        if not same_world_size or not rng_file.exists():
            return ["rng (world size changed)" if not same_world_size else "rng"]
        return set_rng_state(torch.load(rng_file, weights_only=True))

    def export_hf(self, directory: Path, full_state: dict[str, torch.Tensor]) -> None:
        """Rank 0 only: write a HuggingFace directory (safetensors, config.json, tokenizer files)."""
        cfg = model_config(self.config.model, self.tokenizer)
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per rank would interleave with the job's own progress bar
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(full_state, strict=False, assign=True)
        model.tie_weights()
        save_model_dir(model, self.tokenizer, self.config.model, directory, self.config.saver.max_shard_size)
