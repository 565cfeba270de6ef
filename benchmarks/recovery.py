"""What a failure costs: the default job run side by side on one local 3-node Ray cluster, once
uninterrupted and then with a TrainWorker SIGKILLed mid-update, once per warm spare pool size
(`recover.spare_workers`, default 0, 1 and 2), and the figures from their events. It measures the restart
from disk (`recover.memory=off`): what spares buy there; benchmarks/baselines.py sets the memory tier beside it.
With `--engine-kill`, the engine is killed instead (SIGKILLed as its rollout of step 6 begins; vLLM's engine core
runs in the engine's process, so this is the engine core's death), once per engine, side by side: the built-in
engine, vLLM, and vLLM with a warm spare engine (`rollout.spare_engines=1`), each at the shape vLLM runs
(`--quick`: tiny, the built-in engine and vLLM with its spare). With `--drain`, the ranks' node is lost after step
`--kill-at-step` (default 20), side by side: killed without notice, and drained first (a preemption notice through
`ray drain-node`, 30 s) then killed once its work moved and the next step completed; both with the memory
tier and a warm spare per rank, linked before the loss (`--quick`: one epoch, the loss after step 8); then Ray
Train 2.60's own preemption path on the same model, its node drained as that step begins and killed at the
deadline (`--quick`: 20 s), for a table of the two side by side.

    .venv/bin/python benchmarks/recovery.py [--size tiny|100m|0.5b] [--kill-at-step 30] [--spares 0,1,2]
                                            [--engine-kill | --drain] [--quick] [--address ADDR] [--json FILE]
                                            [KEY=VALUE ...]

Prints, one column per pool size, wall times and their ratio, how long detection, restart and resync took,
the time from the fault to the completion of the killed step and what it lost beyond one steady step, where
that time went, how many ranks came from spares, started cold or kept their processes, the step loaded and
how many steps were trained again, what the recover checkpoints cost, and whether the final weights are
identical. `--quick` runs one epoch,
kills at step 10, with 0 and 2 spares (CI runs it so that it cannot rot).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import arguments, report
from sizes import ENGINE, SIZES

from supervisor.checkpoint.layout import TrialLayout
from supervisor.cluster.drains import POLL_SECS
from supervisor.config import load_config
from supervisor.control.events import Event, read_jsonl
from supervisor.control.policy import Action
from supervisor.control.repair_clock import PARTS
from supervisor.launch import run_job
from supervisor.testing.local_cluster import LocalCluster


def run(address: str, fileroot: Path, trial: str, overrides: list[str], config_path: Path | None = None,
        during=None) -> tuple[float, TrialLayout]:
    """The job (the default config, or `config_path`) run to its end; `during(config)`, if given, is called
    before it starts and returns a callable called after it ended (a profiler, say)."""
    config = load_config(config_path, [ENGINE, f"cluster.fileroot={fileroot}", f"trial_name={trial}", *overrides])
    started = time.monotonic()
    after = during(config) if during else None
    try:
        code = run_job(config, address)
    finally:
        if after:
            after()
    assert code == 0, f"{trial} failed with exit code {code}"
    return time.monotonic() - started, TrialLayout.from_config(config)


def final_weights(layout: TrialLayout) -> bytes:
    exports = sorted(layout.export_root.glob("epoch*"), key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
    return (exports[-1] / "model.safetensors").read_bytes()


KILL_POINT = "TrainWorker.train.enter"
ENGINE_KILL_POINT = "RolloutWorker.generate.enter"


def killed_run(address: str, fileroot: Path, trial: str, overrides: list[str], kill_at: int,
               config_path: Path | None = None, warm_spares: bool = False,
               point: str = KILL_POINT, role: str | None = None) -> tuple[float, TrialLayout]:
    """The job (the default config, or `config_path`) with rank 1 SIGKILLed as it enters the update of step
    `kill_at` (once; `role` "critic": the critic's rank 1), or with `point` ENGINE_KILL_POINT engine 0 as it
    enters the step's rollout. With
    `warm_spares`, step 1 starts only once the spare pools are warm, so that the memory tier's buddies are linked
    before the kill, as they are a minute into any job (a short run would otherwise race the spares' start-up)."""
    fault_dir = fileroot / f"faults-{trial}"
    fault_dir.mkdir()
    faults = [f"{point}:kill:step={kill_at}:rank={0 if point == ENGINE_KILL_POINT else 1}"
              + (f":role={role}" if role else "")]
    os.environ.update(RELAUNCH_FAULT=",".join(faults + ["step.begin:wait_spares:step=1"] * warm_spares),
                      RELAUNCH_FAULT_DIR=str(fault_dir))
    try:
        return run(address, fileroot, trial, overrides, config_path)
    finally:
        del os.environ["RELAUNCH_FAULT"], os.environ["RELAUNCH_FAULT_DIR"]


def kill_time(fileroot: Path, trial: str, point: str = KILL_POINT) -> float:
    """When killed_run's kill fired: its fault point's marker file (not the warm-spares wait's, at step 1)."""
    return next(p.stat().st_mtime for p in (fileroot / f"faults-{trial}").iterdir() if p.name.endswith(point))


def figures(clean: TrialLayout, faulty: TrialLayout, faulty_secs: float, clean_secs: float) -> dict:
    """The killed run's figures from its events: detection, the restart, the `recovery` event (timed to the
    completion of the killed step), the spares it took."""
    events = read_jsonl(faulty.events_log)
    failure = next(e for e in events if e["event"] == Event.FAILURE)
    after = [e for e in events if e["time"] >= failure["time"]]
    loaded = next(e for e in after if e["event"] == Event.LOADED)
    resync = next(e for e in after if e["event"] == Event.RESYNC)
    recovery = next(e for e in after if e["event"] == Event.RECOVERY)
    taken = next((e for e in after if e["event"] == Event.SPARES and e["action"] == "taken"
                  and "group" not in e), None)  # the actor's (a critic's names its group)
    return {"killed_secs": faulty_secs, "ratio": faulty_secs / clean_secs, "detect_secs": failure["detect_secs"],
            "cause": failure["cause"], "loaded_secs": loaded["time"] - failure["time"], "load_secs": loaded["secs"],
            "resynced_secs": resync["time"] - failure["time"], "recovery": recovery,
            "ranks_from_spares": taken["taken"] if taken else 0,
            "cold_ranks": taken["cold"] if taken else len(loaded["nodes"]) - len(loaded["kept"]),
            "kept_ranks": len(loaded["kept"]),  # the ranks that kept their processes (from disk: all but the lost)
            "replayed_steps": recovery["replayed_steps"],
            "identical": final_weights(clean) == final_weights(faulty)}


def recovery_rows(row) -> list[tuple[str, ...]]:
    """A kill's `recovery` event as rows (`row(label, fmt)` makes one, a column per run): the time from the fault to
    the completion of the killed step, what it lost beyond a steady step and where, the step loaded and the steps
    trained again."""
    return [
        row("fault -> killed step completed", lambda f: f"{f['recovery']['total']:.1f} s"),
        row("  lost beyond one steady step", lambda f: f"{f['recovery']['lost']:.1f} s "
                                                     f"(step {f['recovery']['steady_step']:.2f} s)"),
        *(row(f"  {p}", lambda f, p=p: f"{f['recovery'].get(p, 0.0):.2f} s") for p in PARTS),
        row("step loaded (from), steps trained again",
            lambda f: f"{f['recovery']['loaded_step']} ({f['recovery']['source']}), {f['replayed_steps']}"),
    ]


def table(runs: dict[int, dict], clean_secs: float, commits: list[dict]) -> list[tuple[str, ...]]:
    """One row per figure, one column per spare pool size."""
    cols = list(runs.values())

    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in cols))

    return [
        ("recover.spare_workers", *(str(n) for n in runs)),
        ("wall time, uninterrupted job", *(f"{clean_secs:.1f} s" for _ in cols)),
        row("wall time, job with a TrainWorker killed", lambda f: f"{f['killed_secs']:.1f} s"),
        row("ratio killed / uninterrupted", lambda f: f"{f['ratio']:.2f}"),
        row("fault detected after", lambda f: f"{f['detect_secs']:.2f} s ({f['cause']})"),
        row("ranks from spares / cold / kept", lambda f: f"{f['ranks_from_spares']} / {f['cold_ranks']} / "
                                                         f"{f['kept_ranks']}"),
        row("failure -> new TrainGroup loaded", lambda f: f"{f['loaded_secs']:.1f} s"),
        row("failure -> engines resynced", lambda f: f"{f['resynced_secs']:.1f} s"),
        *recovery_rows(row),
        ("recover checkpoint: count, mean time, size",
         *(f"{len(commits)}, {statistics.mean(c['secs'] for c in commits) * 1000:.0f} ms, "
           f"{commits[-1]['bytes'] / 1e6:.2f} MB" for _ in cols)),
        row("final weights identical", lambda f: str(f["identical"])),
    ]


