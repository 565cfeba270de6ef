"""Recovery from a dead worker side by side in one run: relaunch with its memory tier (with its warm spares as
shipped, and without any: its ranks holding each other's copies), relaunch from disk (recover.memory=off), Ray Train (TorchTrainer + FailureConfig) and torchrun --max-restarts, each with 2 gloo ranks of the same model (`--size`: the default job's tiny one, ~100M or
~0.5B), the same steps (whole epochs of 12), a checkpoint after every step, and rank 1 SIGKILLed at the start of
step K: a fixed step and one drawn at random from the first ones (1 to 8), each system once per step.

    .venv/bin/python benchmarks/baselines.py [--size tiny|100m|0.5b] [--kill-at-step 6,random] [--seed N]
                                             [--steps 12] [--quick] [--address ADDR] [--json FILE]

Every system is timed to one finish line: from the kill (the time the dying rank took just before SIGKILLing
itself) to the completion of the killed step, step K, however many earlier steps a restart trains again first.
relaunch runs the size's job as a user meets it (recover.freq_steps=1, background saves, its default warm spares,
nobody waiting for them to warm; its kill is a fault point whose marker file's time is the kill's, and the killed
step's completion is its `recovery` event), which says where its state came from. The baselines run benchmarks/baseline_loop.py (the same model, AdamW, a DDP update of 64 samples a step, a synchronous
checkpoint every step); the dying rank logs the kill, rank 0 each completed step and the step a restart loaded.
Each system's cost is that time minus its own median steady step (one completed step to the next, the kill's
interval left out), printed with the step loaded and the steps trained again. A system that does not recover,
or cannot run here, fails the benchmark (exit 1) after the table; so does relaunch with its memory tier recovering
from anywhere but memory. `--quick`: 12 steps, one kill at a step drawn from 1 to 8 (CI).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import kill_time, killed_run
from report import arguments
from sizes import SIZES

from supervisor.control.events import Event, read_jsonl
from supervisor.control.repair_clock import steady_steps
from supervisor.testing.local_cluster import LocalCluster
from supervisor.testing.processes import kill_all, process_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def baseline_figures(log: Path) -> dict:
    """From the kill to the first completion of the killed step (rank 0 may log the step before it late), the
    step the restarted group loaded, and the median time between two steps that no kill came between."""
    rows = read_jsonl(log)
    kill = next(r for r in rows if r.get("event") == "kill")
    loaded = next(r["step"] for r in rows if r.get("event") == "loaded" and r["time"] > kill["time"])
    done = sorted((r["step"], r["time"]) for r in rows if "event" not in r)
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in zip(done, done[1:]) if s1 == s0 + 1 and not t0 < kill["time"] < t1]
    return {"recovery_secs": min(t for s, t in done if s >= kill["step"] and t > kill["time"]) - kill["time"],
            "median_step_secs": statistics.median(gaps), "loaded_step": loaded,
            "replayed_steps": kill["step"] - loaded - 1}


def relaunch(address: str, root: Path, steps: int, kill_at: int, size: str, memory: bool,
             spares: bool = True) -> dict:
    """relaunch with the memory tier (the default; its buddies linked before the first step) or from disk; without
    `spares` (recover.spare_workers=0), the ranks hold each other's copies and a new process takes the dead
    rank's place with its peer's ("peers")."""
    # 12 steps an epoch at every size
    expected = "disk" if not memory else "memory" if spares else "peers"
    epochs, trial = steps // 12, f"relaunch-{expected}-{kill_at}"
    secs, layout = killed_run(address, root, trial, [f"total_train_epochs={epochs}", "recover.freq_steps=1",
                                                     f"recover.memory={'auto' if memory else 'off'}",
                                                     *([] if spares else ["recover.spare_workers=0"])],
                              kill_at, SIZES[size].config)
    killed = kill_time(root, trial)
    recovery = next(e for e in read_jsonl(layout.events_log) if e["event"] == Event.RECOVERY)
    assert recovery["global_step"] == kill_at, recovery  # its clock stops at the killed step, as the baselines'
    if recovery["source"] != ("disk" if not memory else "memory"):
        return {"system": f"relaunch ({expected})", "kill_at_step": kill_at,
                "error": f"recovered from {recovery['source']}, not {expected}: {recovery.get('reason')}"}
    return {"system": f"relaunch ({expected})", "kill_at_step": kill_at, "recovery_secs": recovery["time"] - killed,
            "median_step_secs": statistics.median(steady_steps(read_jsonl(layout.stats_log), steps)),
            "loaded_step": recovery["loaded_step"], "replayed_steps": recovery["replayed_steps"], "wall_secs": secs,
            "steps": epochs * 12, "breakdown": recovery}


def ray_train(address: str, root: Path, steps: int, kill_at: int, size: str) -> dict:
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as e:
        return {"system": "Ray Train", "error": f"not run: {e}"}
    from baseline_loop import ray_train_loop

    run_dir = root / f"ray-train-{kill_at}"
    run_dir.mkdir()
    paths = os.pathsep.join([str(REPO), str(HERE)])
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": paths}}, logging_level="ERROR",
             log_to_driver=False)
    try:
        started = time.monotonic()
        trainer = TorchTrainer(
            ray_train_loop, train_loop_config={"dir": str(run_dir), "steps": steps, "kill_at": kill_at,
                                               "config": str(SIZES[size].config)},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="baseline", storage_path=str(run_dir / "storage"),
                                 failure_config=FailureConfig(max_failures=3)))
        trainer.fit()
        wall = time.monotonic() - started
    finally:
        ray.shutdown()
    return {"system": f"Ray Train {ray.__version__}", "kill_at_step": kill_at, **baseline_figures(run_dir / "log.jsonl"),
            "wall_secs": wall, "steps": steps}


def torchrun(root: Path, steps: int, kill_at: int, bound: float, size: str) -> dict:
    run_dir = root / f"torchrun-{kill_at}"
    run_dir.mkdir()
    started = time.monotonic()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", str(HERE / "baseline_loop.py"), str(run_dir), str(steps), str(kill_at), str(SIZES[size].config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)])),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        # torchrun and every rank it started (the ranks may have process groups of their own, and hold the pipes)
        kill_all(process_tree(proc.pid))
        proc.communicate()
        return {"system": "torchrun", "error": f"did not finish within {bound:.0f} s (a restarted group hung)"}
    wall = time.monotonic() - started
    if proc.returncode != 0:
        last = [line for line in stderr.splitlines() if line.strip() and not set(line.strip()) <= set("=-")][-1:]
        return {"system": "torchrun", "error": f"did not recover: exit {proc.returncode} ({''.join(last)[:160]})"}
    import torch

    return {"system": f"torchrun (torch {torch.__version__})", "kill_at_step": kill_at,
            **baseline_figures(run_dir / "log.jsonl"), "wall_secs": wall, "steps": steps}


FIRST_STEPS = range(1, 9)  # where `random` draws the killed step: the job's first steps, its spares still warming


def kill_steps(spec: str, seed: int) -> list[int]:
    """`--kill-at-step`: steps and `random` (one drawn from FIRST_STEPS with `seed`), comma-separated."""
    draw = random.Random(seed)
    return [draw.choice(FIRST_STEPS) if part == "random" else int(part) for part in spec.split(",")]


def systems(address: str, root: Path, steps: int, kill_at: int, size: str, quick: bool) -> list[dict]:
    """Every system killed at `kill_at`, one after the other on the same cluster."""
    # torchrun's bound: its two process starts (imports, the model) on a loaded 2-core machine, and the steps
    return [relaunch(address, root, steps, kill_at, size, memory=True),
            relaunch(address, root, steps, kill_at, size, memory=True, spares=False),
            relaunch(address, root, steps, kill_at, size, memory=False),
            ray_train(address, root, steps, kill_at, size),
            torchrun(root, steps, kill_at, 180 if quick else 300 * (1 + 4 * (size != "tiny")), size)]


def print_table(rows: list[dict], size: str, kill_at: int) -> None:
    """One kill's rows, each system's cost beside relaunch's with its memory tier (rows[0])."""
    for row in rows:
        if "error" not in row:
            row["cost_secs"] = row["recovery_secs"] - row["median_step_secs"]
    ours = rows[0]
    print(f"model: {size} ({SIZES[size].config.name}); rank 1 killed at the start of step {kill_at}")
    print(f"{'system':<26} {'kill -> killed step done':>25} {'median step':>12} {'lost beyond a step':>19} "
          f"{'vs relaunch':>12} {'loaded / trained again':>23} {'wall (steps)':>14}")
    for row in rows:
        if "error" in row:
            print(f"{row['system']:<26} {row['error']}")
            continue
        ratios = "-"
        if "error" not in ours:
            row["ratio_to_relaunch"] = row["recovery_secs"] / ours["recovery_secs"]
            row["cost_ratio_to_relaunch"] = row["cost_secs"] / max(ours["cost_secs"], 1e-3)
            ratios = f"{row['ratio_to_relaunch']:>5.2f}x /{row['cost_ratio_to_relaunch']:>5.1f}x"
        print(f"{row['system']:<26} {row['recovery_secs']:>23.2f} s {row['median_step_secs']:>10.2f} s "
              f"{row['cost_secs']:>17.2f} s {ratios:>12} "
              f"{'step ' + str(row['loaded_step']) + ' / ' + str(row['replayed_steps']):>23} "
              f"{row['wall_secs']:>8.1f} s ({row['steps']})")


