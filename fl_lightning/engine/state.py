"""ClientStateBank: every per-client tensor as one client-indexed table ``[num_clients, ...]``, placed where it fits.

``model.client_state`` (issue 28) says where the table lives:

* ``device``: registered buffers on the module's device (the layout before issue 28): checkpoints carry the whole
  bank in ``state_dict`` (``bank.<name>``), O(N) bytes per checkpoint.
* ``host``: CPU memory (pinned when CUDA is available); each round's cohort rows are gathered there and moved to the
  device, and the new rows moved back.
* ``disk``: memory-mapped files ``<run_dir>/client_state/<name>.bin`` (sparse: a row takes disk space once written),
  so the process's anonymous memory is bounded by the cohort, not by N.

Host and disk banks start *lazily*: a row that was never written is the template (every client starts from the same
state), so building a bank of 10⁶ clients touches no row. Their checkpoints are incremental: the rows written since
the previous checkpoint are appended to the run's journal (``client_state/rows-<id>.pt``) and the checkpoint keeps
the list of journal files it consists of (``fl_client_state``); resuming replays that list, so a ``kill -9`` after
a checkpoint resumes exactly that checkpoint's bank, whatever the killed process wrote afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError

log = logging.getLogger("fl_lightning")

__all__ = [
    "AUTO_DEVICE_BYTES",
    "STATE_PREFIX",
    "STEPS",
    "ClientStateBank",
    "Placement",
    "choose_placement",
    "make_bank",
    "memory_available",
    "split_state",
    "state_name",
]

Placement = Literal["auto", "device", "host", "disk"]

#: ``auto`` keeps a bank of at most this many bytes on the device (today's layout: every checkpoint writes it whole,
#: which costs little below this size); a larger one goes to the host or disk, whose checkpoints write what changed
AUTO_DEVICE_BYTES = 32 * 2**20


def _key(name: str) -> str:
    return name.replace(".", "__")


def memory_available() -> int:
    """Bytes of memory available to a new allocation (``MemAvailable`` of ``/proc/meminfo``; 0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def choose_placement(requested: Placement, bank_bytes: int, world_size: int = 1) -> str:
    """Where the bank goes. ``auto``: ``device`` when the bank is at most ``AUTO_DEVICE_BYTES`` (32 MiB) or the run
    has several processes; else ``host`` when it takes at most half of the memory available now (``MemAvailable``);
    else ``disk``. (On a GPU the host bank moves only the cohort's rows each round.)"""
    if requested not in ("auto", "device", "host", "disk"):
        raise ConfigError(f"model.client_state must be auto, device, host or disk, got {requested!r}")
    if requested != "auto":
        if requested != "device" and world_size > 1:
            raise ConfigError(
                f"model.client_state {requested} runs on one process ({world_size} here); use device (or auto)"
            )
        return requested
    if bank_bytes <= AUTO_DEVICE_BYTES or world_size > 1:
        return "device"
    available = memory_available()
    return "host" if available and bank_bytes <= available // 2 else "disk"


class ClientStateBank(nn.Module):
    """Per-client state (personal layers, control variates, personal models…), one table per state name.

    ``gather``/``scatter`` move a cohort's rows with one index operation; ``get`` is one client's state on the
    module's device. ``row(name)`` is the whole table (for small banks and tests: on a host or disk bank it writes
    the template into every unwritten row first and marks the bank for a full journal entry).
    """

    def __init__(
        self,
        template: dict[str, Tensor],
        num_clients: int,
        placement: Literal["device", "host", "disk"] = "device",
        directory: str | Path | None = None,
    ) -> None:
        super().__init__()
        self.names = list(template)
        self.num_clients = num_clients
        self.placement = placement
        if placement == "device":
            self._initial = {name: value.detach().cpu().clone() for name, value in template.items()}
            for name, value in template.items():
                self.register_buffer(_key(name), value.detach().unsqueeze(0).repeat(num_clients, *[1] * value.dim()))
            return
        if placement not in ("host", "disk"):
            raise ConfigError(f"model.client_state must be device, host or disk, got {placement!r}")
        for name, value in template.items():  # non-persistent: they follow .to() / .double(), not in state_dict
            self.register_buffer("template__" + _key(name), value.detach().clone(), persistent=False)
        if directory is None:
            directory = tempfile.mkdtemp(prefix="fl_client_state_")
            weakref.finalize(self, shutil.rmtree, directory, True)
        self.directory = Path(directory)
        self.pinned = placement == "host" and torch.cuda.is_available()
        self.written = torch.zeros(num_clients, dtype=torch.bool)  #: rows that differ from the template
        self.dirty: set[int] = set()  #: rows written since the last journal entry
        self.all_dirty = False
        self.segments: list[str] = []  #: this bank's journal files, oldest first
        self._stores: dict[str, Tensor] = {n: self._allocate(n, self.template(n).dtype) for n in self.names}

    # ---- storage ---------------------------------------------------------------------------------------------
    def template(self, name: str) -> Tensor:
        return getattr(self, "template__" + _key(name))

    def _allocate(self, name: str, dtype: torch.dtype, suffix: str = "") -> Tensor:
        shape = (self.num_clients, *self.template(name).shape)
        numel = int(torch.Size(shape).numel())
        if self.placement == "host" or numel == 0:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned and numel > 0)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{_key(name)}{suffix}.bin"
        path.unlink(missing_ok=True)  # a fresh sparse file: rows of an earlier process are not this bank's
        with open(path, "wb") as f:
            f.truncate(numel * torch.empty((), dtype=dtype).element_size())
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)

    def _apply(self, fn: Any, recurse: bool = True) -> ClientStateBank:
        """``.to(device)`` moves the templates only (host and disk tables stay); a dtype change (``.double()``,
        ``trainer.precision: 64-true``) converts the tables too."""
        super()._apply(fn, recurse)
        if self.placement != "device":
            for n in self.names:
                dtype = self.template(n).dtype
                if self._stores[n].dtype != dtype:
                    old, self._stores[n] = self._stores[n], self._allocate(n, dtype, suffix=".retyped")
                    self._stores[n].copy_(old)
                    if self.placement == "disk":  # the mapping follows the renamed file
                        os.replace(self.directory / f"{_key(n)}.retyped.bin", self.directory / f"{_key(n)}.bin")
        return self

    @property
    def device(self) -> torch.device:
        if self.placement == "device":
            return next((b.device for b in self.buffers()), torch.device("cpu"))
        return self.template(self.names[0]).device if self.names else torch.device("cpu")

    # ---- rows --------------------------------------------------------------------------------------------------
    def row(self, name: str) -> Tensor:
        """The whole table ``[num_clients, ...]`` of ``name`` (O(N): not for the round's hot path)."""
        if self.placement == "device":
            return getattr(self, _key(name))
        self._materialize()
        return self._stores[name]

    def _materialize(self) -> None:
        missing = (~self.written).nonzero().flatten()
        if missing.numel():
            for n in self.names:
                self._stores[n][missing] = self.template(n).to("cpu", self._stores[n].dtype)
            self.written[:] = True
        self.all_dirty = True  # the caller may write into the table directly

    def get(self, client: int) -> dict[str, Tensor]:
        """Client ``client``'s state on the module's device (on a device bank: views; callers must not modify
        them in place)."""
        if self.placement == "device":
            return {n: self.row(n)[client] for n in self.names}
        if not bool(self.written[client]):
            return {n: self.template(n) for n in self.names}
        device = self.device
        return {n: self._stores[n][client].to(device, non_blocking=self.pinned) for n in self.names}

    def gather(self, clients: Tensor) -> dict[str, Tensor]:
        """The rows of ``clients`` ``[K, ...]`` on the module's device (a copy for host and disk banks)."""
        if self.placement == "device":
            return {n: self.row(n)[clients] for n in self.names}
        ids = clients.cpu()
        fresh = ~self.written[ids]
        any_fresh = bool(fresh.any())
        device, out = self.device, {}
        for n in self.names:
            rows = self._stores[n][ids]
            if any_fresh:
                rows[fresh] = self.template(n).to("cpu", rows.dtype)
            out[n] = rows.pin_memory().to(device, non_blocking=True) if self.pinned else rows.to(device)
        return out

    def scatter(self, clients: Tensor, values: dict[str, Tensor]) -> None:
        if self.placement == "device":
            for n in self.names:
                self.row(n)[clients] = values[n].to(self.row(n).dtype)
            return
        ids = clients.cpu()
        for n in self.names:
            self._stores[n][ids] = values[n].detach().to("cpu", self._stores[n].dtype)
        self.written[ids] = True
        self.dirty.update(ids.tolist())

    def bytes_per_client(self) -> int:
        if self.placement == "device":
            return sum(self.row(n)[0].numel() * self.row(n).element_size() for n in self.names)
        return sum(self.template(n).numel() * self._stores[n].element_size() for n in self.names)

    def shapes(self) -> dict[str, Tensor]:
        """``bank.<name>`` → an empty ``meta`` tensor of the table's shape and dtype (checkpoint checks)."""
        if self.placement == "device":
            return {f"bank.{k}": v.to("meta") for k, v in self.state_dict().items()}
        return {
            f"bank.{_key(n)}": torch.empty((self.num_clients, *self.template(n).shape), dtype=s.dtype, device="meta")
            for n, s in self._stores.items()
        }

    # ---- checkpoints: the journal ----------------------------------------------------------------------------
    def save_journal(self, directory: str | Path) -> dict[str, Any]:
        """Append the rows written since the last entry to the journal in ``directory`` (nothing when none were);
        returns the checkpoint's ``fl_client_state``: the journal files that rebuild this bank, in order."""
        directory = Path(directory)
        if self.placement == "device":
            raise RuntimeError("a device bank is checkpointed whole in state_dict")
        if self.all_dirty:
            ids = self.written.nonzero().flatten()
        else:
            ids = torch.tensor(sorted(self.dirty), dtype=torch.long)
        if ids.numel():
            directory.mkdir(parents=True, exist_ok=True)
            name = f"rows-{uuid.uuid4().hex[:16]}.pt"
            tmp = directory / (name + ".tmp")
            torch.save({"clients": ids, "rows": {n: self._stores[n][ids] for n in self.names}}, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, directory / name)  # a journal file is complete or absent
            self.segments.append(name)
        self.dirty.clear()
        self.all_dirty = False
        return {
            "format": 1,
            "directory": str(directory.resolve()),
            "segments": list(self.segments),
            "num_clients": self.num_clients,
            "shapes": {_key(n): [list(self.template(n).shape), str(self._stores[n].dtype)] for n in self.names},
        }

    def restore_journal(self, journal: dict[str, Any], directories: list[Path]) -> None:
        """Rebuild the bank of a checkpoint's ``fl_client_state``: template everywhere, then every journal file in
        order (looked up in ``journal['directory']``, else in ``directories``)."""
        segments = journal["segments"]
        candidates = [Path(journal["directory"]), *directories]
        folder = next((d for d in candidates if all((d / s).is_file() for s in segments)), None)
        if folder is None:
            raise ConfigError(
                f"the checkpoint's client state ({len(journal['segments'])} journal files in {journal['directory']}) "
                "is missing; fix: resume from the run folder that wrote it (its client_state/ folder)"
            )
        if self.placement == "device":
            for n in self.names:
                row = self.row(n)
                row.copy_(self._device_template(n).expand_as(row))
        else:
            self.written.zero_()
        for segment in journal["segments"]:
            entry = torch.load(folder / segment, map_location="cpu", weights_only=True)
            rows = {n: entry["rows"][n] for n in self.names}
            self.scatter(entry["clients"], rows)
        if self.placement != "device":
            self.segments = list(journal["segments"])
            self.dirty.clear()
            self.all_dirty = False

    def _device_template(self, name: str) -> Tensor:
        return self._initial[name].to(self.row(name).device, self.row(name).dtype)

    def load_full(self, rows: dict[str, Tensor]) -> None:
        """A whole bank (``bank.<name>`` tables of a device-placed checkpoint) into a host or disk bank; the next
        journal entry holds every row."""
        for n in self.names:
            self._stores[n].copy_(rows[f"bank.{_key(n)}"].to("cpu", self._stores[n].dtype))
        self.written[:] = True
        self.all_dirty = True


