"""Read back an offline W&B run (``wandb/offline-run-*/run-<id>.wandb``) without the network.

wandb 0.31 ships no Python reader for its transaction log (``wandb.sdk.internal.datastore`` is gone), and an
offline run writes no ``config.yaml`` or ``wandb-metadata.json``: everything is in the ``.wandb`` file. Its format
is a LevelDB-style log: a 7-byte header (``:W&B``, magic ``0xBEE1``, version 0), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC-32 ``<I``, length ``<H``, type ``<B``: 1 full, 2 first, 3 middle, 4 last) that together
carry serialized ``wandb.proto.wandb_internal_pb2.Record`` messages (run, config, history, summary, exit, ...).

This module reads those records into an :class:`OfflineRun` (id, project, group, name, job type, tags, config,
summary, history rows). The tests use it to check what a run sent to W&B; ``wandb sync`` uploads the same files.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    """The ``Record`` messages of one ``.wandb`` file, in order (a torn last chunk is ignored)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B transaction log")
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            pos += left
            continue
        body = data[pos + CHUNK.size : pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if len(body) < length or zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF != crc:
            break  # a run killed mid-write
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _key(item: Any) -> tuple[str, ...]:
    return tuple(item.nested_key) if item.nested_key else (item.key,)


def _set(target: dict[str, Any], key: tuple[str, ...], value: Any) -> None:
    for part in key[:-1]:
        target = target.setdefault(part, {})
    target[key[-1]] = value


@dataclass
class OfflineRun:
    id: str = ""
    project: str = ""
    group: str = ""
    name: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed: bool = False
    exited: bool = False  #: the file holds the run's exit record (W&B finished writing it)
    files: list[Path] = field(default_factory=list)


def read_offline_run(path: str | Path) -> OfflineRun:
    """One ``offline-run-*`` folder (or its ``.wandb`` file)."""
    path = Path(path)
    file = path if path.suffix == ".wandb" else next(path.glob("*.wandb"))
    run = OfflineRun(files=[file])
    for record in records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.id, run.project, run.group = r.run_id, r.project, r.run_group
            run.name, run.job_type, run.tags = r.display_name, r.job_type, list(r.tags)
            run.resumed = bool(getattr(r, "resumed", False))
            for item in r.config.update:
                _set(run.config, _key(item), json.loads(item.value_json))
        elif kind == "config":
            for item in record.config.update:
                _set(run.config, _key(item), json.loads(item.value_json))
        elif kind == "summary":
            for item in record.summary.update:
                _set(run.summary, _key(item), json.loads(item.value_json))
        elif kind == "exit":
            run.exited = True
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                row["/".join(_key(item))] = json.loads(item.value_json)
            run.history.append(row)
    run.config.pop("_wandb", None)
    if not run.id and file.parent.name.startswith(("offline-run-", "run-")):
        run.id = file.parent.name.rsplit("-", 1)[-1]  # a process killed before W&B flushed: only the folder names it
    return run


def offline_runs(root: str | Path, wait_s: float = 0.0) -> list[OfflineRun]:
    """Every offline run below ``root`` (each ``offline-run-*`` folder once, oldest first). W&B's service writes
    the file in the background, also after ``finish()`` returned: ``wait_s`` waits up to that long for every run
    to hold its exit record (a run killed with SIGKILL never gets one)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        folders = sorted({p.parent for p in Path(root).rglob("offline-run-*/*.wandb")}, key=lambda p: p.name)
        runs = [read_offline_run(f) for f in folders]
        if all(r.exited for r in runs) or time.monotonic() >= deadline:
            return runs
        time.sleep(0.1)
