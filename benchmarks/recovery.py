"""What a failure costs: the default job run twice side by side on one local 3-node Ray cluster, once
uninterrupted and once with a TrainWorker SIGKILLed mid-update, and the figures from their events.

    .venv/bin/python benchmarks/recovery.py [--kill-at-step 30] [--quick] [--address ADDR] [--json FILE] [KEY=VALUE ...]

Prints wall times and their ratio, how long detection, restart and resync took and where the recovery's
time went, how many steps were trained again, what the recover checkpoints cost, and whether the final
weights are identical. `--quick` runs one epoch and kills at step 6 (CI runs it so that it cannot rot).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from supervisor.config import load_config
from supervisor.events import read_jsonl
from supervisor.launch import run_job
from supervisor.layout import TrialLayout
from supervisor.local_cluster import LocalCluster


def run(address: str, fileroot: Path, trial: str, overrides: list[str]) -> tuple[float, TrialLayout]:
    config = load_config(None, [f"cluster.fileroot={fileroot}", f"trial_name={trial}", *overrides])
    started = time.monotonic()
    code = run_job(config, address)
    assert code == 0, f"{trial} failed with exit code {code}"
    return time.monotonic() - started, TrialLayout.from_config(config)


def killed_run(address: str, fileroot: Path, trial: str, overrides: list[str], kill_at: int) -> tuple[float, TrialLayout]:
    """The job with rank 1 SIGKILLed as it enters the update of step `kill_at` (once)."""
    fault_dir = fileroot / f"faults-{trial}"
    fault_dir.mkdir()
    os.environ.update(RELAUNCH_FAULT=f"TrainWorker.train.enter:kill:step={kill_at}:rank=1",
                      RELAUNCH_FAULT_DIR=str(fault_dir))
    try:
        return run(address, fileroot, trial, overrides)
    finally:
        del os.environ["RELAUNCH_FAULT"], os.environ["RELAUNCH_FAULT_DIR"]


def final_weights(layout: TrialLayout) -> bytes:
    exports = sorted(layout.export_root.glob("epoch*"), key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
    return (exports[-1] / "model.safetensors").read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at-step", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="one epoch, the kill at step 6")
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local 3-node one)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides, kill_at = (["total_train_epochs=1", *args.overrides], 6) if args.quick else \
        (args.overrides, args.kill_at_step)
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    cluster = None if args.address else LocalCluster()
    address = args.address or cluster.address
    try:
        clean_secs, clean = run(address, fileroot, "uninterrupted", overrides)
        faulty_secs, faulty = killed_run(address, fileroot, "killed", overrides, kill_at)
    finally:
        if cluster:
            cluster.shutdown()
    events = read_jsonl(faulty.events_log)
    failure = next(e for e in events if e["event"] == "failure")
    after = [e for e in events if e["time"] >= failure["time"]]
    loaded = next(e for e in after if e["event"] == "loaded")
    resync = next(e for e in after if e["event"] == "resync")
    recovery = next(e for e in after if e["event"] == "recovery")
    parts = ("detection", "backoff", "teardown", "validate", "scheduling", "process_start", "rendezvous", "load",
             "resync", "first_step")
    commits = [e for e in read_jsonl(clean.events_log) if e["event"] == "commit"]
    rows = [
        ("wall time, uninterrupted job", f"{clean_secs:.1f} s"),
        ("wall time, job with a TrainWorker killed", f"{faulty_secs:.1f} s"),
        ("ratio killed / uninterrupted", f"{faulty_secs / clean_secs:.2f}"),
        ("fault detected after", f"{failure['detect_secs']:.2f} s ({failure['cause']})"),
        ("failure -> new TrainGroup loaded", f"{loaded['time'] - failure['time']:.1f} s (load {loaded['secs']:.1f} s)"),
        ("failure -> engines resynced", f"{resync['time'] - failure['time']:.1f} s"),
        ("failure -> next completed step", f"{recovery['total']:.1f} s"),
        *((f"  {p}", f"{recovery[p]:.2f} s") for p in parts if p in recovery),
        ("steps trained again", f"{failure['global_step'] - loaded['global_step'] - 1}"),
        ("recover checkpoint: count, mean time, size",
         f"{len(commits)}, {statistics.mean(c['secs'] for c in commits) * 1000:.0f} ms, "
         f"{commits[-1]['bytes'] / 1e6:.2f} MB"),
        ("final weights identical", str(final_weights(clean) == final_weights(faulty))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"(runs under {fileroot})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "recovery", "uninterrupted_secs": clean_secs, "killed_secs": faulty_secs,
                       "recovery": recovery, "identical": final_weights(clean) == final_weights(faulty)}, f, indent=1)


if __name__ == "__main__":
    main()
