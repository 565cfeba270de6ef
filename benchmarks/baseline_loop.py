"""The training loop that benchmarks/baselines.py runs under Ray Train and under torchrun: the model of a relaunch
config (workers/model.py, the default job's tiny one unless a config is named) on 2 gloo ranks with DDP and AdamW,
a checkpoint after every step, and rank 1 SIGKILLing itself once at the start of step `kill_at`.

Each rank appends what the benchmark measures to `log` (JSON lines): the kill's time, and rank 0 the step each
group loaded (-1: nothing) and each completed step's time. As a torchrun entry point:
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 benchmarks/baseline_loop.py DIR STEPS KILL_AT [CONFIG]
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SAMPLES_PER_RANK = 32  # the default job's 64 samples a step over 2 ranks


def log_line(log: Path, **row) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def build(config_path: str | None = None):
    from supervisor.config import load_config
    from workers.model import build_model, build_tokenizer

    cfg = load_config(config_path)
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, cfg.seed)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.actor.lr), len(tok)


def step_batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(vocab, (SAMPLES_PER_RANK, 8), generator=g)


def train_step(model, optim, ids: torch.Tensor) -> float:
    logits = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.detach().item()


def maybe_kill(step: int, kill_at: int, rank: int, marker: Path, log: Path) -> None:
    """Rank 1 dies once, at the start of step `kill_at` (the marker makes it fire only in the first attempt)."""
    if step != kill_at or rank != 1:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    log_line(log, event="kill", step=step, time=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def ray_train_resume(model, optim, rank: int, log: Path) -> int:
    """The step to start from: after the one in ray.train.get_checkpoint(), loaded into `model` and `optim`, or 0.
    Rank 0 logs the step loaded (-1: nothing, the first attempt or a restart before any checkpoint registered)."""
    import ray.train

    start, ckpt = 0, ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"] + 1
    if rank == 0:
        log_line(log, event="loaded", step=start - 1, time=time.time())
    return start


def ray_train_report(model, optim, step: int, loss: float, rank: int, log: Path) -> None:
    """A completed step reported to Ray Train with a checkpoint (rank 0's; every rank reports), then logged."""
    import tempfile

    import ray.train

    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, Path(d) / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)
    if rank == 0:
        log_line(log, step=step, time=time.time())


def ray_train_loop(args: dict) -> None:
    """Ray Train's train_loop_per_worker: resumes from ray.train.get_checkpoint(), reports one every step."""
    import ray.train
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    run_dir = Path(args["dir"])
    log, marker = run_dir / "log.jsonl", run_dir / "killed"
    model, optim, vocab = build(args.get("config"))
    start = ray_train_resume(model, optim, rank, log)
    ddp = DDP(model)
    for step in range(start, args["steps"]):
        maybe_kill(step, args["kill_at"], rank, marker, log)
        loss = train_step(ddp, optim, step_batch(step, rank, vocab))
        ray_train_report(model, optim, step, loss, rank, log)


def ray_train_drained_loop(args: dict) -> None:
    """Ray Train's loop under a drain notice (benchmarks/recovery.py --drain): as ray_train_loop, but every rank
    logs its node, waits at the start of step `at` until the benchmark has sent the notice (the file `go`), and
    asks ray.train.get_preemption_info() at every step (Ray Train's way to tell a loop; a barrier of all ranks),
    rank 0 logging when it first answers. Every step is checkpointed already: nothing more to save on notice.
    The first group trains on until its node goes at the deadline; the one Ray Train starts after it ends 3 steps
    after the step it loaded."""
    import itertools

    import ray.train
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    run_dir = Path(args["dir"])
    log = run_dir / "log.jsonl"
    log_line(log, event="node", rank=rank, node=ray.get_runtime_context().get_node_id(), time=time.time())
    model, optim, vocab = build(args.get("config"))
    start = ray_train_resume(model, optim, rank, log)
    restarted, noticed = (run_dir / "go").exists(), False
    ddp = DDP(model)
    for step in itertools.count(start):
        if restarted and step >= start + 3:
            break
        if step == args["at"] and not restarted:
            while not (run_dir / "go").exists():
                time.sleep(0.05)
        if ray.train.get_preemption_info() is not None and not noticed:
            noticed = True
            if rank == 0:
                log_line(log, event="notice", step=step, time=time.time())
        loss = train_step(ddp, optim, step_batch(step, rank, vocab))
        ray_train_report(model, optim, step, loss, rank, log)


def torchrun_loop(run_dir: Path, steps: int, kill_at: int, config_path: str | None = None) -> None:
    """torchrun's entry point: resumes from the newest torch.save checkpoint, writes one every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    # A bounded collective timeout: a rank stuck after a peer's death fails, and torchrun restarts the group.
    # The agent's store outlives a restart, and a new process's default group reuses the prefix of the last
    # attempt's: gloo would read the dead attempt's addresses and fail (connection refused) or hang. Each
    # attempt gets a prefix of its own, as torchelastic's restart count tells it.
    timeout = datetime.timedelta(seconds=60)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"baseline/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    rank = dist.get_rank()
    log, marker, path = run_dir / "log.jsonl", run_dir / "killed", run_dir / "state.pt"
    model, optim, vocab = build(config_path)
    start = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"] + 1
    if rank == 0:  # step -1: nothing to load (the first attempt, or a restart before any checkpoint was written)
        log_line(log, event="loaded", step=start - 1, time=time.time())
    ddp = DDP(model)
    for step in range(start, steps):
        maybe_kill(step, kill_at, rank, marker, log)
        train_step(ddp, optim, step_batch(step, rank, vocab))
        if rank == 0:  # written to a temporary name, fsynced, renamed: a kill never leaves half a checkpoint
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        dist.barrier()  # every rank waits for the checkpoint, as a Ray Train report does
        if rank == 0:
            log_line(log, step=step, time=time.time())
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_loop(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