ENGINES = {"hf": ["rollout.engine=hf"], "vllm": ["rollout.engine=vllm"],
           "vllm, warm spare": ["rollout.engine=vllm", "rollout.spare_engines=1"]}


def engine_kills(address: str, fileroot: Path, size: str, overrides: list[str], kill_at: int,
                 columns: list[str]) -> dict[str, dict]:
    """The job once per ENGINES column with its engine SIGKILLed at step `kill_at`; each column's figures from
    its `recovery` event, beside the time from the kill's marker to that event (the same clock, read from
    outside)."""
    runs = {}
    for label in columns:
        trial = "engine-killed-" + label.replace(", ", "-").replace(" ", "-")
        overrides_here = [*ENGINES[label], *overrides]
        secs, layout = killed_run(address, fileroot, trial, overrides_here, kill_at, SIZES[size].config,
                                  warm_spares=True, point=ENGINE_KILL_POINT)
        events = read_jsonl(layout.events_log)
        recovery = next(e for e in events if e["event"] == Event.RECOVERY and e["what"] == Action.RESTART_ENGINES)
        restarted = next(e for e in events if e["event"] == Event.ENGINES_RESTARTED)
        runs[label] = {"engine": label, "wall_secs": secs, "recovery": recovery,
                       "from_spares": restarted["from_spares"],
                       "kill_to_done_secs": recovery["time"] - kill_time(fileroot, trial, ENGINE_KILL_POINT)}
    return runs


