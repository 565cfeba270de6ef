"""The model sizes the benchmarks take (`--size tiny|100m|0.5b`, several comma-separated): the shipped configs,
and what a one-node cluster needs to run each (its object store holds a whole model on every push)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from supervisor.config import REPO_ROOT, load_config


@dataclass(frozen=True)
class Size:
    config: Path
    object_store: int  # bytes: two versions of the fp32 weights in flight, and room for the rest


# The benchmarks time the trainer's side (steps, saves, a rank's recovery, the Supervisor's overhead) on the
# built-in engine: it starts without vLLM's 10-20 s import, which CI's quick runs cannot pay in every job, and a
# rank's recovery does not restart the engine. It goes first, so a `rollout.engine=vllm` given on the command line
# wins; benchmarks/engines.py and `recovery.py --engine-kill` compare the engines.
ENGINE = "rollout.engine=hf"

SIZES = {
    "tiny": Size(REPO_ROOT / "configs" / "tiny_grpo.yaml", 150 * 1024**2),
    "100m": Size(REPO_ROOT / "configs" / "grpo_100m.yaml", 2 * 1024**3),
    "0.5b": Size(REPO_ROOT / "configs" / "grpo_0.5b.yaml", 4 * 1024**3),
}


def parse_sizes(text: str) -> list[str]:
    sizes = text.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--size: unknown {unknown}; choose from {', '.join(SIZES)}")
    return sizes


def weight_shapes(size: str) -> list[torch.Size]:
    """The shapes of the model's distinct parameters (tied ones once), from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    from workers.model import build_tokenizer, model_config

    cfg = load_config(SIZES[size].config).model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(cfg, build_tokenizer(cfg)))
    return [p.shape for p in model.parameters()]
