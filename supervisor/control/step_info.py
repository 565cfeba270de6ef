"""Where the run is: the last completed step, and the one after it.

`global_step` counts steps from 0 across epochs; `epoch_step` restarts at 0 every epoch. A checkpoint
records the last *completed* step; training resumes at `.next()`, so an epoch's last step rolls over to
step 0 of the next epoch instead of an exhausted loader (verl 5725).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepInfo:
    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int

    @classmethod
    def before_start(cls, steps_per_epoch: int) -> "StepInfo":
        """The virtual step before the first one, so that `.next()` is step 0."""
        return cls(epoch=0, epoch_step=-1, global_step=-1, steps_per_epoch=steps_per_epoch)

    def next(self) -> "StepInfo":
        if self.epoch_step + 1 < self.steps_per_epoch:
            return StepInfo(self.epoch, self.epoch_step + 1, self.global_step + 1, self.steps_per_epoch)
        return StepInfo(self.epoch + 1, 0, self.global_step + 1, self.steps_per_epoch)

    @property
    def is_epoch_end(self) -> bool:
        return self.epoch_step == self.steps_per_epoch - 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepInfo":
        return cls(int(d["epoch"]), int(d["epoch_step"]), int(d["global_step"]), int(d["steps_per_epoch"]))
