"""Full weights -> a HuggingFace directory that AutoModelForCausalLM / AutoTokenizer load, for every engine."""
from __future__ import annotations

from pathlib import Path

import torch

from workers.model import model_config


def write_hf(model_cfg, tokenizer, full_state: dict[str, torch.Tensor], directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(model_cfg, tokenizer), dtype=torch.float32)
    model.load_state_dict(full_state, strict=False, assign=True)  # a tied lm_head may be left out
    model.tie_weights()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
