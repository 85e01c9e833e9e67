"""Read an offline W&B run back (history and config), for tests of the W&B sink."""

import json
import struct
import time
from pathlib import Path


def wandb_records(path):
    """The records of an offline run's .wandb file: LevelDB log blocks after a 7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def finished_records(run_dir, timeout=30.0):
    """The run file's records once W&B's service has written its exit record: the service writes the file in a
    process of its own, so a run's `finish()` can return before the last records reach the disk."""
    deadline = time.monotonic() + timeout
    while True:
        run_files = list(Path(run_dir).glob("run-*.wandb"))
        try:
            records = list(wandb_records(run_files[0])) if len(run_files) == 1 else []
        except Exception:  # a record cut short mid-write: read again
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(run_dir):
    history, config = {}, {}
    for record in finished_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind in ("run", "config"):
            source = record.run.config if kind == "run" else record.config
            config |= {i.key: json.loads(i.value_json) for i in source.update}
    return history, config
