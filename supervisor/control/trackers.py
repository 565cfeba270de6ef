"""Experiment trackers (`logging.trackers`): TensorBoard and Weights & Biases get exactly stats.jsonl's rows.

A rollback rewinds stats.jsonl, but W&B's steps only grow, so a tracker is given a step only once it is final:
covered by a published recover checkpoint (a `commit` event; no rollback goes behind the last one), or the job's
end, or at once when recover is off. Faults, restarts and recoveries go with them as markers, at the step that
was in flight. What each tracker surely holds is recorded in `state.json`, so a restarted Supervisor or a rerun
of the job continues the same tracker run from there: W&B resumes the run whose id comes from the trial (and
is given again what a kill may have kept from its file), TensorBoard appends to the trial's directory and
purges anything written past its record. Only a load behind what they hold (a damaged newest checkpoint passed
over, a clean-restart) starts a new generation: a new W&B run, and TensorBoard purges the steps to be trained
again.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from supervisor.checkpoint.durable import write_atomic
from supervisor.checkpoint.layout import TrialLayout
from supervisor.config import Config, Tracker
from supervisor.control.events import ENDED, Event, read_jsonl

MARKERS = (Event.FAILURE, Event.RESTART, Event.RECOVERY)  # events shown on the trackers' step axis
PACKAGES = {Tracker.TENSORBOARD: "tensorboard", Tracker.WANDB: "wandb"}
WANDB_FLUSH_SECS = 1.0  # how often W&B writes its run file (its x_transaction_log_flush_interval, default 15 s)
WANDB_HELD_SECS = 3 * WANDB_FLUSH_SECS  # a batch given this long ago is in the file
# W&B's settings the driver passes to the Supervisor (WANDB_MODE=offline without internet); never the API key,
# which would show in the job's runtime env: the nodes' own environment or ~/.netrc holds that.
ENV_VARS = ("WANDB_MODE", "WANDB_ENTITY", "WANDB_BASE_URL")


@dataclass(frozen=True)
class Mark:
    """What a tracker holds: every step up to `step`, every marker up to `event_time`."""
    step: int = -1
    event_time: float = 0.0


@dataclass
class Entry:
    """One step as the trackers get it: the stats row's numbers and the markers that belong to the step."""
    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items()
            if k != "global_step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _note(event: dict) -> str:
    kind = Event(event["event"])
    if kind is Event.FAILURE:
        return f"failure: {event.get('cause')} in {event.get('group')}: {event.get('message')}"
    if kind is Event.RESTART:
        return f"restart {event.get('n')} of {event.get('limit')}: {event.get('what')}"
    return f"recovery: {event.get('total')} s ({event.get('cause')}, {event.get('what')})"


def batch(rows: list[dict], events: list[dict], mark: Mark, final_step: int) -> tuple[list[Entry], Mark]:
    """The entries the trackers do not hold yet, up to `final_step`, in step order, and the mark after them.

    A marker sits at the step that was in flight (a failure's `global_step`; a restart or recovery at its
    failure's), never before a step already given (W&B would drop it), and waits while that step is not final."""
    entries = {r["global_step"]: Entry(r["global_step"], _numbers(r))
               for r in rows if mark.step < r["global_step"] <= final_step}
    new_mark, at = mark, mark.step + 1
    for e in sorted((e for e in events if Event(e["event"]) in MARKERS), key=lambda e: e["time"]):
        if e["time"] <= mark.event_time:
            continue
        at = max(at if e.get("global_step") is None else e["global_step"], mark.step + 1)
        if at > final_step:
            break  # this one and every later marker wait for a later batch
        entry = entries.setdefault(at, Entry(at))
        key = f"events/{e['event']}"
        entry.scalars[key] = entry.scalars.get(key, 0) + 1
        entry.notes.append(_note(e))
        new_mark = replace(new_mark, event_time=e["time"])
    if entries:
        new_mark = replace(new_mark, step=max(new_mark.step, max(entries)))
    return [entries[s] for s in sorted(entries)], new_mark


def rewind(mark: Mark, loaded_step: int) -> Mark:
    """The mark after a load of `loaded_step`: lowered to it when the tracker holds later steps (the run went
    back behind them: a new generation)."""
    return mark if loaded_step >= mark.step else Mark(loaded_step, mark.event_time)


def missing_packages(trackers: list[Tracker]) -> list[str]:
    """The packages the configured trackers need that this Python lacks."""
    import importlib.util

    return [PACKAGES[t] for t in trackers if importlib.util.find_spec(PACKAGES[t]) is None]


def run_id(config: Config, generation: int) -> str:
    """The W&B run id of a trial (and of its generation): the same for every Supervisor and rerun."""
    trial = f"{config.cluster.fileroot}/{config.cluster.user}/{config.experiment_name}/{config.trial_name}"
    digest = hashlib.sha256(trial.encode()).hexdigest()[:12]
    return f"{config.trial_name[:40]}-{digest}" + (f"-g{generation}" if generation else "")


