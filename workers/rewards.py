"""The user's reward function, named by import path `module:function` in `reward.fn`.

It is called as fn(prompt=..., completion=..., row=...) and returns a float. Anything it raises is user
code failing, not infrastructure: the Supervisor fails fast with the traceback (reward.retry_user_errors).
"""
from __future__ import annotations

import importlib
from typing import Callable

from workers.errors import UserCodeError


def load_reward_fn(path: str) -> Callable[..., float]:
    module_name, _, fn_name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise UserCodeError(f"reward.fn: cannot import {path!r} ({e})") from e
    return fn


def score(fn: Callable[..., float], rows: list[dict], completions: list[str]) -> list[float]:
    try:
        return [float(fn(prompt=row["prompt"], completion=c, row=row)) for row, c in zip(rows, completions)]
    except Exception as e:  # noqa: BLE001 - any exception from user code is reported as such
        raise UserCodeError(f"reward function raised {type(e).__name__}: {e}") from e
