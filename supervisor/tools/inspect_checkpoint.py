"""`relaunch inspect CHECKPOINT`: what a recover checkpoint holds and whether a resume would accept it.

Reads only what cannot run code: JSON files, the DCP metadata through the safe unpickler, DeepSpeed's files
weights_only with the allow-list a resume uses, the manifest check of every file. A damaged checkpoint is
still described (its files, sizes, what is wrong).
"""
from __future__ import annotations

import json
from pathlib import Path

from supervisor.checkpoint.layout import (
    DATALOADER_INFO,
    MANIFEST,
    META,
    ROLE_DIRS,
    RUN_CONFIG,
    STEP_INFO,
    deepspeed_tag,
    role_step_dir,
    step_of,
)
from supervisor.checkpoint.safe_load import check_deepspeed
from supervisor.checkpoint.store import CheckpointError, entry_path, read_checkpoint
from supervisor.config import Backend


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _state_summary(checkpoint: Path) -> list[str]:
    """What DCP holds per part (model, optimizer, scheduler), from the safely read metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from supervisor.checkpoint.safe_load import read_metadata

    parts: dict[str, list] = {}
    for key, meta in read_metadata(checkpoint).state_dict_metadata.items():
        parts.setdefault(key.split(".", 1)[0], []).append(meta)
    lines = []
    for part, metas in sorted(parts.items()):
        tensors = [m for m in metas if isinstance(m, TensorStorageMetadata)]
        numel = sum(m.size.numel() for m in tensors)
        lines.append(f"{part}: {len(tensors)} tensors ({numel:,} values), {len(metas) - len(tensors)} other entries")
    return lines


def inspect(checkpoint: Path) -> tuple[bool, str]:
    """(valid, report). Valid means a resume would load it: every file matches the manifest."""
    checkpoint = checkpoint.resolve()
    if step_of(checkpoint) is None or not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: not a recover checkpoint directory (globalstep<N>)")
    lines = [f"checkpoint   {checkpoint}"]
    loaded, reason = None, ""
    try:
        loaded = read_checkpoint(checkpoint)
    except CheckpointError as e:
        reason = str(e)
    zero_files = 0
    if loaded is not None and loaded.manifest.get("engine", Backend.FSDP) == Backend.DEEPSPEED:
        try:
            zero_files = check_deepspeed(checkpoint, deepspeed_tag(loaded.global_step))
        except Exception as e:  # noqa: BLE001 - refused or unreadable: a resume would not load it either
            loaded, reason = None, f"{checkpoint / deepspeed_tag(step_of(checkpoint))}: cannot load ({e})"
    valid = loaded is not None
    lines.append("valid        yes" if valid else f"valid        NO: {reason}")
    manifest = _json(checkpoint / MANIFEST) or {}
    step = _json(checkpoint / META / STEP_INFO) or {}
    config = _json(checkpoint / RUN_CONFIG) or {}
    lines.append(f"global step  {step.get('global_step', step_of(checkpoint))}  (epoch {step.get('epoch', '?')}, "
                 f"epoch step {step.get('epoch_step', '?')}, {step.get('steps_per_epoch', '?')} steps per epoch)")
    lines.append(f"world size   {manifest.get('world_size', '?')}")
    lines.append(f"engine       {config.get('actor', {}).get('backend', '?')}, model "
                 f"{config.get('model', {}).get('path') or 'tiny (built from the config sizes)'}")
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    listed = manifest.get("files", {})
    lines.append(f"files        {len(files)}, {_size(sum(p.stat().st_size for p in files))}")
    for p in files:
        name = str(p.relative_to(checkpoint))
        note = "" if name in listed or name == MANIFEST else "  (not in manifest)"
        lines.append(f"  {name:<36} {_size(p.stat().st_size):>10}{note}")
    for name in sorted(set(listed) - {str(p.relative_to(checkpoint)) for p in files}):
        # outside the step directory: a file shared by several steps (the KL reference), or a critic's part
        try:
            elsewhere = entry_path(checkpoint, name)
        except CheckpointError:
            elsewhere = None
        state = _size(elsewhere.stat().st_size) if elsewhere is not None and elsewhere.is_file() else "MISSING"
        lines.append(f"  {name:<36} {state:>10}")
    for role, part in manifest.get("roles", {}).items():
        lines.append(f"{role + ' part':<12} world size {part.get('world_size', '?')}, engine {part.get('engine', '?')}, "
                     f"in {role_step_dir(checkpoint, role) if role in ROLE_DIRS else '? (no such role)'}")
    if valid:
        loader = loaded.infos[DATALOADER_INFO]
        lines.append("a resume would load:")
        if manifest.get("engine", Backend.FSDP) == Backend.DEEPSPEED:
            lines.append(f"  DeepSpeed ZeRO partitions of tag {deepspeed_tag(loaded.global_step)}: {zero_files} "
                         f"file{'s' if zero_files != 1 else ''} read with weights_only and an allow-list of "
                         f"DeepSpeed's classes, as on resume")
        else:
            lines += [f"  {line}" for line in _state_summary(checkpoint)]
        lines.append(f"  RNG states of {len(list(checkpoint.glob('rng_rank*.pt')))} ranks, the {len(loaded.infos)} "
                     f"recover_info files of step {loaded.global_step} from {META}/")
        lines.append(f"  dataloader at epoch {loader.get('epoch')}, epoch step {loader.get('epoch_step')}; "
                     f"training goes on at global step {loaded.global_step + 1}")
    return valid, "\n".join(lines)
