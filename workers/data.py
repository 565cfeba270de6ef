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
    """Every row of `data.path` (iter_prompts), in memory: the Supervisor serves batches from it."""
    return list(iter_prompts(path, prompt_key, answer_key))


def iter_prompts(path: Path, prompt_key: str = "prompt", answer_key: str | None = None) -> Iterator[dict]:
    """The rows of `data.path`, told apart by the path: a Parquet file, a directory saved by HF `datasets`
    (`save_to_disk`) or of Parquet files, else JSONL. Each row keeps its own keys and gets `prompt` (and
    `answer`, with `answer_key`) from the keys the config names, replacing any of those names it had; a row
    without them is refused with its file and number. A prompt is a string or a chat (a list of messages with
    `role` and `content`, as verl's datasets keep it), which the engine puts through the chat template."""
    path = Path(path)
    try:
        if path.is_dir():
            source = _saved_dataset_rows(path) if (path / "state.json").is_file() or \
                (path / "dataset_dict.json").is_file() else _parquet_directory_rows(path)
        elif path.suffix.lower() in PARQUET_SUFFIXES:
            source = _parquet_rows(path, path)
        else:
            source = _jsonl_rows(path)
        for where, row in source:
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a mapping of keys, not {type(row).__name__}")
            row["prompt"] = _field(row, prompt_key, where, "data.prompt_key")
            if not _is_prompt(row["prompt"]):
                raise DataError(f"{where}: {prompt_key!r} must be a string or a list of messages with 'role' and "
                                f"'content', not {_kind(row['prompt'])} (data.prompt_key)")
            if answer_key is not None:
                row["answer"] = _field(row, answer_key, where, "data.answer_key")
            yield row
    except OSError as e:
        raise DataError(f"data.path {path}: {e.strerror or e}") from None


def _is_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _field(row: dict, key: str, where: str, config_key: str):
    """`row[key]`, or for a dotted key a nested field (`reward_model.ground_truth`, as verl's datasets keep it);
    a null (Parquet's and Arrow's missing value) is no value."""
    value = row.get(key)
    if key not in row:
        value = row
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise DataError(f"{where}: no {key!r} key ({config_key})")
            value = value[part]
    if value is None:
        raise DataError(f"{where}: {key!r} is null ({config_key})")
    return value


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    """One JSON object per line, read line by line (blank lines skipped; a UTF-8 byte order mark allowed)."""
    number = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}: row {number}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: row {number}: not JSON ({e.msg}); data.path is read as JSONL unless "
                                    f"it ends in {' or '.join(PARQUET_SUFFIXES)} or is a directory") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: row {number + 1}: not UTF-8 text (a compressed file is not read: give JSONL, "
                        f"Parquet or a saved HF dataset)") from None


def _parquet_rows(path: Path, named: Path, first: int = 1) -> Iterator[tuple[str, object]]:
    """A Parquet file's rows, a record batch at a time (the whole table is never held beside the rows); rows
    are numbered from `first` within the dataset `named`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = first - 1
    try:
        with pq.ParquetFile(path) as file:
            for batch in file.iter_batches():
                for row in batch.to_pylist():
                    number += 1
                    yield f"{named}: row {number}", row
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a Parquet file pyarrow reads ({e})") from None


def _parquet_directory_rows(path: Path) -> Iterator[tuple[str, object]]:
    """A directory of Parquet files (as Spark and the HF hub's `data/` folders keep them), in name order."""
    files = sorted(f for f in path.rglob("*") if f.suffix.lower() in PARQUET_SUFFIXES)
    if not files:
        raise DataError(f"data.path {path} is a directory of no dataset: neither saved by HF datasets "
                        f"(save_to_disk: state.json) nor holding Parquet files")
    number = 0
    for file in files:
        for where, row in _parquet_rows(file, path, number + 1):
            number += 1
            yield where, row


def _saved_dataset_rows(path: Path) -> Iterator[tuple[str, object]]:
    """A directory written by HF `Dataset.save_to_disk`: its Arrow files in the order its state.json lists."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"data.path {path} holds a DatasetDict: name one split's directory"
                        + (f", e.g. {path / splits[0]}" if splits else ""))
    try:
        state = json.loads((path / "state.json").read_text())
        files = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path / 'state.json'}: not the state of a dataset saved by HF datasets ({e!r})") from None
    if state.get("_indices_data_files"):  # datasets 1.x kept a selection beside the rows: not read here
        raise DataError(f"data.path {path}: saved with an indices mapping (datasets 1.x); save it again with a "
                        f"newer datasets (flatten_indices first)")
    number = 0
    for name in files:
        try:
            with pa.memory_map(str(path / name)) as source:
                for batch in pa.ipc.open_stream(source):
                    for row in batch.to_pylist():
                        number += 1
                        yield f"{path}: row {number}", row
        except pa.ArrowException as e:
            raise DataError(f"{path / name}: not an Arrow file of a saved HF dataset ({e})") from None


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
