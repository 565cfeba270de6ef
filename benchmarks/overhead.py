"""The Supervisor's per-step overhead against a bare loop doing the same work with the same actors.

    .venv/bin/python benchmarks/overhead.py [--epochs 5] [--repeats 2] [--quick] [--address ADDR] [--json FILE]

Both run the default job's steps with no saves, exports or evaluations (recover.mode=off): generate on a
RolloutWorker, score, train on the TrainWorkers, push the weights. The bare loop drives supervisor/cluster/groups.py's
TrainGroup and RolloutGroup directly, without events, stats rows, frequency checks or checksums. The figure
compared is the median step (start of the rollout to the weights pushed and, for the Supervisor, its stats
row written: `time/step`), so start-up and shutdown do not blur it. Runs alternate (bare, Supervisor, ...).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from recovery import run as run_job_timed
from report import arguments, report

from supervisor.cluster.groups import RolloutGroup, TrainGroup
from supervisor.config import load_config
from supervisor.control.events import read_jsonl
from supervisor.launch import connect
from supervisor.testing.local_cluster import LocalCluster
from workers.data import PromptLoader, read_prompts
from workers.grpo import group_advantages
from workers.rewards import load_reward_fn, score

NO_SAVES = ["recover.mode=off", "saver.freq_epochs=null", "evaluator.freq_epochs=null"]


def bare(address: str, overrides: list[str]) -> list[float]:
    """Seconds of every step."""
    cfg = load_config(None, [*NO_SAVES, *overrides])
    loader = PromptLoader(read_prompts(cfg.data.path), cfg.data.batch_size, cfg.seed, cfg.data.shuffle)
    reward_fn, group = load_reward_fn(cfg.reward.fn), cfg.data.group_size
    steps = loader.steps_per_epoch * cfg.total_train_epochs
    connect(cfg, address)
    try:
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
            advantages = group_advantages(torch.tensor(score(reward_fn, rows, rollout["completions"])), group)
            n = trainers.world_size
            shards = [dict({k: rollout[k].chunk(n)[r] for k in ("input_ids", "attention_mask", "response_mask")},
                           advantages=advantages.chunk(n)[r]) for r in range(n)]
            trainers.train(shards, g)
            stream.sync(g)
            secs.append(time.monotonic() - started)
        trainers.shutdown()
        engines.shutdown()
        return secs
    finally:
        ray.shutdown()


def supervised(address: str, fileroot: Path, trial: str, overrides: list[str]) -> list[float]:
    """Seconds of every step (its stats row's `time/step`)."""
    _, layout = run_job_timed(address, fileroot, trial, [*NO_SAVES, *overrides])
    return [row["time/step"] for row in read_jsonl(layout.stats_log)]


def main() -> None:
    parser = arguments(__doc__, "one epoch, one run of each (CI)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    epochs, repeats = (1, 1) if args.quick else (args.epochs, args.repeats)
    overrides = [f"total_train_epochs={epochs}"]
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-overhead-"))
    cluster = None if args.address else LocalCluster()
    address = args.address or cluster.address
    per_step = {"bare": [], "supervisor": []}
    try:
        for i in range(repeats):
            per_step["bare"] += bare(address, overrides)
            per_step["supervisor"] += supervised(address, fileroot, f"run{i}", overrides)
    finally:
        if cluster:
            cluster.shutdown()
    b, s = statistics.median(per_step["bare"]), statistics.median(per_step["supervisor"])
    overhead = (s - b) / b * 100
    steps = len(per_step["supervisor"]) // repeats
    rows = [("steps per run", f"{steps}"), ("runs of each", f"{repeats}"),
            ("bare loop, median step", f"{b * 1000:.0f} ms"),
            ("Supervisor, median step", f"{s * 1000:.0f} ms"),
            ("Supervisor overhead", f"{s * 1000 - b * 1000:+.0f} ms a step = {overhead:+.1f}% of a step")]
    report(rows, {"benchmark": "overhead", "steps": steps, "bare_step_secs": per_step["bare"],
                  "supervisor_step_secs": per_step["supervisor"], "overhead_percent": overhead}, args.json)


if __name__ == "__main__":
    main()
