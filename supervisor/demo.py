"""`relaunch demo`: the default job on a local multi-node Ray cluster, with a worker node killed mid-run.

It starts a head and two worker nodes (own temp dir and ports), runs the job, kills the node that hosts
the TrainGroup once training passes `kill_at_step` (its raylet and every process under it), prints what
happened from events.jsonl and plots the run beside its logs. The cluster is torn down at the end, also on
Ctrl-C. Ray's test cluster writes its address file into Ray's default temp dir and deletes it at shutdown,
where a real Ray cluster on this machine keeps its own: the demo points that default at a directory of its own.
"""
from __future__ import annotations

import os
import threading
import time

from supervisor.checkpoint.layout import TrialLayout
from supervisor.config import Config
from supervisor.control.recovery_source import Source
from supervisor.control.events import ENDED, Event, read_jsonl
from supervisor.launch import run_job
from supervisor.testing.local_cluster import LocalCluster, short_tmp
from supervisor.tools.plot import plot_trial


class NodeKiller(threading.Thread):
    """Waits for the job to pass a step, then kills the node its TrainGroup runs on."""

    def __init__(self, cluster: LocalCluster, layout: TrialLayout, kill_at_step: int):
        super().__init__(daemon=True)
        self.cluster, self.layout, self.kill_at_step = cluster, layout, kill_at_step
        self.killed_at: float | None = None
        self.node_id: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            stats = read_jsonl(self.layout.stats_log)
            loaded = [e for e in read_jsonl(self.layout.events_log) if e["event"] == Event.LOADED]
            if stats and loaded and stats[-1]["global_step"] >= self.kill_at_step:
                self.node_id = loaded[-1]["nodes"][0]
                print(f"\n[demo] killing worker node {self.node_id[:8]} (raylet and all its processes) "
                      f"after step {stats[-1]['global_step']}", flush=True)
                self.killed_at = time.time()
                self.cluster.kill_node(self.cluster.node_of(self.node_id))
                return


def timeline(layout: TrialLayout, killed_at: float | None) -> list[str]:
    events = read_jsonl(layout.events_log)
    out = []
    failure = next((e for e in events if e["event"] == Event.FAILURE), None)
    if failure:
        after = f"{failure['time'] - killed_at:.1f} s after the kill" if killed_at else "detected"
        out.append(f"fault detected {after}: {failure['cause']} of {failure['actor']} "
                   f"on node {str(failure['node'])[:8]}")
        later = [e for e in events if e["time"] >= failure["time"]]
        loaded = next((e for e in later if e["event"] == Event.LOADED), None)
        if loaded and loaded.get("source") == Source.MEMORY:
            out.append(f"TrainGroup rejoined on node {loaded['nodes'][0][:8]} at step {loaded['global_step']} from "
                       f"memory (the dead ranks' buddies took their places; nothing read from disk)")
        elif loaded:
            kept = f"; ranks {loaded['kept']} kept their processes" if loaded.get("kept") else ""
            out.append(f"TrainGroup restarted on node {loaded['nodes'][0][:8]} from step {loaded['global_step']} "
                       f"({loaded['path']}{kept})")
        resync = next((e for e in later if e["event"] == Event.RESYNC), None)
        if resync:
            out.append(f"engines resynced to weights version {resync['version']} (checksum {resync['checksum']})")
        recovery = next((e for e in later if e["event"] == Event.RECOVERY), None)
        if recovery and recovery.get("lost") is not None:
            out.append(f"step {recovery['global_step']}, in flight at the fault, completed {recovery['total']:.1f} s "
                       f"after it: {recovery['lost']:.1f} s lost beyond a steady step, "
                       f"{recovery['replayed_steps']} completed steps trained again (from {recovery['source']})")
    done = next((e for e in reversed(events) if e["event"] in ENDED), None)
    if done and done["event"] == Event.DONE:
        out.append(f"job finished at step {done['global_step']} with mean reward {done.get('reward') or 0:.3f}")
    elif done:
        out.append(f"job {done['event']}: {done.get('reason')}")
    return out


def run_demo(config: Config, kill_at_step: int) -> int:
    layout = TrialLayout.from_config(config)
    os.environ["RAY_TMPDIR"] = str(short_tmp("rld"))  # leave any real cluster's address file alone
    print("[demo] starting a local Ray cluster: a head node and 2 worker nodes of 3 CPUs", flush=True)
    cluster = LocalCluster()
    killer = NodeKiller(cluster, layout, kill_at_step)
    try:
        print(f"[demo] cluster at {cluster.address} (temp dir {cluster.temp_dir}); running {config.experiment_name}/"
              f"{config.trial_name}, outputs under {layout.checkpoint_root}", flush=True)
        killer.start()
        code = run_job(config, cluster.address)
    finally:
        killer.stop.set()
        cluster.shutdown()
        print("[demo] cluster shut down", flush=True)
    print("\n[demo] timeline:")
    for line in timeline(layout, killer.killed_at):
        print(f"  - {line}")
    if layout.stats_log.exists():
        plot = layout.log_root / "curves.png"
        plot_trial(layout, plot)
        print(f"[demo] reward and loss per step, the fault and the restart marked: {plot}")
    return code