def main() -> None:
    parser = arguments(__doc__, "12 steps, one kill at a step drawn from 1 to 8 (CI)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="the model of every system")
    parser.add_argument("--kill-at-step", default=None,
                        help="the killed steps, comma-separated; `random`: one drawn from 1 to 8 (--seed); "
                             "default 6,random (--quick: random)")
    parser.add_argument("--seed", type=int, default=None, help="the draw of `random` (default: a fresh one, printed)")
    parser.add_argument("--steps", type=int, default=12, help="every system's steps, rounded up to whole epochs of 12")
    args = parser.parse_args()
    seed = random.SystemRandom().randrange(2**16) if args.seed is None else args.seed
    steps = 12 if args.quick else args.steps
    kills = kill_steps(args.kill_at_step or ("random" if args.quick else "6,random"), seed)
    steps = -(-steps // 12) * 12  # whole epochs of the shipped data (12 steps each): relaunch's job runs epochs
    print(f"[baselines] killed steps {kills} (random ones drawn with --seed {seed})", flush=True)
    root = Path(tempfile.mkdtemp(prefix="relaunch-baselines-"))
    cluster = None if args.address else LocalCluster(object_store=SIZES[args.size].object_store)
    address = args.address or cluster.address
    try:
        runs = {kill_at: systems(address, root, steps, kill_at, args.size, args.quick) for kill_at in kills}
    finally:
        if cluster:
            cluster.shutdown()
    for kill_at, rows in runs.items():
        print_table(rows, args.size, kill_at)
    print(f"(vs relaunch: kill -> killed step done / lost beyond a step, against relaunch with the memory tier; "
          f"runs under {root}; again with --seed {seed})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "baselines", "size": args.size, "seed": seed, "kill_at_steps": kills,
                       "rows": [row for rows in runs.values() for row in rows]}, f, indent=1)
    failed = [f"{row['system']} (step {kill_at}, --seed {seed}): {row['error']}" for kill_at, rows in runs.items()
              for row in rows if "error" in row]
    if failed:
        sys.exit("baselines: " + "; ".join(failed))


if __name__ == "__main__":
    main()
