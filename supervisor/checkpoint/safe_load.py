"""Reading DCP checkpoints that someone else may have written, without running their code (invariant 5).

DCP itself reads `.metadata` with a plain `pickle.load` and every non-tensor entry (scheduler state,
optimizer hyper-parameters) with `torch.load(weights_only=False)`: a copied checkpoint could run anything
on resume or export, whatever its manifest says. Here `.metadata` goes through an unpickler that admits
only DCP's own metadata classes, and non-tensor entries through `torch.load(weights_only=True)`.
Every place relaunch reads a DCP checkpoint (resume, export, verify, inspect) goes through this module.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

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
