"""The run's logs: a torn last line (a crash mid-write) never swallows the next row."""
from supervisor.control.events import Event, EventLog, StatsLog, read_jsonl


def test_a_torn_last_event_is_dropped_before_the_next_is_appended(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", job="j")
    log.emit(Event.START)
    with open(log.path, "a") as f:
        f.write('{"event": "restart", "n": 1, "ti')  # the previous Supervisor died mid-write
    log.emit(Event.RESTART, n=1)
    log.emit(Event.DONE)
    assert [e["event"] for e in read_jsonl(log.path)] == ["start", "restart", "done"]


def test_a_torn_only_line_is_dropped_too(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text('{"global_step": 0, "rew')
    StatsLog(path).append({"global_step": 0})
    assert read_jsonl(path) == [{"global_step": 0}]
