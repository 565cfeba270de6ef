"""The recovery clock stops at the completion of the step that was in flight, never at a replayed one."""
import pytest

from supervisor.control import repair_clock
from supervisor.control.repair_clock import RepairClock, recovery_line, steady_steps


@pytest.fixture
def now(monkeypatch):
    t = [1000.0]
    monkeypatch.setattr(repair_clock.time, "time", lambda: t[0])
    return t


def test_the_clock_runs_through_replayed_steps_to_the_step_in_flight(now):
    clock = RepairClock()
    clock.start("worker_died", "restart_train_group", detection=0.5, in_flight=7)
    clock.start("hang", "restart_train_group", detection=9.0, in_flight=9)  # a second fault adds to the repair
    clock.add("load", 2.0)
    clock.disk_because("rank 1 had no buddy holding its state")
    clock.loaded(5, "disk")
    now[0] += 4.0
    clock.resumed()
    now[0] += 8.0
    assert clock.completed(6, [8.0]) is None and clock.running  # step 6 was replayed: the clock runs on
    now[0] += 9.0
    rec = clock.completed(7, [8.0, 8.0, 10.0])
    assert not clock.running
    assert rec["global_step"] == 7 and rec["loaded_step"] == 5 and rec["source"] == "disk"
    assert rec["replayed_steps"] == 1 and rec["cause"] == "worker_died"
    assert rec["reason"] == "rank 1 had no buddy holding its state"  # from disk: why not from memory
    assert rec["total"] == 21.5 and rec["replay"] == 8.0 and rec["redo"] == 9.0 and rec["load"] == 2.0
    assert rec["steady_step"] == 8.0 and rec["lost"] == 13.5
    line = recovery_line(rec)
    assert "step 7 completed 21.5s after the fault (13.5s lost beyond a 8.0s step)" in line
    assert "loaded step 5 from disk, 1 step trained again" in line


def test_a_fault_while_steps_are_replayed_keeps_the_replay_done_and_no_part_is_negative(now):
    """Seen in a hang job: a rank hung while the repair replayed steps, and the engines broke in that repair's
    resync; the replay done before the second fault stays `replay`, the second repair's time goes to its parts."""
    clock = RepairClock()
    clock.start("hang", "restart_train_group", detection=10.0, in_flight=9)
    clock.loaded(6, "disk")
    now[0] += 3.0
    clock.resumed()
    now[0] += 2.0
    assert clock.completed(7, []) is None  # replayed
    now[0] += 1.0
    clock.start("collective_failed", "restart_engines", detection=1.0, in_flight=8)  # the same repair
    clock.add("teardown", 25.0)
    now[0] += 25.0
    clock.resumed()
    now[0] += 2.0
    assert clock.completed(8, []) is None  # replayed, after the second repair
    now[0] += 4.0
    rec = clock.completed(9, [1.0])
    assert rec["replay"] == 2.0 + 2.0 and rec["redo"] == 4.0 and rec["teardown"] == 25.0
    assert min(v for v in rec.values() if isinstance(v, float)) >= 0
    assert rec["total"] == 37.0 + 10.0


def test_a_repair_extended_by_later_faults_reports_its_deepest_rollback(now):
    """Seen in a SIGKILL job with the memory tier: a restarted Supervisor replayed from disk, a rank died during the
    replay and was repaired from memory; the event said "memory, 0 steps trained again" for four trained again."""
    clock = RepairClock()
    clock.start("supervisor_died", "restart_train_group", detection=1.0, in_flight=19)
    clock.disk_because("the Supervisor restarted: the state it kept in memory is gone")
    clock.loaded(14, "disk")
    clock.resumed()
    assert clock.completed(17, []) is None
    clock.start("worker_died", "restart_train_group", detection=0.1, in_flight=18)  # the same repair
    clock.loaded(17, "memory")
    clock.resumed()
    rec = clock.completed(19, [1.0])
    assert (rec["cause"], rec["source"], rec["loaded_step"], rec["replayed_steps"]) == \
        ("supervisor_died", "disk", 14, 4)
    assert rec["reason"] == "the Supervisor restarted: the state it kept in memory is gone"
    # the other way round: training went on from memory, and a later fault sent it further back, to disk
    clock.start("worker_died", "restart_train_group", detection=0.1, in_flight=30)
    clock.loaded(29, "memory")
    clock.resumed()
    clock.start("hang", "restart_train_group", detection=0.1, in_flight=30)
    clock.disk_because("rank 1 had no buddy holding its state")
    clock.loaded(24, "disk")
    clock.resumed()
    rec = clock.completed(30, [1.0])
    assert (rec["source"], rec["loaded_step"], rec["replayed_steps"]) == ("disk", 24, 5)
    assert rec["reason"] == "rank 1 had no buddy holding its state"


def test_a_load_that_training_never_went_on_from_is_replaced_by_the_next(now):
    """A repair from memory whose resync failed loads from disk instead, possibly a newer step than the copy: the
    event is the disk load's (the `loaded` events say so too)."""
    clock = RepairClock()
    clock.start("worker_died", "restart_train_group", detection=0.1, in_flight=8)
    clock.loaded(6, "memory")
    clock.disk_because("recovery from memory failed: RestoredWeightsDiffer: ...")
    clock.loaded(7, "disk")
    clock.resumed()
    rec = clock.completed(8, [1.0])
    assert (rec["source"], rec["loaded_step"], rec["replayed_steps"]) == ("disk", 7, 0)
    assert rec["reason"] == "recovery from memory failed: RestoredWeightsDiffer: ..."


def test_an_engine_repair_rolls_nothing_back_and_a_first_step_has_no_steady_step(now):
    clock = RepairClock()
    clock.start("worker_died", "restart_engines", detection=None, in_flight=0)
    now[0] += 3.0
    rec = clock.completed(0, [])
    assert rec["loaded_step"] is None and rec["replayed_steps"] == 0 and rec["source"] == "none"
    assert rec["reason"] is None
    assert rec["steady_step"] is None and rec["lost"] is None and rec["redo"] == 3.0
    assert "nothing rolled back" in recovery_line(rec)
    assert clock.completed(1, [1.0]) is None  # no repair in progress


def test_steady_steps_leave_out_a_group_s_first_step_and_steps_after_the_finish():
    rows = [{"global_step": 0, "time/step": 5.0}, {"global_step": 1, "time/step": 1.0, "time/between_steps": 0.5},
            {"global_step": 2, "time/step": 2.0, "time/between_steps": 0.5}]
    assert steady_steps(rows, before=2) == [1.5]
