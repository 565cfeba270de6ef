"""The built-in engine vs vLLM, side by side in one run: engine start, generation, weight sync against memcpy.

    .venv/bin/python benchmarks/engines.py [--size tiny,100m] [--samples 64] [--new-tokens 32] [--quick]
                                           [--json FILE]

Each (size, engine) runs in a process of its own, as a RolloutWorker's engine does (one thread, on one core),
without Ray. The sizes are benchmarks/sizes.py's: the shipped configs' models. Start: the tokenizer and model build,
and for vLLM its import and engine start (import shown apart). Generation: `--samples` completions of `--new-tokens`
tokens (no EOS: all run to the full length), each seeded by its sample, after one warm-up call. Weight sync, the
RolloutWorker's path once the transfer's bytes arrive: new weights received into the engine's parameters (the
built-in engine's model, vLLM's staging copy: one copy, as the ranks' writes into its shared weights are), for vLLM
fed through `reload_weights`, then the digest of what the engine holds (for vLLM read back from its model; the two
halves of `VllmEngine.refit`, timed apart). Its bandwidth is the weights' bytes over its time, against a plain copy
of the same bytes (memcpy, best of five) and as a share of it; the sync is the best of three too. `--quick`: tiny
only, 16 samples of 8 tokens.
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time

ENGINES = ("hf", "vllm")


def memcpy_secs(nbytes: int, repeats: int = 5) -> float:
    """A plain copy of `nbytes` between two tensors whose pages are already touched: the best of `repeats`."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return min(times)


def one(size: str, engine: str, samples: int, new_tokens: int) -> dict:
    """Measured in this process: one engine at one size."""
    import torch

    from supervisor.config import load_config
    from workers.generate import Sampling, encode_prompt, generate, sample_seed
    from workers.model import build_model, build_tokenizer
    from workers.weight_sync import local_digest

    from sizes import SIZES

    config = load_config(SIZES[size].config, [f"rollout.engine={engine}"])
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

    def draw() -> None:
        if vllm is None:
            generate(model, tokenizer, prompts, list(range(samples)), seed=1, step=0, max_new_tokens=new_tokens)
        else:
            encoded = [encode_prompt(tokenizer, p, config.data.chat_template) for p in prompts]
            vllm.generate(encoded, [sample_seed(1, 0, s) for s in range(samples)], new_tokens, Sampling(), False)

    bucket_bytes = config.rollout.weight_bucket_mb * 2**20
    params = list(model.parameters())
    new = [p.detach().clone() for p in params]  # the trainer's weights, as a sync brings them

    def sync() -> dict:
        """One sync after its bytes arrive: received into the engine's parameters, into vLLM, the digest."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for p, n in zip(params, new):
                p.copy_(n)
        t1 = time.perf_counter()
        if vllm is None:
            local_digest(params, torch.float32, bucket_bytes)
            t2 = t1
        else:
            vllm.load(model.state_dict().items())
            t2 = time.perf_counter()
            vllm.digest(model, names, bucket_bytes)
        t3 = time.perf_counter()
        return {"sync_secs": t3 - t0, "receive_secs": t1 - t0, "reload_secs": t2 - t1, "digest_secs": t3 - t2}

    if vllm is not None:
        sync()  # the first sync brings vLLM off its dummy weights
    draw()
    t1 = time.perf_counter()
    draw()
    row["generate_secs"] = time.perf_counter() - t1
    row["tokens_per_sec"] = samples * new_tokens / row["generate_secs"]
    sync()
    row |= min((sync() for _ in range(3)), key=lambda r: r["sync_secs"])  # the best of three, as memcpy's
    row["weight_bytes"] = sum(p.numel() * p.element_size() for p in params)
    row["sync_gbps"] = row["weight_bytes"] / row["sync_secs"] / 1e9
    row["memcpy_gbps"] = row["weight_bytes"] / memcpy_secs(row["weight_bytes"]) / 1e9
    row["share_of_memcpy"] = row["sync_gbps"] / row["memcpy_gbps"]
    return row


def main(sizes: list[str], samples: int, new_tokens: int) -> list[dict]:
    rows = []
    print(f"{'size':>5} {'engine':>8} {'start s':>8} {'(import)':>9} {'gen s':>7} {'tok/s':>8} {'sync s':>8} "
          f"{'(reload)':>9} {'(digest)':>9} {'sync GB/s':>10} {'memcpy GB/s':>12} {'share':>6}")
    for size in sizes:
        for engine in ENGINES:
            out = subprocess.run([sys.executable, __file__, "--one", size, engine, "--samples", str(samples),
                                  "--new-tokens", str(new_tokens)], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{size} {engine} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{size:>5} {engine:>8} {row['start_secs']:>8.1f} {row.get('import_secs', 0):>9.1f} "
                  f"{row['generate_secs']:>7.2f} {row['tokens_per_sec']:>8.0f} {row['sync_secs']:>8.3f} "
                  f"{row['reload_secs']:>9.3f} {row['digest_secs']:>9.3f} {row['sync_gbps']:>10.2f} "
                  f"{row['memcpy_gbps']:>12.2f} {row['share_of_memcpy']:>6.1%}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny,100m")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny only, 16 samples of 8 tokens (CI)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.samples, args.new_tokens)))
    else:
        if args.quick:
            args.size, args.samples, args.new_tokens = "tiny", 16, 8
        result = main(args.size.split(","), args.samples, args.new_tokens)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": result}, f, indent=1)
