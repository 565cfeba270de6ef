"""The run's logs on the bucket. With a URL `cluster.fileroot`, logs/ live on the head node's disk under
`cluster.local_root` (they are appended to, line by line, which an object store cannot do). A user who has only
the bucket still reads them: after every commit and when the run ends, each log file is copied whole (one PUT)
to the place it would have under a local fileroot, `{fileroot}/logs/{user}/{experiment}/{trial}/`, and
`relaunch status` reads that copy where the head's own is not there."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from supervisor.checkpoint.layout import TMP_PREFIX, TrialLayout
from supervisor.checkpoint.storage import storage_for
from supervisor.control.events import ENDED, Event, EventLog, parse_jsonl, read_jsonl


class LogMirror:
    """An EventLog listener: copies the logs in the background after a commit, and before the run's end returns."""

    def __init__(self, layout: TrialLayout, events: EventLog, retry_secs: float):
        self.local, self.remote, self.events = layout.log_root, layout.log_mirror, events
        self.fs = storage_for(self.remote, retry_secs)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="log-mirror")  # one copy at a time, in order
        self._failing = False

    def on_event(self, row: dict) -> None:
        if row["event"] == Event.COMMIT:
            self._copier.submit(self.copy)
        elif row["event"] in ENDED:
            copied = self._copier.submit(self.copy)
            if not self._failing:  # a store that was down at the last copy does not hold the run's end up
                copied.result()

    def copy(self) -> None:
        names = [str(p.relative_to(self.local)) for p in sorted(self.local.rglob("*"))
                 if p.is_file() and not p.name.startswith(TMP_PREFIX)]  # not a file being replaced just now
        try:
            self.fs.upload(self.local, [n for n in names if (self.local / n).exists()], self.remote)
        except OSError as e:  # the store is down: the logs on the head stay whole, the next copy catches up
            if not self._failing:
                self.events.emit(Event.WARNING, message=f"the logs could not be copied to {self.remote}: {e}")
            self._failing = True
        else:
            self._failing = False


def read_log(layout: TrialLayout, name: str) -> list[dict]:
    """The rows of one log (`stats.jsonl`, `events.jsonl`): the head's own, else the bucket's copy."""
    local = layout.log_root / name
    if local.exists() or layout.log_mirror is None:
        return read_jsonl(local)
    fs = storage_for(layout.log_mirror, retry_secs=10)
    remote = layout.log_mirror / name
    return parse_jsonl(fs.read_bytes(remote).decode()) if fs.is_file(remote) else []
