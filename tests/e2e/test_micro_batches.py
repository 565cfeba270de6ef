"""actor.micro_batch_size, actor.gradient_checkpointing and actor.dtype on the real engines (a gloo group of one
rank, no Ray): micro-batches accumulate to the update of one pass over the shard, whatever their share of the
generated tokens (up to float rounding: the sums are taken in another order), recomputed activations change
nothing, and a bf16 engine (FSDP2's mixed precision, DeepSpeed's bf16 mode), with both, resumes from its save bit
for bit."""
from __future__ import annotations

import importlib.util
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from supervisor.config import load_config
from supervisor.testing.local_cluster import free_port

pytestmark = pytest.mark.e2e

BACKENDS = ["fsdp"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])


def batch(seed: int, rows: int = 16) -> dict:
    """Rows of several lengths of completion: micro-batches with unequal shares of the generated tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 14, (rows, 8), generator=g)
    response = torch.zeros(rows, 8, dtype=torch.long)
    for i, n in enumerate(torch.randint(1, 5, (rows,), generator=g).tolist()):
        response[i, -n:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response,
            "advantages": torch.randn(rows, generator=g)}


def trained(backend: str, *overrides: str, steps: int = 3) -> tuple[dict, list[dict], dict]:
    """The full weights and the metrics after `steps` steps of a fresh engine, rank 0 of 1, and (fsdp) the first
    step's gradients."""
    from workers.engines.base import make_engine

    config = load_config(None, [f"actor.backend={backend}", "data.batch_size=2", "cluster.n_train_workers=1",
                                "actor.kl_coef=0.1", *overrides])
    try:
        engine = make_engine(config, 0, 1, "127.0.0.1", free_port())
        metrics, grads = [], {}
        for step in range(steps):
            metrics.append(engine.train_step(batch(step), step))
            if step == 0 and backend == "fsdp":
                grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
        return {k: v.clone() for k, v in engine.full_state_dict().items()}, metrics, grads
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fresh(backend: str, *overrides: str, steps: int = 3):
    """`trained` in a process of its own: DeepSpeed keeps its groups in globals no second engine may reuse."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(trained, (backend, *overrides), {"steps": steps})


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_and_recomputed_activations_reach_the_update_of_one_pass(backend):
    # the first step's gradient is the update's whole input (after it, Adam divides by the gradients' own size,
    # so a rounding apart where a gradient is near 0 becomes a step apart: micro-batches are compared there)
    plain, plain_metrics, plain_grads = fresh(backend)
    _, micro_metrics, micro_grads = fresh(backend, "actor.micro_batch_size=3", steps=1)  # 16 rows: 3 x 5 and 1
    a, (b,) = plain_metrics[0], micro_metrics
    assert (b["loss"], b["kl"], b["grad_norm"]) == pytest.approx((a["loss"], a["kl"], a["grad_norm"]), rel=1e-4)
    # apart by rounding only. Where a gradient is a near-cancelling sum, how far rounding moves it depends on the
    # CPU's kernels: 2e-7 of its size on this project's machines, 8e-5 once in CI. A micro-batch weighted by its own
    # token mean instead of its share of the shard's moves every gradient by 12-37% of its size.
    for name, g in plain_grads.items():
        assert float((g - micro_grads[name]).norm() / g.norm()) < 1e-3, name
    # recomputed activations: the same arithmetic, bit for bit, over three steps
    checkpointed, metrics, _ = fresh(backend, "actor.gradient_checkpointing=true")
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain) and metrics == plain_metrics


def bf16_resumed(directory: str, backend: str) -> tuple:
    """A bf16 engine: three steps, then the third again after loading the save made after the second."""
    from pathlib import Path

    from workers.engines.base import make_engine

    config = load_config(None, ["actor.dtype=bf16", "data.batch_size=2", "cluster.n_train_workers=1",
                                "actor.micro_batch_size=8", "actor.gradient_checkpointing=true",
                                f"actor.backend={backend}"])
    try:
        engine = make_engine(config, 0, 1, "127.0.0.1", free_port())
        from workers.model import forward_logits

        if backend == "fsdp":  # fp32 shards (what the optimizer steps and the saves hold), gathered in bf16
            model = engine.model
            assert {p.dtype for p in model.parameters()} == {torch.float32}
        else:  # DeepSpeed's bf16 mode: bf16 weights, fp32 master weights in its optimizer
            model = engine.engine.module
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
            assert {g.dtype for g in engine.engine.optimizer.single_partition_of_fp32_groups} == {torch.float32}
        ids = batch(0)["input_ids"]
        assert forward_logits(model, ids, torch.ones_like(ids)).dtype == torch.bfloat16  # computed in bf16
        for step in range(2):
            engine.train_step(batch(step), step)
        engine.save(Path(directory), 1)
        first = engine.train_step(batch(2), 2), {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.train_step(batch(3), 3)
        engine.load(Path(directory), 1, same_world_size=True)
        again = engine.train_step(batch(2), 2), engine.full_state_dict()
        return first, again
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_trains_in_mixed_precision_and_resumes_bit_for_bit(tmp_path, backend):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        (metrics, weights), (metrics_again, weights_again) = pool.apply(bf16_resumed, (str(tmp_path), backend))
    assert metrics == metrics_again and all(torch.equal(weights[k], weights_again[k]) for k in weights)
    assert metrics["loss"] == metrics["loss"] and metrics["grad_norm"] == metrics["grad_norm"]  # not NaN


def ppo_resumed(directory: str) -> tuple:
    """Two passes of two mini-batches a step (in micro-batches of 3): four optimizer updates a step, then the third
    step again after loading the save made after the second."""
    from pathlib import Path

    from workers.engines.base import make_engine

    config = load_config(None, ["actor.ppo_epochs=2", "actor.mini_batches=2", "actor.micro_batch_size=3",
                                "data.batch_size=2", "cluster.n_train_workers=1"])
    try:
        engine = make_engine(config, 0, 1, "127.0.0.1", free_port())
        metrics = [engine.train_step(batch(step), step) for step in range(2)]
        updates = {int(s["step"]) for s in engine.optimizer.state.values()}
        engine.save(Path(directory), 1)
        first = engine.train_step(batch(2), 2), {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.train_step(batch(3), 3)
        engine.load(Path(directory), 1, same_world_size=True)
        again = engine.train_step(batch(2), 2), engine.full_state_dict()
        return metrics, updates, first, again
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ppo_epochs_and_mini_batches_make_their_updates_in_a_drawn_order_and_resume_bit_for_bit(tmp_path):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        metrics, updates, (m, w), (m_again, w_again) = pool.apply(ppo_resumed, (str(tmp_path),))
    assert updates == {8}  # 2 passes x 2 mini-batches, 2 steps
    assert "clip_frac" in metrics[0]  # reported with several updates
    assert metrics[1]["clip_frac"] > 0  # lr 3e-3 moves the policy past the clip within a step
    assert m == m_again and all(torch.equal(w[k], w_again[k]) for k in w)
