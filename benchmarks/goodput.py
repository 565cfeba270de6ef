"""Goodput of the default job with a TrainWorker SIGKILLed every N seconds: useful step time over wall time.

    .venv/bin/python benchmarks/goodput.py [--every 60] [--epochs 25] [--quick] [--address ADDR] [--json FILE] [KEY=VALUE ...]

A timer thread asks the running Supervisor for its workers (`progress()`) and SIGKILLs a random TrainWorker
by pid, N seconds after the first step and, after each kill, N seconds after training is past the killed step
(so that a slow recovery is not killed again before it trains). Useful time is the sum of `time/step`
over the final stats rows (each step once: rows of steps trained again are cut back on resume); wall time runs
from the job's `start` event to its `done` event. Faults N seconds apart are isolated faults, not a crash loop,
so the job runs with recover.quiet_secs = N / 2 (every restart immediate) and retries to spare; pass
`recover.quiet_secs=...` to see the back-off instead. `--quick` is 2 epochs and a kill every 3 s (CI), with
hangs bounded at 30 s (a step) and 60 s (a start) instead of the defaults' minutes. Each kill is printed as it
is sent, and the table counts the faults the job saw by cause.
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import ray
from recovery import run
from report import arguments, report

from supervisor.control.actor import NAMESPACE
from supervisor.control.events import Event, read_jsonl
from supervisor.testing.local_cluster import LocalCluster


def kill_every(every: float, name: str, stop: threading.Event, killed: list) -> None:
    """SIGKILL a random TrainWorker (pids from the Supervisor) `every` seconds after training first runs and,
    after each kill, `every` seconds after training has moved past the killed step again."""
    rng = random.Random(0)
    deadline, after_step = None, -1
    while not stop.wait(0.2):
        if not ray.is_initialized():  # the job connects inside run_job
            continue
        try:
            progress = ray.get(ray.get_actor(name, namespace=NAMESPACE).progress.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - not started yet, or restarting
            continue
        if progress["global_step"] <= after_step or progress["phase"] in ("repairing", "starting"):
            continue
        deadline = deadline or time.monotonic() + every
        pids = [w["pid"] for w in progress["workers"] if w["name"].startswith("TrainWorker") and w["pid"]]
        if time.monotonic() >= deadline and pids:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append({"time": time.time(), "pid": pid, "global_step": progress["global_step"]})
            print(f"[goodput] SIGKILL pid {pid} at step {progress['global_step']} ({progress['phase']})", flush=True)
            deadline, after_step = None, progress["global_step"]


def main() -> None:
    parser = arguments(__doc__, "2 epochs, a kill every 3 s (CI)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--epochs", type=int, default=25, help="total_train_epochs (12 steps each)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    every, epochs = (3.0, 2) if args.quick else (args.every, args.epochs)
    overrides = [f"total_train_epochs={epochs}", f"recover.quiet_secs={every / 2:g}", "recover.retries=100",
                 *(["recover.step_timeout_secs=30", "recover.start_timeout_secs=60"] if args.quick else []),
                 *args.overrides]
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-goodput-"))
    cluster = None if args.address else LocalCluster()
    address = args.address or cluster.address
    stop, killed = threading.Event(), []
    timer = threading.Thread(target=kill_every, args=(every, "tiny-grpo/goodput", stop, killed), daemon=True)
    try:
        timer.start()
        _, layout = run(address, fileroot, "goodput", overrides)
    finally:
        stop.set()
        timer.join()
        if cluster:
            cluster.shutdown()
    events, stats = read_jsonl(layout.events_log), read_jsonl(layout.stats_log)
    wall = next(e["time"] for e in events if e["event"] == Event.DONE) - next(e["time"] for e in events
                                                                         if e["event"] == Event.START)
    useful = sum(r["time/step"] for r in stats)
    recoveries = [e["total"] for e in events if e["event"] == Event.RECOVERY]
    causes = Counter(e["cause"] for e in events if e["event"] == Event.FAILURE)
    figures = {"benchmark": "goodput", "every_secs": every, "steps": len(stats), "faults": len(killed),
               "restarts": sum(e["event"] == Event.RESTART for e in events), "wall_secs": wall, "useful_secs": useful,
               "goodput": useful / wall, "recovery_secs": recoveries, "failures": dict(causes)}
    rows = [("fault every", f"{every:g} s (SIGKILL of a random TrainWorker)"),
            ("steps", f"{len(stats)}"), ("faults injected, restarts", f"{len(killed)}, {figures['restarts']}"),
            ("faults seen, by cause", ", ".join(f"{c} {n}" for c, n in causes.items()) or "-"),
            ("recoveries (fault -> the step in flight completed)", ", ".join(f"{r:.1f} s" for r in recoveries) or "-"),
            ("wall time (start -> done)", f"{wall:.1f} s"), ("useful step time", f"{useful:.1f} s"),
            ("goodput", f"{figures['goodput'] * 100:.1f}%")]
    report(rows, figures, args.json)


if __name__ == "__main__":
    main()
