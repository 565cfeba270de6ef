"""KV-cached vs full-recomputation sampling, side by side in one process: wall time and identical tokens.

    .venv/bin/python benchmarks/generation.py [--batch 32] [--lengths 16 64 256] [--quick] [--json FILE]
A random-init Llama (4 layers, hidden 256) with the tiny word-level tokenizer, a batch of prompts of
mixed lengths, no end-of-sequence token so every completion runs to the full length.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from supervisor.config import ModelConfig
from workers.generate import generate
from workers.model import build_tokenizer


def main(batch: int, lengths: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    tok = build_tokenizer(ModelConfig())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tok.eos_token = None  # no completion ends early: every one is `new tokens` long
    prompts = [" ".join(str((i * 7 + j) % 10) for j in range(2 + i % 5)) + " =" for i in range(batch)]
    print(f"{'new tokens':>10} {'cached s':>9} {'full s':>9} {'speed-up':>9} {'same tokens':>12}")
    rows = []
    for n in lengths:
        times, outs = {}, {}
        for cache in (True, False):
            t0 = time.perf_counter()
            outs[cache] = generate(model, tok, prompts, list(range(batch)), seed=1, step=0, max_new_tokens=n,
                                   use_cache=cache)
            times[cache] = time.perf_counter() - t0
        same = torch.equal(outs[True]["input_ids"], outs[False]["input_ids"])
        print(f"{n:>10} {times[True]:>9.2f} {times[False]:>9.2f} {times[False] / times[True]:>8.1f}x {str(same):>12}")
        rows.append({"new_tokens": n, "cached_secs": times[True], "full_secs": times[False],
                     "speedup": times[False] / times[True], "same_tokens": same})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--quick", action="store_true", help="a few seconds: batch 4, lengths 4 and 8 (CI)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    batch, lengths = (4, [4, 8]) if args.quick else (args.batch, args.lengths)
    figures = main(batch, lengths)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "generation", "batch": batch, "rows": figures}, f, indent=1)
