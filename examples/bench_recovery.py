"""What a failure costs: the default job run twice side by side on one local 3-node Ray cluster, once
uninterrupted and once with a TrainWorker SIGKILLed mid-update, and the figures from their events.

    .venv/bin/python examples/bench_recovery.py [--kill-at-step 30] [KEY=VALUE ...]

Prints wall times and their ratio, how long detection, restart and resync took, how many steps were
trained again, what the recover checkpoints cost, and whether the final weights are identical.
"""
from __future__ import annotations

import argparse
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


def run(cluster: LocalCluster, fileroot: Path, trial: str, overrides: list[str]) -> tuple[float, TrialLayout]:
    config = load_config(None, [f"cluster.fileroot={fileroot}", f"trial_name={trial}", *overrides])
    started = time.monotonic()
    code = run_job(config, cluster.address)
    assert code == 0, f"{trial} failed with exit code {code}"
    return time.monotonic() - started, TrialLayout.from_config(config)


def final_weights(layout: TrialLayout) -> bytes:
    exports = sorted(layout.export_root.glob("epoch*"), key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
    return (exports[-1] / "model.safetensors").read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at-step", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    fault_dir = fileroot / "faults"
    fault_dir.mkdir()
    cluster = LocalCluster()
    try:
        clean_secs, clean = run(cluster, fileroot, "uninterrupted", args.overrides)
        os.environ.update(RELAUNCH_FAULT=f"TrainWorker.train.enter:kill:step={args.kill_at_step}:rank=1",
                          RELAUNCH_FAULT_DIR=str(fault_dir))
        faulty_secs, faulty = run(cluster, fileroot, "killed", args.overrides)
    finally:
        cluster.shutdown()
    events = read_jsonl(faulty.events_log)
    failure = next(e for e in events if e["event"] == "failure")
    after = [e for e in events if e["time"] >= failure["time"]]
    loaded = next(e for e in after if e["event"] == "loaded")
    resync = next(e for e in after if e["event"] == "resync")
    commits = [e for e in read_jsonl(clean.events_log) if e["event"] == "commit"]
    rows = [
        ("wall time, uninterrupted job", f"{clean_secs:.1f} s"),
        ("wall time, job with a TrainWorker killed", f"{faulty_secs:.1f} s"),
        ("ratio killed / uninterrupted", f"{faulty_secs / clean_secs:.2f}"),
        ("fault detected after", f"{failure['detect_secs']:.2f} s ({failure['cause']})"),
        ("failure -> new TrainGroup loaded", f"{loaded['time'] - failure['time']:.1f} s (load {loaded['secs']:.1f} s)"),
        ("failure -> engines resynced", f"{resync['time'] - failure['time']:.1f} s"),
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


if __name__ == "__main__":
    main()
