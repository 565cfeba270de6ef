"""Prompts and the order they are served in: a pure function of (seed, epoch, epoch_step).

Each epoch's order is a permutation drawn from (seed, epoch), so the loader's whole state is its position.
A resume inside epoch 2 serves epoch 2's order (not epoch 0's, as a plain DistributedSampler would),
and a resume at an epoch boundary starts the next epoch instead of an exhausted iterator.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_prompts(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{path}:{i + 1}: a row needs a 'prompt' key")
        rows.append(row)
    return rows


class PromptLoader:
    def __init__(self, rows: list[dict], batch_size: int, seed: int, shuffle: bool = True):
        if len(rows) < batch_size:
            raise ValueError(f"data.batch_size {batch_size} is larger than the dataset ({len(rows)} prompts)")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size  # the last partial batch is dropped

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def batch(self, epoch: int, epoch_step: int) -> list[dict]:
        idx = self.order(epoch)[epoch_step * self.batch_size:(epoch_step + 1) * self.batch_size]
        return [self.rows[i] for i in idx]

    def state_dict(self, epoch: int, next_epoch_step: int) -> dict:
        """Plain data only (it is pickled into dataloader_info.pkl and read back by a safe unpickler)."""
        return {"epoch": epoch, "epoch_step": next_epoch_step, "dataset_size": len(self.rows),
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}
