"""The Supervisor's per-step overhead against a bare loop doing the same work with the same actors, and where
its extra milliseconds go.

    .venv/bin/python benchmarks/overhead.py [--size tiny,100m] [--epochs 5] [--repeats 2] [--profile]
                                            [--quick] [--address ADDR] [--json FILE]

Both run a size's job (benchmarks/sizes.py; the default job at tiny) with no saves, exports or evaluations
(recover.mode=off): generate on a RolloutWorker, score, train on the TrainWorkers, push the weights. The bare
loop drives supervisor/cluster/groups.py's TrainGroup and RolloutGroup directly, without events, stats rows,
frequency checks or checksums, from a Ray task on the driver's node (where the Supervisor actor runs). The figure compared is the median step: for the bare loop the start of the
rollout to the weights pushed; for the Supervisor the time from one stats row's write to the next
(`time/between_steps` + `time/step`: the row's fsync and the controller's loop count). Start-up and shutdown
do not blur it. Runs alternate (bare, Supervisor, ...), sizes side by side on one cluster.

`--profile` samples the Supervisor's process with py-spy in one more run of each size (benchmarks/pyspy.py), and
prints, per step, how much of its job thread's time waits on workers (by call) and which of its own functions
take the rest.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import pyspy
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from recovery import run as run_job_timed
from report import arguments, report
from sizes import ENGINE, SIZES, parse_sizes

from supervisor.cluster.groups import RolloutGroup, TrainGroup
from supervisor.config import load_config
from supervisor.control.events import read_jsonl
from supervisor.launch import connect
from supervisor.testing.local_cluster import LocalCluster
from workers.data import PromptLoader, read_prompts
from workers.grpo import group_advantages
from workers.rewards import Rewards

NO_SAVES = ["recover.mode=off", "saver.freq_epochs=null", "evaluator.freq_epochs=null", "recover.spare_workers=0"]


def bare(address: str, config_path: Path, overrides: list[str]) -> list[float]:
    """Seconds of every step of the bare loop, run in a Ray task on the driver's node as the Supervisor actor
    runs there: Ray starts its workers at nice 15, so on a loaded machine a loop in the driver (nice 0) would
    get more CPU than the Supervisor does, and the comparison would not be like for like."""
    cfg = load_config(config_path, [ENGINE, *NO_SAVES, *overrides])
    connect(cfg, address)
    try:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.get(bare_loop.options(scheduling_strategy=here).remote(cfg))
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
def bare_loop(cfg) -> list[float]:
    loader = PromptLoader(read_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key),
                          cfg.data.batch_size, cfg.seed, cfg.data.shuffle)
    rewards, group = Rewards.from_config(cfg.reward), cfg.data.group_size
    steps = loader.steps_per_epoch * cfg.total_train_epochs
    engines = RolloutGroup(cfg, cfg.recover.step_timeout_secs)
    trainers = TrainGroup(cfg, cfg.cluster.n_train_workers, cfg.recover.step_timeout_secs)
    stream = engines.connect(trainers)
    stream.sync(-1)
    secs = []
    for g in range(steps):
        started = time.monotonic()
        rows = [r for r in loader.batch(g // loader.steps_per_epoch, g % loader.steps_per_epoch)
                for _ in range(group)]
        rollout = engines.generate([r["prompt"] for r in rows], g, version=g)
        advantages = group_advantages(torch.tensor(rewards(rows, rollout["completions"])), group)
        n = trainers.world_size
        shards = [dict({k: rollout[k].chunk(n)[r] for k in ("input_ids", "attention_mask", "response_mask")},
                       advantages=advantages.chunk(n)[r]) for r in range(n)]
        trainers.train(shards, g)
        stream.sync(g)
        secs.append(time.monotonic() - started)
    stream.close()
    trainers.shutdown()
    engines.shutdown()
    rewards.close()
    return secs


def supervised(address: str, fileroot: Path, trial: str, config_path: Path, overrides: list[str],
               profile: Path | None = None) -> list[float]:
    """Seconds of every step after the first: from the previous stats row's write to its own."""
    def during(config):
        profiler = pyspy.SupervisorProfile(config, profile)
        return profiler.stop

    _, layout = run_job_timed(address, fileroot, trial, [*NO_SAVES, *overrides], config_path,
                              during if profile else None)
    return [row["time/between_steps"] + row["time/step"] for row in read_jsonl(layout.stats_log)
            if "time/between_steps" in row]


