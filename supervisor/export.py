"""`relaunch export`: a recover checkpoint (fsdp's DCP shards or DeepSpeed's ZeRO files) -> a HuggingFace
model directory, in one process.

The checkpoint is validated against its manifest first (which names the engine that wrote it); the model
is rebuilt from the run's own config (run_config.json), the weights are merged without a process group
(DCP, or DeepSpeed's zero_to_fp32), and the directory is published atomically like every other export.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from supervisor.config import Config
from supervisor.durable import publish_dir, tmp_name
from supervisor.recovery import RUN_CONFIG, CheckpointError, read_checkpoint, step_of


class ExportError(RuntimeError):
    pass


def export_recover_checkpoint(checkpoint: Path, out: Path) -> None:
    from workers.engines.export import write_hf
    from workers.model import build_tokenizer

    checkpoint = checkpoint.resolve()
    step = step_of(checkpoint)
    if step is None or not (checkpoint / RUN_CONFIG).is_file():
        raise ExportError(f"{checkpoint}: not a recover checkpoint directory (globalstep<N> with {RUN_CONFIG})")
    if out.exists():
        raise ExportError(f"{out}: already exists; choose another --out")
    try:
        config = Config.model_validate(json.loads((checkpoint / RUN_CONFIG).read_text()))
    except ValueError as e:
        raise ExportError(f"{checkpoint / RUN_CONFIG}: unreadable ({e})") from e
    try:
        manifest = read_checkpoint(checkpoint).manifest
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    tokenizer = build_tokenizer(config.model)
    if manifest.get("engine", "fsdp") == "deepspeed":
        weights = _deepspeed_weights(checkpoint, step)
    else:
        weights = _dcp_weights(checkpoint, config, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(out)
    write_hf(config.model, tokenizer, weights, tmp)
    publish_dir(tmp, out)


def _dcp_weights(checkpoint: Path, config: Config, tokenizer) -> dict[str, torch.Tensor]:
    """The model's entries of a DCP checkpoint, read without a process group."""
    from transformers import AutoModelForCausalLM

    from workers.model import model_config

    model = AutoModelForCausalLM.from_config(model_config(config.model, tokenizer), dtype=torch.float32)
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {"model": {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state["model"]


def _deepspeed_weights(checkpoint: Path, step: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 merge of every rank's ZeRO partitions (stage 1, 2 or 3)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=f"global_step{step}")
