"""The built-in engine vs vLLM, side by side in one run: engine start, generation, weight update.

    .venv/bin/python benchmarks/engines.py [--size tiny,100m] [--samples 64] [--new-tokens 32] [--json FILE]

Each (size, engine) runs in a process of its own, as a RolloutWorker's engine does (one thread, on one core),
without Ray. `tiny` is the tiny config at the smallest shape vLLM's CPU attention runs (hidden 128, 4 heads),
`100m` configs/grpo_100m.yaml. Start: the tokenizer and model build, and for vLLM its import and engine
start (import shown apart). Generation: `--samples` completions of `--new-tokens` tokens (no EOS: all run to
the full length), each seeded by its sample, after one warm-up call. Weight update: new weights copied into
the engine's parameters (the built-in engine's model, vLLM's staging copy, where a sync lands) and, for vLLM,
fed through `reload_weights`; then the digest of what the engine holds (for vLLM read back from its model).
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time

SIZES = {
    "tiny": ["configs/tiny_grpo.yaml", "model.hidden_size=128", "model.intermediate_size=256", "model.num_heads=4"],
    "100m": ["configs/grpo_100m.yaml"],
}
ENGINES = ("hf", "vllm")


def one(size: str, engine: str, samples: int, new_tokens: int) -> dict:
    """Measured in this process: one engine at one size."""
    import torch

    from supervisor.config import load_config
    from workers.generate import encode_prompt, generate, sample_seed
    from workers.model import build_model, build_tokenizer
    from workers.weight_sync import local_digest

    path, *overrides = SIZES[size]
    config = load_config(path, [*overrides, f"rollout.engine={engine}"])
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(config.model)
    model = build_model(config.model, tokenizer, config.seed).eval()
    row = {"size": size, "engine": engine, "params": sum(p.numel() for p in model.parameters())}
    vllm = None
    if engine == "vllm":
        t1 = time.perf_counter()
        importlib.import_module("vllm")  # timed apart: every engine start pays it

        row["import_secs"] = time.perf_counter() - t1
        from workers.vllm_engine import VllmEngine

        vllm = VllmEngine(config, tokenizer, 0)
    row["start_secs"] = time.perf_counter() - t0
    tokenizer.eos_token = None  # every completion runs to `new_tokens`
    prompts = [f"{i % 10} {(i * 7) % 10} =" for i in range(samples)]
    names = [n for n, _ in model.named_parameters()]
    shapes = [list(p.shape) for _, p in model.named_parameters()]

    def draw() -> None:
        if vllm is None:
            generate(model, tokenizer, prompts, list(range(samples)), seed=1, step=0, max_new_tokens=new_tokens)
        else:
            encoded = [encode_prompt(tokenizer, p, config.data.chat_template) for p in prompts]
            vllm.generate(encoded, [sample_seed(1, 0, s) for s in range(samples)], new_tokens, 1.0, False)

    def update(scale: float) -> tuple[float, float]:
        t1 = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        if vllm is not None:
            vllm.load(model.state_dict().items())
        t2 = time.perf_counter()
        held = vllm.loaded(names, shapes) if vllm is not None else list(model.parameters())
        local_digest(held, torch.float32, config.rollout.weight_bucket_mb * 2**20)
        return t2 - t1, time.perf_counter() - t2

    if vllm is not None:
        update(1.0)  # the first update brings vLLM off its dummy weights
    draw()
    t1 = time.perf_counter()
    draw()
    row["generate_secs"] = time.perf_counter() - t1
    row["tokens_per_sec"] = samples * new_tokens / row["generate_secs"]
    update(1.0)
    row["update_secs"], row["digest_secs"] = update(1.0)
    row["weight_mb"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    return row


def main(sizes: list[str], samples: int, new_tokens: int) -> list[dict]:
    rows = []
    print(f"{'size':>5} {'engine':>8} {'start s':>8} {'(import)':>9} {'gen s':>7} {'tok/s':>8} "
          f"{'update s':>9} {'digest s':>9}")
    for size in sizes:
        for engine in ENGINES:
            out = subprocess.run([sys.executable, __file__, "--one", size, engine, "--samples", str(samples),
                                  "--new-tokens", str(new_tokens)], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{size} {engine} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{size:>5} {engine:>8} {row['start_secs']:>8.1f} {row.get('import_secs', 0):>9.1f} "
                  f"{row['generate_secs']:>7.2f} {row['tokens_per_sec']:>8.0f} {row['update_secs']:>9.2f} "
                  f"{row['digest_secs']:>9.2f}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny,100m")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.samples, args.new_tokens)))
    else:
        result = main(args.size.split(","), args.samples, args.new_tokens)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
