"""The FSDP2 training engine: one rank's shard of the policy, its optimizer, LR scheduler and RNGs.

The model is built identically on every rank, then each decoder layer and the root are `fully_shard`ed.
Recover checkpoints are DCP (sharded model + optimizer + scheduler; DCP reshards on load) plus one small
RNG file per rank, loaded with weights_only. Full weights are gathered for the inference engines and
for HuggingFace exports. A background save (`save_async`, DCP's async_save) blocks only while the shards
are copied to CPU memory (on a GPU into pinned buffers made at the first save and reused); a writer thread with a
gloo group of its own, so its collectives never interleave with training's, writes and fsyncs them.
"""
from __future__ import annotations

import contextlib
import os
import stat
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from supervisor.checkpoint import safe_load
from supervisor.checkpoint.layout import DCP_METADATA
from supervisor.config import Config, TrainDtype
from supervisor.testing.fault_points import armed
from workers.engines.base import EngineBase, collective_timeout, even_part, init_process_group, lr_scheduler
from workers.engines.reference import reference_step
from workers.engines.rng import load_rng, rng_state, save_rng, set_rng_state
from workers.memory_tier import KINDS, Slot, StateLayout
from workers.roles import Role


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP shards one by one: those transformers never splits across devices, for any
    architecture (LlamaDecoderLayer, GPT2Block, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter or optimizer state (the tensor itself when it is not sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPEngine(EngineBase):
    MEMORY_TIER = True  # rejoin, stage_memory and load_memory: a rank rolls back and re-forms in place

    def __init__(self, config: Config, rank: int, world_size: int, device: torch.device, tokenizer,
                 model: torch.nn.Module, role: Role | None = None):
        """`tokenizer` and `model` (unsharded, on CPU) come from base.build_parts; `role`: the actor's by default."""
        super().__init__(config, rank, world_size, device, tokenizer, role)
        model = model.to(device)
        mesh = init_device_mesh(device.type, (world_size,))
        # bf16: each layer's parameters gathered in bf16 for its forward and backward, its gradients reduced in
        # fp32 into the fp32 shards the optimizer steps and the checkpoints hold
        mixed = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if self.section.dtype is TrainDtype.BF16 else {}
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, **mixed)
        self.model = fully_shard(model, mesh=mesh, **mixed)
        train = self.section
        self.params = list(self.model.parameters())  # in named_parameters' order: what the stream sends
        self.gathered: torch.Tensor | None = None  # rank 0: where full_param gathers a parameter's shards
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, train.warmup_steps)
        self.memory_layout = StateLayout.of([local(p) for p in self.params])
        self._make_writer_group()
        self.copies: torch.cuda.Stream | None = None  # the memory tier's copies off the GPU, once there is one
        if config.async_recover:
            # on a GPU, pinned host buffers made at the first save and copied into at every later one (TorchTitan's
            # async_with_pinned_mem); torch 2.11's DefaultStager failed its second save of an FSDP2 state there
            self.stager = (BlockingAsyncStager(cache_staged_state_dict=True, type_check=False)
                           if device.type == "cuda" else
                           DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False)))

    def _make_writer_group(self) -> None:
        """Collective: every rank makes the background writer's group, right after the default group and the
        mesh (which makes none: a 1-D mesh over the world is WORLD), whether it is new or rejoining."""
        if self.config.async_recover:
            self.writer_group = dist.new_group(backend="gloo", timeout=collective_timeout(self.config))

    def train_step(self, batch: dict, global_step: int) -> dict:
        """The step's optimizer updates on this rank's shard of the batch (one, or actor.ppo_epochs x
        actor.mini_batches), each in micro-batches whose gradients accumulate (reduced across the ranks once, after
        the last; averaged by FSDP). The figures are each update's, averaged over the updates; the LR scheduler
        moves once a step."""
        self.model.train()
        lr = self.scheduler.get_last_lr()[0]
        figures = [self._update(update, n == 0) for n, update in enumerate(self.updates(self.model, batch,
                                                                                        global_step))]
        self.scheduler.step()
        if self.reference is not None and self.reference.refresh_due(global_step):
            # every rank needs the full weights here (full_state_dict gives them to rank 0 only)
            self.reference.refresh(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True)))
        mean = {k: sum(f[k] for f in figures) / len(figures) for k in figures[0]}
        return {"loss": mean.pop("loss"), "grad_norm": mean.pop("grad_norm"), "lr": lr, **mean}

    def values(self, batch: dict) -> torch.Tensor:
        return self._values(self.model, batch)

    def logprobs(self, batch: dict) -> dict[str, torch.Tensor]:
        return self._token_logprobs(self.model, batch)

    def _update(self, batch: dict, first: bool) -> dict:
        """One optimizer update on `batch` (this rank's rows of it); `first`: the step's first, before which the
        memory tier's copy of the previous step must be done reading the state."""
        self.optimizer.zero_grad(set_to_none=True)
        parts, tokens = self.micro_batches(batch)
        loss, metrics = None, {}
        for i, part in enumerate(parts):
            self.model.set_requires_gradient_sync(i == len(parts) - 1)
            part_loss, part_metrics = self._loss(self.model, part, tokens)
            part_loss.backward()
            loss = part_loss.detach() if loss is None else loss + part_loss.detach()
            metrics = self._add_metrics(metrics, part_metrics)
        grad_norm = float("nan")
        if self.section.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.section.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if first:
            self._settle()
        self.optimizer.step()
        return {"loss": self._mean_over_ranks(loss), "grad_norm": grad_norm, **metrics}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank must call it; rank 0 gets the full weights on CPU, the others an empty dict."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def weight_params(self) -> list[tuple[str, torch.Size]]:
        return [(name, p.shape) for name, p in self.model.named_parameters()]

    def full_param(self, index: int) -> torch.Tensor | None:
        """Parameter `index` whole on rank 0: every other rank sends it its dim-0 shard, which lands in place in
        a buffer reused from parameter to parameter (valid until the next call; not an all-gather: only rank 0
        needs the bytes). FSDP2 cuts dim 0 like torch.chunk, so only the last non-empty shard is short: padded
        to the same length, the shards laid end to end are the parameter followed by padding."""
        p = self.params[index]
        if not isinstance(p, DTensor):
            return p.detach()
        if tuple(p.placements) != (Shard(0),):
            with torch.no_grad():
                return p.full_tensor()
        local = p.to_local().detach()
        rows = -(-p.shape[0] // self.world_size)
        if local.shape[0] != rows:
            local = torch.cat([local, local.new_zeros((rows - local.shape[0], *p.shape[1:]))])
        group = p.device_mesh.get_group()
        if self.rank != 0:
            dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
            return None
        numel = local.numel() * self.world_size
        if self.gathered is None or self.gathered.numel() < numel or self.gathered.dtype != local.dtype:
            self.gathered = torch.empty(numel, dtype=local.dtype, device=local.device)
        whole = self.gathered[:numel].view(rows * self.world_size, *p.shape[1:])
        shards = whole.chunk(self.world_size)
        shards[0].copy_(local)
        works = [dist.irecv(shards[r], src=dist.get_global_rank(group, r), group=group)
                 for r in range(1, self.world_size)]
        for work in works:
            work.wait()
        return whole[:p.shape[0]]

    def placed_part(self, index: int) -> tuple[int, torch.Tensor]:
        """A dim-0 shard where DTensor's own placement puts it (not weight_shard's arithmetic): nothing is
        gathered. A parameter sharded otherwise, or not at all, is vouched for whole by rank 0."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # DCP's own, private

        p = self.params[index]
        if isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            return offset[0] * (p.numel() // max(p.shape[0], 1)), p.to_local().detach()
        whole = self.full_param(index)
        return (0, whole) if self.rank == 0 else (0, p.new_empty(0))

    def weight_shard(self, index: int) -> tuple[int, torch.Tensor]:
        """A dim-0 shard is contiguous in the flattened parameter: rank r's rows start at r * ceil(rows / world)."""
        p = self.params[index]
        if not isinstance(p, DTensor):
            return even_part(p.detach().reshape(-1), self.rank, self.world_size)
        if tuple(p.placements) != (Shard(0),):
            with torch.no_grad():
                return even_part(p.full_tensor().reshape(-1), self.rank, self.world_size)
        local = p.to_local().detach()
        rows = -(-p.shape[0] // self.world_size)
        return self.rank * rows * (p.numel() // max(p.shape[0], 1)), local.reshape(-1)

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def save(self, directory: Path, global_step: int) -> list[str]:
        """Collective: DCP shards (`__{rank}_*.distcp`, rank 0's `.metadata`) and this rank's RNG file."""
        self._arm_dcp_write(directory, global_step)
        dcp.save(self._state(), checkpoint_id=str(directory))
        return self._shards(directory) + self._save_small(directory, global_step)

    def save_local(self, directory: Path, global_step: int) -> list[str]:
        """This rank's files of a background save that need no peer (RNG, reference): written before any
        rank starts its upload, so that a storage error here skips the save on every rank."""
        return self._save_small(directory, global_step)

    def save_async(self, directory: Path, global_step: int) -> Future:
        """Collective: the shards of `save`, returning once they are staged in CPU memory; a future of the
        shard files, done when they are durable. `save_local` wrote the rest of this rank's part."""
        self._arm_dcp_write(directory, global_step)
        upload = dcp.async_save(self._state(), checkpoint_id=str(directory), process_group=self.writer_group,
                                async_stager=self.stager)
        shards: Future = Future()

        def written(f: Future) -> None:
            try:
                f.result()
                shards.set_result(self._shards(directory))
            except BaseException as e:  # noqa: BLE001 - the write's error is the future's
                shards.set_exception(e)

        upload.add_done_callback(written)
        return shards

    def _shards(self, directory: Path) -> list[str]:
        written = [p.name for p in directory.iterdir() if p.name.startswith(f"__{self.rank}_")]
        return written + [DCP_METADATA] if self.rank == 0 else written

    def _save_small(self, directory: Path, global_step: int) -> list[str]:
        """This rank's RNG file (and, on the steps it changed, the reference weights beside the step)."""
        if self.reference is not None:
            self.reference.save(directory.parent, global_step, self.rank)
        return [save_rng(directory, self.rank)]

    def _arm_dcp_write(self, directory: Path, global_step: int) -> None:
        if armed("dcp_write", step=global_step, rank=self.rank) == "enospc":
            # test instrumentation: a real disk-full inside DCP's writer, through a shard that is /dev/full
            if not stat.S_ISCHR(os.stat("/dev/full").st_mode):
                raise RuntimeError("fault dcp_write:enospc needs the /dev/full device")
            (directory / f"__{self.rank}_0.distcp").symlink_to("/dev/full")

    def load(self, directory: Path, global_step: int, same_world_size: bool) -> list[str]:
        """Collective: load a DCP checkpoint (resharding if the world size changed); returns RNG gaps."""
        self._settle()
        self._drop_gathered()
        state = self._state()
        safe_load.load(state, directory)  # a copied checkpoint cannot run code here
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.reference is not None:
            self.reference.load(directory.parent, global_step)
        return load_rng(directory, self.rank, same_world_size)


    def _settle(self) -> None:
        """Before anything overwrites this rank's state: the memory tier's copy still reading it off the GPU is
        done, waited for on the device (the host goes on)."""
        if self.copies is not None:
            torch.cuda.current_stream().wait_stream(self.copies)

    def _drop_gathered(self) -> None:
        """Before a restore writes the shards: no parameter is left gathered by a forward that no backward
        followed (the values or log-probabilities computed before a step's updates). FSDP keeps the root module's
        gathered after its forward and would run the next forward on them, not on what was restored."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _copy_stream(self) -> "torch.cuda.Stream | None":
        """The memory tier's stream for copies off the GPU (None on CPU, where a copy is done when it returns)."""
        if self.device.type == "cuda" and self.copies is None:
            self.copies = torch.cuda.Stream()
        return self.copies

    # ---- the memory tier (workers/memory_tier.py) ---------------------------------------------------
    def stage_memory(self, slot: Slot, global_step: int) -> None:
        """This rank's recover state after the optimizer step of `global_step`, copied into `slot`: the local
        shards of the parameters and of AdamW's moments, and beside them what a bitwise continuation needs. On a
        GPU the copies into the (pinned) slot are queued on a stream of their own and this returns at once: they
        run beside the next step's rollout and forward, whose optimizer step waits for them (`_settle`), and the
        slot's readers wait for its `pending` event (Slot.wait)."""
        slot.meta = None  # a copy cut short leaves no slot that claims a step
        parts = self.memory_layout.parts(slot.flat)
        stream = self._copy_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # after the optimizer step it copies the result of
        with torch.no_grad(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            for p, dst in zip(self.params, parts["param"]):
                dst.copy_(local(p).reshape(-1), non_blocking=True)
            for kind in KINDS[1:]:
                for p, dst in zip(self.params, parts[kind]):
                    if p in self.optimizer.state:
                        dst.copy_(local(self.optimizer.state[p][kind]).reshape(-1), non_blocking=True)
        if stream is not None:
            slot.pending = torch.cuda.Event()
            slot.pending.record(stream)
        slot.meta = {
            "global_step": global_step,
            "adam_steps": [self.optimizer.state[p]["step"].clone() if p in self.optimizer.state else None
                           for p in self.params],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
        }

    def load_memory(self, flat: torch.Tensor, meta: dict) -> None:
        """Restore a slot staged by this rank (rolling back in place) or by the rank this one replaces. The
        param groups are part of it: a scheduler's load_state_dict does not set their lr back."""
        self._settle()
        self._drop_gathered()
        global_step = meta["global_step"]
        if self.reference is not None and reference_step(global_step, self.reference.every) is not None:
            raise RuntimeError(f"step {global_step}: the memory tier does not hold the KL reference policy "
                               f"refreshed every actor.ref_update_steps = {self.reference.every}; recover from disk")
        parts = self.memory_layout.parts(flat)
        with torch.no_grad():
            for p, src in zip(self.params, parts["param"]):
                local(p).copy_(src.view_as(local(p)))
                p.grad = None
            for i, p in enumerate(self.params):
                step = meta["adam_steps"][i]
                if step is None:
                    self.optimizer.state.pop(p, None)
                    continue
                state = {"step": step.clone()}
                for kind in KINDS[1:]:
                    old = self.optimizer.state.get(p, {}).get(kind)
                    if old is not None:  # a survivor: in place
                        local(old).copy_(parts[kind][i].view_as(local(old)))
                        state[kind] = old
                    else:
                        state[kind] = self._like(p, parts[kind][i])
                self.optimizer.state[p] = state
        for group, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
            group.update(saved)
        self.scheduler.load_state_dict(meta["scheduler"])
        set_rng_state(meta["rng"])

    @staticmethod
    def _like(p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """A copy of `flat` shaped, placed and sharded like parameter `p` (a new AdamW state tensor)."""
        shard = flat.view_as(local(p)).to(local(p).device, copy=True)
        if not isinstance(p, DTensor):
            return shard
        return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)

    def rejoin(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """Collective with the other ranks' rejoin and the replacements' setup: leave the old process group and
        join a new one, keeping the sharded model and the optimizer. FSDP caches the ProcessGroup object of its
        mesh, so it is pointed at the new WORLD; the mesh itself resolves its group by name, and
        destroy_process_group resets the names, so it already resolves to the new WORLD (checked: DTensor's
        collectives, clip_grad_norm_ and full_tensor, go through it). The rank stays the same: its shards map
        1:1 onto its memory copy."""
        if (rank, world_size) != (self.rank, self.world_size):
            raise ValueError(f"rank {self.rank} of {self.world_size} cannot rejoin as rank {rank} of {world_size}")
        self._settle()
        dist.destroy_process_group()  # every group, the writer's too
        init_process_group(self.config, rank, world_size, master_addr, master_port)
        # what a step cut short left: unsharded parameters, hooks' trackers; a model that has not run a forward
        # since it was built (a rank that took a dead one's place, then a second fault) has none, and FSDP's
        # reset fails on it (its lazy init has not run: the root's `_is_root` is still None)
        if self.model._get_fsdp_state()._is_root:
            self.model.reset_iter_state()
        world = dist.group.WORLD
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    if group.mesh_info.mesh.get_group() is not world:
                        raise RuntimeError("FSDP's device mesh does not resolve to the new process group")
                    group.mesh_info.shard_process_group = world
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.mesh_info.shard_process_group = world
        for p in self.params:
            p.grad = None
        self._make_writer_group()