class _TensorBoard:
    """Event files written as given: durable at once (flushed), so a new life purges what lies past its mark."""

    def __init__(self, config: Config, directory: Path, mark: Mark, generation: int):
        from torch.utils.tensorboard import SummaryWriter

        self.given = mark
        self.writer = SummaryWriter(str(directory / "tensorboard"), purge_step=mark.step + 1)

    def write(self, entries: list[Entry], given: Mark) -> None:
        for e in entries:
            for key, value in e.scalars.items():
                self.writer.add_scalar(key, value, e.step)
            for note in e.notes:
                self.writer.add_text("events", note, e.step)
        self.writer.flush()
        self.given = given

    def durable(self) -> Mark:
        return self.given

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """W&B's own process writes the run file every WANDB_FLUSH_SECS; a batch is counted as held only once that
    long has surely passed (or the run finished), so a new life gives again whatever a kill may have lost
    (W&B keeps the first of a step given twice: its steps only grow)."""

    def __init__(self, config: Config, directory: Path, mark: Mark, generation: int):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.given, self.held, self.recent = mark, mark, []
        self.run = wandb.init(project=config.experiment_name, name=f"{config.experiment_name}/{config.trial_name}",
                              id=run_id(config, generation), resume="allow", dir=str(directory),
                              config=config.model_dump(mode="json"),
                              settings=wandb.Settings(console="off", silent=True, disable_git=True,
                                                      x_transaction_log_flush_interval=WANDB_FLUSH_SECS))

    def write(self, entries: list[Entry], given: Mark) -> None:
        for e in entries:  # commit: each step's row is sent now, not when a later step comes
            self.run.log({**e.scalars, **({"events/notes": "; ".join(e.notes)} if e.notes else {})}, step=e.step,
                         commit=True)
        self.given = given
        self.recent.append((time.monotonic(), given))

    def durable(self) -> Mark:
        now = time.monotonic()
        while self.recent and self.recent[0][0] <= now - WANDB_HELD_SECS:
            self.held = self.recent.pop(0)[1]
        return self.held

    def close(self) -> None:
        self.run.finish()
        self.held, self.recent = self.given, []


SINKS = {Tracker.TENSORBOARD: _TensorBoard, Tracker.WANDB: _WandB}


def _dropped(tracker: Tracker, what: str, error: Exception) -> None:
    print(f"relaunch: tracker {tracker.value} {what}: {type(error).__name__}: {error}; stats.jsonl has every row",
          file=sys.stderr)


class Trackers:
    """The configured trackers, fed from stats.jsonl and events.jsonl: an EventLog and StatsLog listener.
    state.json holds the trial's tracker generation and, per tracker, the mark of what it surely holds."""

    def __init__(self, config: Config, layout: TrialLayout):
        self.config, self.layout = config, layout
        self.dir = layout.trackers_dir
        self.state_file = self.dir / "state.json"
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.generation = state.get("generation", 0)
        self.marks = {t: Mark(**state.get(t.value, {})) for t in config.logging.trackers}
        self.sinks: dict[Tracker, object] = {}
        self._open()

    def _open(self) -> None:
        for tracker, mark in self.marks.items():
            try:
                self.sinks[tracker] = SINKS[tracker](self.config, self.dir, mark, self.generation)
            except Exception as e:  # noqa: BLE001 - W&B online without a key, say: the job trains on without it
                _dropped(tracker, "not started", e)

    def on_stats(self, row: dict) -> None:
        if not self.config.recover.mode.enabled:  # nothing to roll back to: a row is final once written
            self.flush(row["global_step"])

    def on_event(self, row: dict) -> None:
        kind = Event(row["event"])
        if kind is Event.LOADED:
            self._loaded(row["global_step"])
        if kind in (Event.LOADED, Event.COMMIT, Event.DONE):
            self.flush(row["global_step"])
        if kind in ENDED:
            self.close()

    def _loaded(self, step: int) -> None:
        """A load behind what a tracker holds (a fallback, a clean-restart): a new generation."""
        given = {t: sink.given for t, sink in self.sinks.items()}
        if all(rewind(mark, step) == mark for mark in given.values()):
            return
        self.close()
        self.generation += 1
        self.marks = {t: rewind(mark, step) for t, mark in {**self.marks, **given}.items()}
        self._save()
        self._open()

    def flush(self, final_step: int) -> None:
        """Give every tracker the final steps (and markers) it lacks, then record what each holds."""
        rows, events = read_jsonl(self.layout.stats_log), read_jsonl(self.layout.events_log)
        for tracker, sink in list(self.sinks.items()):
            entries, given = batch(rows, events, sink.given, final_step)
            if not entries:
                continue
            try:
                sink.write(entries, given)
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not fail the training job
                _dropped(tracker, "stopped", e)
                del self.sinks[tracker]
        self.marks.update({t: sink.durable() for t, sink in self.sinks.items()})
        self._save()

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {"generation": self.generation, **{t.value: asdict(m) for t, m in self.marks.items()}}
        write_atomic(self.state_file, json.dumps(state).encode())

    def close(self) -> None:
        """Finish every tracker: all it was given is held."""
        for tracker, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - as in flush: never the training job's failure
                _dropped(tracker, "not finished", e)
            self.marks[tracker] = sink.durable()
        if self.sinks:
            self._save()
        self.sinks = {}
