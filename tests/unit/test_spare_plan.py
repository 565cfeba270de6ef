"""The warm spare pools' pure decisions: how many spares, on which nodes, and which spare engine replaces which."""
from __future__ import annotations

import pytest

from supervisor.cluster.spare_placement import (choose_nodes, engine_resources, rank_resources, spare_count,
                                                take_spares)
from supervisor.config import ClusterConfig

# the e2e cluster: a head of 1 CPU and two worker nodes of 3
E2E_TOTAL = {"CPU": 7.0, "memory": 1e9}


@pytest.mark.parametrize("setting, total, cluster, expected", [
    (3, {"CPU": 1.0}, {}, 3),                                        # an explicit size is kept as given
    (0, E2E_TOTAL, {}, 0),
    ("auto", E2E_TOTAL, {}, 2),                                      # 2 ranks + 1 engine + 2 spares = 5 <= 7
    ("auto", {"CPU": 16.0}, {}, 2),                                  # never more spares than ranks
    ("auto", {"CPU": 3.0}, {}, 0),                                   # only the group and the engine fit
    ("auto", {"CPU": 4.0}, {}, 1),                                   # room for one more rank, not two
    ("auto", E2E_TOTAL, {"n_train_workers": 4, "cpus_per_worker": 2}, 0),   # 12 CPUs wanted
    # on GPU auto idles no GPU, however many are free; a number is kept as given
    ("auto", {"CPU": 16.0, "GPU": 4.0}, {"gpus_per_worker": 1}, 0),
    ("auto", {"CPU": 64.0, "GPU": 16.0}, {"gpus_per_worker": 1, "gpus_per_engine": 1}, 0),
    (1, {"CPU": 16.0, "GPU": 4.0}, {"gpus_per_worker": 1}, 1),
    ("auto", {"CPU": 16.0, "GPU": 1.0}, {"gpus_per_engine": 1}, 2),  # GPU engines, CPU ranks: CPU spares
])
def test_spare_count(setting, total, cluster, expected):
    assert spare_count(setting, total, ClusterConfig(**cluster)) == expected


@pytest.mark.parametrize("spare_engines, expected", [(0, 2), (2, 2), (3, 1), (4, 0)])
def test_spare_engines_take_room_from_auto_spares(spare_engines, expected):
    """On the e2e cluster (7 CPUs): 2 ranks and 1 engine, then the spare engines, then as many spares as fit."""
    assert spare_count("auto", E2E_TOTAL, ClusterConfig(), spare_engines) == expected


@pytest.mark.parametrize("total, actor, critic", [
    (E2E_TOTAL, 2, 0),       # 2 + 2 ranks, 1 engine, the actor's 2 spares: the e2e cluster is full
    ({"CPU": 8.0}, 2, 1),    # room for one of the critic's
    ({"CPU": 16.0}, 2, 2),   # one per rank, for each group
])
def test_a_critics_pool_takes_the_room_the_actors_left(total, actor, critic):
    """PPO: the actor's pool is sized beside the critic's ranks, then the critic's beside the actor's ranks and
    spares (as the Supervisor sizes them)."""
    assert spare_count("auto", total, ClusterConfig(), 0, other_ranks=2) == actor
    assert spare_count("auto", total, ClusterConfig(), 0, other_ranks=2 + actor, ranks=2) == critic
    assert spare_count(1, total, ClusterConfig(), 0, other_ranks=2 + actor, ranks=2) == 1  # a number is per group


def test_engine_resources_name_gpus_only_when_asked():
    assert engine_resources(ClusterConfig(cpus_per_worker=2, gpus_per_worker=1)) == {"CPU": 2.0}
    assert engine_resources(ClusterConfig(gpus_per_engine=1)) == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize("slots, answering, starting, expected", [
    ([0], ["s1"], ["s2"], {0: "s1"}),                        # a warm spare before one still starting
    ([0, 2], ["s1"], ["s2"], {0: "s1", 2: "s2"}),            # then one still starting: sooner than a cold start
    ([0, 1, 2], [], ["s2"], {0: "s2"}),                      # slots left over start cold
    ([1], [], [], {}),                                       # no spare (or only dead ones, not offered): cold
    ([], ["s1"], [], {}),                                    # nothing to replace: the spares stay
])
def test_take_spares(slots, answering, starting, expected):
    assert take_spares(slots, answering, starting) == expected


def test_rank_resources_name_gpus_only_when_asked():
    assert rank_resources(ClusterConfig(cpus_per_worker=2)) == {"CPU": 2.0}
    assert rank_resources(ClusterConfig(gpus_per_worker=1)) == {"CPU": 1.0, "GPU": 1.0}


ONE_CPU = {"CPU": 1.0}


@pytest.mark.parametrize("free, avoid, n, expected", [
    # a node without ranks wins, even with less room than a node with ranks
    ({"a": {"CPU": 3.0}, "b": {"CPU": 1.0}}, {"a"}, 1, ["b"]),
    # the ranks' node only when nothing else has room
    ({"a": {"CPU": 1.0}, "b": {"CPU": 0.5}}, {"a"}, 1, ["a"]),
    # spares spread: the most free CPU first, counting earlier picks
    ({"a": {"CPU": 2.0}, "b": {"CPU": 2.0}, "c": {"CPU": 0.0}}, set(), 3, ["a", "b", "a"]),
    # no room for more: fewer spares than asked, never a pick that does not fit
    ({"a": {"CPU": 1.0}, "b": {"CPU": 0.0}}, {"b"}, 2, ["a"]),
    ({}, set(), 1, []),
    ({"a": {"CPU": 5.0}}, set(), 0, []),
])
def test_choose_nodes(free, avoid, n, expected):
    assert choose_nodes(free, avoid, ONE_CPU, n) == expected


def test_choose_nodes_needs_every_resource_and_leaves_its_input_alone():
    free = {"cpu-only": {"CPU": 8.0}, "gpu": {"CPU": 1.0, "GPU": 1.0}}
    assert choose_nodes(free, {"gpu"}, {"CPU": 1.0, "GPU": 1.0}, 2) == ["gpu"]
    assert free["gpu"] == {"CPU": 1.0, "GPU": 1.0}
