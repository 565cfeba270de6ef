"""The driver's watchdog: a hung Supervisor is one whose controller stopped moving, or that stopped answering
while Ray has it running; a Supervisor Ray is restarting is not hung."""
from supervisor.config import load_config
from supervisor.control.watchdog import MIN_UNANSWERED_SECS, WAIT_SLACK_SECS, Waits, Watchdog, stall_bound


def answer(since: float) -> dict:
    return {"since_transition_secs": since, "waits": []}


def test_a_frozen_supervisor_is_hung_once_unanswered_for_the_step_timeout():
    w = Watchdog.from_config(load_config(None, ["recover.step_timeout_secs=45", "recover.start_timeout_secs=50"]),
                             now=0)
    assert w.verdict(1, answer(1), alive=True) is None
    assert w.verdict(40, None, alive=True) is None
    assert "not answered for 46s" in w.verdict(47, None, alive=True)
    w.restarted(47)
    assert w.verdict(140, None, alive=True) is None  # the new Supervisor is starting: the start-up bound
    assert "not answered for 101s" in w.verdict(148, None, alive=True)


def test_a_supervisor_restarted_by_ray_gets_the_start_up_bound_until_it_answers():
    w = Watchdog(unanswered_secs=30, stalled_secs=1000, start_secs=60)
    assert w.verdict(0, answer(1), alive=True) is None
    assert w.verdict(10, None, alive=False) is None   # Ray restarts it (it was SIGKILLed)
    assert w.verdict(65, None, alive=True) is None    # alive again, still starting
    assert w.verdict(71, None, alive=True) is not None


def test_the_unanswered_bound_has_a_floor_for_loaded_machines():
    assert Watchdog.from_config(load_config(None, ["recover.step_timeout_secs=5"]), 0).unanswered_secs == \
        MIN_UNANSWERED_SECS


def test_a_supervisor_that_ray_is_restarting_is_not_hung():
    w = Watchdog(unanswered_secs=30, stalled_secs=1000, start_secs=30)
    assert w.verdict(100, None, alive=False) is None  # dead or restarting: Ray's own restart
    assert w.verdict(125, None, alive=True) is None   # alive again, the bound counts from there
    assert w.verdict(131, None, alive=True) is not None


def test_a_supervisor_that_answers_but_whose_controller_stopped_is_hung():
    config = load_config(None, [])
    w = Watchdog.from_config(config, now=0)
    bound = stall_bound(config)
    assert w.verdict(10, answer(bound - 1), alive=True) is None
    assert "no transition for" in w.verdict(11, answer(bound + 1), alive=True)


def test_the_stall_bound_covers_every_bounded_wait_of_one_transition():
    config = load_config(None, ["reward.timeout_secs=5000"])
    r = config.recover
    assert stall_bound(config) > r.capacity_timeout_secs + 2 * r.start_timeout_secs + r.write_timeout_secs + \
        4 * r.step_timeout_secs + config.reward.timeout_secs


def test_a_controller_blocked_in_one_wait_is_hung_once_that_wait_passes_its_own_bound():
    """A commit's fsync on a hung mount: progress() answers from another thread and the last transition is
    recent enough for the stall bound (hours), but the commit, bounded by recover.step_timeout_secs, is over."""
    config = load_config(None, ["recover.step_timeout_secs=60"])
    w = Watchdog.from_config(config, now=0)
    clock = [0.0]
    waits = Waits(clock=lambda: clock[0])
    with waits.on("the commit of step 9", config.recover.step_timeout_secs):
        clock[0] = 60 + WAIT_SLACK_SECS
        assert w.verdict(clock[0], {"since_transition_secs": clock[0], "waits": waits.report()}, alive=True) is None
        clock[0] += 1
        hung = w.verdict(clock[0], {"since_transition_secs": clock[0], "waits": waits.report()}, alive=True)
    assert hung == f"its controller has waited {60 + WAIT_SLACK_SECS + 1:.0f}s on the commit of step 9, bounded by 60s"
    assert clock[0] < stall_bound(config) / 10  # long before the stall bound would have said so


def test_only_open_waits_are_judged_each_by_its_own_bound():
    clock = [0.0]
    waits = Waits(clock=lambda: clock[0])
    with waits.on("the validation of the last checkpoint", 3600):
        with waits.on("the commit of step 4", 5):
            clock[0] = 4
        assert [x["what"] for x in waits.report()] == ["the validation of the last checkpoint"]
        clock[0] = 3000  # far past the closed commit's bound, within the open validation's
        w = Watchdog(unanswered_secs=30, stalled_secs=10_000, start_secs=60)
        assert w.verdict(clock[0], {"since_transition_secs": 3000, "waits": waits.report()}, alive=True) is None
    assert waits.report() == []


def test_the_supervisors_log_appends_are_reported_while_they_block(tmp_path, monkeypatch):
    """events.jsonl and stats.jsonl are fsynced on every row: on a hung mount that is where the controller
    blocks, and progress() must name it."""
    import supervisor.control.events as events_module
    from supervisor.control.events import Event, EventLog, StatsLog

    waits = Waits()
    guard = lambda: waits.on("an append to the run's logs", 5)  # noqa: E731 - as the Supervisor actor builds it
    seen = []
    monkeypatch.setattr(events_module.os, "fsync", lambda fd: seen.append([w["what"] for w in waits.report()]))
    EventLog(tmp_path / "events.jsonl", guard=guard).emit(Event.START)
    StatsLog(tmp_path / "stats.jsonl", guard=guard).append({"global_step": 0})
    assert seen == [["an append to the run's logs"]] * 2 and waits.report() == []
