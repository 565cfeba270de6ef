"""Every RNG of one rank (python, numpy, torch CPU and every CUDA device), saved and restored per rank.

Restoring tolerates an older checkpoint that lacks an entry: the gap is returned (and reported as a
warning event), never a KeyError.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from supervisor.checkpoint.layout import rng_file


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": np_state[0], "state": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> list[str]:
    """Restore what the checkpoint has; returns the names it lacked (an older checkpoint), never raises."""
    missing = []
    if "python" in state:
        random.setstate(state["python"])
    else:
        missing.append("python")
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    else:
        missing.append("numpy")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    else:
        missing.append("torch")
    if torch.cuda.is_available():
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            missing.append("cuda")
    return missing


def save_rng(directory: Path, rank: int) -> str:
    torch.save(rng_state(), rng_file(directory, rank))
    return rng_file(directory, rank).name


def load_rng(directory: Path, rank: int, same_world_size: bool) -> list[str]:
    """This rank's RNGs from `directory`; after a reshard no file belongs to this rank any more."""
    path = rng_file(directory, rank)
    if not same_world_size:
        return ["rng (world size changed)"]
    if not path.exists():
        return ["rng"]
    return set_rng_state(torch.load(path, weights_only=True))
