"""`relaunch plot`: reward and loss per step, with failures, restarts and checkpoints marked."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from supervisor.checkpoint.layout import TrialLayout  # noqa: E402
from supervisor.control.events import Event, read_jsonl  # noqa: E402


def plot_trial(layout: TrialLayout, out: Path) -> None:
    stats = read_jsonl(layout.stats_log)
    if not stats:
        raise FileNotFoundError(f"{layout.stats_log}: no steps logged yet")
    events = read_jsonl(layout.events_log)
    steps = [r["global_step"] for r in stats]
    fig, (ax_r, ax_l) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    ax_r.plot(steps, [r["reward"] for r in stats], color="tab:blue", label="mean reward (sampled)")
    evals = [(r["global_step"], r["eval/reward"]) for r in stats if "eval/reward" in r]
    if evals:
        ax_r.plot(*zip(*evals), "o-", color="tab:purple", label="eval reward (greedy)")
    ax_l.plot(steps, [r["loss"] for r in stats], color="tab:gray", label="policy loss")
    marks = [(Event.COMMIT, "tab:green", ":", "recover checkpoint"), (Event.EXPORT, "tab:olive", "--", "HF export"),
             (Event.FAILURE, "tab:red", "-", "failure"), (Event.LOADED, "tab:orange", "-.", "restarted from")]
    for name, color, style, label in marks:
        xs = [e["global_step"] for e in events if e["event"] == name and e.get("global_step", -1) >= 0]
        for i, x in enumerate(xs):
            for ax in (ax_r, ax_l):
                ax.axvline(x, color=color, linestyle=style, alpha=0.7, lw=1.2 if name in (Event.FAILURE, Event.LOADED) else 0.8,
                           label=label if ax is ax_r and i == 0 else None)
    for i, (start, end) in enumerate(_replayed(events)):
        for ax in (ax_r, ax_l):
            ax.axvspan(start, end, color="tab:red", alpha=0.08,
                       label="trained again after the restart" if ax is ax_r and i == 0 else None)
    restarts = sum(e["event"] == Event.RESTART for e in events)
    ax_r.set_title(f"{layout.experiment_name}/{layout.trial_name}: {len(stats)} steps, "
                   f"{restarts} restart{'s' if restarts != 1 else ''}")
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.05, 1.05)
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("global step")
    ax_r.legend(loc="lower right", fontsize=8)
    ax_l.legend(loc="upper right", fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _replayed(events: list[dict]) -> list[tuple[int, int]]:
    """(checkpoint step, failed step) for each failure followed by a reload: the steps trained twice."""
    spans = []
    for i, e in enumerate(events):
        if e["event"] == Event.FAILURE:
            loaded = next((x for x in events[i:] if x["event"] == Event.LOADED), None)
            if loaded is not None:
                spans.append((max(loaded["global_step"], 0), e["global_step"]))
    return spans
