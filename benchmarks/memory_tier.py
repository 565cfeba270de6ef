"""What the memory tier costs a step: the size's job run with it and without it (`recover.memory=off`) on one
local 3-node Ray cluster, at the config's own save cadence (an epoch of 12 steps), in alternating rounds, side by side.

    .venv/bin/python benchmarks/memory_tier.py [--size tiny|100m|0.5b] [--rounds 2] [--quick]
                                               [--address ADDR] [--json FILE] [KEY=VALUE ...]

With the tier, step 1 waits until the spares are warm (the fault action `wait_spares`), so that every later
step is copied to a buddy; without it the same spares stand by. A step's period is the time from one stats row
to the next (`time/between_steps` + `time/step`); each run's figure is the median over its steady steps (not a
TrainGroup's first, not step 1, whose wait is for the spares), and a side's figure is the median over its
rounds' steps. Also printed: the tier's two parts on the step, the wait for the previous step's copy to land
before the update (`time/memory_wait`) and the copy into the rank's slot after it (`time/memory_stage`), and
what it holds where. `--quick`: tiny, one round of one epoch (CI).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from recovery import run
from report import arguments, report
from sizes import SIZES

from supervisor.control.events import Event, read_jsonl
from supervisor.testing.local_cluster import LocalCluster


def one_run(address: str, root: Path, trial: str, size: str, memory: bool, overrides: list[str]) -> dict:
    """One job to its end; its steady periods, the tier's parts and the buddies it linked."""
    fault_dir = root / f"faults-{trial}"
    fault_dir.mkdir()
    os.environ.update(RELAUNCH_FAULT="step.begin:wait_spares:step=1", RELAUNCH_FAULT_DIR=str(fault_dir))
    try:
        _, layout = run(address, root, trial, [f"recover.memory={'auto' if memory else 'off'}", *overrides],
                        SIZES[size].config)
    finally:
        del os.environ["RELAUNCH_FAULT"], os.environ["RELAUNCH_FAULT_DIR"]
    rows = [r for r in read_jsonl(layout.stats_log) if "time/between_steps" in r and r["global_step"] >= 2]
    buddies = [e["nodes"] for e in read_jsonl(layout.events_log) if e["event"] == Event.BUDDIES]
    return {"periods": [r["time/between_steps"] + r["time/step"] for r in rows],
            "wait": [r.get("time/memory_wait", 0.0) for r in rows],
            "stage": [r.get("time/memory_stage", 0.0) for r in rows],
            "buddies": buddies[-1] if buddies else {}}


def main() -> None:
    parser = arguments(__doc__, "tiny, one round of one epoch (CI)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    size, rounds = ("tiny", 1) if args.quick else (args.size, args.rounds)
    overrides = [*args.overrides, *(["total_train_epochs=1"] if args.quick else [])]
    root = Path(tempfile.mkdtemp(prefix="relaunch-memory-tier-"))
    cluster = None if args.address else LocalCluster(object_store=SIZES[size].object_store)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    try:
        for i in range(rounds):
            for memory in (True, False) if i % 2 == 0 else (False, True):
                trial = f"{'memory' if memory else 'off'}-{i}"
                runs[memory].append(one_run(args.address or cluster.address, root, trial, size, memory, overrides))
    finally:
        if cluster:
            cluster.shutdown()
    on, off = ([x for r in runs[m] for x in r[key]] for m, key in ((True, "periods"), (False, "periods")))
    if not runs[True][-1]["buddies"]:
        raise SystemExit("memory_tier: the tier never linked a buddy; nothing was measured")
    step_on, step_off = statistics.median(on), statistics.median(off)
    wait = statistics.median(x for r in runs[True] for x in r["wait"])
    stage = statistics.median(x for r in runs[True] for x in r["stage"])
    figures = {"size": size, "rounds": rounds, "step_with_tier": step_on, "step_without": step_off,
               "cost": step_on / step_off - 1, "memory_wait": wait, "memory_stage": stage,
               "steps_with_tier": len(on), "steps_without": len(off), "buddies": runs[True][-1]["buddies"]}
    report([("model", f"{size} ({SIZES[size].config.name}), {rounds} round(s) per side"),
            ("median step with the tier", f"{step_on:.3f} s ({len(on)} steps)"),
            ("median step without (recover.memory=off)", f"{step_off:.3f} s ({len(off)} steps)"),
            ("the tier's cost", f"{step_on / step_off - 1:+.1%}"),
            ("  waiting for the copy to land (median)", f"{wait:.3f} s"),
            ("  staging into the slot (median)", f"{stage:.3f} s"),
            ("buddies (rank -> node)", ", ".join(f"{r}: {n[:8]}" for r, n in figures["buddies"].items()))],
           figures, args.json)


if __name__ == "__main__":
    main()
