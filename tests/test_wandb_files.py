"""``fl_lightning/wandb_files.py``: an offline W&B transaction log written here in the format the module documents
(a 7-byte header, 32 KiB blocks of CRC-checked chunks carrying ``Record`` messages), read back: the run's fields,
nested config and summary keys, history rows, a record split over blocks, a torn last chunk, and the folder walk."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

from fl_lightning.wandb_files import offline_runs, read_offline_run, records  # noqa: E402

BLOCK = 32 * 1024


def write_log(path: Path, messages: list[bytes], torn: bytes = b"") -> None:
    """A LevelDB-style log: each message in chunks that never cross a block (FULL, or FIRST/MIDDLE…/LAST), a block's
    tail under 7 bytes zero padded; ``torn``: a last chunk whose CRC does not match (a run killed mid-write)."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))

    def chunk(kind: int, body: bytes, crc: int | None = None) -> None:
        crc = zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF if crc is None else crc
        out.extend(struct.pack("<IHB", crc, len(body), kind) + body)

    for message in messages:
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out.extend(b"\0" * left)
                continue
            room = left - 7
            piece, message = message[:room], message[room:]
            kind = (1 if first else 4) if not message else (2 if first else 3)
            chunk(kind, piece)
            first = False
            if not message:
                break
    if torn:
        chunk(1, torn, crc=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))


def _items(target, values: dict) -> None:
    for key, value in values.items():
        item = target.add()
        if isinstance(key, tuple):
            item.nested_key.extend(key)
        else:
            item.key = key
        item.value_json = json.dumps(value)


def run_messages(run_id: str, rows: int = 2, big: int = 0) -> list[bytes]:
    run = pb.Record()
    run.run.run_id, run.run.project, run.run.run_group = run_id, "proj", "grp"
    run.run.display_name, run.run.job_type = "name", "train"
    run.run.tags.extend(["a", "b"])
    _items(run.run.config.update, {"lr": 0.1, ("model", "executor"): "auto", "_wandb": {"x": 1}})
    config = pb.Record()
    _items(config.config.update, {"note": "x" * big})  # a long value: the record spans several blocks
    history = []
    for step in range(rows):
        record = pb.Record()
        _items(record.history.item, {"round": step, ("val", "acc_mean"): 0.5 + step / 10})
        history.append(record)
    summary = pb.Record()
    _items(summary.summary.update, {"final": 0.7, ("ran", "executor"): "stacked"})
    done = pb.Record()
    done.exit.exit_code = 0
    return [m.SerializeToString() for m in (run, config, *history, summary, done)]


def test_a_run_is_read_back_field_by_field(tmp_path: Path) -> None:
    file = tmp_path / "wandb" / "offline-run-20261128_101010-abc123" / "run-abc123.wandb"
    write_log(file, run_messages("abc123", big=70_000))
    run = read_offline_run(file.parent)
    assert (run.id, run.project, run.group, run.name, run.job_type, run.tags) == (
        "abc123", "proj", "grp", "name", "train", ["a", "b"])  # fmt: skip
    assert run.config == {"lr": 0.1, "model": {"executor": "auto"}, "note": "x" * 70_000}  # _wandb dropped
    assert run.history == [{"round": 0, "val/acc_mean": 0.5}, {"round": 1, "val/acc_mean": 0.6}]
    assert run.summary == {"final": 0.7, "ran": {"executor": "stacked"}}
    assert run.exited and run.files == [file]
    assert len(list(records(file))) == 6


def test_a_torn_log_keeps_what_was_complete_and_the_folder_names_the_run(tmp_path: Path) -> None:
    messages = run_messages("ignored", rows=3)
    file = tmp_path / "offline-run-20261128_101010-zz9" / "run-zz9.wandb"
    write_log(file, messages[2:4], torn=messages[4])  # no run record, two history rows, a torn third one
    run = read_offline_run(file)
    assert run.id == "zz9" and len(run.history) == 2 and not run.exited
    (tmp_path / "bad.wandb").write_bytes(b"not a log at all")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(records(tmp_path / "bad.wandb"))


def test_offline_runs_finds_every_run_folder_oldest_first(tmp_path: Path) -> None:
    write_log(tmp_path / "a" / "wandb" / "offline-run-20261128_120000-late" / "run-late.wandb", run_messages("late"))
    write_log(tmp_path / "b" / "wandb" / "offline-run-20261128_110000-soon" / "run-soon.wandb", run_messages("soon"))
    assert [r.id for r in offline_runs(tmp_path)] == ["soon", "late"]