def make_bank(template: dict[str, Tensor], num_clients: int, client_state: str, trainer: Any) -> ClientStateBank:
    """The run's bank where ``model.client_state`` puts it (``choose_placement`` from its size and the trainer's
    world size; logged when not on the device); disk banks live in ``<trainer.default_root_dir>/client_state``."""
    per_client = sum(t.numel() * t.element_size() for t in template.values())
    placement = choose_placement(client_state, per_client * num_clients, getattr(trainer, "world_size", 1))
    root = getattr(trainer, "default_root_dir", None)
    directory = None if root is None else Path(root) / "client_state"
    if placement != "device":
        log.info("client state: %s (%.3g GB for %d clients)", placement, per_client * num_clients / 1e9, num_clients)
    return ClientStateBank(template, num_clients, placement, directory)


# ---- the kept client optimiser state (``model.keep_client_optimizer_state``): bank rows beside the algorithm's ----
#: Bank names of the kept client optimiser state: ``client_optimizer.<key>.<parameter name>``.
STATE_PREFIX = "client_optimizer."
#: The per-parameter step counter that says whether a kept state exists yet (0: fresh, as torch builds it).
STEPS = "steps"


def split_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the algorithm's client state, the kept client optimiser state)."""
    mine = {n: v for n, v in state.items() if n.startswith(STATE_PREFIX)}
    return {n: v for n, v in state.items() if n not in mine}, mine


def state_name(key: str, param: str) -> str:
    """The bank name of the kept optimiser state ``key`` of parameter ``param``."""
    return f"{STATE_PREFIX}{key}.{param}"
