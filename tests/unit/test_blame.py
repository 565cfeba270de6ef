"""One blame rule for every gather (supervisor/cluster/blame.py): who is at fault when calls made together end
in different ways. Tier 0 is the TrainGroup, tier 1 the engines waiting on it."""
from __future__ import annotations

import pytest

from supervisor.cluster.blame import Call, Outcome, Verdict, blame, group_error
from supervisor.cluster.errors import Group

OK, RAISED, DIED, PENDING = Outcome.OK, Outcome.RAISED, Outcome.DIED, Outcome.PENDING


@pytest.mark.parametrize("calls, verdict", [
    pytest.param([Call(OK), Call(OK)], None, id="all-answered"),
    pytest.param([Call(RAISED, order=1), Call(DIED, order=2), Call(PENDING)], Verdict(DIED, (1,), False),
                 id="one-raises-one-dies-one-times-out:-the-dead"),
    pytest.param([Call(PENDING), Call(RAISED, order=1)], Verdict(RAISED, (1,), False),
                 id="one-raises-its-peer-stuck-in-the-collective:-the-raiser"),
    pytest.param([Call(RAISED, order=2), Call(RAISED, order=1), Call(OK)], Verdict(RAISED, (1, 0), True),
                 id="two-raise:-the-first-first,-settled"),
    pytest.param([Call(PENDING), Call(PENDING), Call(OK)], Verdict(PENDING, (0, 1), False),
                 id="no-answer:-hung"),
    pytest.param([Call(DIED, order=3), Call(DIED, tier=1, order=1)], Verdict(DIED, (0,), False),
                 id="deaths-in-both-tiers:-the-earlier-tier"),
    pytest.param([Call(PENDING), Call(OK), Call(RAISED, tier=1, order=1)], Verdict(PENDING, (0,), False),
                 id="a-rank-hangs,-the-engine-gives-up:-the-rank"),
    pytest.param([Call(RAISED, order=2), Call(RAISED, order=3), Call(RAISED, tier=1, order=1)],
                 Verdict(RAISED, (0, 1), True), id="ranks-and-engine-raise:-the-ranks,-even-if-later"),
    pytest.param([Call(OK), Call(OK), Call(PENDING, tier=1), Call(RAISED, tier=1, order=1)],
                 Verdict(RAISED, (3,), False), id="trainers-done,-one-engine-raises,-one-hangs:-the-raiser"),
    pytest.param([Call(OK), Call(PENDING, tier=1)], Verdict(PENDING, (1,), False), id="an-engine-hangs"),
])
def test_the_precedence(calls, verdict):
    assert blame(calls) == verdict


def test_a_hang_is_raised_as_a_timeout_naming_every_hung_actor_and_the_first_ones_node():
    from types import SimpleNamespace

    from ray.exceptions import GetTimeoutError

    members = [SimpleNamespace(name=f"TrainWorker[rank {r}]", node_id=f"n{r}") for r in range(3)]
    error = group_error(Verdict(PENDING, (1, 2), False), Group.TRAIN, {}, members, 30.0)
    assert isinstance(error.error, GetTimeoutError) and "30s" in str(error.error)
    assert error.actors == ("TrainWorker[rank 1]", "TrainWorker[rank 2]") and error.node == "n1"
    assert not error.node_lost  # a hang is not a death, whatever Ray says of the node


@pytest.mark.parametrize("dead, lost", [({"n1"}, True), ({"n0"}, False), (set(), False)])
def test_a_death_says_whether_ray_has_the_culprits_node_dead(monkeypatch, dead, lost):
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    from supervisor.cluster import blame as module

    monkeypatch.setattr(module, "dead_nodes", lambda: dead)
    members = [SimpleNamespace(name=f"TrainWorker[rank {r}]", node_id=f"n{r}") for r in range(2)]
    error = group_error(Verdict(DIED, (1,), False), Group.TRAIN, {1: ActorDiedError()}, members, 1.0)
    assert (error.node, error.node_lost) == ("n1", lost)
    monkeypatch.setattr(module, "dead_nodes", lambda: {"n1"})
    assert not group_error(Verdict(PENDING, (1,), False), Group.TRAIN, {}, members, 1.0).node_lost


def test_dead_nodes_without_ray_is_empty():
    from supervisor.cluster.blame import dead_nodes

    assert dead_nodes() == set()
