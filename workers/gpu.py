"""What a process that trains or generates on a GPU sets first: the deterministic settings exact recovery needs.

A resumed run ends bit-identical to an uninterrupted one only if the same step on the same state gives the same
bits. On CPU torch's kernels do (one thread); on CUDA cuBLAS picks reduction orders per workspace and some
kernels accumulate with atomics, unless told otherwise. So before a TrainWorker or an engine touches CUDA:
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (read when cuBLAS makes its first handle), deterministic algorithms (a kernel
without a deterministic version warns rather than stops the job: the warning names it), attention through the
math kernel (the fused flash, memory-efficient and cuDNN attention backward passes accumulate with atomics), no
cuDNN autotuning, and no TF32 (fp32 matmuls stay fp32). What it costs: docs/benchmarks.md, "On a GPU".
"""
from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def deterministic_cuda() -> None:
    """Set the deterministic CUDA settings in this process; call it before the first CUDA kernel. A value of
    CUBLAS_WORKSPACE_CONFIG the user set is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device_uuid(device: torch.device | int | None = None) -> str:
    """The GPU's UUID: the same physical GPU whatever index CUDA_VISIBLE_DEVICES gives it in each process."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid)
