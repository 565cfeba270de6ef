"""PPO beside GRPO at one model size: what the critic adds to a step, and what a critic rank's kill costs against an
actor rank's, on one local 3-node Ray cluster.

    .venv/bin/python benchmarks/ppo.py [--size tiny|100m|0.5b] [--steps N] [--kill-at-step K] [--source memory|disk]
                                       [--quick] [--address ADDR] [--json FILE] [KEY=VALUE ...]

Five runs of one epoch over the dataset's first N batches (default: all of them), each a step at a time: GRPO
uninterrupted, GRPO with actor rank 1 SIGKILLed as it enters the update of step K, PPO (the size's config with a
`critic` section: a value model of the policy's shape in a group of its own, as many ranks, the actor's lr)
uninterrupted, and PPO with actor rank 1, then critic rank 1, killed at the same moment. Every kill recovers from
`--source`: memory (the tier as shipped, which holds both groups' copies: the spare holding the dead rank's copy
takes its place, every other rank of both groups rolls back in place), or disk (`recover.memory=off`), with one
warm spare per group (`recover.spare_workers=1`: the local cluster's 7 CPUs hold 2 + 2 ranks, the engine and a
spare for each; step 1 waits for them to warm, as a kill a minute into a job meets warm spares).
Prints each run's median step period and update (the critic's values and both groups' updates, for PPO), each
kill's time from the fault to the completion of the killed step and what it lost beyond one steady step, its
parts, the step loaded and the steps trained again, and the ratio of a critic rank's kill to an actor rank's
(the goal: within 1.2). `--quick`: tiny, one epoch, the kill at step 8, no GRPO kill (CI).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from recovery import figures, killed_run, recovery_rows, run
from report import arguments, report
from sizes import SIZES

from supervisor.checkpoint.layout import TrialLayout
from supervisor.config import load_config
from supervisor.control.events import Event, read_jsonl
from supervisor.testing.local_cluster import LocalCluster

COMMON = ["total_train_epochs=1"]
SOURCES = {"memory": "recover.memory=auto", "disk": "recover.memory=off"}


def critic_section(config: Path) -> list[str]:
    """The size's job with a critic: the actor's backend, lr and clipping for a value model of its shape."""
    actor = load_config(config).actor
    return [f"critic.backend={actor.backend.value}", f"critic.lr={actor.lr}", f"critic.grad_clip={actor.grad_clip}"]


def first_batches(config: Path, fileroot: Path, steps: int) -> list[str]:
    """An override for a dataset of the config's first `steps` batches (a large model's steps are long)."""
    data = load_config(config).data
    path = fileroot / "data.jsonl"
    path.write_text("".join(data.path.read_text().splitlines(keepends=True)[:steps * data.batch_size]))
    return [f"data.path={path}"]


def steady(layout: TrialLayout) -> dict:
    """The median step period and update over the steps that have a period (a new group's first has none)."""
    rows = [r for r in read_jsonl(layout.stats_log) if "time/between_steps" in r]
    return {"steps": len(rows), "period": statistics.median(r["time/between_steps"] + r["time/step"] for r in rows),
            "train": statistics.median(r["time/train"] for r in rows)}


def kill_figures(clean: TrialLayout, faulty: TrialLayout, secs: float, clean_secs: float) -> dict:
    """recovery.py's figures for the kill, with the group whose rank died (the `failure` event's), and what the
    critic's group did (the `loaded` event's `critic_kept`, the `spares` event it took its ranks from)."""
    events = read_jsonl(faulty.events_log)
    failure = next(e for e in events if e["event"] == Event.FAILURE)
    after = [e for e in events if e["time"] >= failure["time"]]
    loaded = next(e for e in after if e["event"] == Event.LOADED)
    critic = next((e for e in after if e["event"] == Event.SPARES and e["action"] == "taken"
                   and e.get("group") == "critic"), None)
    return figures(clean, faulty, secs, clean_secs) | {
        "group": failure.get("group"), "critic_kept": len(loaded.get("critic_kept", [])),
        "critic_from_spares": critic["taken"] if critic else 0}


def table(clean: dict[str, dict], kills: dict[str, dict]) -> list[tuple[str, ...]]:
    """Two blocks: the uninterrupted runs' steps, then one column per kill."""
    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in kills.values()))

    actor, critic = kills["PPO, actor rank"]["recovery"]["lost"], kills["PPO, critic rank"]["recovery"]["lost"]
    return [
        ("uninterrupted", *clean),
        ("step period, median", *(f"{f['period']:.2f} s" for f in clean.values())),
        ("  update (PPO: values, both groups)", *(f"{f['train']:.2f} s" for f in clean.values())),
        ("wall time", *(f"{f['secs']:.1f} s" for f in clean.values())),
        ("", *("" for _ in clean)),
        ("rank 1 killed", *kills),
        row("failure.group", lambda f: str(f["group"])),
        row("fault detected after", lambda f: f"{f['detect_secs']:.2f} s ({f['cause']})"),
        *recovery_rows(row),
        row("actor ranks from spares / kept", lambda f: f"{f['ranks_from_spares']} / {f['kept_ranks']}"),
        row("critic ranks from spares / kept", lambda f: f"{f['critic_from_spares']} / {f['critic_kept']}"),
        row("final policy identical", lambda f: str(f["identical"])),
        ("critic rank's kill / actor rank's (lost)", f"{critic / actor:.2f}"),
    ]


