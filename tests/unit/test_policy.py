from dataclasses import asdict

import pytest

from supervisor.cluster.errors import Group
from supervisor.config import load_config
from supervisor.control.classify import Fault, FaultKind
from supervisor.control.events import Event
from supervisor.control.policy import Action, RestartPolicy, budget, engines_to_replace


def fault(kind=FaultKind.WORKER_DIED, group=Group.TRAIN, settled=False, in_save=False, node=None, node_lost=False):
    return Fault(kind, "boom", group, ("TrainWorker[rank 1]",), node=node, settled=settled, in_save=in_save,
                 node_lost=node_lost)


@pytest.mark.parametrize("kind, group, action", [
    (FaultKind.WORKER_DIED, Group.TRAIN, Action.RESTART_TRAIN_GROUP),
    (FaultKind.COLLECTIVE_FAILED, Group.TRAIN, Action.RESTART_TRAIN_GROUP),
    (FaultKind.DEVICE_ERROR, Group.TRAIN, Action.RESTART_TRAIN_GROUP),
    (FaultKind.HANG, Group.TRAIN, Action.RESTART_TRAIN_GROUP),
    (FaultKind.SUPERVISOR_DIED, Group.SUPERVISOR, Action.RESTART_TRAIN_GROUP),
    (FaultKind.HANG, Group.ROLLOUT, Action.RESTART_ENGINES),       # a hung engine is replaced alone
    (FaultKind.ENGINE_DIED, Group.ROLLOUT, Action.RESTART_ENGINES),
    (FaultKind.OBJECT_LOST, Group.ROLLOUT, Action.RESTART_ENGINES),
    (FaultKind.STALE_WEIGHTS, Group.ROLLOUT, Action.RESTART_ENGINES),
    (FaultKind.DEVICE_ERROR, Group.ROLLOUT, Action.RESTART_ENGINES),
    (FaultKind.OBJECT_LOST, Group.TRAIN, Action.RESTART_TRAIN_GROUP),  # a rank's argument lost with its node
    (FaultKind.STORAGE_ERROR, Group.TRAIN, Action.RESTART_TRAIN_GROUP),  # outside a save: e.g. while loading
])
def test_faults_are_routed_to_the_smallest_repair(kind, group, action):
    assert RestartPolicy(retries=3).decide(fault(kind, group)).action is action


def test_retries_are_counted_and_then_exhausted():
    p = RestartPolicy(retries=2, backoff_secs=1, max_backoff_secs=30)
    d1, d2, d3 = (p.decide(fault()) for _ in range(3))
    assert (d1.action, d2.action, d3.action) == (Action.RESTART_TRAIN_GROUP,) * 2 + (Action.FAIL,)
    assert "retries exhausted (2/2)" in d3.reason and "worker_died" in d3.reason
    assert p.restarts == 2


def test_the_supervisors_own_restart_spends_the_same_budget():
    p = RestartPolicy(retries=1)
    assert p.decide(fault(FaultKind.SUPERVISOR_DIED, Group.SUPERVISOR)).action is Action.RESTART_TRAIN_GROUP
    last = p.decide(fault(FaultKind.SUPERVISOR_DIED, Group.SUPERVISOR))
    assert last.action is Action.FAIL and "retries exhausted (1/1)" in last.reason


def test_the_first_restart_is_immediate_and_backoff_doubles_within_a_burst_up_to_the_cap():
    p = RestartPolicy(retries=10, backoff_secs=1, max_backoff_secs=5, quiet_secs=60)
    assert [p.decide(fault(), now=t).delay_secs for t in (0, 1, 2, 3, 4, 5)] == [0, 1, 2, 4, 5, 5]


def test_a_fault_after_a_quiet_period_restarts_at_once():
    p = RestartPolicy(retries=10, backoff_secs=1, quiet_secs=60)
    assert [p.decide(fault(), now=t).delay_secs for t in (0, 10, 100, 110)] == [0, 1, 0, 1]
    assert p.restarts == 4  # every restart still counts against the retries


def test_user_errors_fail_fast_without_spending_retries():
    p = RestartPolicy(retries=3)
    d = p.decide(fault(FaultKind.USER_ERROR, Group.SUPERVISOR))
    assert d.action is Action.FAIL and p.restarts == 0


def test_user_errors_can_be_made_restartable_and_replay_the_step():
    p = RestartPolicy(retries=3, retry_user_errors=True)
    assert p.decide(fault(FaultKind.USER_ERROR, Group.SUPERVISOR)).action is Action.REPLAY_STEP
    assert p.restarts == 1


