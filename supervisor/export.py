"""`relaunch export`: a recover checkpoint (DCP shards) -> a HuggingFace model directory, in one process.

The checkpoint is validated against its manifest first; the model is rebuilt from the run's own config
(run_config.json), DCP reshards the weights into it without a process group, and the directory is
published atomically like every other export.
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
    from transformers import AutoModelForCausalLM

    from workers.model import build_tokenizer, model_config

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
        read_checkpoint(checkpoint)
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    tokenizer = build_tokenizer(config.model)
    model = AutoModelForCausalLM.from_config(model_config(config.model, tokenizer), dtype=torch.float32)
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}
    state = {"model": weights}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(out)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, out)

