"""The built-in engine on a GPU: generation there, and its weights written by a trainer process on the same GPU
through CUDA IPC (workers/cuda_weights.py), checked by the device-side digest (`sum64`)."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

BUCKET = 1 << 16  # bytes: several buckets even for the tiny model


def trainer(config, handle: dict, seed: int | None, queue, go=None) -> None:
    """Another process, as a TrainWorker on the engine's GPU: open the engine's buffer (then, given `go`, say so
    and wait for it: a writer left over from an earlier group) and write into it the weights the config builds
    (`seed` None) or random ones; then the digest of what it wrote, hashed there."""
    from workers.cuda_weights import open_handle
    from workers.model import build_model, build_tokenizer
    from workers.weight_sync import flat_digest

    buffer = open_handle(handle)
    if buffer is None:
        queue.put(None)
        return
    if go is not None:
        queue.put("opened")
        go.wait(120)
    flat = buffer.view(torch.float32)
    if seed is None:
        params = [p for _, p in build_model(config.model, build_tokenizer(config.model), config.seed).named_parameters()]
        flat.copy_(torch.cat([p.detach().reshape(-1) for p in params]).cuda())
    else:
        flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(seed)).cuda())
    torch.cuda.current_stream().synchronize()
    queue.put(flat_digest(flat, torch.float32, BUCKET, "sum64"))


def write_from_another_process(config, handle: dict, seed: int | None, meanwhile=None) -> str | None:
    """`trainer` in a process of its own; with `meanwhile`, called once it has opened the buffer, before it
    writes."""
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=trainer, args=(config, handle, seed, queue, go if meanwhile else None))
    proc.start()
    try:
        if meanwhile:
            assert queue.get(timeout=120) == "opened"
            meanwhile()
            go.set()
        return queue.get(timeout=120)
    finally:
        proc.join(timeout=60)


def engine_model(config):
    from workers.model import build_model, build_tokenizer

    tokenizer = build_tokenizer(config.model)
    return tokenizer, build_model(config.model, tokenizer, config.seed).cuda().eval()


def rollouts(model, tokenizer, config) -> torch.Tensor:
    from workers.generate import generate

    prompts = [f"{a} {b}" for a in range(4) for b in range(4)]
    out = generate(model, tokenizer, prompts, list(range(len(prompts))), seed=config.seed, step=3,
                   max_new_tokens=4, chat_template=config.data.chat_template)
    return out["input_ids"]


def test_generation_on_the_gpu_is_reproducible_and_unchanged_by_a_refit_of_the_same_weights(gpu_config):
    from workers.cuda_weights import CudaSharedWeights

    tokenizer, model = engine_model(gpu_config)
    before = rollouts(model, tokenizer, gpu_config)
    assert torch.equal(before, rollouts(model, tokenizer, gpu_config))  # the same seeds, the same samples
    shared = CudaSharedWeights(model)
    assert torch.equal(before, rollouts(model, tokenizer, gpu_config))  # moved into one buffer, the same model
    written = write_from_another_process(gpu_config, shared.renew("refit"), None)
    assert written is not None
    assert torch.equal(before, rollouts(model, tokenizer, gpu_config))


def test_a_trainer_on_the_same_gpu_writes_the_engines_weights_in_place_and_the_digests_agree(gpu_config):
    from workers.cuda_weights import CudaSharedWeights
    from workers.weight_sync import flat_digest, local_digest

    tokenizer, model = engine_model(gpu_config)
    shared = CudaSharedWeights(model)
    handle = shared.renew("group-1")
    assert handle["gpu"] and handle["bytes"] == sum(p.numel() * 4 for p in model.parameters())
    digest = write_from_another_process(gpu_config, handle, seed=5)
    params = [p for _, p in model.named_parameters()]
    want = torch.randn(shared.nbytes // 4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]).cpu(), want)  # the model reads them
    assert digest.startswith("sum64-")
    assert digest == flat_digest(shared.flat().view(torch.float32), torch.float32, BUCKET, "sum64") \
        == local_digest(params, torch.float32, BUCKET, "sum64") \
        == flat_digest(shared.flat().cpu().view(torch.float32), torch.float32, BUCKET, "sum64")  # GPU == CPU

    # a writer of group 1 that still has its buffer open writes after group 2 began: into memory the engine no
    # longer serves (torch keeps a block another process has open out of its allocator's reach)
    late = write_from_another_process(gpu_config, shared.renew("group-1b"), seed=6,
                                      meanwhile=lambda: shared.renew("group-2"))
    assert late is not None
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]).cpu(), want)

