"""Waiting for a background write: a slow, healthy write is waited for past the step timeout (each poll is
bounded by it, not the write), up to recover.write_timeout_secs."""
import pytest

from supervisor.cluster.groups import wait_for_write


class Clock:
    def __init__(self):
        self.now = 0.0

    def sleep(self, secs: float) -> None:
        self.now += secs


def test_a_write_that_takes_longer_than_a_step_timeout_is_waited_for():
    clock, polls = Clock(), []

    def poll():  # two ranks; rank 0 is done at once, rank 1 after 900 s of a 300 s step timeout
        polls.append(clock.now)
        return [{"a": 1}, {"b": 2} if clock.now >= 900 else None]

    assert wait_for_write(poll, bound=3600, sleep=clock.sleep, clock=lambda: clock.now) == [{"a": 1}, {"b": 2}]
    assert clock.now >= 900 and len(polls) > 1


def test_a_write_past_its_own_bound_names_the_ranks_still_writing():
    clock = Clock()
    with pytest.raises(TimeoutError) as info:
        wait_for_write(lambda: [True, None, None], bound=60, sleep=clock.sleep, clock=lambda: clock.now)
    assert info.value.args[0] == [1, 2] and clock.now >= 60
