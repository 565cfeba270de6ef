import pytest

from supervisor.policy import Action, Fault, FaultKind, RestartPolicy


def fault(kind=FaultKind.WORKER_DIED):
    return Fault(kind, "boom", actor="TrainWorker[rank 1]")


@pytest.mark.parametrize("kind, action", [
    (FaultKind.WORKER_DIED, Action.RESTART_TRAIN_GROUP),
    (FaultKind.HANG, Action.RESTART_TRAIN_GROUP),
    (FaultKind.ENGINE_DIED, Action.RESTART_ENGINES),
])
def test_fault_kinds_map_to_the_smallest_restart(kind, action):
    assert RestartPolicy(retries=3).decide(fault(kind)).action is action


def test_retries_are_counted_and_then_exhausted():
    p = RestartPolicy(retries=2, backoff_secs=1, max_backoff_secs=30)
    d1, d2, d3 = (p.decide(fault()) for _ in range(3))
    assert (d1.action, d2.action, d3.action) == (Action.RESTART_TRAIN_GROUP,) * 2 + (Action.FAIL,)
    assert "retries exhausted (2/2)" in d3.reason and "worker_died" in d3.reason
    assert p.restarts == 2


def test_backoff_doubles_up_to_the_cap():
    p = RestartPolicy(retries=10, backoff_secs=1, max_backoff_secs=5)
    assert [p.decide(fault()).delay_secs for _ in range(5)] == [1, 2, 4, 5, 5]


def test_user_errors_fail_fast_without_spending_retries():
    p = RestartPolicy(retries=3)
    d = p.decide(fault(FaultKind.USER_ERROR))
    assert d.action is Action.FAIL and p.restarts == 0


def test_user_errors_can_be_made_restartable():
    p = RestartPolicy(retries=3, retry_user_errors=True)
    assert p.decide(fault(FaultKind.USER_ERROR)).action is Action.RESTART_TRAIN_GROUP


def test_zero_retries_fails_at_once():
    assert RestartPolicy(retries=0).decide(fault()).action is Action.FAIL