def test_internal_errors_fail_at_once():
    p = RestartPolicy(retries=3)
    d = p.decide(fault(FaultKind.INTERNAL_ERROR))
    assert d.action is Action.FAIL and d.reason.startswith("relaunch internal error") and p.restarts == 0


def test_storage_errors_skip_the_save_or_stop_without_spending_retries():
    skip, stop = RestartPolicy(retries=3), RestartPolicy(retries=3, stop_on_save_error=True)
    assert skip.decide(fault(FaultKind.STORAGE_ERROR, settled=True, in_save=True)).action is Action.SKIP_SAVE
    assert stop.decide(fault(FaultKind.STORAGE_ERROR, settled=True, in_save=True)).action is Action.FAIL
    assert skip.restarts == stop.restarts == 0


def test_a_storage_error_that_left_ranks_stuck_restarts_the_train_group():
    p = RestartPolicy(retries=3)
    assert p.decide(fault(FaultKind.STORAGE_ERROR, settled=False, in_save=True)).action is Action.RESTART_TRAIN_GROUP
    assert p.restarts == 1


def test_zero_retries_fails_at_once():
    assert RestartPolicy(retries=0).decide(fault()).action is Action.FAIL


def test_a_runtime_env_failure_fails_before_the_first_start_and_is_a_counted_restart_after_it():
    p = RestartPolicy(retries=3)
    d = p.decide(fault(FaultKind.RUNTIME_ENV))
    assert d.action is Action.FAIL and "runtime env" in d.reason and p.restarts == 0
    p.started = True
    assert p.decide(fault(FaultKind.RUNTIME_ENV)).action is Action.RESTART_TRAIN_GROUP
    assert p.decide(fault(FaultKind.RUNTIME_ENV, Group.ROLLOUT)).action is Action.RESTART_ENGINES
    assert p.restarts == 2


@pytest.mark.parametrize("kind, replaced", [
    (FaultKind.ENGINE_DIED, True), (FaultKind.HANG, True), (FaultKind.DEVICE_ERROR, True),
    (FaultKind.COLLECTIVE_FAILED, True), (FaultKind.INTERNAL_ERROR, True),
    (FaultKind.OBJECT_LOST, False), (FaultKind.STALE_WEIGHTS, False),  # what it was given, not the engine
])
def test_the_engines_a_rollout_fault_names_are_replaced(kind, replaced):
    f = Fault(kind, "boom", Group.ROLLOUT, ("RolloutWorker[0]",))
    assert engines_to_replace(f) == (("RolloutWorker[0]",) if replaced else ())
    assert engines_to_replace(fault(kind, Group.TRAIN)) == ()


def test_faults_seen_while_repairing_soon_after_the_first_are_one_incident_and_one_retry():
    p = RestartPolicy(retries=3, backoff_secs=1, incident_secs=60)
    first = p.decide(fault(FaultKind.ENGINE_DIED, Group.ROLLOUT), now=100)  # the node's engine is seen first
    assert first.action is Action.RESTART_ENGINES and first.counted and p.restarts == 1
    rank = p.decide(fault(FaultKind.WORKER_DIED), now=103, repairing=True)  # then its rank, while repairing
    assert rank.action is Action.RESTART_TRAIN_GROUP and not rank.counted and rank.delay_secs == 0
    assert p.restarts == 1 and "part of the fault 3s ago" in rank.reason


@pytest.mark.parametrize("now, repairing", [(103, False),   # the repair was done: a new fault
                                            (200, True)])   # a repair failing long after: a crash loop
def test_a_fault_after_the_repair_or_outside_the_window_is_counted(now, repairing):
    p = RestartPolicy(retries=3, incident_secs=60)
    p.decide(fault(FaultKind.ENGINE_DIED, Group.ROLLOUT), now=100)
    d = p.decide(fault(), now=now, repairing=repairing)
    assert d.counted and p.restarts == 2


@pytest.mark.parametrize("node, lost, repairing, counted", [
    ("n1", True, True, False),   # the lost node's rank, seen only after cold engines took minutes to start
    ("n1", False, True, True),   # a process on that node died, the node lives on: a crash loop, not the incident
    ("n2", True, True, True),    # another node lost
    ("n1", True, False, True),   # after the repair was done: a new fault
])
def test_a_death_on_the_incidents_lost_node_is_part_of_it_however_late_the_repair_sees_it(node, lost, repairing,
                                                                                          counted):
    p = RestartPolicy(retries=1, incident_secs=60)
    p.decide(fault(FaultKind.ENGINE_DIED, Group.ROLLOUT, node="n1"), now=100)
    d = p.decide(fault(node=node, node_lost=lost), now=400, repairing=repairing)
    assert d.counted is counted and d.action is (Action.FAIL if counted else Action.RESTART_TRAIN_GROUP)


