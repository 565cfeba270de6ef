"""A GPU engine's weights in one device buffer that trainer ranks on the same GPU write through CUDA IPC.

The GPU counterpart of workers/shared_weights.py, and the colocated path verl, OpenRLHF and slime take (their
engines rebuild tensors from the trainer's CUDA IPC handles; here the trainer writes into the engine's): the
engine keeps its parameters laid end to end in the stream's order in one CUDA buffer and offers its IPC handle
(torch's own `reduce_tensor`, which keeps the buffer alive while another process has it open) with the GPU's
UUID. A rank whose process sees that GPU opens it and copies its shard of every parameter straight into the
engine's parameters, device to device: no gather on rank 0, no host round trip, no NCCL pair (NCCL refuses two
ranks on one device). A rank on another GPU, or another host, cannot, and the sync streams instead.
Each weights-update group gets a buffer of its own (`renew`), as the CPU segment does, so a writer left over
from an earlier group writes into memory the engine no longer serves.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import reduce_tensor

from workers.gpu import device_uuid
from workers.shared_weights import move_into

DEVICE_ARG = 6  # the index of the device in the arguments of torch's rebuild_cuda_tensor


class CudaSharedWeights:
    """Engine side: moves `model`'s parameters (on one GPU, of one dtype; each once) into a device buffer.
    Raises OSError where it cannot (the engine then offers none and is streamed to)."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for _, p in model.named_parameters()]
        if len({p.dtype for p in self.params}) != 1 or any(not p.is_cuda for p in self.params):
            raise OSError("the engine's parameters are not of one dtype on one GPU: one buffer cannot hold them")
        self.layout = [(name, list(p.shape)) for name, p in model.named_parameters()]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self.generation: str | None = None  # the weights-update group whose ranks may write it
        self.buffer: torch.Tensor | None = None
        self.renew(None)

    def renew(self, generation: str | None) -> dict:
        """A new buffer for the group `generation`, holding the parameters as they are; returns its handle."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.params[0].device)
        move_into(self.params, buffer)
        torch.cuda.current_stream().synchronize()  # whole before any rank is told where it is
        self.buffer, self.generation = buffer, generation  # the old buffer goes with its last view and opener
        return self.handle()

    def flat(self) -> torch.Tensor:
        """The parameters as one flat uint8 tensor, in the stream's order: what the ranks write and hash."""
        return self.buffer

    def handle(self) -> dict:
        """What a trainer rank needs to open the buffer: picklable; `gpu` names the device it lives on."""
        _, args = reduce_tensor(self.buffer)
        return {"cuda_ipc": list(args), "gpu": device_uuid(self.buffer.device), "bytes": self.nbytes,
                "layout": self.layout, "generation": self.generation}


def open_handle(handle: dict) -> torch.Tensor | None:
    """Trainer side: the engine's buffer as a flat uint8 CUDA tensor opened in this process, or None when this
    process does not see the engine's GPU (or has none, or the handle is malformed or stale)."""
    try:
        if not torch.cuda.is_available():
            return None
        index = next((i for i in range(torch.cuda.device_count()) if device_uuid(i) == handle["gpu"]), None)
        if index is None:
            return None
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle["cuda_ipc"])
        args[DEVICE_ARG] = index  # the engine's GPU as this process numbers it
        buffer = rebuild_cuda_tensor(*args)
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None
    return buffer if buffer.dtype == torch.uint8 and buffer.numel() == handle["bytes"] else None
