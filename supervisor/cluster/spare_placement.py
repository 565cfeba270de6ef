"""How many warm spare TrainWorkers to keep, and on which nodes; which spare engine replaces which (pure: no Ray).

A spare holds the resources of one rank (`cluster.cpus_per_worker`, `cluster.gpus_per_worker`) from the
moment it starts, so it is kept only where the cluster has room for it beside the TrainGroup and the
engines, and it is put on a node that runs no rank: a node loss then does not take the pool with the ranks.
"""
from __future__ import annotations

from supervisor.config import AUTO

Resources = dict[str, float]


def rank_resources(cluster) -> Resources:
    """What one TrainWorker (rank or spare) holds."""
    need = {"CPU": float(cluster.cpus_per_worker)}
    if cluster.gpus_per_worker:
        need["GPU"] = float(cluster.gpus_per_worker)
    return need


def engine_resources(cluster) -> Resources:
    """What one engine (serving or spare) holds."""
    need = {"CPU": float(cluster.cpus_per_worker)}
    if cluster.gpus_per_engine:
        need["GPU"] = float(cluster.gpus_per_engine)
    return need


def spare_count(setting: int | str, total: Resources, cluster, spare_engines: int = 0, other_ranks: int = 0,
                ranks: int | None = None) -> int:
    """A group's pool's size: `recover.spare_workers` as given, or for `auto` on CPU one spare per rank of the
    group (`ranks`, default cluster.n_train_workers) as far as the cluster's total resources hold them beside
    the group, `other_ranks` (another group's ranks and spares: a PPO job's critic), the engines and the
    `spare_engines` (a restart is only as fast as its slowest rank: one rank started cold sets the pace). On GPU
    `auto` is 0: a spare idles whole GPUs for the whole job to save one rank's start-up at a rare restart, a trade
    only its owner can make (set a number)."""
    if setting != AUTO:
        return int(setting)
    if cluster.gpus_per_worker:
        return 0

    ranks = cluster.n_train_workers if ranks is None else ranks

    def fits(spares: int) -> bool:
        held = ranks + other_ranks + spares
        engines = cluster.n_rollout_workers + spare_engines
        need = {"CPU": (held + engines) * cluster.cpus_per_worker,
                "GPU": held * cluster.gpus_per_worker + engines * cluster.gpus_per_engine}
        return all(total.get(k, 0.0) >= v for k, v in need.items() if v)

    return max((n for n in range(ranks + 1) if fits(n)), default=0)


def choose_nodes(free: dict[str, Resources], avoid: set[str], need: Resources, n: int) -> list[str]:
    """Up to `n` nodes for new spares (a node may be named more than once), each with room for `need` after
    the earlier picks: nodes in `avoid` (those running ranks) only when no other has room, then the node
    with the most free CPU, so spares spread. Shorter than `n` when the cluster has no room for more."""
    free = {node: dict(res) for node, res in free.items()}
    picks: list[str] = []
    for _ in range(n):
        fits = [node for node, res in free.items() if all(res.get(k, 0.0) >= v for k, v in need.items())]
        if not fits:
            break
        node = min(fits, key=lambda x: (x in avoid, -free[x].get("CPU", 0.0), x))
        for k, v in need.items():
            free[node][k] -= v
        picks.append(node)
    return picks


def take_spares(slots: list[int], answering: list[str], starting: list[str]) -> dict[int, str]:
    """Which spare engine takes which dead engine's slot: those that answered a probe first (warm), then those
    still starting (sooner than a cold start); slots left over start cold."""
    return dict(zip(slots, answering + starting))