def engine_table(runs: dict[str, dict]) -> list[tuple[str, ...]]:
    """One row per figure, one column per engine."""
    cols = list(runs.values())

    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in cols))

    return [
        ("rollout.engine", *runs),
        row("wall time, job with its engine killed", lambda f: f"{f['wall_secs']:.1f} s"),
        row("engines from the warm spares", lambda f: str(f["from_spares"])),
        row("fault -> killed step completed", lambda f: f"{f['recovery']['total']:.1f} s"),
        row("  lost beyond one steady step", lambda f: f"{f['recovery']['lost']:.1f} s "
                                                     f"(step {f['recovery']['steady_step']:.2f} s)"),
        *(row(f"  {p}", lambda f, p=p: f"{f['recovery'].get(p, 0.0):.2f} s") for p in PARTS),
        row("steps trained again", lambda f: str(f["recovery"]["replayed_steps"])),
    ]


DRAIN_SECS = 30  # the notice's deadline: between GCP's 30 s and AWS's 2 min


def node_lost_run(address: str, fileroot: Path, trial: str, overrides: list[str], at: int, config_path: Path,
                  cluster: LocalCluster, notice: bool) -> tuple[float, TrialLayout]:
    """The job with its ranks' node lost after step `at` (the spare pools warm before step 1): with `notice`,
    drained first (`ray drain-node`, a preemption with DRAIN_SECS to go, sent while the job waits as step `at`
    begins, so that the notice lands at a known step however fast the job runs) and killed once its work moved and
    the next step completed (the `recovery` event), else killed without notice once step `at` is logged. The wall
    time leaves out the wait for the notice. A node is added back once the job ended."""
    fault_dir = fileroot / f"faults-{trial}"
    fault_dir.mkdir()
    paused, failed = [0.0], []

    def during(config):
        layout = TrialLayout.from_config(config)
        thread = threading.Thread(target=lose_node, args=(layout,), daemon=True)
        thread.start()

        def after() -> None:
            thread.join(timeout=60)
            if failed:
                raise RuntimeError(f"{trial}: the node was not lost as planned: {failed[0]}")
        return after

    def lose_node(layout: TrialLayout) -> None:
        rows = lambda: [r for r in read_jsonl(layout.stats_log) if "global_step" in r]  # noqa: E731
        events = lambda kind: [e for e in read_jsonl(layout.events_log) if e["event"] == kind]  # noqa: E731
        try:
            if notice:
                node = drain_while_paused(fault_dir / "fired-1-step.begin", events)
                deadline = time.monotonic() + DRAIN_SECS  # the node goes then, whatever the job did
                while not events(Event.RECOVERY) and time.monotonic() < deadline:  # its handoff, and the next step
                    time.sleep(0.05)
            else:
                while not (rows() and rows()[-1]["global_step"] >= at):
                    time.sleep(0.05)
                node = events(Event.LOADED)[-1]["nodes"][0]
            cluster.kill_node(cluster.node_of(node))
        except Exception as e:  # noqa: BLE001 - said by the run, once it ended
            failed.append(e)

    def drain_while_paused(pause: Path, events) -> str:
        """The ranks' node drained while the job waits as step `at` begins; the job let go once the Supervisor's
        drain watch may poll again (at most once a POLL_SECS, the last time just before the wait), whatever
        happened: a notice that failed must not leave the job waiting."""
        while not pause.exists():
            time.sleep(0.05)
        try:
            node = events(Event.LOADED)[-1]["nodes"][0]
            r = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", address,
                                "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                                "benchmark", "--deadline-remaining-seconds", str(DRAIN_SECS)],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"ray drain-node failed: {(r.stderr or r.stdout).strip()[-500:]}")
            time.sleep(max(0.0, pause.stat().st_mtime + POLL_SECS - time.time()))
            return node
        finally:
            paused[0] = time.time() - pause.stat().st_mtime
            (fault_dir / "go").touch()

    faults = ["step.begin:wait_spares:step=1"] + [f"step.begin:pause:step={at}"] * notice
    os.environ.update(RELAUNCH_FAULT=",".join(faults), RELAUNCH_FAULT_DIR=str(fault_dir))
    try:
        secs, layout = run(address, fileroot, trial, overrides, config_path, during=during)
        return secs - paused[0], layout
    finally:
        del os.environ["RELAUNCH_FAULT"], os.environ["RELAUNCH_FAULT_DIR"]
        cluster.add_node()


