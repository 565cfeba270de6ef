"""Reading DCP checkpoints that someone else may have written, without running their code (invariant 5).

DCP itself reads `.metadata` with a plain `pickle.load` and every non-tensor entry (scheduler state,
optimizer hyper-parameters) with `torch.load(weights_only=False)`: a copied checkpoint could run anything
on resume or export, whatever its manifest says. Here `.metadata` goes through an unpickler that admits
only DCP's own metadata classes, and non-tensor entries through `torch.load(weights_only=True)`.
Every place relaunch reads a DCP checkpoint (resume, export, verify, inspect) goes through this module.

DeepSpeed reads its own `*_model_states.pt` / `*_optim_states.pt` with `torch.load(weights_only=False)`
(zero_to_fp32, load_checkpoint); `deepspeed_files` makes every torch.load weights_only while it does,
admitting only the few DeepSpeed classes those files hold.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from supervisor.checkpoint.layout import inside

METADATA_FILE = ".metadata"

# What DCP's FileSystemWriter pickles into `.metadata` (torch 2.6 - 2.13): dataclasses describing
# tensors and byte entries, torch.Size / dtypes / layouts, and the checkpoint's path.
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to the torch.layout object, nothing else
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


# What DeepSpeed pickles into its model and optimizer state files besides tensors and plain containers (ZeRO
# 1-3, checked on the checkpoints this repo writes): the ZeRO stage, the loss scaler, ZeRO-2's fragment addresses.
_DEEPSPEED_CLASSES = ("deepspeed.runtime.zero.config:ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler:LossScaler",
                      "deepspeed.utils.tensor_fragment:fragment_address")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to load something other than DCP metadata or plain tensors."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_CLASSES or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"refusing to load {module}.{name}: not a DCP metadata class")


def read_metadata(checkpoint: Path) -> Metadata:
    """DCP metadata of a checkpoint directory; raises UnsafeCheckpointError (or OSError/UnpicklingError)."""
    with open(Path(checkpoint) / METADATA_FILE, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def check_dcp(checkpoint: Path, entries: bool = True) -> None:
    """A DCP checkpoint that loads without running code and reads nothing outside its directory: the metadata
    through the safe unpickler, every storage path inside `checkpoint`, and (with `entries`) every non-tensor
    entry through weights_only loading. Raises UnsafeCheckpointError (or OSError, ValueError) naming the problem."""
    metadata = read_metadata(checkpoint)
    for info in (metadata.storage_data or {}).values():
        inside(Path(checkpoint), str(getattr(info, "relative_path", "")))
    byte_entries = {k: None for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if entries and byte_entries:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point
            warnings.simplefilter("ignore", UserWarning)
            load(byte_entries, checkpoint, no_dist=True)


def check_deepspeed(checkpoint: Path, tag: str) -> int:
    """Every file of DeepSpeed's tag loads as a resume reads it (deepspeed_files), memory-mapped; returns how
    many there are. Raises UnsafeCheckpointError (or OSError, RuntimeError) naming a file that does not."""
    files = sorted((Path(checkpoint) / tag).glob("*.pt"))
    with deepspeed_files():
        for f in files:
            torch.load(f, map_location="cpu", mmap=True)
    return len(files)


@contextlib.contextmanager
def deepspeed_files():
    """While DeepSpeed reads its checkpoint files: every torch.load is weights_only (DeepSpeed asks for
    weights_only=False) and admits only _DEEPSPEED_CLASSES; a refused file raises UnsafeCheckpointError naming
    it. Process-wide for the duration: use it only where nothing else loads files meanwhile."""
    allowed = [getattr(importlib.import_module(m), n) for m, n in (c.split(":") for c in _DEEPSPEED_CLASSES)]
    original = torch.load

    def weights_only_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"{f}: refused to load it ({str(e).splitlines()[0]})") from e

    torch.load = weights_only_load
    try:
        yield
    finally:
        torch.load = original


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict, checkpoint: Path, no_dist: bool = False) -> None:
    """`dcp.load` into `state` in place, through the safe reader and planner; UnsafeCheckpointError when a
    file asks for more than metadata and plain tensors."""
    read_metadata(checkpoint)  # refused here in one line, not inside DCP's wrapped, logged failure
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=SafeLoadPlanner(),
                 no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, pickle.UnpicklingError)]
        if refused:
            raise UnsafeCheckpointError(f"{checkpoint}: {str(refused[0]).splitlines()[0]}") from e
        raise
