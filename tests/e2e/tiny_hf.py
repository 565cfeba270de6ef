"""A tiny HuggingFace model directory made in the test, the way a user's own model arrives: a Llama-
architecture causal LM with its own byte-level BPE tokenizer trained on the task's text (with the
`tokenizers` library) and a chat template, saved with save_pretrained. No downloads."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def train_bpe_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is what the texts use, so the vocabulary stays small enough for a random model to
    # sample digits often (a full byte alphabet would make the first rollouts mostly noise).
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"])
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tiny_llama(directory: Path, data: Path) -> Path:
    """Write the model directory for the prompts and answers of a JSONL dataset; returns `directory`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    tokenizer = train_bpe_tokenizer([f"{r['prompt']} {r['answer']}" for r in rows])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
