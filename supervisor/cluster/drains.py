"""Ray's drain notices: the nodes that are about to go, and by when.

A preempted spot VM, a Kubernetes node the scheduler reclaims, a capacity block that expires: whatever watches
for that calls Ray's drain API with a reason and a deadline (`ray drain-node` by hand, a `preStop` hook; Ray's own
autoscaler drains only the nodes it removes itself). Ray then starts nothing new there; the caller takes the node
away at the deadline. Ray Serve and Ray Train read the same list (GCS `get_draining_nodes`); the Supervisor reads
it at each step boundary (control/preemption.py, docs/failures.md#preemption).
"""
from __future__ import annotations

import time
from typing import Callable

RPC_SECS = 2.0   # one GCS call's bound: a GCS that does not answer costs a step boundary at most this
POLL_SECS = 1.0  # at most one call per this many seconds, however short the steps


def draining_nodes() -> dict[str, float | None] | None:
    """node id -> its deadline (seconds since the epoch; None: no deadline). None when Ray is not connected or its
    GCS does not answer in RPC_SECS: not known (a notice missed is a node loss, repaired when the node goes)."""
    import ray

    if not ray.is_initialized():
        return None
    try:  # this process's own GCS client (Ray Train reads the same list through ray._private.state, unbounded)
        nodes = ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=RPC_SECS)
    except Exception:  # noqa: BLE001 - see above
        return None
    return {node: (ms / 1000 if ms else None) for node, ms in nodes.items()}  # GCS: 0 for no deadline


def room_per_node() -> dict[str, dict[str, float]]:
    """Each node's free resources, but for the draining ones: where a new spare can start (Ray starts nothing on a
    draining node, and one started there would go with it)."""
    from ray._private.state import available_resources_per_node

    draining = draining_nodes() or {}
    return {node: free for node, free in available_resources_per_node().items() if node not in draining}


class DrainWatch:
    """The drain notices not acted on yet. A node is acted on once; a node whose drain was cancelled (it left the
    list while alive) is forgotten, so that a later notice for it is acted on again."""

    def __init__(self, source: Callable[[], dict[str, float | None] | None] = draining_nodes,
                 clock: Callable[[], float] = time.monotonic):
        self.source, self.clock = source, clock
        self.acted: set[str] = set()
        self.polled: float | None = None

    def new(self, used: set[str]) -> dict[str, float | None]:
        """The draining nodes among `used` (the nodes the job runs on) not acted on yet: node -> deadline."""
        now = self.clock()
        if self.polled is not None and now - self.polled < POLL_SECS:
            return {}
        self.polled = now
        draining = self.source()
        if draining is None:  # not known this time: nothing is taken for a cancelled drain
            return {}
        self.acted &= set(draining)
        return {node: deadline for node, deadline in draining.items() if node in used and node not in self.acted}

    def done(self, node: str) -> None:
        self.acted.add(node)

    def again(self, node: str) -> None:
        """Act on `node` again at the next poll (its handoff failed: what it did not move is planned again)."""
        self.acted.discard(node)
