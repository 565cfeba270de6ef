"""A process's peak memory, returned with results the Supervisor already gets (no extra calls per step).

Peak RSS is the kernel's high-water mark of this process's resident memory (`ru_maxrss`), so a short spike (a
gathered state dict, an incoming copy of the weights) is counted even though it is gone by the time anyone asks.
It includes pages of Ray's shared-memory object store the process has touched (an engine reading pushed
weights), which are shared, not private. Where CUDA is in use, the device's peak allocated bytes come too.
"""
from __future__ import annotations

import resource

import torch

GB = 1e9


def peak_memory() -> dict[str, float]:
    """{"rss_gb": peak RSS} and, when this process has used CUDA, {"cuda_gb": peak allocated}."""
    peak = {"rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 4)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_gb"] = round(torch.cuda.max_memory_allocated() / GB, 4)
    return peak
