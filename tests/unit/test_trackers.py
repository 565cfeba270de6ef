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


def test_a_marker_for_a_step_already_given_or_of_no_step_goes_to_the_next_step():
    late = [{"event": "failure", "time": 5.0, "global_step": 1, "cause": "storage_error", "group": "train",
             "message": "disk full"},
            {"event": "failure", "time": 6.0, "global_step": None, "cause": "actor_died", "group": "rollout",
             "message": "engine 0 died"}]
    entries, _ = batch(rows(0, 1, 2, 3), late, Mark(step=2), final_step=3)
    assert [(e.step, e.scalars.get("events/failure")) for e in entries] == [(3, 2)]


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


@pytest.fixture
def fresh_wandb():
    """W&B reads its settings from the environment once per process: read them again before and after."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_trackers_follow_a_rollback_a_new_life_and_a_clean_restart(tmp_path, monkeypatch, fresh_wandb):
    """Real TensorBoard and offline W&B, fed through the two logs as the Supervisor feeds them, read back."""
    import sys
    from pathlib import Path

    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.config import Tracker
    from supervisor.control.events import Event, EventLog, StatsLog
    from supervisor.control.trackers import Trackers

    sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
    from tracker_files import tensorboard_rows, wandb_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "logging.trackers=[tensorboard,wandb]"])
    layout = TrialLayout.from_config(config)

    def life() -> tuple[EventLog, StatsLog, Trackers]:
        events, stats, trackers = EventLog(layout.events_log), StatsLog(layout.stats_log), Trackers(config, layout)
        events.listeners.append(trackers.on_event)
        stats.listeners.append(trackers.on_stats)
        return events, stats, trackers

    def step(stats: StatsLog, s: int, reward: float) -> None:
        stats.append({"global_step": s, "reward": reward})

    events, stats, trackers = life()
    events.emit(Event.LOADED, global_step=-1)
    for s in range(4):
        step(stats, s, s / 10)
    events.emit(Event.COMMIT, global_step=1)
    events.emit(Event.FAILURE, global_step=4, cause="actor_died", group="train", message="rank 1 died")
    events.emit(Event.RESTART, n=1, limit=3, what="restart_train")
    stats.truncate_after(1)  # the rollback to the commit at 1: steps 2-3 are trained again
    events.emit(Event.LOADED, global_step=1)
    for s in (2, 3, 4):
        step(stats, s, 1 + s / 10)
    events.emit(Event.COMMIT, global_step=3)
    trackers.sinks[Tracker.WANDB].run.finish()  # the Supervisor dies: W&B's process ends, state.json is not told
    events, stats, trackers = life()  # its new life resumes the same tracker run
    events.emit(Event.LOADED, global_step=3)
    step(stats, 4, 1.4)
    events.emit(Event.DONE, global_step=4)

    expected = {0: 0.0, 1: 0.1, 2: 1.2, 3: 1.3, 4: 1.4}
    board = tensorboard_rows(layout.trackers_dir / "tensorboard")
    assert {s: round(row["reward"], 6) for s, row in board.items()} == expected
    assert {s for s, row in board.items() if "events/failure" in row} == {4}
    runs = wandb_runs(layout.trackers_dir)
    assert len({run_id for run_id, _ in runs}) == 1
    history: dict[int, dict] = {}  # as `wandb sync` leaves the run: a step at or below the last one is dropped
    for _, rows in runs:
        history.update({s: row for s, row in rows.items() if s > max(history, default=-1)})
    assert {s: row["reward"] for s, row in history.items()} == expected

    # clean-restart: the trial trains from scratch, so its trackers start a new generation
    events, stats, trackers = life()
    stats.truncate_after(-1)
    events.emit(Event.LOADED, global_step=-1)
    step(stats, 0, 5.0)
    events.emit(Event.DONE, global_step=0)
    assert {s: round(row["reward"], 6) for s, row in tensorboard_rows(layout.trackers_dir / "tensorboard").items()} \
        == {0: 5.0}
    assert len({run_id for run_id, _ in wandb_runs(layout.trackers_dir)}) == 2


def test_a_tracker_that_cannot_start_is_left_out_with_one_line(tmp_path, monkeypatch, capsys, fresh_wandb):
    """W&B online without an API key (no tty to ask for one): the job trains on, TensorBoard still writes."""
    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.config import Tracker
    from supervisor.control.trackers import Trackers

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no key saved by an earlier login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "logging.trackers=[tensorboard,wandb]"])
    trackers = Trackers(config, TrialLayout.from_config(config))
    assert list(trackers.sinks) == [Tracker.TENSORBOARD]
    assert capsys.readouterr().err.startswith("relaunch: tracker wandb not started: ")
    trackers.close()
