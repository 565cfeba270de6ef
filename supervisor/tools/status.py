"""What `relaunch status` reports, read from disk (and from the live Supervisor when reachable)."""
from __future__ import annotations

import enum
import time
from collections import Counter

from supervisor.checkpoint.layout import STEP_INFO, TrialLayout
from supervisor.checkpoint.store import CheckpointError, RecoverStore
from supervisor.checkpoint.trial_lock import TrialLocked, trial_lock
from supervisor.config import Config
from supervisor.control.events import ENDED, Event
from supervisor.control.log_mirror import read_log
from supervisor.control.repair_clock import recovery_line


class TrialState(str, enum.Enum):
    """What `status` says of a trial: how its latest job ended, or why it has not."""
    DONE = Event.DONE.value
    GAVE_UP = Event.GAVE_UP.value
    FAILED = Event.FAILED.value
    INTERRUPTED = Event.INTERRUPTED.value
    RUNNING = "running"      # a live run holds the trial's lock
    STOPPED = "stopped"      # started, never ended, no run holds the lock: its driver was killed or its machine died
    NEVER_RUN = "never run"  # no job of this trial under this fileroot (a misspelled name?): status exits 2


def state_of(job: str | None, ended: Event | None, locked: bool) -> TrialState:
    """Pure: a live lock means running (also before the new run's first event); else how the latest job ended."""
    if locked:
        return TrialState.RUNNING
    if ended is not None:
        return TrialState(ended.value)
    return TrialState.STOPPED if job else TrialState.NEVER_RUN


def _locked(layout: TrialLayout) -> bool:
    try:
        return trial_lock(layout).live_holder() is not None
    except (TrialLocked, OSError):  # a file that is not a lock, a store that does not answer: say nothing here
        return False


def trial_status(config: Config, n_events: int = 10) -> dict:
    layout = TrialLayout.from_config(config)
    store = RecoverStore(layout, config.recover.keep_last)
    last_valid, error = None, None
    try:
        ckpt = store.load_latest().checkpoint
        if ckpt is not None:
            s = ckpt.infos[STEP_INFO]
            last_valid = {"global_step": ckpt.global_step, "epoch": s["epoch"], "epoch_step": s["epoch_step"],
                          "path": str(ckpt.path)}
    except CheckpointError as e:
        error = str(e)
    events = read_log(layout, layout.events_log.name)
    job = next((e.get("job") for e in reversed(events) if e["event"] == Event.START), None)
    this_job = [e for e in events if e.get("job") == job] if job else []
    stats = read_log(layout, layout.stats_log.name)
    ended = next((Event(e["event"]) for e in reversed(this_job) if e["event"] in ENDED), None)
    return {
        "experiment_name": config.experiment_name,
        "trial_name": config.trial_name,
        "checkpoint_root": str(layout.checkpoint_root),
        "last_valid": last_valid,
        "checkpoint_error": error,
        "restarts": sum(e["event"] == Event.RESTART for e in this_job),
        "job": job,
        "state": state_of(job, ended, _locked(layout)),
        "last_step": stats[-1] if stats else None,
        "last_recovery": next((e for e in reversed(events) if e["event"] == Event.RECOVERY), None),
        "recover_interval": next((e for e in reversed(this_job) if e["event"] == Event.RECOVER_INTERVAL), None),
        "buddies": _buddies(this_job),
        "events": events[-n_events:],
        "live": None,
        "memory": peak_memory_of(stats),
        **({"critic_buddies": _buddies(this_job, "critic")} if config.critic is not None else {}),
    }


def _buddies(events: list[dict], group: str | None = None) -> dict | None:
    """The memory tier's last links of a group's ranks (the actor's: events without a group), or None."""
    return next((e["nodes"] for e in reversed(events) if e["event"] == Event.BUDDIES and e.get("group") == group),
                None)


KINDS = ("train", "engine", "spare", "supervisor")  # the order status lists them in


