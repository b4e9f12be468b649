"""One copy of a dataset for all runs of a process: runs keep their own partition as row indices.

Every run's DataModule builds its splits as client-sorted copies (``ClientSplit.from_indices``). Runs of one
dataset (seeds, methods, hyper-parameters) hold the same rows in other orders. ``RowPool.share`` finds each
split's rows in one pool per row shape (rows are matched by content: a float64 projection as the key, then an
exact comparison), and replaces the split by a ``SharedRowsSplit``: the run's own ``y`` and ``ptr`` plus row
indices into the pool. The pool keeps one tensor per device, so R runs on a GPU hold one device copy of the
images instead of R; a client's rows are gathered when it trains or is evaluated (a copy of that client only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.engine.client_data import ClientSplit, FederatedData


class _Rows:
    """The pooled rows of one shape and dtype, with one copy per device (rebuilt when rows are added)."""

    def __init__(self, example: Tensor) -> None:
        self.chunks: list[Tensor] = []
        self.count = 0
        self.index: dict[float, int] = {}
        width = int(example[0].numel()) if example.shape[0] else 0
        self.projection = torch.randn(width, generator=torch.Generator().manual_seed(12345), dtype=torch.float64)
        self.copies: dict[str, Tensor] = {}

    def keys(self, x: Tensor) -> list[float]:
        return (x.reshape(x.shape[0], -1).double() * self.projection).sum(1).tolist()

    def add(self, x: Tensor) -> Tensor:
        """Indices of ``x``'s rows in the pool (rows not there yet are appended)."""
        x = x.detach().cpu()
        rows, new = [], []
        for i, key in enumerate(self.keys(x)):
            j = self.index.get(key)
            if j is None:
                j = self.index[key] = self.count + len(new)
                new.append(i)
            rows.append(j)
        if new:
            self.chunks.append(x[new].clone())
            self.count += len(new)
            self.copies.clear()
        found = torch.tensor(rows, dtype=torch.long)
        if not torch.equal(self.on("cpu")[found], x):  # two different rows with one key: keep x's rows apart
            self.chunks.append(x.clone())
            found = torch.arange(self.count, self.count + x.shape[0])
            self.count += x.shape[0]
            self.copies.clear()
        return found

    def on(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
        """The rows on ``device`` (floating rows cast to ``dtype`` if given): one copy per device and dtype."""
        if "cpu" not in self.copies:
            self.copies["cpu"] = torch.cat(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
            self.chunks = [self.copies["cpu"]]
        base = self.copies["cpu"]
        dtype = dtype if dtype is not None and base.is_floating_point() else base.dtype
        key = f"{device}/{dtype}"
        if key not in self.copies:
            self.copies[key] = base.to(device, dtype)
        return self.copies[key]


class SharedRowsSplit(ClientSplit):
    """A ``ClientSplit`` whose ``x`` rows live in a pool shared with other runs: ``x = pool[rows]``.

    ``client(c)`` gathers client ``c``'s rows; ``x`` gathers the whole split (for code that reads it directly).
    """

    def __init__(
        self, pool: _Rows, rows: Tensor, y: Tensor, ptr: Tensor, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        # ClientSplit's dataclass __init__ would assign ``x``, which is a property here
        self.pool, self.rows, self.y, self.ptr, self.device, self.dtype = pool, rows, y, ptr, device, dtype

    @property
    def x(self) -> Tensor:  # type: ignore[override]
        return self.pool.on(self.device, self.dtype)[self.rows]

    def client(self, c: int) -> tuple[Tensor, Tensor]:
        lo, hi = int(self.ptr[c]), int(self.ptr[c + 1])
        return self.pool.on(self.device, self.dtype)[self.rows[lo:hi]], self.y[lo:hi]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SharedRowsSplit:
        y = self.y.to(device, dtype) if dtype is not None and self.y.is_floating_point() else self.y.to(device)
        return SharedRowsSplit(
            self.pool, self.rows.to(device), y, self.ptr.to(device), str(device), dtype if dtype else self.dtype
        )


class RowPool:
    """The rows of every run's splits, one pool per row shape and dtype."""

    def __init__(self) -> None:
        self.pools: dict[tuple, _Rows] = {}

    def share_split(self, split: ClientSplit) -> ClientSplit:
        if isinstance(split, SharedRowsSplit):
            return split
        x = split.x
        key = (tuple(x.shape[1:]), x.dtype)
        if key not in self.pools:
            self.pools[key] = _Rows(x)
        rows = self.pools[key].add(x)
        device = str(x.device)
        return SharedRowsSplit(self.pools[key], rows.to(device), split.y, split.ptr, device)

    def share(self, fed: FederatedData) -> FederatedData:
        """``fed`` with every split's rows in the pool (same values, same clients)."""
        return fed.map_splits(self.share_split)

    def rows(self) -> int:
        """Rows held (one copy each)."""
        return sum(p.count for p in self.pools.values())
