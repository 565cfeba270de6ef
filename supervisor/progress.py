"""What the driver tells the user while a run goes on, and how it ended when interrupted.

The progress bar is drawn from the Supervisor's progress answers; the step a run resumed from is read from its
own `loaded` event, said once in a line of its own, and the bar (and its rate) starts there.
"""
from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

from supervisor.checkpoint.layout import TrialLayout
from supervisor.control.events import Event, EventLog, read_jsonl
from supervisor.control.log_mirror import LogMirror

MIRROR_SECS = 5.0  # how long an interrupted run may spend copying its logs to the bucket: a Ctrl-C wants out


def kept_step(job_events: list[dict]) -> int | None:
    """Pure: the global step of the last checkpoint the job loaded or committed (None: none yet)."""
    kept = next((e["global_step"] for e in reversed(job_events) if e["event"] in (Event.COMMIT, Event.LOADED)),
                None)
    return None if kept is None or kept < 0 else kept


class RunProgress:
    def __init__(self, layout: TrialLayout, job: str):
        self.layout, self.events_log, self.job = layout, layout.events_log, job
        self.loaded: dict | None = None  # this job's first `loaded` event, once it is written
        self.bar = tqdm(desc="relaunch", unit="step", mininterval=1.0, dynamic_ncols=True, file=sys.stderr)

    def job_events(self) -> list[dict]:
        return [e for e in read_jsonl(self.events_log) if e.get("job") == self.job]

    def show(self, p: dict) -> None:
        if self.loaded is None:
            self.loaded = next((e for e in self.job_events() if e["event"] == Event.LOADED), None)
            if self.loaded is not None and self.loaded["global_step"] >= 0:
                self.bar.write(f"relaunch: resumed from global step {self.loaded['global_step']} "
                               f"({self.loaded['path']}); training on from step {self.loaded['global_step'] + 1}",
                               file=sys.stderr)
                self.bar.initial = self.bar.n = self.loaded["global_step"] + 1
                self.bar.start_t = self.bar.last_print_t = time.time()
        self.bar.total = p["total_steps"]
        self.bar.n = max(p["global_step"] + 1, self.bar.initial)
        reward = f"{p['reward']:.3f}" if p["reward"] is not None else "-"
        self.bar.set_postfix(phase=p["phase"], reward=reward, restarts=p["restarts"], refresh=False)
        self.bar.refresh()

    def interrupted(self) -> str:
        """Record the interrupt in events.jsonl (the Supervisor is gone by now) and say what was kept."""
        events = self.job_events()
        step = kept_step(events)
        attempt = max((e.get("attempt", 0) for e in events), default=0)
        log = EventLog(self.events_log, attempt=attempt, job=self.job)
        log.emit(Event.INTERRUPTED, global_step=step)
        if self.layout.log_mirror is not None:  # the bucket's copy of the logs gets it too, if the store answers soon
            copy = threading.Thread(target=LogMirror(self.layout, log, MIRROR_SECS).copy, daemon=True)
            copy.start()
            copy.join(MIRROR_SECS)
        if step is None:
            return "relaunch: interrupted before this run loaded or saved a checkpoint; what was on disk is kept"
        return (f"relaunch: interrupted; the last valid checkpoint (global step {step}) is kept, "
                f"the next run resumes after it")

    def close(self) -> None:
        self.bar.close()
