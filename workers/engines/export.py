"""Full weights -> a HuggingFace directory that AutoModelForCausalLM (a value model's: AutoModelForTokenClassification)
and AutoTokenizer load, for every engine."""
from __future__ import annotations

from pathlib import Path

import torch

from workers.model import model_class, model_config, save_model_dir


def write_hf(model_cfg, tokenizer, full_state: dict[str, torch.Tensor], directory: Path,
             max_shard_size: str | int = "2GB", value: bool = False) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per rank would interleave with the job's own progress bar
    with torch.device("meta"):
        model = model_class(value).from_config(model_config(model_cfg, tokenizer, value), dtype=torch.float32)
    model.load_state_dict(full_state, strict=False, assign=True)  # a tied lm_head may be left out
    model.tie_weights()
    save_model_dir(model, tokenizer, model_cfg, directory, max_shard_size)