def main() -> None:
    parser = arguments(__doc__, "tiny, one epoch, the kill at step 8, no GRPO kill (CI)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="the model (benchmarks/sizes.py)")
    parser.add_argument("--steps", type=int, help="one epoch of this many batches (default: the whole dataset's)")
    parser.add_argument("--kill-at-step", type=int, default=8)
    parser.add_argument("--source", default="memory", choices=list(SOURCES), help="where every kill recovers from")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    size = "tiny" if args.quick else args.size
    config = SIZES[size].config
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-ppo-"))
    common = [*COMMON, SOURCES[args.source], *(first_batches(config, fileroot, args.steps) if args.steps and not args.quick else []),
              *args.overrides]
    ppo = [*critic_section(config), *common]
    cluster = None if args.address else LocalCluster(object_store=SIZES[size].object_store)
    address = args.address or cluster.address
    clean, kills = {}, {}
    try:
        for name, overrides in (("GRPO", common), ("PPO", ppo)):
            secs, layout = run(address, fileroot, f"{name.lower()}-uninterrupted",
                               [*overrides, "recover.spare_workers=0"], config)
            clean[name] = {"secs": secs, "layout": layout, **steady(layout)}
        for label, name, overrides, role in (("GRPO, actor rank", "GRPO", common, None),
                                             ("PPO, actor rank", "PPO", ppo, None),
                                             ("PPO, critic rank", "PPO", ppo, "critic")):
            if args.quick and name == "GRPO":
                continue  # benchmarks/recovery.py times GRPO's kill
            trial = label.lower().replace(", ", "-").replace(" ", "-")
            secs, layout = killed_run(address, fileroot, trial, [*overrides, "recover.spare_workers=1"],
                                      args.kill_at_step, config, warm_spares=True, role=role)
            kills[label] = kill_figures(clean[name]["layout"], layout, secs, clean[name]["secs"])
    finally:
        if cluster:
            cluster.shutdown()
    print(f"model: {size} ({config.name}), one epoch of {clean['PPO']['steps'] + 1} steps, "
          f"rank 1 killed at step {args.kill_at_step}, recovered from {args.source}")
    report(table(clean, kills), {
        "benchmark": "ppo", "size": size, "kill_at_step": args.kill_at_step, "source": args.source,
        "clean": {n: {k: v for k, v in f.items() if k != "layout"} for n, f in clean.items()},
        "kills": kills, "critic_over_actor": kills["PPO, critic rank"]["recovery"]["lost"]
        / kills["PPO, actor rank"]["recovery"]["lost"]}, args.json)
    print(f"(runs under {fileroot})")


if __name__ == "__main__":
    main()
