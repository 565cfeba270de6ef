"""Recovery from a dead worker side by side in one run: relaunch, Ray Train (TorchTrainer + FailureConfig) and
torchrun --max-restarts, each with 2 gloo ranks of the default job's tiny model, a checkpoint after every step,
and rank 1 SIGKILLed at the start of step K.

    .venv/bin/python benchmarks/baselines.py [--kill-at-step 6] [--steps 12] [--quick] [--address ADDR] [--json FILE]

relaunch runs the default job (recover.freq_steps=1) and its figure is its `recovery` event's total (detection
included). The baselines run benchmarks/baseline_loop.py (the same model, AdamW, a DDP update of 64 samples a step)
and their figure is the time from the kill, logged by the dying rank, to the next step rank 0 completes.
A baseline that cannot run here (Ray Train's extras missing) is reported as not run, with the reason.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import killed_run
from report import arguments

from supervisor.control.events import Event, read_jsonl
from supervisor.testing.local_cluster import LocalCluster

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def dead_to_next_step(log: Path) -> float:
    """From the kill to the first completion of the killed step (rank 0 may log the step before it late)."""
    rows = read_jsonl(log)
    kill = next(r for r in rows if r.get("event") == "kill")
    return min(r["time"] for r in rows if "event" not in r and r["step"] >= kill["step"]) - kill["time"]


def relaunch(address: str, root: Path, steps: int, kill_at: int) -> dict:
    epochs = -(-steps // 12)  # the default data gives 12 steps an epoch
    secs, layout = killed_run(address, root, "relaunch", [f"total_train_epochs={epochs}", "recover.freq_steps=1"],
                              kill_at)
    recovery = next(e for e in read_jsonl(layout.events_log) if e["event"] == Event.RECOVERY)
    return {"system": "relaunch", "recovery_secs": recovery["total"], "wall_secs": secs, "steps": epochs * 12,
            "breakdown": recovery}


def ray_train(address: str, root: Path, steps: int, kill_at: int) -> dict:
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as e:
        return {"system": "Ray Train", "error": f"not run: {e}"}
    from baseline_loop import ray_train_loop

    run_dir = root / "ray-train"
    run_dir.mkdir()
    paths = os.pathsep.join([str(REPO), str(HERE)])
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": paths}}, logging_level="ERROR",
             log_to_driver=False)
    try:
        started = time.monotonic()
        trainer = TorchTrainer(
            ray_train_loop, train_loop_config={"dir": str(run_dir), "steps": steps, "kill_at": kill_at},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="baseline", storage_path=str(run_dir / "storage"),
                                 failure_config=FailureConfig(max_failures=3)))
        trainer.fit()
        wall = time.monotonic() - started
    finally:
        ray.shutdown()
    return {"system": f"Ray Train {ray.__version__}", "recovery_secs": dead_to_next_step(run_dir / "log.jsonl"),
            "wall_secs": wall, "steps": steps}


def torchrun(root: Path, steps: int, kill_at: int, bound: float) -> dict:
    run_dir = root / "torchrun"
    run_dir.mkdir()
    started = time.monotonic()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", str(HERE / "baseline_loop.py"), str(run_dir), str(steps), str(kill_at)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)])),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started: the session this call made
        proc.communicate()
        return {"system": "torchrun", "error": f"did not finish within {bound:.0f} s (a restarted group hung)"}
    wall = time.monotonic() - started
    if proc.returncode != 0:
        return {"system": "torchrun", "error": f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}"}
    import torch

    return {"system": f"torchrun (torch {torch.__version__})", "recovery_secs": dead_to_next_step(run_dir / "log.jsonl"),
            "wall_secs": wall, "steps": steps}


def main() -> None:
    parser = arguments(__doc__, "5 steps for the baselines, the kill at step 3 (CI)")
    parser.add_argument("--kill-at-step", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    steps, kill_at = (5, 3) if args.quick else (args.steps, args.kill_at_step)
    root = Path(tempfile.mkdtemp(prefix="relaunch-baselines-"))
    cluster = None if args.address else LocalCluster()
    address = args.address or cluster.address
    try:
        rows = [relaunch(address, root, steps, kill_at), ray_train(address, root, steps, kill_at),
                torchrun(root, steps, kill_at, bound=60 if args.quick else 300)]
    finally:
        if cluster:
            cluster.shutdown()
    ours = rows[0]["recovery_secs"]
    print(f"{'system':<26} {'dead worker -> next step':>25} {'vs relaunch':>12} {'wall (steps)':>14}")
    for row in rows:
        if "error" in row:
            print(f"{row['system']:<26} {row['error']}")
            continue
        row["ratio_to_relaunch"] = row["recovery_secs"] / ours
        print(f"{row['system']:<26} {row['recovery_secs']:>23.2f} s {row['ratio_to_relaunch']:>11.2f}x "
              f"{row['wall_secs']:>8.1f} s ({row['steps']})")
    print(f"(kill of rank 1 at step {kill_at}; runs under {root})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "baselines", "kill_at_step": kill_at, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