def measure(size: str, address: str, fileroot: Path, epochs: int, repeats: int, profile: bool) -> dict:
    config_path, overrides = SIZES[size].config, [f"total_train_epochs={epochs}"]
    per_step = {"bare": [], "supervisor": []}
    raw = fileroot / f"profile-{size}.txt" if profile else None
    for i in range(repeats):
        per_step["bare"] += bare(address, config_path, overrides)[1:]  # the first step: as the Supervisor's
        per_step["supervisor"] += supervised(address, fileroot, f"{size}-run{i}", config_path, overrides)
    b, s = statistics.median(per_step["bare"]), statistics.median(per_step["supervisor"])
    steps = len(per_step["supervisor"]) // repeats
    prof = None
    if raw:  # a run of its own: sampling pauses the process, its steps are not among those compared
        supervised(address, fileroot, f"{size}-profiled", config_path, overrides, raw)
        prof = pyspy.summary(raw, steps) if raw.exists() else None
    return {"size": size, "steps": steps, "repeats": repeats, "bare_step_secs": per_step["bare"],
            "supervisor_step_secs": per_step["supervisor"], "bare_median": b, "supervisor_median": s,
            "overhead_percent": (s - b) / b * 100, "profile": prof}


def table(runs: list[dict]) -> list[tuple[str, ...]]:
    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in runs))

    rows = [("size", *(f["size"] for f in runs)),
            row("steps per run, runs of each", lambda f: f"{f['steps']}, {f['repeats']}"),
            row("bare loop, median step", lambda f: f"{f['bare_median'] * 1000:.0f} ms"),
            row("Supervisor, median step", lambda f: f"{f['supervisor_median'] * 1000:.0f} ms"),
            row("Supervisor overhead", lambda f: f"{(f['supervisor_median'] - f['bare_median']) * 1000:+.0f} ms "
                                                 f"= {f['overhead_percent']:+.1f}%")]
    if all(f["profile"] for f in runs):
        rows += [row("profiled: job thread per step", lambda f: f"{f['profile']['ms_per_step']:.0f} ms"),
                 row("  waiting on workers (ray get/wait)", lambda f: f"{f['profile']['waiting_ms_per_step']:.0f} ms"),
                 row("  the Supervisor's own work", lambda f: f"{f['profile']['own_ms_per_step']:.1f} ms")]
    return rows


def profile_lines(runs: list[dict]) -> None:
    for f in runs:
        if f["profile"]:
            print(f"\n{f['size']}, per step: the Supervisor waiting on workers, by call")
            for name, ms in f["profile"]["waits"]:
                print(f"  {ms:7.2f} ms  {name}")
            print("the Supervisor's own work, by function (self time; then relaunch's functions, inclusive)")
            for name, ms in f["profile"]["top_self"]:
                print(f"  {ms:7.2f} ms  {name}")
            print("  --")
            for name, ms in f["profile"]["top_inclusive"]:
                print(f"  {ms:7.2f} ms  {name}")


def main() -> None:
    parser = arguments(__doc__, "tiny, one epoch, one run of each (CI)")
    parser.add_argument("--size", default="tiny", help="sizes side by side, comma-separated: tiny,100m,0.5b")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="sample the Supervisor with py-spy (one more run)")
    args = parser.parse_args()
    sizes = ["tiny"] if args.quick else parse_sizes(args.size)
    epochs, repeats = (1, 1) if args.quick else (args.epochs, args.repeats)
    if args.profile and not pyspy.executable():
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-overhead-"))
    cluster = None if args.address else LocalCluster(object_store=max(SIZES[s].object_store for s in sizes))
    address = args.address or cluster.address
    try:
        runs = [measure(size, address, fileroot, epochs, repeats, args.profile) for size in sizes]
    finally:
        if cluster:
            cluster.shutdown()
    report(table(runs), {"benchmark": "overhead", "runs": runs, **{k: runs[0][k] for k in (
        "steps", "bare_step_secs", "supervisor_step_secs", "overhead_percent")}}, args.json)
    profile_lines(runs)


if __name__ == "__main__":
    main()