def ray_train_drained(cluster: LocalCluster, root: Path, size: str, at: int, deadline_secs: int) -> dict:
    """Ray Train's own preemption path on the same cluster: a TorchTrainer (its preemption watcher on, as shipped:
    it polls Ray's drain list every 5 s) with the same model on 2 gloo ranks of one node and a checkpoint every
    step (benchmarks/baseline_loop.py: ray_train_drained_loop). Their node is drained as step `at` begins, with
    `deadline_secs` to go, and killed at the deadline: Ray Train trains on until then, and then restarts the whole
    group from its last checkpoint. Timed from the node's loss (nothing is lost before it) to the completion of the
    step then in flight, less its median steady step."""
    import ray
    from baseline_loop import ray_train_drained_loop
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = root / "ray-train-drained"
    run_dir.mkdir()
    log = run_dir / "log.jsonl"
    here = Path(__file__).resolve().parent
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}})
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            TorchTrainer(ray_train_drained_loop,
                         train_loop_config={"dir": str(run_dir), "at": at, "config": str(SIZES[size].config)},
                         torch_config=TorchConfig(backend="gloo"),
                         scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1},
                                                      placement_strategy="STRICT_PACK"),
                         run_config=RunConfig(name="baseline-drained", storage_path=str(run_dir / "storage"),
                                              checkpoint_config=CheckpointConfig(num_to_keep=2),  # ~1.2 GB at ~100M
                                              # its node's loss at the deadline may be seen as a worker's
                                              # failure (a health check) rather than the preemption: either
                                              # restarts the group once
                                              failure_config=FailureConfig(max_failures=1,
                                                                           max_preemption_failures=1))).fit()
        except BaseException as e:  # noqa: BLE001 - said after the run
            errors.append(e)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    rows = lambda: read_jsonl(log) if log.exists() else []  # noqa: E731
    try:
        while not any(r.get("step") == at - 1 and "event" not in r for r in rows()):
            if not thread.is_alive():
                raise RuntimeError(f"Ray Train ended before step {at}: {errors[:1]}")
            time.sleep(0.05)
        [node] = {r["node"] for r in rows() if r.get("event") == "node"}
        r = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                            "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                            "benchmark", "--deadline-remaining-seconds", str(deadline_secs)],
                           capture_output=True, text=True)
        drained = time.time()  # the deadline counts from the drain's call (the CLI's start is seconds)
        (run_dir / "go").touch()
        if r.returncode:
            raise RuntimeError(f"ray drain-node failed: {(r.stderr or r.stdout).strip()[-500:]}")
        time.sleep(max(0.0, drained + deadline_secs - time.time()))
        cluster.kill_node(cluster.node_of(node))
        lost = time.time()
        thread.join(timeout=600)
    finally:
        ray.shutdown()
        cluster.add_node()
    if thread.is_alive() or errors:
        raise RuntimeError(f"Ray Train did not recover from the drained node: {errors[:1] or 'still running'}")
    done = sorted((r["step"], r["time"]) for r in rows() if "event" not in r)
    in_flight = max(step for step, t in done if t < lost) + 1
    finished = min(t for step, t in done if step >= in_flight and t > lost)
    notice = next((r["time"] for r in rows() if r.get("event") == "notice"), None)
    steady = statistics.median(t1 - t0 for (s0, t0), (s1, t1) in zip(done, done[1:])
                               if s1 == s0 + 1 and s1 != at and t1 < lost)
    loaded = next(r["step"] for r in rows() if r.get("event") == "loaded" and r["time"] > lost)
    return {"system": f"Ray Train {ray.__version__}", "deadline_secs": deadline_secs,
            "notice_seen_secs": None if notice is None else notice - drained,
            "steps_before_the_node_went": sum(drained < t < lost for _, t in done),
            "total": finished - lost, "steady_step": steady, "lost": finished - lost - steady,
            "loaded_step": loaded, "replayed_steps": in_flight - loaded - 1}


