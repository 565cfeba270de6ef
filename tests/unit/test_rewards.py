"""The reward's calls: per sample on threads of their own, so that a reward that waits on a service overlaps its
waits; batched in one call; each bounded; whatever goes wrong is the user's code, named."""
from __future__ import annotations

import threading
import time

import pytest

from supervisor.config import DEFAULT_CONFIG, load_config
from supervisor.testing.reward_service import RewardService
from workers.rewards import Rewards, UserCodeError

ROWS = [{"prompt": f"{i} {i + 1} =", "answer": str(i + 1)} for i in range(64)]
COMPLETIONS = [r["answer"] if i % 3 else "0" for i, r in enumerate(ROWS)]
EXPECTED = [1.0 if i % 3 else 0.0 for i in range(64)]


@pytest.fixture
def verifier():
    service = RewardService(latency=0.05)
    yield service
    service.close()


def test_a_reward_behind_http_is_called_for_many_samples_at_once_in_order(verifier):
    def reward(prompt, completion, row):
        return verifier.score(row["answer"], completion)

    rewards = Rewards(reward, concurrency=16)
    try:
        assert rewards(ROWS, COMPLETIONS) == EXPECTED
    finally:
        rewards.close()
    assert verifier.most == 16  # the calls overlapped their waits, up to reward.concurrency


def test_a_batched_reward_is_one_call_with_the_lists():
    calls = []

    def reward(prompts, completions, rows):
        calls.append(len(prompts))
        return [float(c == r["answer"]) for c, r in zip(completions, rows)]

    assert Rewards(reward, batch=True)(ROWS, COMPLETIONS) == EXPECTED and calls == [64]
    with pytest.raises(UserCodeError, match="returned list of 63 rewards for 64 samples"):
        Rewards(lambda prompts, completions, rows: [0.0] * 63, batch=True)(ROWS, COMPLETIONS)


def test_a_reward_that_raises_hangs_or_returns_no_number_is_the_users_error():
    def raises(prompt, completion, row):
        return row["missing"] if row["answer"] == "6" else 1.0

    with pytest.raises(UserCodeError, match=r"raised KeyError: 'missing' \(on sample 5, prompt '5 6 ='\)") as e:
        Rewards(raises)(ROWS, COMPLETIONS)
    assert e.value.__cause__ is not None and e.value.__cause__.__traceback__ is not None  # the user's traceback

    release = threading.Event()

    def hangs(prompt, completion, row):
        if row["answer"] == "10":
            release.wait(30)
        return 1.0

    rewards = Rewards(hangs, timeout_secs=0.3)
    started = time.monotonic()
    with pytest.raises(UserCodeError, match=r"within reward.timeout_secs = 0.3s \(on sample 9, prompt '9 10 ='\)"):
        rewards(ROWS, COMPLETIONS)
    assert time.monotonic() - started < 5  # its bound, not the hang
    release.set()
    assert rewards(ROWS[:4], COMPLETIONS[:4]) == [1.0] * 4  # the next step's calls get threads of their own
    with pytest.raises(UserCodeError, match=r"returned 'high', not a number, for sample 0 \(prompt '0 1 ='\)"):
        Rewards(lambda prompt, completion, row: "high")(ROWS, COMPLETIONS)


def test_the_config_names_the_calls():
    reward = load_config(DEFAULT_CONFIG, ["reward.batch=true", "reward.concurrency=4", "reward.timeout_secs=9"]).reward
    rewards = Rewards.from_config(reward)
    assert (rewards.batch, rewards.concurrency, rewards.timeout_secs) == (True, 4, 9.0)
    rewards.close()


def test_a_batched_reward_may_return_an_array_or_a_tensor():
    import numpy as np
    import torch

    for kind in (np.array, torch.tensor):
        rewards = Rewards(lambda prompts, completions, rows: kind(EXPECTED), batch=True)
        assert rewards(ROWS, COMPLETIONS) == EXPECTED


def test_each_call_that_returns_is_progress_for_the_watchdog():
    """A step scoring many samples one slow call after another is healthy: the Supervisor reports each return, so
    the driver's stall bound needs one reward.timeout_secs, not one per call."""
    returns = []
    rewards = Rewards(lambda prompt, completion, row: returns.append(rewards.returned) or 1.0, concurrency=1)
    before = time.monotonic()
    rewards(ROWS[:5], COMPLETIONS[:5])
    assert returns[0] < before < returns[1] < returns[2] < returns[3] < returns[4] < rewards.returned
    # a call the scoring abandoned (past its bound) that returns later, while the Supervisor is elsewhere: no progress
    release = threading.Event()
    late = Rewards(lambda prompt, completion, row: (row is not ROWS[0] or release.wait(30)) and 1.0, timeout_secs=0.2)
    with pytest.raises(UserCodeError):
        late(ROWS[:1], COMPLETIONS[:1])  # sample 0 hangs past its bound: abandoned
    assert late(ROWS[1:2], COMPLETIONS[1:2]) == [1.0]  # the next scoring
    before = late.returned
    release.set()  # the abandoned call returns now
    time.sleep(0.2)
    assert late.returned == before
    rewards.close()
    late.close()
