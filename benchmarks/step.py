"""Where a step's time goes, at each model size side by side: the default job's task run for an epoch per size.

    .venv/bin/python benchmarks/step.py [--size tiny,100m,0.5b] [--steps N] [--quick] [--address ADDR] [--json FILE]
                                        [KEY=VALUE ...]

Each size runs its shipped config (benchmarks/sizes.py) with its own saves, exports and evaluations, on a
one-node Ray cluster with room for the ranks, the engine and a warm spare (or on ADDR). The phases come from
the stats rows (supervisor/control/step.py): a step's period is the time from the previous row's write to its
own (`time/between_steps` + `time/step`), split into rollout (with scoring), train, push (the weight stream
to the engines, its per-bucket digest included), HF export, evaluation, the recover save's stall, and the rest:
the row's write, the commit of a save, background collections, frequency checks, the controller's loop. The
digest is the one the stream computes on rank 0 as it sends (`time/weight_digest`, hashed in a thread beside
the transfer). The sync's bandwidth is the weights' bytes over the median push, against a memcpy of the same
bytes. Every figure is a
median over the steps after the first (a new TrainGroup's first step has no period); sporadic phases (save,
export, evaluation) also get their mean per step, which is what they cost. `--steps N` runs one epoch over the
dataset's first N batches (a large model's steps are long); KEY=VALUE overrides apply to every size.
`--quick`: tiny, one epoch (CI).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import arguments, report
from sizes import ENGINE, SIZES, parse_sizes, weight_shapes

from supervisor.checkpoint.layout import TrialLayout
from supervisor.config import Config, load_config
from supervisor.control.events import read_jsonl
from supervisor.launch import run_job
from supervisor.testing.local_cluster import LocalCluster
from supervisor.tools.plan import built_shape
from supervisor.tools.rank_memory import GB, rank_memory

PHASES = ("rollout", "train", "push", "export", "evaluate", "save")
KINDS = ("train", "engine", "spare", "supervisor")
CHUNK = 256 * 1024**2  # bytes copied at a time by the memcpy reference


def run_size(size: str, address: str | None, fileroot: Path, steps: int | None,
             overrides: list[str]) -> tuple[Config, list[dict]]:
    """The size's job run for one epoch (of its first `steps` batches, if given); its config and stats rows."""
    overrides = [ENGINE, *overrides]
    base = load_config(SIZES[size].config, overrides)
    if steps:
        data = fileroot / f"data-{size}.jsonl"
        rows = base.data.path.read_text().splitlines(keepends=True)
        data.write_text("".join(rows[:steps * base.data.batch_size]))
        overrides = [*overrides, f"data.path={data}"]
    config = load_config(SIZES[size].config, [*overrides, f"cluster.fileroot={fileroot}",
                                               f"trial_name=step-{size}", "total_train_epochs=1"])
    cluster = None if address else LocalCluster(n_workers=0, head_cpus=4, object_store=SIZES[size].object_store)
    try:
        code = run_job(config, address or cluster.address)
    finally:
        if cluster:
            cluster.shutdown()
    assert code == 0, f"the {size} job failed with exit code {code}"
    return config, read_jsonl(TrialLayout.from_config(config).stats_log)


