"""The policy model and its tokenizer: a HuggingFace directory, or a Qwen2 built from the config's sizes.

A built model needs no download: its tokenizer is a word-level `tokenizers` model over the config's
vocabulary (the tiny default) or a byte-level BPE trained here (workers/tokenizer.py, the sized configs),
wrapped as a HuggingFace fast tokenizer so exports load with AutoTokenizer.
transformers is imported where it is used: the driver and the Supervisor import this package's actor
classes but never build a model, and skip its seconds of import time.
"""
from __future__ import annotations

import torch

from supervisor.config import BUILT_MODEL_CONTEXT, TokenizerKind


def build_tokenizer(model_cfg):
    """The model directory's own tokenizer (and chat template), or the built model's word-level or BPE one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model_cfg.path is not None:
        tok = AutoTokenizer.from_pretrained(model_cfg.path)
        if tok.pad_token is None:  # many causal LMs ship without one; rollouts are left-padded
            tok.pad_token = tok.eos_token
        return tok
    if model_cfg.tokenizer is TokenizerKind.BPE:
        from workers.tokenizer import bpe_tokenizer

        return bpe_tokenizer(model_cfg.vocab_size)
    vocab = {tok: i for i, tok in enumerate(model_cfg.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# a value model's head: one output per token, and no dropout before it (transformers' default is 0.1, which makes
# the values a critic computes for GAE differ from those its update trains; verl sets 0 too)
VALUE_HEAD = {"num_labels": 1, "classifier_dropout": 0.0}


def model_config(model_cfg, tokenizer, value: bool = False):
    """The model's transformers config: the directory's, or a Qwen2's of the config's sizes; `value`: with a value
    model's head."""
    from transformers import AutoConfig, Qwen2Config

    head = VALUE_HEAD if value else {}
    if model_cfg.path is not None:
        config = AutoConfig.from_pretrained(model_cfg.path)
        for key, setting in head.items():  # set, not passed: from_pretrained drops a key its class does not name
            setattr(config, key, setting)
        return config
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size, num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads, num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=BUILT_MODEL_CONTEXT, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **head,
    )


def model_class(value: bool = False):
    """transformers' auto class of the language model, or of a value model (`value`)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    return AutoModelForTokenClassification if value else AutoModelForCausalLM


def build_model(model_cfg, tokenizer, seed: int, value: bool = False) -> torch.nn.Module:
    """Identical on every rank: loaded weights, or a random init seeded by `seed`. `value`: the value model of a
    critic instead of the language model, the same body with one output per token (a token-classification model
    of one label, as verl's critic; over loaded weights, its head alone is a new init seeded by `seed`)."""
    from transformers.utils import logging as hf_logging

    if model_cfg.path is not None:
        hf_logging.disable_progress_bar()  # one bar per worker would interleave with the job's own progress bar
        if value:
            torch.manual_seed(seed)
        return model_class(value).from_pretrained(model_cfg.path, config=model_config(model_cfg, tokenizer, value),
                                                  dtype=torch.float32)
    torch.manual_seed(seed)
    return model_class(value).from_config(model_config(model_cfg, tokenizer, value), dtype=torch.float32)


def save_model_dir(model, tokenizer, model_cfg, directory, max_shard_size: str | int = "2GB") -> None:
    """A HuggingFace directory: sharded safetensors (with an index above `max_shard_size`), config.json,
    the source's generation config when it has one, and the tokenizer files."""
    from pathlib import Path

    from transformers import GenerationConfig

    source = model_cfg.path
    if source is not None and (Path(source) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(directory)


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits for left-padded sequences; positions count real tokens only, as in generation."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=False).logits
