"""Prompts, read from the user's dataset, and the order they are served in: a function of (seed, epoch, epoch_step).

Each epoch's order is a permutation drawn from (seed, epoch), so the loader's whole state is its position.
A resume inside epoch 2 serves epoch 2's order (not epoch 0's, as a plain DistributedSampler would),
and a resume at an epoch boundary starts the next epoch instead of an exhausted iterator.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

PARQUET_SUFFIXES = (".parquet", ".pq")


class DataError(ValueError):
    """A dataset that cannot be read, or a row without what the job needs: its file, row number and key."""


def read_prompts(path: Path, prompt_key: str = "prompt", answer_key: str | None = None) -> list[dict]:
    """Every row of `data.path`, told apart by the path: a Parquet file, a directory saved by HF `datasets`
    (`save_to_disk`), else JSONL. Each row keeps its own keys and gets `prompt` (and `answer`, with
    `answer_key`) from the keys the config names; a row without them is refused with its file and number."""
    path = Path(path)
    if path.is_dir():
        source = _saved_dataset_rows(path)
    elif path.suffix.lower() in PARQUET_SUFFIXES:
        source = _parquet_rows(path)
    else:
        source = _jsonl_rows(path)
    rows = []
    for where, row in source:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a mapping of keys, not {type(row).__name__}")
        row["prompt"] = _field(row, prompt_key, where, "data.prompt_key")
        if not isinstance(row["prompt"], str):
            raise DataError(f"{where}: {prompt_key!r} must be a string, not {type(row['prompt']).__name__} "
                            f"(data.prompt_key)")
        if answer_key is not None:
            row["answer"] = _field(row, answer_key, where, "data.answer_key")
        rows.append(row)
    return rows


def _field(row: dict, key: str, where: str, config_key: str):
    """`row[key]`, or for a dotted key a nested field (`reward_model.ground_truth`, as verl's datasets keep it)."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{where}: no {key!r} key ({config_key})")
        value = value[part]
    return value


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    """One JSON object per line, read line by line (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}: row {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {number}: not JSON ({e.msg}); data.path is read as JSONL unless it "
                                f"ends in {' or '.join(PARQUET_SUFFIXES)} or is a saved HF dataset") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    """A Parquet file's rows, a record batch at a time (the whole table is never held beside the rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches()
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield f"{path}: row {number}", row
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file pyarrow reads ({e})") from None


def _saved_dataset_rows(path: Path) -> Iterator[tuple[str, object]]:
    """A directory written by HF `Dataset.save_to_disk`: its Arrow files in the order its state.json lists."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"data.path {path} holds a DatasetDict: name one split's directory"
                        + (f", e.g. {path / splits[0]}" if splits else ""))
    state = path / "state.json"
    if not state.is_file():
        raise DataError(f"data.path {path} is a directory without state.json: not a dataset saved by HF "
                        f"datasets (save_to_disk); give a JSONL or Parquet file instead")
    number = 0
    for entry in json.loads(state.read_text())["_data_files"]:
        file = path / entry["filename"]
        try:
            with pa.memory_map(str(file)) as source:
                for batch in pa.ipc.open_stream(source):
                    for row in batch.to_pylist():
                        number += 1
                        yield f"{path}: row {number}", row
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not an Arrow file of a saved HF dataset ({e})") from None


class PromptLoader:
    def __init__(self, rows: list[dict], batch_size: int, seed: int, shuffle: bool = True):
        if len(rows) < batch_size:
            raise ValueError(f"data.batch_size {batch_size} is larger than the dataset ({len(rows)} prompts)")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size  # the last partial batch is dropped

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def batch(self, epoch: int, epoch_step: int) -> list[dict]:
        idx = self.order(epoch)[epoch_step * self.batch_size:(epoch_step + 1) * self.batch_size]
        return [self.rows[i] for i in idx]

    def state_dict(self, epoch: int, next_epoch_step: int) -> dict:
        """Plain data only (it is pickled into dataloader_info.pkl and read back by a safe unpickler)."""
        return {"epoch": epoch, "epoch_step": next_epoch_step, "dataset_size": len(self.rows),
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}
