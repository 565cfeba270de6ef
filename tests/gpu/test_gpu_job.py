"""The default job on one GPU, its rank and its engine sharing it (and its warm spare beside them), on a local
3-node Ray cluster (each node sees the machine's GPU): a TrainWorker SIGKILLed mid-step is replaced by the spare
from the copy it holds in memory, no completed step trained again, and the run ends bit-identical to an
uninterrupted run on the same GPU. Every weight sync writes the engine's weights in place through CUDA IPC."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = ["recover.spare_workers=1", "total_train_epochs=1"]  # 12 steps, a recover checkpoint every 5


@pytest.fixture(scope="module")
def cluster():
    from supervisor.testing.local_cluster import LocalCluster

    c = LocalCluster(n_workers=2, cpus_per_worker=3, head_cpus=1, gpus_per_node=1)
    try:
        yield c
    finally:
        c.shutdown()


def run(cluster, gpu: list[str], fileroot: Path, faults: str = "") -> tuple[list[dict], list[dict]]:
    """The default job on one GPU (`gpu`: the overrides that put it there) run to its end on `cluster`; its
    stats rows and events."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if faults:
        env.update(RELAUNCH_FAULT=faults, RELAUNCH_FAULT_DIR=str(fileroot))
    proc = subprocess.run([sys.executable, "-m", "supervisor", "run", *gpu, *JOB, f"cluster.fileroot={fileroot}",
                           "--address", cluster.address], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = next((fileroot / "logs").glob("*/tiny-grpo/trial0"))
    return [[json.loads(x) for x in (logs / name).read_text().splitlines()] for name in ("stats.jsonl", "events.jsonl")]


def test_a_killed_rank_on_the_gpu_is_replaced_from_memory_and_the_run_ends_bit_identical(cluster, gpu_overrides,
                                                                                        tmp_path):
    stats, events = run(cluster, gpu_overrides, tmp_path / "reference")
    faults = "step.begin:wait_spares:step=2,TrainWorker.train.enter:kill:step=7:rank=0"
    killed_stats, killed_events = run(cluster, gpu_overrides, tmp_path / "killed", faults)

    def of(rows, kind):
        return [e for e in rows if e["event"] == kind]

    assert [(e["cause"], e["global_step"]) for e in of(killed_events, "failure")] == [("worker_died", 7)]
    assert [(e["source"], e["replayed_steps"]) for e in of(killed_events, "recovery")] == [("memory", 0)]
    curve = [(r["global_step"], r["reward"], r["loss"], r["grad_norm"]) for r in stats]
    assert [(r["global_step"], r["reward"], r["loss"], r["grad_norm"]) for r in killed_stats] == curve
    final = of(events, "commit")[-1]
    assert (of(killed_events, "commit")[-1]["global_step"], of(killed_events, "commit")[-1]["weights_checksum"]) \
        == (final["global_step"], final["weights_checksum"])
    # the engine's weights on the GPU, checked on the device, written in place by the rank through CUDA IPC
    assert final["weights_checksum"].startswith("sum64-")
    assert all("time/weight_write" in r for r in stats + killed_stats)
