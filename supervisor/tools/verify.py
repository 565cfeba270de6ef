"""`relaunch verify EXPORT --against DIR_OR_CHECKPOINT`: are two sets of model weights the same?

Tensor by tensor: names, shapes, dtypes and the largest absolute difference. Either side can be a
HuggingFace directory (safetensors, sharded or not) or a recover checkpoint (read as `relaunch export`
reads it: validated, safe metadata). An output tied to the input embeddings (`lm_head.weight` when the
export's config ties them) is compared through the embeddings, since safetensors stores it once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from supervisor.checkpoint.layout import step_of
from supervisor.tools.export import ExportError, checkpoint_weights, validated

TIED_OUTPUT = "lm_head.weight"


class VerifyError(ValueError):
    """One side cannot be read as model weights (bad input, exit 2)."""


@dataclass
class Comparison:
    compared: int = 0
    max_diff: float = 0.0
    max_diff_name: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise VerifyError(f"{directory}: no *.safetensors files")
    weights = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                weights[name] = sf.get_tensor(name)
    return weights


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    path = path.resolve()
    if step_of(path) is not None:
        try:
            return checkpoint_weights(path, validated(path))
        except ExportError as e:
            raise VerifyError(str(e)) from e
    if path.is_dir():
        return read_hf_weights(path)
    raise VerifyError(f"{path}: neither a HuggingFace directory nor a recover checkpoint (globalstep<N>)")


def ties_output(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))


def compare(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float = 0.0,
            tied: bool = False) -> Comparison:
    """Pure: every difference between two state dicts, as lines naming the tensor."""
    if tied:
        mine, theirs = ({k: v for k, v in d.items() if k != TIED_OUTPUT} for d in (mine, theirs))
    result = Comparison()
    for name in sorted(set(mine) - set(theirs)):
        result.problems.append(f"{name}: only in the export")
    for name in sorted(set(theirs) - set(mine)):
        result.problems.append(f"{name}: missing from the export")
    for name in sorted(set(mine) & set(theirs)):
        a, b = mine[name], theirs[name]
        result.compared += 1
        if a.shape != b.shape:
            result.problems.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if a.dtype != b.dtype:
            result.problems.append(f"{name}: dtype {a.dtype} != {b.dtype}")
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        if diff > result.max_diff or result.max_diff_name is None:
            result.max_diff, result.max_diff_name = diff, name
        if diff > atol:
            result.problems.append(f"{name}: max abs difference {diff:.3g} > {atol:g}")
    return result


def verify(export: Path, against: Path, atol: float = 0.0) -> Comparison:
    return compare(read_weights(export), read_weights(against), atol, tied=ties_output(export))
