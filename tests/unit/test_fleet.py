"""The fleet's check of a repair from memory: the trainers' restored weights hashed again and compared with what
they were at that version before the fault (the controller recovers from disk when they differ)."""
from __future__ import annotations

import pytest
from test_controller import FakeEngines, FakeTrainers, World

from supervisor.control.events import EventLog
from supervisor.control.fleet import Fleet, RestoredWeightsDiffer


@pytest.fixture
def fleet(tmp_path) -> Fleet:
    world = World()
    fleet = Fleet(EventLog(tmp_path / "events.jsonl", job="j"))
    fleet.trainers, fleet.engines = FakeTrainers(world, 2), FakeEngines(world)
    for version in (1, 2, 3):  # three steps, each pushed to the engines
        fleet.trainers.history.append(version - 1)
        fleet.sync_engines(version, gate=False)
    return fleet


def test_weights_restored_from_memory_that_differ_from_before_the_fault_fail_the_repair(fleet):
    fleet.trainers.history = [0, 7]  # rolled back to version 2, but not to its weights
    fleet.restored_from_memory(2)
    with pytest.raises(RestoredWeightsDiffer, match="version 2"):
        fleet.sync_engines(2, gate=True)


def test_weights_restored_exactly_pass_and_the_engines_that_hold_them_are_not_pushed_to(fleet):
    fleet.trainers.history = [0, 1, 2]  # rolled back to version 3, exactly
    fleet.restored_from_memory(3)
    passes = fleet.engines.world.digest_passes
    fleet.sync_engines(3, gate=True)
    assert fleet.engines.world.digest_passes == passes + 1  # hashed again (pushing to nobody)
    assert fleet.weights_checksum(3) == fleet.digests[3]


def test_without_the_repair_from_memory_the_known_digest_is_trusted(fleet):
    """An engine restart keeps the trainers: their digest of the version is known and not computed again."""
    passes = fleet.engines.world.digest_passes
    fleet.sync_engines(3, gate=True)
    assert fleet.engines.world.digest_passes == passes
