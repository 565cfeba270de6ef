"""The user's reward function, named by import path `module:function` in `reward.fn`, and the calls to it.

Per sample (the default) it is called as fn(prompt=..., completion=..., row=...) and returns a float; with
`reward.batch` once per batch as fn(prompts=[...], completions=[...], rows=[...]) and returns a list of floats.
The calls run on threads of their own, up to `reward.concurrency` at once, so that a reward that waits on a
service (a verifier, a reward model behind HTTP) waits for many samples at a time instead of one after another;
each call is bounded by `reward.timeout_secs`. Anything it raises, or a call past its bound, is user code
failing, not infrastructure: the Supervisor fails fast with the traceback (reward.retry_user_errors).
"""
from __future__ import annotations

import importlib
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable

from workers.errors import UserCodeError

POLL_SECS = 0.05  # how often the calls in flight are looked at for one past its bound


def load_reward_fn(path: str) -> Callable[..., float]:
    module_name, _, fn_name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise UserCodeError(f"reward.fn: cannot import {path!r} ({e})") from e
    return fn


class Rewards:
    """The reward of every sample, in order; owns the threads that call the user's function."""

    def __init__(self, fn: Callable, batch: bool = False, concurrency: int = 16, timeout_secs: float = 300.0):
        self.fn, self.batch, self.concurrency, self.timeout_secs = fn, batch, concurrency, timeout_secs
        self.returned = 0.0  # when a call of the scoring in progress last returned (monotonic): the watchdog's
        self._scoring = 0    # the scorings so far: a call abandoned by an earlier one that returns late is no progress
        self._pool = self._new_pool()

    @classmethod
    def from_config(cls, reward) -> "Rewards":
        """From the config's `reward` section (raises UserCodeError when its function cannot be imported)."""
        return cls(load_reward_fn(reward.fn), reward.batch, reward.concurrency, reward.timeout_secs)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1 if self.batch else self.concurrency, thread_name_prefix="reward")

    def __call__(self, rows: list[dict], completions: list[str]) -> list[float]:
        if self.batch:
            calls = [dict(prompts=[r["prompt"] for r in rows], completions=list(completions), rows=rows)]
        else:
            calls = [dict(prompt=r["prompt"], completion=c, row=r) for r, c in zip(rows, completions)]
        results = self._call_all(calls)
        if self.batch:  # a list, a tuple, a numpy array or a tensor of one number per sample
            results = results[0]
            sized = hasattr(results, "__len__") and not isinstance(results, (str, bytes, dict))
            if not sized or len(results) != len(rows):
                raise UserCodeError(f"reward function (reward.batch) returned {type(results).__name__} of "
                                    f"{len(results) if sized else '?'} rewards for {len(rows)} samples: one "
                                    f"number per sample is expected")
            results = list(results)
        numbers = []
        for i, x in enumerate(results):
            try:
                numbers.append(float(x))
            except (TypeError, ValueError) as e:
                raise UserCodeError(f"reward function returned {x!r:.60}, not a number, for sample {i} "
                                    f"(prompt {str(rows[i]['prompt'])[:60]!r})") from e
        return numbers

    def _call_all(self, calls: list[dict]) -> list:
        started: dict[int, float] = {}
        self._scoring += 1
        scoring = self._scoring

        def timed(i: int, kwargs: dict):
            started[i] = time.monotonic()
            result = self.fn(**kwargs)
            if scoring == self._scoring:
                self.returned = time.monotonic()
            return result

        futures: dict[Future, int] = {self._pool.submit(timed, i, kw): i for i, kw in enumerate(calls)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=POLL_SECS, return_when=FIRST_EXCEPTION)
            for f in sorted(done, key=futures.get):
                if (e := f.exception()) is not None:
                    self._abandon(pending)
                    raise UserCodeError(f"reward function raised {type(e).__name__}: {e} (on "
                                        f"{self._which(futures[f], calls)})") from e
            now = time.monotonic()
            late = sorted(futures[f] for f in pending if now - started.get(futures[f], now) > self.timeout_secs)
            if late:
                self._abandon(pending)
                raise UserCodeError(f"reward function did not return within reward.timeout_secs = "
                                    f"{self.timeout_secs:g}s (on {self._which(late[0], calls)})")
        return [f.result() for f in sorted(futures, key=futures.get)]

    def _which(self, i: int, calls: list[dict]) -> str:
        """The call named in an error: the batch, or the sample with the start of its prompt."""
        if self.batch:
            return "the batch"
        prompt = str(calls[i]["prompt"])
        return f"sample {i}, prompt {prompt[:60]!r}{'...' if len(prompt) > 60 else ''}"

    def _abandon(self, pending: set[Future]) -> None:
        """A call failed: the others are not waited for, and calls still running (hung, maybe) keep their
        threads while later steps get a new pool."""
        for f in pending:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
