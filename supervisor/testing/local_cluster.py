"""A multi-node Ray cluster on this one machine, for `relaunch demo` and the end-to-end tests.

A head node (the Supervisor and one inference engine) and worker nodes with a few CPUs each, so a
TrainGroup fits on one node and another is a spare. The cluster has its own temp dir and ports, small
object stores and short health checks (a dead node is noticed in under three seconds). Each node has a disk of
its own: its processes' TMPDIR, a directory no other node uses. A node is killed the way a machine dies: its
raylet and every process under it at once, found through the process ids this cluster started, never by
name, and its disk gone with it.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from supervisor.testing.processes import kill_all, process_tree

OBJECT_STORE = 150 * 1024**2
# A killed node refuses the checks at once: it is seen dead in 2.5 s. A live node's raylet on two cores loaded by
# engines starting gets 2 s to answer, five times: at 0.5 s and three misses, a node could be declared dead as it
# joined or while it started actors (a node that never stayed, in CI).
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 5,
                 "health_check_timeout_ms": 2000, "health_check_initial_delay_ms": 0}
# the longest Ray takes to mark a killed node dead: its checks are refused at once, one a period, the last timing out
NODE_DEATH_SECS = (HEALTH_CHECKS["health_check_period_ms"] * HEALTH_CHECKS["health_check_failure_threshold"]
                   + HEALTH_CHECKS["health_check_timeout_ms"]) / 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_tmp(prefix: str) -> Path:
    """A fresh directory with a short path: Ray's unix sockets live under its temp dir (107-byte limit).
    Under $TMPDIR when that is short (CI points it at a new empty directory), else under /tmp."""
    base = tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base if len(base) <= 40 else "/tmp"))


def ensure_default_ray_temp_dir() -> None:
    """Ray's `Cluster` writes its address file (`ray_current_cluster`) into Ray's default temp dir
    ($RAY_TMPDIR, $TMPDIR or /tmp, + /ray), whatever the head's own temp dir; on a machine that never ran
    Ray that directory does not exist yet, and the head's start fails."""
    from ray._private.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)


class LocalCluster:
    def __init__(self, n_workers: int = 2, cpus_per_worker: int = 3, head_cpus: int = 1,
                 object_store: int = OBJECT_STORE, gpus_per_node: float = 0):
        """`object_store`: bytes of each node's object store (benchmarks at real size push whole models);
        `gpus_per_node`: the GPUs each node declares (Ray's test nodes declare none; on a one-GPU machine every
        node may declare that GPU, shared between them, tests/gpu)."""
        from ray.cluster_utils import Cluster

        self.temp_dir = short_tmp("rlc")
        self.cpus_per_worker, self.object_store, self.gpus_per_node = cpus_per_worker, object_store, gpus_per_node
        ensure_default_ray_temp_dir()
        self.cluster = Cluster()
        self.disks: dict[str, Path] = {}  # node id -> that node's own disk
        try:
            self._add(num_cpus=head_cpus, num_gpus=gpus_per_node, object_store_memory=object_store,
                      gcs_server_port=free_port(),
                      temp_dir=str(self.temp_dir), include_dashboard=False, _system_config=HEALTH_CHECKS)
            self.workers = [self.add_node() for _ in range(n_workers)]
        except BaseException:
            self.shutdown()
            raise
        self.address = self.cluster.address

    def _add(self, **node_args):
        """A node whose processes write their temporary files to a disk of its own (a machine's local disk)."""
        disk = Path(tempfile.mkdtemp(prefix="disk", dir=self.temp_dir))
        node = self.cluster.add_node(env_vars={"TMPDIR": str(disk)}, **node_args)
        self.disks[node.node_id] = disk
        return node

    def add_node(self):
        node = self._add(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_node,
                         object_store_memory=self.object_store)
        if hasattr(self, "workers"):
            self.workers.append(node)
        return node

    def node_of(self, node_id: str):
        return next(n for n in self.workers if n.node_id == node_id)

    def kill_node(self, node) -> None:
        """End the node's raylet and every process under it at once, lose its disk, then forget the node."""
        kill_all(process_tree(node.all_processes["raylet"][0].process.pid))
        shutil.rmtree(self.disks.pop(node.node_id), ignore_errors=True)
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def shutdown(self) -> None:
        self.cluster.shutdown()