def drain_figures(clean: TrialLayout, layout: TrialLayout, secs: float) -> dict:
    events = read_jsonl(layout.events_log)
    recovery = next(e for e in events if e["event"] == Event.RECOVERY)
    preemption = next((e for e in events if e["event"] == Event.PREEMPTION), None)
    return {"wall_secs": secs, "recovery": recovery, "preemption": preemption,
            "failures": sum(e["event"] == Event.FAILURE for e in events),
            "retries": sum(e["event"] == Event.RESTART for e in events),
            "identical": final_weights(clean) == final_weights(layout)}


def drain_table(runs: dict[str, dict], clean_secs: float) -> list[tuple[str, ...]]:
    """One row per figure, one column per way the node went."""
    cols = list(runs.values())

    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(f) for f in cols))

    return [
        ("the ranks' node", *runs),
        ("wall time, uninterrupted job", *(f"{clean_secs:.1f} s" for _ in cols)),
        row("wall time, job that lost the node", lambda f: f"{f['wall_secs']:.1f} s"),
        row("failures seen, retries spent", lambda f: f"{f['failures']}, {f['retries']}"),
        row("handoff (preemption event)", lambda f: f"{f['preemption']['secs']:.2f} s" if f["preemption"] else "-"),
        row("fault or notice -> step in flight completed", lambda f: f"{f['recovery']['total']:.2f} s"),
        row("  lost beyond one steady step", lambda f: f"{f['recovery']['lost']:.2f} s "
                                                     f"(step {f['recovery']['steady_step']:.2f} s)"),
        *(row(f"  {p}", lambda f, p=p: f"{f['recovery'].get(p, 0.0):.2f} s") for p in PARTS),
        row("step loaded (from), steps trained again",
            lambda f: f"{f['recovery']['loaded_step']} ({f['recovery']['source']}), "
                      f"{f['recovery']['replayed_steps']}"),
        row("final weights identical", lambda f: str(f["identical"])),
    ]


