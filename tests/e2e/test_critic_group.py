"""A critic's TrainGroup on a real cluster, driven directly (the step drives it in test_ppo_job.py): its own ranks,
named as a critic's, in a placement group of their own, each building the value model; values asked before a
step, a clipped value loss that learns the returns over the ranks' shards, and a recover save that a new critic
group loads bitwise."""
from __future__ import annotations

import pytest
import torch
from harness import CONFIG, REPO
from test_async_save import batch

from workers.ppo import gae, token_rewards

pytestmark = pytest.mark.e2e


def shards_of(step: int, values: list[torch.Tensor] | None = None) -> list[dict]:
    """`batch(step)` cut in two, one part per rank; with the ranks' `values`, what the critic trains on: the
    returns of an outcome reward of 1 for rows whose first token is even (GAE with gamma = lambda = 1)."""
    b = batch(step)
    parts = [{k: v.chunk(2)[r] for k, v in b.items()} for r in range(2)]
    if values is None:
        return parts
    for part, v in zip(parts, values):
        rewards = token_rewards((part["input_ids"][:, 0] % 2 == 0).float(), part["response_mask"])
        part.update(old_values=v, returns=gae(rewards, v, part["response_mask"], 1.0, 1.0)[1])
    return parts


def test_a_critics_group_learns_the_returns_and_a_new_one_loads_its_save_bitwise(cluster, tmp_path):
    import ray
    from ray.util import placement_group_table

    from supervisor.cluster.errors import Group
    from supervisor.cluster.groups import TrainGroup, placement_group_name
    from supervisor.config import CriticConfig, load_config

    config = load_config(CONFIG, [f"cluster.fileroot={tmp_path}", "recover.write_mode=sync"])
    config = config.model_copy(update={"critic": CriticConfig(lr=1e-2)})
    ray.init(address=cluster.address, namespace="relaunch-test", logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    groups = []
    try:
        critics = TrainGroup(config, 2, timeout=120, role="critic")
        groups.append(critics)
        assert [m.name for m in critics.members] == ["TrainWorker[critic rank 0]", "TrainWorker[critic rank 1]"]
        assert critics.group is Group.CRITIC
        names = {info["name"] for info in placement_group_table().values() if info["state"] == "CREATED"}
        assert placement_group_name(config, "critic") in names and placement_group_name(config) not in names

        losses = []
        for step in range(12):  # a new batch each step: the loss falls on the whole, not on every step
            shards = shards_of(step, critics.values(shards_of(step), step))
            assert [tuple(v.shape) for v in (s["old_values"] for s in shards)] == [(4, 5), (4, 5)]
            losses.append(critics.train(shards, step)[0]["loss"])
        assert sum(losses[-4:]) < sum(losses[:4]) / 2, losses

        staging = tmp_path / "critic-step"
        staging.mkdir()
        critics.save_recover(str(staging), 11)
        before = critics.values(shards_of(12), 12)
        critics.shutdown()
        groups.remove(critics)
        again = TrainGroup(config, 2, timeout=120, role="critic")
        groups.append(again)
        assert again.load_recover(str(staging), 2) == []
        after = again.values(shards_of(12), 12)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        for group in groups:
            group.shutdown()
        ray.shutdown()