def memcpy_gbps(nbytes: int) -> float:
    """The same bytes copied (at least CHUNK in all, so that a tiny model's copy is timed at all)."""
    src = torch.ones(min(nbytes, CHUNK) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched before the clock starts
    started, copied = time.perf_counter(), 0
    while copied < max(nbytes, CHUNK):
        dst.copy_(src)
        copied += src.numel() * 4
    return copied / (time.perf_counter() - started) / 1e9


def figures(size: str, config: Config, rows: list[dict]) -> dict:
    """Per phase: median and mean seconds over the steps that have a period; the sync's bandwidth; memory, and a
    rank's peak as `relaunch plan` predicts it (supervisor/tools/rank_memory.py)."""
    steady = [r for r in rows if "time/between_steps" in r]
    for r in steady:
        r["time/period"] = r["time/between_steps"] + r["time/step"]
        r["time/rest"] = r["time/period"] - sum(r[f"time/{p}"] for p in PHASES)
    phases = (*PHASES, "rest", "period")
    med = {p: statistics.median(r[f"time/{p}"] for r in steady) for p in phases}
    mean = {p: statistics.fmean(r[f"time/{p}"] for r in steady) for p in phases}
    shapes = weight_shapes(size)
    nbytes = sum(s.numel() for s in shapes) * 4
    digest = statistics.median(r.get("time/weight_digest", 0.0) for r in steady)
    push = med["push"]
    return {"size": size, "params": nbytes // 4, "weights_bytes": nbytes, "steps": len(steady),
            "median": med, "mean": mean, "digest_secs": digest, "digest_share_of_push": digest / max(push, 1e-9),
            "outside_share_median": statistics.median(1 - (r["time/rollout"] + r["time/train"]) / r["time/period"]
                                                      for r in steady),
            "outside_share_mean": 1 - (mean["rollout"] + mean["train"]) / mean["period"],
            "sync_gbps": nbytes / push / 1e9, "memcpy_gbps": memcpy_gbps(nbytes),
            "memory_gb": {k: max(r.get(f"mem/{k}_peak_gb", 0.0) for r in rows) for k in KINDS},
            "planned_train_gb": rank_memory(config, built_shape(config),
                                            config.memory_tier_off(None) is None).peak_bytes / GB}


def table(runs: list[dict]) -> list[tuple[str, ...]]:
    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in runs))

    def secs(p: str, sporadic: bool = False):
        return lambda f: f"{f['median'][p]:.3f} s" + (f" ({f['mean'][p]:.3f})" if sporadic else "")

    return [
        ("size", *(f["size"] for f in runs)),
        row("parameters / fp32 weights", lambda f: f"{f['params'] / 1e6:.1f}M / {f['weights_bytes'] / 1e9:.2f} GB"),
        row("steps measured", lambda f: str(f["steps"])),
        row("step period, median (mean)", secs("period", True)),
        row("  rollout + scoring", secs("rollout")),
        row("  train", secs("train")),
        row("  weight push (sync)", secs("push", True)),
        row("    its digest (rank 0, per push)", lambda f: f"{f['digest_secs']:.3f} s "
                                                       f"({f['digest_share_of_push'] * 100:.0f}%)"),
        row("  HF export stall", secs("export", True)),
        row("  evaluation", secs("evaluate", True)),
        row("  recover save stall", secs("save", True)),
        row("  log, commits, bookkeeping", secs("rest", True)),
        row("outside rollout+train, median step", lambda f: f"{f['outside_share_median'] * 100:.1f}%"),
        row("outside rollout+train, all steps", lambda f: f"{f['outside_share_mean'] * 100:.1f}%"),
        row("sync GB/s / memcpy GB/s", lambda f: f"{f['sync_gbps']:.2f} / {f['memcpy_gbps']:.1f}"),
        *(row(f"peak RSS, {k}", lambda f, k=k: f"{f['memory_gb'][k]:.2f} GB") for k in KINDS),
        row("  train, as `plan` predicts (measured / plan)",
            lambda f: f"{f['planned_train_gb']:.2f} GB ({f['memory_gb']['train'] / f['planned_train_gb']:.2f})"),
    ]


def main() -> None:
    parser = arguments(__doc__, "tiny, one epoch (CI)")
    parser.add_argument("--size", default="tiny,100m", help="sizes side by side, comma-separated: tiny,100m,0.5b")
    parser.add_argument("--steps", type=int, help="one epoch of this many steps (default: the whole dataset's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sizes = ["tiny"] if args.quick else parse_sizes(args.size)
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-step-"))
    runs = []
    for size in sizes:
        config, rows = run_size(size, args.address, fileroot, None if args.quick else args.steps, args.overrides)
        runs.append(figures(size, config, rows))
    report(table(runs), {"benchmark": "step", "runs": runs}, args.json)
    print("(median over the steps after the first; in brackets the mean per step; digest: its share of the push)")


if __name__ == "__main__":
    main()
