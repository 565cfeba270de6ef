"""What relaunch's GPU paths cost, on one GPU: a rank's step, the background save's stall on it, the memory tier's
copy into pinned host memory, the weight sync to an engine on the same GPU against a device-to-device copy of the
same bytes, and what a rank's death loses beyond a steady step.

    python benchmarks/gpu.py [--size 0.5b] [--steps 8] [--no-kill] [--quick] [--json FILE] [--plot FILE.png]
    python benchmarks/gpu.py --from docs/gpu-h200.json [--plot FILE.png]      (a recorded run's report, no GPU)

`--size 0.5b` (the default) is configs/grpo_0.5b.yaml: the Qwen2.5-0.5B shape with a 32k vocabulary, ~390M
parameters, fp32 weights and AdamW state (relaunch has no bf16 yet), random init. Part one, in this process: the
FSDP2 engine as a TrainWorker on a GPU runs it (a world of one on nccl), on a batch of the job's shape (64
sequences of 34 tokens), and times each part with the GPU synchronized around it; the weight sync is the real
`write_shared` into an engine's weights held by another process on the same GPU (workers/cuda_weights.py), digest
included. Part two (unless `--no-kill`): the job itself on a local 3-node Ray cluster on this GPU, a rank and its
engine sharing it, a warm spare beside them, the rank SIGKILLed as step 7 trains: the `recovery` event says what
it lost beyond a steady step, where its state came from and how many steps were trained again. Each figure is the
median over the steps after the first, and the first (a cold allocation) beside it. `--quick`: the tiny model,
four steps. A run needs CUDA: without it, it says so and exits 2; `--from` prints a recorded run's report anywhere
(CI does, so that the report cannot rot).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from report import arguments, report
from sizes import SIZES

from supervisor.config import REPO_ROOT, load_config

# the default job's GPU layout: one rank and its engine sharing the GPU (tests/gpu/conftest.py's)
GPU = ["rollout.engine=hf", "cluster.n_train_workers=1", "cluster.gpus_per_worker=0.25",
       "cluster.gpus_per_engine=0.25"]
KILL_AT = 7


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def summary(secs: list[float]) -> dict:
    return {"first": secs[0], "median": statistics.median(secs[1:] or secs)}


def engine_holder(shapes: list[list[int]], queue, done) -> None:
    """Another process, as an engine on this GPU: its weights (fp32, the trainer's shapes) in one CUDA buffer; its
    handle out, then held until `done`."""
    from workers.cuda_weights import CudaSharedWeights

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, device="cuda")) for s in shapes])
    shared = CudaSharedWeights(model)
    queue.put(shared.renew("benchmark"))
    done.wait(600)


def engine_part(size: str, steps: int, workdir: Path) -> dict:
    """Step, save stall, memory staging and weight sync of the size's rank on this GPU."""
    import torch.distributed as dist

    from supervisor.testing.local_cluster import free_port
    from workers.cuda_weights import open_handle
    from workers.engines.base import build_parts, init_process_group
    from workers.engines.fsdp import FSDPEngine
    from workers.gpu import deterministic_cuda
    from workers.memory_tier import Slots
    from workers.weight_sync import op_timeout, write_shared

    config = load_config(SIZES[size].config, [*GPU, f"cluster.fileroot={workdir}", "recover.write_mode=async"])
    deterministic_cuda()
    device = init_process_group(config, 0, 1, "127.0.0.1", free_port())
    t = time.perf_counter()
    engine = FSDPEngine(config, 0, 1, device, *build_parts(config))
    build_secs = time.perf_counter() - t
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(engine.tokenizer), (64, 34), generator=g)
    response = torch.zeros_like(ids)
    response[:, -1] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response,
             "advantages": torch.randn(64, generator=g)}
    layout = engine.memory_layout
    slots_secs, slots = timed(lambda: Slots(layout.numel, layout.dtype, pin=True))

    def back_to_back(what: str, after=None) -> float:
        """Seconds per step of `steps` steps run back to back, `after(step)` called after each, not waited for:
        the next step's optimizer step waits for whatever copy it queued (FSDPEngine._settle)."""
        print(f"[gpu] {size}: {steps} steps, {what}", flush=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            engine.train_step(batch, s)
            if after:
                after(s)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / steps

    first_step = timed(lambda: engine.train_step(batch, 0))[0]
    plain = back_to_back("plain")
    with_tier = back_to_back("each copied into the memory tier's pinned slots",
                             lambda s: engine.stage_memory(slots.for_step(s), s))
    stage_call, stage_copy = [], []  # the call, and until the copy landed (nothing else running)
    for s in range(3):
        t = time.perf_counter()
        engine.stage_memory(slots.for_step(s), s)
        stage_call.append(time.perf_counter() - t)
        slots.for_step(s).wait()
        stage_copy.append(time.perf_counter() - t)
    save_call, save_staged, save_write = [], [], []  # the call (its stall), staged in pinned memory, written
    for s in range(3):
        engine.train_step(batch, s)
        target = workdir / f"save{s}"
        target.mkdir(parents=True)
        t = time.perf_counter()
        engine.save_local(target, s)
        future = engine.save_async(target, s)  # returns once staged in pinned memory (BlockingAsyncStager)
        save_call.append(time.perf_counter() - t)
        save_staged.append(time.perf_counter() - t)
        future.result(timeout=600)
        save_write.append(time.perf_counter() - t)
    params = engine.weight_params()
    numels = [int(torch.Size(shape).numel()) for _, shape in params]
    nbytes = sum(numels) * 4
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    holder = ctx.Process(target=engine_holder, args=([list(shape) for _, shape in params], queue, done))
    holder.start()
    try:
        segment = open_handle(queue.get(timeout=300))
        assert segment is not None, "the engine's buffer could not be opened through CUDA IPC"
        bucket = config.rollout.weight_bucket_mb * 2**20
        syncs = [write_shared(engine.weight_shard, numels, torch.float32, bucket, [segment], 0, 1, None, [],
                              op_timeout(config), s, "sum64") for s in range(5)]
        # full_param gathers into one buffer reused from parameter to parameter: each copied out before the next
        own = torch.cat([engine.full_param(i).reshape(-1).clone() for i in range(len(numels))])
        written = torch.equal(own.view(torch.uint8), segment)
    finally:
        done.set()
        holder.join(timeout=60)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = [timed(lambda: dst.copy_(src))[0] for _ in range(6)]
    dist.destroy_process_group()
    return {"size": size, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "float32",
            "params": sum(numels), "weights_bytes": nbytes, "state_bytes": layout.numel * 4, "build_secs": build_secs,
            "step": {"first": first_step, "median": plain}, "step_with_tier": with_tier,
            "pinned_slots_alloc_secs": slots_secs, "memory_stage_call": summary(stage_call),
            "memory_stage_copy": summary(stage_copy), "save_call": summary(save_call),
            "save_staged": summary(save_staged), "save_write": summary(save_write),
            "sync": {k: summary([x[k] for x in syncs]) for k in ("secs", "write_secs", "digest_secs")},
            "sync_written_equals_trainer": written, "d2d_copy_secs": statistics.median(copies[1:]),
            "cuda_peak_gb": torch.cuda.max_memory_allocated() / 2**30}

def kill_part(size: str, workdir: Path) -> dict:
    """The size's job on a local cluster on this GPU with a warm spare, the rank killed as step KILL_AT trains."""
    from supervisor.testing.local_cluster import LocalCluster

    cluster = LocalCluster(n_workers=2, cpus_per_worker=4, head_cpus=2, object_store=SIZES[size].object_store,
                           gpus_per_node=1)
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RELAUNCH_FAULT=f"step.begin:wait_spares:step=2,TrainWorker.train.enter:kill:step={KILL_AT}:rank=0",
                   RELAUNCH_FAULT_DIR=str(workdir))
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "supervisor", "run", str(SIZES[size].config), *GPU,
                               "recover.spare_workers=1", f"cluster.fileroot={workdir}", "--address", cluster.address],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    finally:
        cluster.shutdown()
    if proc.returncode != 0:
        raise RuntimeError(f"the {size} job exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    logs = next((workdir / "logs").glob("*/*/trial0"))
    rows = [json.loads(x) for x in (logs / "stats.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (logs / "events.jsonl").read_text().splitlines()]
    recovery = [e for e in events if e["event"] == "recovery"]
    steady = [r for r in rows if "time/between_steps" in r]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in steady)

    saves = [r["time/save"] for r in steady if r.get("time/save", 0) > 0]  # the steps that began a save
    return {"job_secs": time.monotonic() - started, "recovery": recovery[0] if recovery else None,
            "save_stall": statistics.median(saves) if saves else None,
            "period": statistics.median(r["time/step"] + r["time/between_steps"] for r in steady),
            "phases": {k: median(f"time/{k}") for k in ("rollout", "train", "push", "save", "memory_stage",
                                                          "weight_sync", "weight_write", "weight_digest")},
            "checksum": [e for e in events if e["event"] == "commit"][-1]["weights_checksum"]}


def table(f: dict, kill: dict | None) -> list[tuple[str, str]]:
    step = f["step"]["median"]

    def share(x: float) -> str:
        return f"{x * 1000:.1f} ms ({x / step * 100:.1f}% of the step)"

    gbps = f["weights_bytes"] / f["sync"]["secs"]["median"] / 1e9
    d2d = f["weights_bytes"] / f["d2d_copy_secs"] / 1e9
    rows = [
        ("GPU / torch", f"{f['gpu']} / {f['torch']}"),
        ("model", f"{f['size']}: {f['params'] / 1e6:.0f}M parameters, {f['dtype']} "
                  f"({f['weights_bytes'] / 1e9:.2f} GB weights, {f['state_bytes'] / 1e9:.2f} GB with AdamW)"),
        ("rank's step (64 x 34 tokens), steady (first)", f"{step * 1000:.1f} ms ({f['step']['first'] * 1000:.0f})"),
        ("  with the memory tier's copy after each", f"{f['step_with_tier'] * 1000:.1f} ms "
         f"(+{(f['step_with_tier'] / step - 1) * 100:.1f}%)"),
        ("memory tier: the call (the copy queued)", share(f["memory_stage_call"]["median"])),
        ("  until the copy landed in pinned slots", share(f["memory_stage_copy"]["median"]) +
         f"; {f['state_bytes'] / f['memory_stage_copy']['median'] / 1e9:.0f} GB/s"),
        ("background save: the call (its stall)", share(f["save_call"]["median"])),
        ("  staged in pinned memory / written", f"{f['save_staged']['median'] * 1000:.0f} ms / "
         f"{f['save_write']['median']:.2f} s after the call (first staged in "
         f"{f['save_staged']['first'] * 1000:.0f} ms)"),
        ("weight sync in place (CUDA IPC), digest included", f"{f['sync']['secs']['median'] * 1000:.2f} ms, "
         f"{gbps:.0f} GB/s: {gbps / d2d * 100:.0f}% of a device copy's {d2d:.0f} GB/s"),
        ("  of which writes / digest", f"{f['sync']['write_secs']['median'] * 1000:.2f} / "
                                       f"{f['sync']['digest_secs']['median'] * 1000:.2f} ms"),
        ("  engine's weights equal the trainer's", str(f["sync_written_equals_trainer"])),
        ("peak GPU memory (this process)", f"{f['cuda_peak_gb']:.1f} GiB"),
    ]
    if kill:
        r = kill["recovery"] or {}
        rows += [
            ("job: steady step period (median)", f"{kill['period']:.3f} s; " +
             ", ".join(f"{k} {v:.3f}" for k, v in kill["phases"].items())),
            ("job: memory tier copy / save stall, share of the period",
             f"{kill['phases']['memory_stage'] / kill['period'] * 100:.1f}% / "
             f"{(kill['save_stall'] or 0) / kill['period'] * 100:.1f}% (on the steps that save)"),
            (f"job: rank killed at step {KILL_AT}: lost beyond a steady step",
             f"{r.get('lost')} s (total {r.get('total')} s), from {r.get('source')}, "
             f"{r.get('replayed_steps')} steps trained again"),
        ]
    return rows


def plot(f: dict, kill: dict | None, path: str) -> None:
    """What each path costs beside the step it rides on, in ms (and the kill's loss beside a steady step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {"rank's step": f["step"]["median"], "memory tier: the call": f["memory_stage_call"]["median"],
            "memory tier: copy landed": f["memory_stage_copy"]["median"],
            "background save: the call": f["save_call"]["median"], "background save: staged": f["save_staged"]["median"],
            "weight sync (CUDA IPC)": f["sync"]["secs"]["median"], "device copy, same bytes": f["d2d_copy_secs"]}
    if kill and kill["recovery"]:
        bars |= {"job: steady step": kill["period"], "job: rank kill, lost": kill["recovery"]["lost"]}
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(bars) + 1.2))
    ax.barh(list(bars)[::-1], [v * 1000 for v in bars.values()][::-1], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("ms (log scale)")
    ax.set_title(f"relaunch at {f['size']} ({f['params'] / 1e6:.0f}M, {f['dtype']}) on {f['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "the tiny model, four steps", cluster=False)
    parser.add_argument("--size", default="0.5b", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-kill", action="store_true", help="part one only")
    parser.add_argument("--plot", help="also draw the figures into this PNG")
    parser.add_argument("--from", dest="recorded", help="no run: the report (and plot) of a run's JSON again")
    args = parser.parse_args()
    if args.recorded:
        figures = json.loads(Path(args.recorded).read_text())
        report(table(figures["engine"], figures["kill"]), figures, args.json)
        if args.plot:
            plot(figures["engine"], figures["kill"], args.plot)
        return
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA GPU here (benchmarks/gpu_check.sh runs it on one)", file=sys.stderr)
        raise SystemExit(2)
    size, steps = ("tiny", 4) if args.quick else (args.size, args.steps)
    with tempfile.TemporaryDirectory(prefix="relaunch-gpu-") as tmp:
        figures = {"engine": engine_part(size, steps, Path(tmp) / "engine"), "kill": None}
        report(table(figures["engine"], None), figures, args.json)  # shown now: the job takes minutes more
        if args.plot:
            plot(figures["engine"], None, args.plot)
        if not args.no_kill:
            figures["kill"] = kill_part(size, Path(tmp) / "kill")
            report(table(figures["engine"], figures["kill"])[-3:], figures, args.json)
            if args.plot:
                plot(figures["engine"], figures["kill"], args.plot)

if __name__ == "__main__":
    main()
