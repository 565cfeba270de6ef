"""The weight sync on a real cluster: a 2-rank TrainGroup (FSDP, or DeepSpeed ZeRO-2/3) syncs 2 engines, by writes into
their shared weights or by the stream, and what the engines hold afterwards is bitwise the trainer's full weights
(cast to bf16 for bf16 engines), with the digest of one process's computation. On the shared path also: the gate
sees what an engine really holds, a writer of an earlier group cannot reach the weights an engine serves, a shard
gone stale in training is caught after the group's first step, a failed write fails the sync at once, and after a
step of training the shared path gives what the stream gives."""
from __future__ import annotations

import pytest
import torch
from harness import CONFIG, REPO

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
    pytest.param(True, ["rollout.dtype=bf16"], id="shared-memory-bf16", marks=pytest.mark.quick),
    pytest.param(False, ["actor.dtype=bf16"], id="stream-bf16"),  # rollout.dtype auto: the actor's
    pytest.param(True, ["actor.backend=deepspeed", "actor.zero_stage=2"], id="shared-memory-zero2"),
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
        dtype = getattr(torch, config.engine_dtype)  # the engines' (bf16: the trainer's fp32 weights cast to it)
        full = {n: t.to(dtype) for n, t in full.items()}
        want = local_digest([full[n] for n in names], dtype, 2**20)
        buckets = -(-sum(full[n].numel() for n in names) * dtype.itemsize // 2**20)  # 2 in fp32, 1 in bf16
        assert sent["digest"] == want and sent["buckets"] == buckets and sent["failed"] == {}
        for i in (0, 1):
            got = engine_weights(engines, i)
            assert set(got) == set(names) and "lm_head.weight" not in got  # tied: streamed once, as the embedding
            assert all(got[n].dtype == dtype and torch.equal(got[n], full[n]) for n in names)
        # the parameters only: the buffers (RoPE's frequencies) stay fp32, as the trainer's do
        assert ray.get(engines.members[0].handle.__ray_call__.remote(
            lambda w: {str(b.dtype) for b in w.model.buffers()})) == {"torch.float32"}
        assert engines.weight_status() == [(0, want), (0, want)]

        scramble(engines, 1)  # a subset: only engine 1 is streamed to
        assert stream.sync(-1, only=[1])["digest"] == want
        assert all(torch.equal(engine_weights(engines, 1)[n], full[n]) for n in names)
        assert stream.sync(-1, only=[])["digest"] == want  # the digest alone, nothing sent
        if shared:
            stream = shared_path_checks(config, stream, engines, trainers, want)
        stream.close()
    finally:
        for group in (trainers, engines):
            if group is not None:
                group.shutdown()
        ray.shutdown()


def shared_path_checks(config, stream, engines, trainers, want: str):
    """Past the first syncs (version 0 on both engines, `want` its digest); returns the stream in use."""
    import ray

    from supervisor.cluster.errors import GroupError
    from supervisor.control.classify import FaultKind, classify
    from workers.data import PromptLoader, read_prompts
    from workers.grpo import group_advantages
    from workers.rewards import Rewards
    from workers.shared_weights import attach

    scramble(engines, 1)  # the gate hashes what an engine holds, not what its last sync said
    assert [d == want for _, d in engines.weight_status()] == [True, False]
    stream.sync(-1, only=[1])

    # one step of training, with rank 1's shards frozen as they were: only a check after the step can see it
    # (the stream's first sync was checked whole: before the step)
    def freeze(w):
        frozen = [(start, part.clone()) for start, part in map(w.engine.weight_shard,
                                                                range(len(w.engine.weight_params())))]
        w.engine.weight_shard = lambda i: frozen[i]

    ray.get(trainers.members[1].handle.__ray_call__.remote(freeze))
    loader = PromptLoader(read_prompts(config.data.path, config.data.prompt_key, config.data.answer_key),
                          config.data.batch_size, config.seed, config.data.shuffle)
    rows = [r for r in loader.batch(0, 0) for _ in range(config.data.group_size)]
    rollout = engines.generate([r["prompt"] for r in rows], 0, version=0)
    advantages = group_advantages(torch.tensor(Rewards.from_config(config.reward)(rows, rollout["completions"])),
                                  config.data.group_size)
    shards = [dict({k: rollout[k].chunk(2)[r] for k in ("input_ids", "attention_mask", "response_mask")},
                   advantages=advantages.chunk(2)[r]) for r in range(2)]
    trainers.train(shards, 0)
    with pytest.raises(GroupError) as caught:
        stream.sync(0)
    assert "differs from the trainer's own" in str(caught.value.error)
    assert classify(caught.value).kind is FaultKind.INTERNAL_ERROR

    ray.get(trainers.members[1].handle.__ray_call__.remote(lambda w: delattr(w.engine, "weight_shard")))
    dtype = getattr(torch, config.engine_dtype)
    full = ray.get([m.handle.__ray_call__.remote(lambda w: w.engine.full_state_dict()) for m in trainers.members])[0]
    full = {n: t.to(dtype) for n, t in full.items()}
    trained = local_digest([full[n] for n in stream.names], dtype, 2**20)
    assert trained != want
    assert stream.sync(0)["digest"] == trained  # whole check after the step, now passing
    assert all(torch.equal(engine_weights(engines, 0)[n], full[n]) for n in stream.names)
    stream.shared = False
    assert stream.sync(0)["digest"] == trained  # the stream gives the same bytes
    stream.shared = True
    assert stream.sync(0)["checked"] == 1  # later syncs check one parameter

    # a late writer: it mapped engine 0's segment in an earlier group, and writes after the next group began
    late = attach(ray.get(engines.members[0].handle.__ray_call__.remote(lambda w: w.shared.handle())))
    stream.close()
    stream = engines.connect(trainers)
    late.view(dtype).fill_(7.0)
    assert engines.weight_status() == [(1, trained), (1, trained)]

    # a rank whose write fails: every rank raises that error at once, no hang, and it is not retried
    def broken(w):
        w.engine.weight_shard = lambda i: (_ for _ in ()).throw(ValueError("a bug in weight_shard"))

    ray.get(trainers.members[1].handle.__ray_call__.remote(broken))
    with pytest.raises(GroupError) as caught:
        stream.sync(0)
    fault = classify(caught.value)
    assert fault.kind is FaultKind.INTERNAL_ERROR and "trainer rank 1" in fault.message
    assert caught.value.waited < 30  # not a step timeout (60 s here)
    return stream