def test_one_incident_with_no_retry_left_is_still_repaired_but_a_new_one_fails():
    p = RestartPolicy(retries=1, incident_secs=60)
    p.decide(fault(FaultKind.ENGINE_DIED, Group.ROLLOUT), now=0)
    assert p.decide(fault(), now=5, repairing=True).action is Action.RESTART_TRAIN_GROUP
    assert p.decide(fault(), now=90, repairing=True).action is Action.FAIL


def decide_and_log(policy: RestartPolicy, rows: list[dict], f: Fault, now: float, repairing: bool = False):
    """What the controller writes around one decision: the failure row, the decision, a restart or repair row."""
    rows.append({"event": Event.FAILURE.value, "time": now, "cause": f.kind.value, "node": f.node})
    d = policy.decide(f, now=now, repairing=repairing)
    if d.action not in (Action.FAIL, Action.SKIP_SAVE):
        rows.append({"event": (Event.RESTART if d.counted else Event.REPAIR).value, "time": now, "n": policy.restarts})
    return d


# a start, a crash loop of three faults (backoff 0, 1, 2 s), a second part of the last one's incident, a skipped
# save, a quiet period, and one more fault: every field of the policy's memory moves at least once
HISTORY = [(100.0, fault(node="n1"), False), (110.0, fault(node="n2"), False), (111.0, fault(), False),
           (130.0, fault(FaultKind.ENGINE_DIED, Group.ROLLOUT), True),
           (140.0, fault(FaultKind.STORAGE_ERROR, settled=True, in_save=True), False),
           (900.0, fault(), False)]


@pytest.mark.parametrize("cut", range(len(HISTORY) + 1))
def test_a_restarted_supervisors_policy_rebuilt_from_the_events_is_the_policy_it_lost(cut):
    config = load_config(None, ["recover.mode=on", "recover.retries=9", "recover.backoff_secs=1",
                                "recover.quiet_secs=300", "recover.incident_secs=60"])
    live, rows = RestartPolicy.from_config(config), [{"event": Event.LOADED.value, "time": 50.0}]
    live.started = True  # the controller sets it when it first runs; LOADED comes just before
    for now, f, repairing in HISTORY[:cut]:
        decide_and_log(live, rows, f, now, repairing)
    assert asdict(RestartPolicy.from_history(config, rows)) == asdict(live)


def test_a_crash_loop_keeps_its_backoff_across_the_supervisors_restart():
    config = load_config(None, ["recover.mode=on", "recover.retries=9", "recover.backoff_secs=1"])
    live, rows = RestartPolicy.from_config(config), []
    for now in (100.0, 101.0, 102.0):
        decide_and_log(live, rows, fault(), now)
    rebuilt = RestartPolicy.from_history(config, rows)
    # the Supervisor's own death 1 s later is the fourth fault of the loop: 4 s, not an immediate restart
    d = rebuilt.decide(fault(FaultKind.SUPERVISOR_DIED, Group.SUPERVISOR), now=103.0)
    assert (d.delay_secs, rebuilt.restarts, d.reason) == (4.0, 4, "restart 4/9 after supervisor_died")


@pytest.mark.parametrize("mode, retries, spent", [("on", 7, 7), ("auto", 7, 7), ("off", 7, 0), ("disabled", 7, 0)])
def test_one_budget_serves_the_policy_and_the_driver(mode, retries, spent):
    config = load_config(None, [f"recover.mode={mode}", f"recover.retries={retries}"])
    assert budget(config) == RestartPolicy.from_config(config).retries == spent


def test_a_worker_that_cannot_be_built_fails_the_first_start_and_is_a_counted_restart_after_it():
    p = RestartPolicy(retries=3)
    d = p.decide(fault(FaultKind.START_FAILED, Group.ROLLOUT))
    assert d.action is Action.FAIL and p.restarts == 0
    p.started = True
    assert p.decide(fault(FaultKind.START_FAILED, Group.ROLLOUT)).action is Action.RESTART_ENGINES
    assert p.decide(fault(FaultKind.START_FAILED)).action is Action.RESTART_TRAIN_GROUP
    assert p.restarts == 2
