"""Read back what the trackers logged, offline (tests only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768  # the .wandb transaction log is a LevelDB-style log: 32 KiB blocks of 7-byte-headed records
_HEADER = 7  # ":W&B", magic 0xBEE1, version


def wandb_records(path: Path) -> list[Any]:
    """Every protobuf ``Record`` of an offline run's ``run-<id>.wandb`` file (wandb >= 0.2x no longer
    ships a Python reader). Record framing: crc32c (4), length (2, little-endian), type (1: FULL, 2:
    FIRST, 3: MIDDLE, 4: LAST); a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if len(data) < _HEADER:
        return []  # not written yet
    assert data[:4] == b":W&B", path
    pos, out, pending = _HEADER, [], b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break  # padding at the end, or a record still being written
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def wandb_offline_run(folder: Path, wait_s: float = 30) -> dict[str, Any]:
    """An offline run folder's id, project, name, config and history rows (``_step`` included). wandb's
    own process may still be flushing the file when ``finish()`` has returned: it is read once it ends
    with the run's ``exit`` record (or after ``wait_s``)."""
    import time

    (log,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    records = wandb_records(log)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = wandb_records(log)
    run: dict[str, Any] = {"config": {}, "history": []}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.update(id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name)
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in rec.history.item})
    # wandb stores a config value as {"value": v} (plus "desc"); unwrap it
    run["config"] = {k: v["value"] if isinstance(v, dict) and "value" in v else v
                     for k, v in run["config"].items() if not k.startswith("_")}
    return run
