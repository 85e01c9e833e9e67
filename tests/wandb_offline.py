"""Read an offline W&B run back (history and config), for tests of the W&B sink."""

import json
import struct
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


def wandb_history(run_dir):
    history, config = {}, {}
    (run_file,) = Path(run_dir).glob("run-*.wandb")
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind in ("run", "config"):
            source = record.run.config if kind == "run" else record.config
            config |= {i.key: json.loads(i.value_json) for i in source.update}
    return history, config
