"""Read what logging.trackers wrote back from disk: TensorBoard's event files and W&B's offline runs."""
from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_HEADER = b":W&B\xe1\xbe\x00"  # W&B's transaction log: its ident, magic 0xBEE1, version 0
BLOCK = 32768                      # records are framed in 32 KiB blocks, LevelDB's log format
FULL, LAST = 1, 4


def tensorboard_rows(directory: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} of every scalar, after TensorBoard's own purge of steps written again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in rows.setdefault(event.step, {}), f"{tag} at step {event.step} twice"
            rows[event.step][tag] = event.value
    return rows


def tensorboard_notes(directory: Path) -> dict[int, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    notes: dict[int, list[str]] = {}
    for event in acc.Tensors("events/text_summary"):
        notes.setdefault(event.step, []).extend(s.decode() for s in event.tensor_proto.string_val)
    return notes


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:len(WANDB_HEADER)] == WANDB_HEADER, path
    records, pending, pos = [], b"", len(WANDB_HEADER)
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def wandb_runs(directory: Path) -> list[tuple[str, dict[int, dict]]]:
    """(run id, {step: {key: value}}) of every offline run under `directory`, oldest first."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, history = None, {}
        for data in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = items.pop("_step")
                assert step not in history, f"step {step} twice in {path}"
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append((run_id, history))
    return runs
