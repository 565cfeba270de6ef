"""logging.trackers' pure decisions: which steps and markers the trackers get, and when a new run starts."""
import pytest

from supervisor.config import Config, ConfigError, load_config
from supervisor.control.trackers import Mark, batch, rewind, run_id


def rows(*steps: int) -> list[dict]:
    return [{"global_step": s, "reward": s / 10, "loss": -s, "epoch": 0, "note": "text", "flag": True}
            for s in steps]


def test_only_final_steps_are_given_and_each_once():
    entries, mark = batch(rows(0, 1, 2, 3, 4), [], Mark(), final_step=2)
    assert [e.step for e in entries] == [0, 1, 2]
    assert entries[1].scalars == {"reward": 0.1, "loss": -1, "epoch": 0}  # numbers only, no step, no bool
    assert mark == Mark(step=2)
    entries, mark = batch(rows(0, 1, 2, 3, 4), [], mark, final_step=4)
    assert [e.step for e in entries] == [3, 4] and mark.step == 4
    assert batch(rows(0, 1, 2, 3, 4), [], mark, final_step=4) == ([], mark)


def test_a_rolled_back_step_is_given_as_stats_jsonl_holds_it_after_the_rollback():
    """Steps 3-4 ran, a fault rolled back to the commit at 2, stats.jsonl was cut and 3-4 ran again: the
    trackers never saw the first 3-4 (not final), and get the second."""
    first, mark = batch(rows(0, 1, 2, 3, 4), [], Mark(), final_step=2)
    again = [{**r, "reward": 9.0} for r in rows(3, 4)]
    second, mark = batch(rows(0, 1, 2) + again, [], mark, final_step=4)
    assert [(e.step, e.scalars["reward"]) for e in first + second] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 9.0),
                                                                         (4, 9.0)]


def test_markers_sit_at_the_step_in_flight_and_wait_until_it_is_final():
    events = [{"event": "commit", "time": 1.0, "global_step": 1},
              {"event": "failure", "time": 2.0, "global_step": 3, "cause": "actor_died", "group": "train",
               "message": "rank 1 died"},
              {"event": "restart", "time": 3.0, "n": 1, "limit": 3, "what": "restart_train"},
              {"event": "recovery", "time": 4.0, "total": 5.5, "cause": "actor_died", "what": "restart_train"}]
    entries, mark = batch(rows(0, 1, 2), events, Mark(), final_step=2)
    assert all(not e.notes for e in entries) and mark == Mark(step=2)  # step 3 is not final yet
    entries, mark = batch(rows(0, 1, 2, 3), events, mark, final_step=3)
    assert [e.step for e in entries] == [3]
    assert entries[0].scalars["events/failure"] == 1 and entries[0].scalars["events/restart"] == 1
    assert entries[0].notes == ["failure: actor_died in train: rank 1 died", "restart 1 of 3: restart_train",
                                "recovery: 5.5 s (actor_died, restart_train)"]
    assert mark == Mark(step=3, event_time=4.0)


def test_a_marker_for_a_step_already_given_moves_to_the_next_step():
    late = [{"event": "failure", "time": 5.0, "global_step": 1, "cause": "storage_error", "group": "train",
             "message": "disk full"}]
    entries, _ = batch(rows(0, 1, 2, 3), late, Mark(step=2), final_step=3)
    assert [(e.step, e.scalars.get("events/failure")) for e in entries] == [(3, 1)]


@pytest.mark.parametrize("loaded, expected", [
    (9, Mark(step=9, event_time=7.0)),    # the tracker holds 9 already: same run
    (12, Mark(step=9, event_time=7.0)),   # a later load: same run
    (4, Mark(step=4, event_time=7.0)),    # behind what it holds (a fallback): lowered, a new generation
    (-1, Mark(step=-1, event_time=7.0)),  # a fresh start after clean-restart
])
def test_rewind_lowers_the_mark_only_behind_it(loaded, expected):
    assert rewind(Mark(step=9, event_time=7.0), loaded) == expected


def test_the_wandb_run_id_is_the_trials_and_its_generations():
    a, b = Config(trial_name="t1"), Config(trial_name="t2")
    assert run_id(a, 0) == run_id(Config(trial_name="t1"), 0) != run_id(b, 0)
    assert run_id(a, 1) == run_id(a, 0) + "-g1"


def test_an_unknown_tracker_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, ["logging.trackers=[tensorboard,mlflow]"])
    assert [t.value for t in load_config(None, ["logging.trackers=[tensorboard,wandb]"]).logging.trackers] == [
        "tensorboard", "wandb"]


def test_a_tracker_whose_package_is_missing_is_named(monkeypatch):
    import importlib.util

    from supervisor.config import Tracker
    from supervisor.control.trackers import missing_packages

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert missing_packages([Tracker.TENSORBOARD, Tracker.WANDB]) == ["wandb"]
    assert missing_packages([]) == []
