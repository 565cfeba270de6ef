"""Fault points name a TrainWorker by its rank in the group, even before it has joined one (warm spares)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from supervisor.testing.fault_points import fault_points


class Worker:
    rank = None  # a warm spare: no rank until it joins a group

    @fault_points
    def where(self, rank=None):
        return rank

    @fault_points
    def setup(self, addr, port, rank, world_size):
        self.rank = rank


def test_the_rank_a_call_is_given_is_the_rank_its_fault_points_see(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAUNCH_FAULT", "Worker.where.enter:enospc:rank=1,Worker.setup.exit:enospc:rank=0")
    monkeypatch.setenv("RELAUNCH_FAULT_DIR", str(tmp_path))
    spare, other = Worker(), Worker()
    assert spare.where(0) == 0                 # armed for rank 1 only
    with pytest.raises(OSError, match="No space left"):
        spare.where(rank=1)
    other.setup("addr", 1, 1, 2)               # setup.exit armed for rank 0 only
    with pytest.raises(OSError):
        spare.setup("addr", 1, 0, 2)
    assert spare.rank == 0



class Ranked:
    """A rank of a trained group: the actor's or the critic's (a TrainWorker's `role`)."""

    def __init__(self, role: str):
        self.rank, self.role = 1, SimpleNamespace(name=role)

    @fault_points
    def train(self, shard, global_step):
        return global_step


def test_a_point_armed_for_the_critic_fires_in_a_critic_rank_only_and_one_without_a_role_in_the_actors(
        tmp_path, monkeypatch):
    monkeypatch.setenv("RELAUNCH_FAULT", "Ranked.train.enter:enospc:rank=1:role=critic,"
                                         "Ranked.train.enter:enospc:step=3")
    monkeypatch.setenv("RELAUNCH_FAULT_DIR", str(tmp_path))
    actor, critic = Ranked("actor"), Ranked("critic")
    assert actor.train({}, 2) == 2              # armed for the critic
    with pytest.raises(OSError):
        critic.train({}, 2)
    assert critic.train({}, 3) == 3             # no role: the actor's
    with pytest.raises(OSError):
        actor.train({}, 3)
