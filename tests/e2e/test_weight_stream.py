"""The weight sync on a real cluster: a 2-rank TrainGroup (FSDP, or DeepSpeed ZeRO-3) syncs 2 engines, by
writes into their shared weights or by the stream, and what the engines hold afterwards is bitwise the
trainer's full weights, with the digest of one process's computation."""
from __future__ import annotations

import pytest
import torch
from conftest import CONFIG, REPO

from workers.weight_sync import local_digest

pytestmark = pytest.mark.e2e


def engine_weights(engines, i: int) -> dict:
    import ray

    handle = engines.members[i].handle
    return ray.get(handle.__ray_call__.remote(lambda w: {n: p.detach().clone() for n, p in w.model.named_parameters()}))


def scramble(engines, i: int) -> None:
    """Fill engine i's weights with other values (its version stays), so that only a sync can restore them."""
    import ray

    def fill(w):
        with torch.no_grad():
            for p in w.model.parameters():
                p.fill_(0.5)

    ray.get(engines.members[i].handle.__ray_call__.remote(fill))


@pytest.mark.parametrize("shared, trainer", [
    pytest.param(True, ["actor.backend=fsdp"], id="shared-memory", marks=pytest.mark.quick),
    pytest.param(False, ["actor.backend=fsdp"], id="stream", marks=pytest.mark.quick),
    pytest.param(True, ["actor.backend=deepspeed", "actor.zero_stage=3"], id="shared-memory-zero3"),
])
def test_two_ranks_stream_to_two_engines_bitwise(cluster, tmp_path, shared, trainer):
    import ray

    from supervisor.cluster.groups import RolloutGroup, TrainGroup
    from supervisor.config import load_config

    # 1 MiB buckets: parameters span buckets; 257 rows: the two ranks' shards of the MLP differ in length
    config = load_config(CONFIG, [f"cluster.fileroot={tmp_path}", "cluster.n_rollout_workers=2",
                                  "rollout.weight_bucket_mb=1", "model.hidden_size=128",
                                  "model.intermediate_size=257", f"rollout.shared_memory_weights={shared}", *trainer])
    ray.init(address=cluster.address, namespace="relaunch-test", logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    engines = trainers = None
    try:
        engines = RolloutGroup(config, timeout=60)
        trainers = TrainGroup(config, 2, timeout=60)
        full = ray.get([m.handle.__ray_call__.remote(lambda w: w.engine.full_state_dict())
                        for m in trainers.members])[0]
        for i in (0, 1):
            scramble(engines, i)
        stream = engines.connect(trainers)
        sent = stream.sync(-1)
        names = stream.names
        assert stream.shared is shared and ("write_secs" in sent) is shared  # same host: the ranks map the engines
        want = local_digest([full[n] for n in names], torch.float32, 2**20)
        assert sent["digest"] == want and sent["buckets"] >= 2 and sent["failed"] == {}
        for i in (0, 1):
            got = engine_weights(engines, i)
            assert set(got) == set(names) and "lm_head.weight" not in got  # tied: streamed once, as the embedding
            assert all(torch.equal(got[n], full[n]) for n in names)
        assert engines.weight_status() == [(0, want), (0, want)]

        scramble(engines, 1)  # a subset: only engine 1 is streamed to
        assert stream.sync(-1, only=[1])["digest"] == want
        assert all(torch.equal(engine_weights(engines, 1)[n], full[n]) for n in names)
        assert stream.sync(-1, only=[])["digest"] == want  # the digest alone, nothing sent
        stream.close()
    finally:
        for group in (trainers, engines):
            if group is not None:
                group.shutdown()
        ray.shutdown()
