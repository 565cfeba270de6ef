"""recover.freq_secs: auto: the Young/Daly interval, from the trial's events, without Ray."""
import math

import pytest

from supervisor.config import ConfigError, load_config
from supervisor.control.freq import FreqCtl
from supervisor.control.interval import MAX_SECS, MIN_SECS, PRIOR_MTBF_SECS, AutoInterval, daly
from supervisor.control.run_state import RunState
from supervisor.control.step_info import StepInfo


def row(event: str, t: float, **fields) -> dict:
    return {"event": event, "time": t, **fields}


@pytest.mark.parametrize("cost, mtbf", [(1.0, 3600.0), (0.1, 600.0), (30.0, 86400.0)])
def test_daly_is_close_to_young_when_the_save_is_cheap(cost, mtbf):
    young = math.sqrt(2 * cost * mtbf)
    assert abs(daly(cost, mtbf) - young) / young < 0.05


def test_daly_saves_every_mtbf_when_a_save_costs_more_than_two_mtbf():
    assert daly(500.0, 100.0) == 100.0


def test_before_any_save_is_measured_the_interval_is_the_lower_bound():
    a = AutoInterval.from_history([row("start", 0.0)])
    assert a.secs(100.0) == MIN_SECS


def test_before_any_failure_the_prior_mtbf_holds_then_the_time_observed():
    a = AutoInterval.from_history([row("start", 0.0), row("commit", 5.0, secs=2.0)])
    assert a.mtbf(60.0) == PRIOR_MTBF_SECS
    assert a.mtbf(PRIOR_MTBF_SECS * 2) == PRIOR_MTBF_SECS * 2
    assert a.secs(60.0) == pytest.approx(daly(2.0, PRIOR_MTBF_SECS))


def test_failures_that_roll_back_shorten_the_interval_and_others_do_not():
    a = AutoInterval.from_history([row("start", 0.0), row("commit", 1.0, secs=2.0)])
    before = a.secs(600.0)
    a.observe(row("failure", 300.0, group="rollout"))  # an engine fault loses no training
    assert a.secs(600.0) == before
    a.observe(row("failure", 400.0, group="train"))
    a.observe(row("failure", 500.0, group="supervisor"))
    assert a.mtbf(600.0) == 300.0
    assert a.secs(600.0) == pytest.approx(daly(2.0, 300.0)) and a.secs(600.0) < before


def test_the_stall_of_an_async_save_is_its_cost_and_recent_saves_count():
    a = AutoInterval.from_history([row("start", 0.0)] + [row("commit", 1.0, secs=9.0)] * 10)
    assert a.save_cost == 9.0
    a.observe(row("commit", 2.0, secs=9.0, blocked_secs=0.5))
    assert a.save_cost == pytest.approx((4 * 9.0 + 0.5) / 5)  # the last five


@pytest.mark.parametrize("cost, mtbf_secs, expected", [(1e-4, 100.0, MIN_SECS), (600.0, 1e6, MAX_SECS)])
def test_the_interval_is_bounded(cost, mtbf_secs, expected):
    a = AutoInterval.from_history([row("start", 0.0), row("commit", 0.0, secs=cost), row("failure", 0.0, group="train")])
    assert a.secs(mtbf_secs) == expected


def test_update_reports_only_moves_of_more_than_a_few_percent():
    a = AutoInterval.from_history([row("start", 0.0), row("commit", 0.0, secs=1.0)])
    secs, moved = a.update(10.0)
    assert moved and secs == a.secs(10.0)
    assert a.update(20.0) == (secs, False)
    a.observe(row("commit", 21.0, secs=1.02))  # the mean cost moves by 0.4%: the interval by ~0.2%
    assert a.update(22.0)[1] is False
    a.observe(row("failure", 30.0, group="train"))
    assert a.update(60.0)[1] is True


def test_config_accepts_auto_for_recover_only():
    assert load_config(None, ["recover.freq_secs=auto"]).recover.freq_secs == "auto"
    assert load_config(None, ["recover.freq_secs=30"]).recover.freq_secs == 30.0
    for override, key in [("recover.freq_secs=soon", "recover.freq_secs"), ("recover.freq_secs=0", "recover.freq_secs"),
                          ("saver.freq_secs=auto", "saver.freq_secs"), ("evaluator.freq_secs=auto", "evaluator.freq_secs")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert key in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_of_an_auto_run_resumes_without_a_frequency_warning():
    config = load_config(None, ["recover.freq_secs=auto"])
    state = RunState.fresh(config, 12)
    assert state.recover.freq_secs is None and state.recover.configured()["freq_secs"] == "auto"
    state.recover.freq_secs = 42.0  # what the runner set for the last check
    state.step = StepInfo(0, 4, 4, 12)
    infos = state.to_infos({"epoch": 0, "epoch_step": 5})
    assert infos["checkpoint_info.json"]["configured"]["freq_secs"] == "auto"
    _, warnings = RunState.from_infos(infos, config, 12)
    assert warnings == []


def test_a_set_interval_fires_by_time():
    ctl = FreqCtl.from_config(load_config(None, ["recover.freq_secs=auto", "recover.freq_steps=null"]).recover)
    ctl.freq_secs = 2.5
    fired = [g for g in range(6) if ctl.check(False, 1.0)]
    assert fired == [2, 5]


def test_time_between_jobs_is_not_running_time():
    rows = [{"event": "start", "time": 0.0, "job": "a"}, {"event": "done", "time": 100.0, "job": "a"},
            {"event": "start", "time": 1e6, "job": "b"},
            {"event": "failure", "time": 1e6 + 50, "job": "b", "group": "train", "cause": "worker_died"},
            {"event": "failure", "time": 1e6 + 60, "job": "b", "group": "train", "cause": "storage_error"}]
    interval = AutoInterval.from_history(rows)
    assert interval.running_secs(1e6 + 100) == 200.0  # 100 s of job a, 100 s of job b; not the week between
    assert interval.failures == 1 and interval.mtbf(1e6 + 100) == 200.0  # a skipped save rolls nothing back
