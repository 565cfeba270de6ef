"""What a drain notice moves off its node, and when it moves nothing (control/preemption.py); which notices the
Supervisor acts on (cluster/drains.py). Pure: no Ray."""
from __future__ import annotations

import pytest

from supervisor.cluster.drains import POLL_SECS, DrainWatch
from supervisor.control.preemption import HANDOFF_SECS, Handoff, plan_handoff
from supervisor.control.recovery_source import Choice, Source

pytestmark = pytest.mark.quick

NOW = 1_000_000.0
MEMORY = Choice(Source.MEMORY, "step 7 from memory", 7, {1: "spare-a"})


def plan(node="b", deadline=NOW + 30, ranks=("a", "b"), engines=None, spares=None, step=7, memory=MEMORY,
         critic=None):
    return plan_handoff(node=node, deadline=deadline, now=NOW,
                        rank_nodes={"actor": list(ranks), **({"critic": list(critic[0])} if critic else {})},
                        engine_nodes=engines or {"RolloutWorker[0]": "head"}, spare_nodes=spares or {},
                        global_step=step, memory={"actor": memory, **({"critic": critic[1]} if critic else {})})


def test_a_node_with_a_rank_an_engine_and_a_spare_hands_all_three_off():
    assert plan(engines={"RolloutWorker[0]": "b", "RolloutWorker[1]": "head"}, spares={"spare-c": "b"}) == \
        Handoff("b", NOW + 30, {"actor": (1,)}, ("RolloutWorker[0]",), ("spare-c",))


def test_a_node_the_job_does_not_use_changes_nothing():
    assert plan(node="elsewhere") is None


def test_a_notice_without_a_deadline_is_handed_off():
    assert plan(deadline=None).ranks == {"actor": (1,)}


@pytest.mark.parametrize("left", [HANDOFF_SECS - 0.1, 0.0, -3.0])
def test_a_deadline_too_close_moves_nothing_and_says_why(left):
    h = plan(deadline=NOW + left, engines={"RolloutWorker[0]": "b"})
    assert not h.moves and "less than the 5s a handoff needs" in h.fallback


@pytest.mark.parametrize("memory, why", [
    (None, "the memory tier does not serve this job"),
    (Choice(Source.DISK, "rank 1 had no buddy holding its state"), "rank 1 had no buddy holding its state"),
    (Choice(Source.MEMORY, "step 6 from memory", 6, {1: "spare-a"}), "holds step 6, not step 7 just completed"),
])
def test_ranks_the_memory_tier_cannot_hand_off_stay_while_the_engines_and_spares_move(memory, why):
    h = plan(memory=memory, engines={"RolloutWorker[0]": "b"}, spares={"spare-c": "b"})
    assert (h.ranks, h.engines, h.spares) == ({}, ("RolloutWorker[0]",), ("spare-c",))
    assert why in h.fallback and h.fallback.startswith("ranks [1] stay until the node goes")


def test_a_critics_ranks_there_move_with_the_actors_or_all_stay():
    """PPO: the critic's ranks on the node hand off beside the actor's, each group to its own holders; where the
    critic's cannot (their copies not held, say), no rank of either group moves: they roll back as one step."""
    critic = Choice(Source.MEMORY, "step 7 from memory", 7, {0: "spare-critic-a"})
    h = plan(critic=(("b", "a"), critic), spares={"spare-critic-a": "c"})
    assert h.ranks == {"actor": (1,), "critic": (0,)} and h.fallback is None
    assert plan(ranks=("a", "a"), critic=(("b", "a"), critic)).ranks == {"critic": (0,)}  # the critic's alone
    h = plan(critic=(("b", "a"), Choice(Source.DISK, "rank 0 had no buddy holding its state")))
    assert h.ranks == {} and h.fallback.startswith("the critic's ranks [0] stay until the node goes (rank 0 had")


