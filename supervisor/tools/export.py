"""`relaunch export`: a recover checkpoint (fsdp's DCP shards or DeepSpeed's ZeRO files) -> a HuggingFace
model directory, in one process.

No cluster and no process group: the checkpoint is validated against its manifest (its DCP metadata read
through the safe unpickler), the model's tensors are read straight from the shards of any world size (DCP
reassembles them; a DeepSpeed checkpoint goes through DeepSpeed's zero_to_fp32, its files read with
weights_only loading), cast to `--dtype` if asked, and written as safetensors, sharded with an index above
`--max-shard-size`, next to config.json, the generation config and the tokenizer. The directory is published
atomically like every other export.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from supervisor.checkpoint import safe_load
from supervisor.checkpoint.durable import publish_dir, tmp_name
from supervisor.checkpoint.layout import MANIFEST, RUN_CONFIG, step_of
from supervisor.checkpoint.store import CheckpointError, read_checkpoint
from supervisor.config import Backend, Config

MODEL_PREFIX = "model."
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for checkpoints above this
READ_CHUNK_BYTES = 512 << 20    # tensors read per DCP call, so the bar moves and memory stays bounded
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(RuntimeError):
    pass


def run_config(checkpoint: Path) -> Config:
    """The config the run that wrote `checkpoint` used (run_config.json); ExportError when there is none."""
    if step_of(checkpoint) is None or not (checkpoint / RUN_CONFIG).is_file():
        raise ExportError(f"{checkpoint}: not a recover checkpoint directory (globalstep<N> with {RUN_CONFIG})")
    try:
        return Config.model_validate(json.loads((checkpoint / RUN_CONFIG).read_text()))
    except ValueError as e:
        raise ExportError(f"{checkpoint / RUN_CONFIG}: unreadable ({str(e).splitlines()[0]})") from e


def validated(checkpoint: Path) -> Config:
    """The run's config of a checkpoint whose every file matches its manifest and whose manifest names the
    engine the run used (the checkpoint's own claim does not choose how it is read); ExportError naming the
    bad file."""
    config = run_config(checkpoint)
    try:
        manifest = read_checkpoint(checkpoint).manifest
    except CheckpointError as e:
        raise ExportError(f"damaged checkpoint: {e}") from e
    engine, backend = manifest.get("engine", "fsdp"), config.actor.backend.value
    if engine != backend:
        raise ExportError(f"damaged checkpoint: {checkpoint / MANIFEST}: engine {engine}, but {RUN_CONFIG} says "
                          f"actor.backend {backend}")
    return config


def read_model_weights(checkpoint: Path, label: str = "reading") -> dict[str, torch.Tensor]:
    """The full model weights of a recover checkpoint written by any number of ranks, in one process."""
    metadata = safe_load.read_metadata(checkpoint).state_dict_metadata
    wanted = {k: v for k, v in metadata.items() if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    weights = {k[len(MODEL_PREFIX):]: torch.empty(v.size, dtype=v.properties.dtype) for k, v in wanted.items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=total < PROGRESS_MIN_BYTES) as bar:
        chunk: dict[str, torch.Tensor] = {}
        names = list(weights)
        for i, name in enumerate(names):
            chunk[name] = weights[name]
            size = sum(t.numel() * t.element_size() for t in chunk.values())
            if size >= READ_CHUNK_BYTES or i == len(names) - 1:
                with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point
                    warnings.simplefilter("ignore", UserWarning)
                    safe_load.load({"model": chunk}, checkpoint, no_dist=True)
                bar.update(size)
                chunk = {}
    return weights


def tied_names(model) -> set[str]:
    """Parameter names that share storage with an earlier one (lm_head tied to the embeddings)."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def export_recover_checkpoint(checkpoint: Path, out: Path, dtype: str | None = None,
                              max_shard_size: str | None = None, model_dir: Path | None = None) -> None:
    """Write `out` from `checkpoint`. The model's config and tokenizer come from the run's model (its
    model.path, or the tiny model's sizes), or from `model_dir` when the source is elsewhere here."""
    from transformers import AutoModelForCausalLM

    from workers.model import build_tokenizer, model_config, save_model_dir

    checkpoint = checkpoint.resolve()
    if out.exists():
        raise ExportError(f"{out}: already exists; choose another --out")
    config = validated(checkpoint)
    model_cfg = config.model
    if model_dir is not None:
        model_cfg = model_cfg.model_copy(update={"path": model_dir.resolve()})
    if model_cfg.path is not None and not (model_cfg.path / "config.json").is_file():
        raise ExportError(f"model.path {model_cfg.path} of this run is not here; pass --model DIR "
                          f"(a directory with the model's config.json and tokenizer)")
    weights = checkpoint_weights(checkpoint, config)
    target = DTYPES[dtype] if dtype else None
    if target is not None:
        weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
    tokenizer = build_tokenizer(model_cfg)
    hf_config = model_config(model_cfg, tokenizer)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=target or torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [k for k in missing if k not in tied_names(model)]
    if missing or unexpected:
        raise ExportError(f"{checkpoint}: weights do not fit the model of {model_cfg.path or 'the tiny config'}: "
                          f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(out)
    save_model_dir(model, tokenizer, model_cfg, tmp, max_shard_size or config.saver.max_shard_size)
    publish_dir(tmp, out)


def checkpoint_weights(checkpoint: Path, config: Config) -> dict[str, torch.Tensor]:
    """The full model weights of a `validated` recover checkpoint, read as the engine of its run wrote them;
    ExportError naming a file that asks to run code."""
    try:
        if config.actor.backend is Backend.DEEPSPEED:
            return deepspeed_weights(checkpoint, step_of(checkpoint))
        return read_model_weights(checkpoint, label=f"reading {checkpoint.name}")
    except safe_load.UnsafeCheckpointError as e:
        raise ExportError(f"unsafe checkpoint: {str(e).splitlines()[0]}") from e


def deepspeed_weights(checkpoint: Path, step: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 merge of every rank's ZeRO partitions (stage 1, 2 or 3), its files read
    with weights_only loading (safe_load.deepspeed_files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with safe_load.deepspeed_files():
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=f"global_step{step}")
    except (ValueError, KeyError, TypeError, OSError) as e:  # files that load safely but are not DeepSpeed's
        raise ExportError(f"damaged checkpoint: {checkpoint}: DeepSpeed cannot read it "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
