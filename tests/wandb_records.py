"""Reads back what an offline Weights & Biases run wrote (`run-*.wandb`), so tests check the real
file and not a mock: the file is LevelDB's log format (32 KiB blocks of chunks, each a 7-byte
header: CRC, length, type full/first/middle/last) after W&B's 7-byte header, and each record a
`wandb_internal_pb2.Record` protobuf. wandb 0.31 ships no Python reader of its own."""

from __future__ import annotations

import json
import time
from pathlib import Path

BLOCK = 32768
HEADER = b":W&B\xe1\xbe\x00"


def _chunks(data: bytes) -> list[bytes]:
    assert data[:7] == HEADER, f"not a W&B run file: {data[:7]!r}"
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        payload = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            break
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
            pending = b""
    return records


def read_run(directory: Path, seconds: float = 60) -> dict:
    """{"name", "project", "config": {key: value}, "history": {step: {key: value}}} of the one
    offline run under `directory` (W&B's `wandb/offline-run-*/run-*.wandb`). The file is written
    by wandb's service process, which may still be flushing it after `finish()` returns: read
    until it holds the run's exit record (or `seconds` pass)."""
    runs = sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    deadline = time.monotonic() + seconds
    while True:
        result = _parse(runs[0].read_bytes())
        if result.pop("exited") or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def _parse(data: bytes) -> dict:
    from wandb.proto import wandb_internal_pb2

    result: dict = {"history": {}, "config": {}, "exited": False}
    for payload in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            result["name"], result["project"] = record.run.display_name, record.run.project
            for item in record.run.config.update:
                result["config"][item.key] = json.loads(item.value_json)
        elif kind == "exit":
            result["exited"] = True
        elif kind == "history":
            row = result["history"].setdefault(record.history.step.num, {})
            for item in record.history.item:
                row["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return result
