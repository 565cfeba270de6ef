"""Frequency control for the Saver, the RecoverHandler and the Evaluator: pure, no clocks of its own.

Fires when any of its epoch/step/time conditions is met. Each condition keeps its own counter and resets
only itself, so "every 5 steps and every epoch" saves at steps 4, 9, 14, ... and at every epoch's end,
an epoch save does not shift the step schedule. Its saved state holds only counters and the
time since it last fired, never the frequencies: the config in force wins over a checkpoint's (AReaL
stored the frequencies, so changing freq_steps before a resume had no effect). With `recover.freq_secs: auto`
the runner sets `freq_secs` before every check (supervisor/control/interval.py); the configured value stays "auto".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from supervisor.config import AUTO


@dataclass
class FreqCtl:
    freq_epochs: Optional[int] = None
    freq_steps: Optional[int] = None
    freq_secs: Optional[float] = None
    epochs_since: int = 0
    steps_since: int = 0
    secs_since: float = 0.0
    secs_auto: bool = False  # freq_secs is set from outside before each check

    @classmethod
    def from_config(cls, freq) -> "FreqCtl":
        return cls(freq.freq_epochs, freq.freq_steps, freq.fixed_secs, secs_auto=freq.secs_auto)

    def configured(self) -> dict:
        """The frequencies as configured (recorded in checkpoints, compared on resume)."""
        return {"freq_epochs": self.freq_epochs, "freq_steps": self.freq_steps,
                "freq_secs": AUTO if self.secs_auto else self.freq_secs}

    def check(self, epoch_end: bool, elapsed_secs: float) -> bool:
        """Account one completed step (that took `elapsed_secs`); True when a condition fires."""
        self.steps_since += 1
        self.epochs_since += int(epoch_end)
        self.secs_since += elapsed_secs
        by_steps = self.freq_steps is not None and self.steps_since >= self.freq_steps
        by_epochs = self.freq_epochs is not None and epoch_end and self.epochs_since >= self.freq_epochs
        by_secs = self.freq_secs is not None and self.secs_since >= self.freq_secs
        if by_steps:
            self.steps_since = 0
        if by_epochs:
            self.epochs_since = 0
        if by_secs:
            self.secs_since = 0.0
        return by_steps or by_epochs or by_secs

    def state_dict(self) -> dict:
        return {"epochs_since": self.epochs_since, "steps_since": self.steps_since, "secs_since": self.secs_since}

    def load_state_dict(self, state: dict) -> None:
        # Missing keys (an older checkpoint) count as "just fired": a sensible default, never a KeyError.
        self.epochs_since = int(state.get("epochs_since", 0))
        self.steps_since = int(state.get("steps_since", 0))
        self.secs_since = float(state.get("secs_since", 0.0))
