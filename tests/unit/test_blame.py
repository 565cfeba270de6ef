"""One blame rule for every gather (supervisor/cluster/blame.py): who is at fault when calls made together end
in different ways. Tier 0 is the TrainGroup, tier 1 the engines waiting on it."""
from __future__ import annotations

import pytest

from supervisor.cluster.blame import Call, Outcome, Verdict, blame, group_error
from supervisor.cluster.errors import Group

OK, RAISED, DIED, PENDING, GAVE_UP = Outcome.OK, Outcome.RAISED, Outcome.DIED, Outcome.PENDING, Outcome.GAVE_UP


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
    # seen in a hang job: engine 0 SIGSTOPped in a sync, the sender held up, engine 1's receive timed out
    pytest.param([Call(OK), Call(PENDING, tier=1), Call(GAVE_UP, tier=1, order=1)], Verdict(PENDING, (1,), False),
                 id="an-engine-stopped,-the-other-times-out-waiting:-the-stopped-one"),
    pytest.param([Call(OK), Call(GAVE_UP, tier=1, order=2), Call(RAISED, tier=1, order=3)],
                 Verdict(RAISED, (2,), True), id="one-engine-raises,-one-times-out:-the-raiser"),
    pytest.param([Call(OK), Call(GAVE_UP, tier=1, order=2), Call(GAVE_UP, tier=1, order=1)],
                 Verdict(RAISED, (2, 1), True), id="all-time-out,-nobody-else-failed:-those-that-timed-out"),
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


def test_a_receive_that_waited_its_whole_timeout_gave_up_and_one_that_broke_raised():
    """An engine's receive (workers/weight_sync.py: received) says which: the blame leans on it."""
    import datetime

    from ray.exceptions import RayTaskError

    from supervisor.cluster.blame import outcome_of
    from workers.errors import TransferTimedOut, WeightSyncError
    from workers.weight_sync import received

    class Work:
        def __init__(self, secs):
            self.secs = secs

        def wait(self, timeout):
            import time
            time.sleep(self.secs)
            raise RuntimeError("Timed out waiting 200ms for recv operation to complete")

    timeout = datetime.timedelta(seconds=0.2)
    for secs, kind in ((0.2, TransferTimedOut), (0.0, WeightSyncError)):
        with pytest.raises(WeightSyncError) as e:
            received(Work(secs), timeout)
        assert type(e.value) is kind
        as_ray = RayTaskError("engine.update", "traceback", e.value)
        assert outcome_of(as_ray) is (GAVE_UP if kind is TransferTimedOut else RAISED)