def test_a_notice_is_acted_on_once_and_again_after_a_cancelled_drain():
    now, draining = [0.0], {"b": NOW + 30, "elsewhere": None}
    watch = DrainWatch(source=lambda: dict(draining), clock=lambda: now[0])
    assert watch.new({"a", "b"}) == {"b": NOW + 30}
    watch.done("b")
    now[0] += POLL_SECS / 2
    draining["a"] = None
    assert watch.new({"a", "b"}) == {}  # not polled again yet
    now[0] += POLL_SECS
    assert watch.new({"a", "b"}) == {"a": None}
    watch.done("a")
    del draining["b"]  # its drain was cancelled: the node stays
    now[0] += POLL_SECS
    assert watch.new({"a", "b"}) == {}
    draining["b"] = NOW + 60  # drained again
    now[0] += POLL_SECS
    assert watch.new({"a", "b"}) == {"b": NOW + 60}


def test_a_rank_is_not_handed_to_a_buddy_whose_node_drains_too():
    h = plan_handoff(node="b", deadline=NOW + 30, now=NOW, rank_nodes={"actor": ["a", "b"]}, engine_nodes={},
                     spare_nodes={"spare-a": "c"}, global_step=7, memory={"actor": MEMORY}, draining={"b", "c"})
    assert h.ranks == {} and "a buddy holding their state is on a node that drains too" in h.fallback


def test_a_notice_not_known_this_time_is_no_cancelled_drain():
    answers = iter([{"b": None}, None, {"b": None}])
    now = [0.0]
    watch = DrainWatch(source=lambda: next(answers), clock=lambda: now[0])
    assert watch.new({"b"}) == {"b": None}
    watch.done("b")
    for _ in range(2):  # the GCS did not answer, then answers with the same drain: acted on once only
        now[0] += POLL_SECS
        assert watch.new({"b"}) == {}


def pool_of(monkeypatch, names, killed):
    from supervisor.cluster import spares as spares_module
    from supervisor.cluster.spares import Spare, SparePool
    from supervisor.config import load_config

    pool = SparePool(load_config("configs/tiny_grpo.yaml", []), len(names))
    pool.spares = [Spare(None, name, None, None) for name in names]
    monkeypatch.setattr(pool, "_kill", lambda spares: killed.extend(s.name for s in spares))
    monkeypatch.setattr(spares_module, "room_per_node", lambda: {"head": {"CPU": 0.0}, "b": {"CPU": 1.0}})
    return pool


def test_room_made_for_a_handoffs_engines_never_costs_the_spares_its_moving_ranks_take(monkeypatch):
    """The cluster has room for one of three engines replaced: spares go to make it, but not the one named to take
    a moving rank's place, nor a free one that a moving rank without a named spare will take (killing either
    would turn the handoff into a fault)."""
    killed = []
    pool = pool_of(monkeypatch, ["spare-a", "spare-b", "spare-c", "spare-d"], killed)
    assert pool.make_room(3, keep=frozenset({"spare-b"}), reserve=1) == 2
    assert killed == ["spare-c", "spare-d"] and [s.name for s in pool.spares] == ["spare-a", "spare-b"]


def test_room_made_for_engines_costs_the_spares_holding_ranks_copies_last(monkeypatch):
    """An engine lost with a node: the spare holding a rank's copy (the rank may have gone with the node too) is
    released only once no other spare is left."""
    killed = []
    pool = pool_of(monkeypatch, ["spare-a", "spare-b", "spare-c"], killed)
    assert pool.make_room(2, last=frozenset({"spare-a"})) == 1 and killed == ["spare-b"]
    assert pool.make_room(3, last=frozenset({"spare-a"})) == 2 and killed == ["spare-b", "spare-c", "spare-a"]
    assert pool.spares == []


def test_room_made_in_two_passes_counts_the_first_passes_kills_once(monkeypatch):
    """A second pass after a first that killed spares for the same engines: Ray shows one CPU free, which may be
    one of those the first pass freed; each freed CPU is counted once (counted twice, the free one and the freed
    one, it left a drain's second engine with no room, waiting out its start-up bound)."""
    killed = []
    pool = pool_of(monkeypatch, ["spare-a", "spare-b", "spare-c"], killed)
    assert pool.make_room(2, freed=1) == 1 and killed == ["spare-a"]  # the free CPU is the one freed: one more
    assert pool.make_room(4, freed=2) == 2 and killed == ["spare-a", "spare-b", "spare-c"]  # 4 - 2, not 4 - 3
