"""Read an offline wandb run file (``run-<id>.wandb``) back, to check what the wandb tracker recorded.

The file is a LevelDB-style log of ``wandb_internal_pb2.Record`` protobufs (header ``:W&B``, 32 KiB blocks, records
split into FULL/FIRST/MIDDLE/LAST chunks). wandb 0.31 no longer ships a Python reader, so this small one lives here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, _magic, _version = HEADER.unpack_from(data, 0)
    if ident != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + CHUNK.size: pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_run(path: Path) -> dict[str, Any]:
    """``{"history": [{key: value}, ...], "config": {...}, "run": Record.run, "alerts": [...], "artifacts": [...]}``."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"history": [], "config": {}, "run": None, "alerts": [], "artifacts": []}
    for raw in raw_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "run":
            out["run"] = record.run
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "artifact" and record.artifact.type != "run_table":  # tables are stored as artifacts too
            out["artifacts"].append(record.artifact)
        elif kind == "alert":
            out["alerts"].append({"title": record.alert.title, "text": record.alert.text})
    return out