def drain_main(args, fileroot: Path, cluster: LocalCluster) -> None:
    """--drain: the uninterrupted job, then the node killed, then the node drained and killed, on one cluster."""
    config = SIZES[args.size].config
    overrides, at = (["total_train_epochs=1", *args.overrides], 8) if args.quick else \
        (args.overrides, args.kill_at_step or 20)
    tier = [*overrides, "recover.spare_workers=2", "recover.memory=on"]
    try:
        clean_secs, clean = run(cluster.address, fileroot, "uninterrupted", [*overrides, "recover.spare_workers=0"],
                                config)
        runs = {}
        for label, notice in (("killed", False), ("drained, then killed", True)):
            trial = "node-" + label.split(",")[0]
            secs, layout = node_lost_run(cluster.address, fileroot, trial, tier, at, config, cluster, notice)
            runs[label] = drain_figures(clean, layout, secs)
        try:  # quick: the deadline leaves Ray Train's watcher (a poll every 5 s) and its 2 s steps time to see it
            ray_train = ray_train_drained(cluster, fileroot, args.size, at, 20 if args.quick else DRAIN_SECS)
        except Exception as e:  # noqa: BLE001 - relaunch's figures are printed first, then the benchmark fails
            ray_train = {"system": "Ray Train", "error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        cluster.shutdown()
    print(f"model: {args.size} ({config.name}), the node lost after step {at}")
    report(drain_table(runs, clean_secs), {"benchmark": "recovery", "size": args.size, "kill": "node",
                                           "uninterrupted_secs": clean_secs, "runs": runs, "ray_train": ray_train},
           args.json)
    if "error" in ray_train:
        sys.exit(f"recovery --drain: Ray Train's preemption path did not run: {ray_train['error']}")
    ours = runs["drained, then killed"]["recovery"]
    print(f"A drained node beside Ray Train's preemption path ({ray_train['system']}: a watcher of the same drain "
          f"list; the group trains on until the deadline, {ray_train['deadline_secs']} s here, then restarts whole "
          f"from its last checkpoint; the same model, a checkpoint every step):")
    report([("", "relaunch (handoff at the next step boundary)", f"{ray_train['system']} (restart at the deadline)"),
            ("lost beyond one steady step", f"{ours['lost']:.2f} s (step {ours['steady_step']:.2f} s)",
             f"{ray_train['lost']:.2f} s (step {ray_train['steady_step']:.2f} s)"),
            ("steps trained again", str(ours["replayed_steps"]), str(ray_train["replayed_steps"])),
            ("notice seen by the training loop", "-", "-" if ray_train["notice_seen_secs"] is None
             else f"{ray_train['notice_seen_secs']:.1f} s after it was sent")], None, None)
    print(f"(runs under {fileroot})")


def main() -> None:
    parser = arguments(__doc__, "one epoch, the kill at step 10, spares 0 and 2")
    parser.add_argument("--kill-at-step", type=int, default=None, help="default 30 (--engine-kill: 6)")
    parser.add_argument("--engine-kill", action="store_true", help="kill an engine (hf, vllm, vllm with a spare)")
    parser.add_argument("--drain", action="store_true", help="lose the ranks' node, with and without a drain notice")
    parser.add_argument("--spares", default="0,1,2",
                        help="recover.spare_workers of each killed run, side by side (--quick: 0,2)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="the model (benchmarks/sizes.py)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = SIZES[args.size].config
    # quick: the kill at step 10 gives the spares, started after step 0, time to warm up on a small machine
    overrides, kill_at = (["total_train_epochs=1", *args.overrides], 10) if args.quick else \
        (args.overrides, args.kill_at_step or 30)
    spares = [int(n) for n in ("0,2" if args.quick and args.spares == parser.get_default("spares")
                               else args.spares).split(",")]
    fileroot = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    if args.drain:
        if args.address:
            parser.error("--drain kills a node: it runs on a local cluster of its own, not --address")
        drain_main(args, fileroot, LocalCluster(object_store=SIZES[args.size].object_store))
        return
    cluster = None if args.address else LocalCluster(object_store=SIZES[args.size].object_store)
    address = args.address or cluster.address
    if args.engine_kill:
        engine_main(args, fileroot, address, cluster)
        return
    runs = {}
    try:
        clean_secs, clean = run(address, fileroot, "uninterrupted",
                                [*overrides, "recover.spare_workers=0", "recover.memory=off"], config)
        for n in spares:
            faulty_secs, faulty = killed_run(address, fileroot, f"killed-spares{n}",
                                             [*overrides, f"recover.spare_workers={n}", "recover.memory=off"],
                                             kill_at, config)
            runs[n] = figures(clean, faulty, faulty_secs, clean_secs)
    finally:
        if cluster:
            cluster.shutdown()
    commits = [e for e in read_jsonl(clean.events_log) if e["event"] == Event.COMMIT]
    rows = table(runs, clean_secs, commits)
    first = runs[spares[0]]
    print(f"model: {args.size} ({config.name})")
    report(rows, {"benchmark": "recovery", "size": args.size, "uninterrupted_secs": clean_secs,
                  "killed_secs": first["killed_secs"], "recovery": first["recovery"], "identical": all(r["identical"] for r in runs.values()),
                  "runs": [{"spare_workers": n, **r} for n, r in runs.items()]}, args.json)
    print(f"(runs under {fileroot})")


def engine_main(args, fileroot: Path, address: str, cluster: LocalCluster | None) -> None:
    """--engine-kill: one epoch, no warm spare TrainWorker or memory tier (an engine's repair uses neither, and
    they would hold memory a ~100M job with two vLLM engines needs). --quick: tiny, the built-in engine and vLLM
    with its spare only."""
    overrides = ["total_train_epochs=1", "recover.spare_workers=0", "recover.memory=off", *args.overrides]
    columns, size = (["hf", "vllm, warm spare"], "tiny") if args.quick else (list(ENGINES), args.size)
    try:
        runs = engine_kills(address, fileroot, size, overrides, args.kill_at_step or 6, columns)
    finally:
        if cluster:
            cluster.shutdown()
    print(f"model: {size} ({SIZES[size].config.name})")
    report(engine_table(runs), {"benchmark": "recovery", "size": size, "kill": "engine",
                                "runs": list(runs.values())}, args.json)
    print(f"(runs under {fileroot})")


if __name__ == "__main__":
    main()