def peak_memory_of(stats: list[dict]) -> dict[str, float]:
    """Each actor kind's peak memory over the trial's steps (GB), from the `mem/` fields of its stats rows:
    {"train": 3.1, "engine": 2.0, ...}, plus `{kind}_cuda` where CUDA was used."""
    peaks: dict[str, float] = {}
    for row in stats:
        for key, value in row.items():
            if key.startswith("mem/") and key.endswith("_peak_gb"):
                kind = key[len("mem/"):-len("_peak_gb")]
                peaks[kind] = max(peaks.get(kind, 0.0), value)
    order = [*KINDS, *(f"{k}_cuda" for k in KINDS)]
    return dict(sorted(peaks.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def format_status(st: dict) -> str:
    lines = [f"trial      {st['experiment_name']}/{st['trial_name']}  ({st['checkpoint_root']})"]
    live = st["live"]
    if live:
        lines.append(f"live       {live['phase']}, step {live['global_step'] + 1}/{live['total_steps']}, "
                     f"weights version {live['weights_version']}, restarts {live['restarts']}")
        for role in ("train", "rollout"):
            per_node = Counter(live[f"{role}_nodes"])
            lines.append(f"  {role:<8} " + ", ".join(f"{n} on node {node[:8]}" for node, n in per_node.items()))
    else:
        why = f"; not live: {st['live_error']}" if st.get("live_error") else ""
        lines.append(f"state      {TrialState(st['state']).value} (from disk{why})")
    lv = st["last_valid"]
    lines.append("last valid " + (f"global step {lv['global_step']} (epoch {lv['epoch']} step {lv['epoch_step']}) "
                                  f"{lv['path']}" if lv else "none") +
                 (f"  [{st['checkpoint_error']}]" if st["checkpoint_error"] else ""))
    lines.append(f"restarts   {st['restarts']}")
    rec = st.get("last_recovery")
    if rec:
        lines.append(f"recovery   {recovery_line(rec)}")
    ri = st.get("recover_interval")
    if ri:
        cost = f"{ri['save_cost_secs']:.3f}s" if ri["save_cost_secs"] is not None else "not measured yet"
        lines.append(f"interval   recover save every {ri['secs']:.1f}s (auto: save stall {cost}, "
                     f"MTBF {ri['mtbf_secs']:.0f}s after {ri['failures']} failures)")
    def held(nodes: dict) -> str:
        return ", ".join(f"rank {rank} on node {node[:8]}" for rank, node in sorted(nodes.items())) or "none"

    if st.get("buddies") is not None:
        lines.append(f"buddies    {held(st['buddies'])} (the memory tier: where each rank's copies were last linked)")
    if st.get("critic_buddies") is not None:
        lines.append(f"           the critic's: {held(st['critic_buddies'])}")
    if st.get("memory"):
        lines.append("memory     peak " + ", ".join(f"{kind} {gb:.2f} GB" for kind, gb in st["memory"].items()))
    if st["last_step"]:
        ls = st["last_step"]
        lines.append(f"last step  {ls['global_step']}: reward {ls['reward']:.3f} loss {ls['loss']:.4f}")
    lines.append("events:")
    for e in st["events"]:
        extra = " ".join(f"{k}={_brief(v)}" for k, v in e.items() if k not in ("event", "time", "job", "attempt"))
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['event']:<17} {extra}")
    return "\n".join(lines)


def _brief(value) -> str:
    """Node ids shortened to 8 characters, paths to their last two parts."""
    if isinstance(value, list):
        return "[" + ",".join(_brief(v) for v in value) + "]"
    if isinstance(value, str) and len(value) == 56 and all(c in "0123456789abcdef" for c in value):
        return value[:8]
    if isinstance(value, str) and value.startswith("/"):
        return "/".join(value.split("/")[-2:])
    return str(value)


def live_progress(config: Config, address: str | None) -> tuple[dict | None, str | None]:
    """The running Supervisor's own answer when a cluster address is known, else why not."""
    if not address:
        return None, None
    import ray

    from supervisor.control.actor import NAMESPACE, supervisor_name

    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        actor = ray.get_actor(supervisor_name(config), namespace=NAMESPACE)
        return ray.get(actor.progress.remote(), timeout=10), None
    except Exception as e:  # noqa: BLE001 - unreachable cluster or no live run: fall back to disk
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    finally:
        ray.shutdown()
