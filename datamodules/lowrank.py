"""Matrices split by rows across clients for federated low-rank factorisation (spec 003 §4.1–4.2).

A client's inputs are its local row indices 0..nᵢ−1 and its targets the rows of Sⁱ (float64), so the
engine's evaluation of ``LowRankFactors`` is the reconstruction of Sⁱ. Sources:

* ``synthetic``: S = U_X diag(σ) V_Xᵀ + E, U_X, V_X orthonormal (QR of Gaussians, spec 003 §4.2 suggestion),
  σ = ``singular_values`` (the paper: all ``rank`` of them 1), E ~ N(0, noise²); N = 25 clients × 200 rows,
  d = 200, rank 5 (spec 003 §4.2). ``singular_values`` is a list of ``rank`` values, or
  ``{linspace: [first, last]}`` / ``{geomspace: [first, last]}`` (``rank`` evenly / geometrically spaced values),
  e.g. ``--data.init_args.singular_values '{linspace: [1, 0.5]}'``;
* ``digits``: the bundled sklearn 8×8 digits (the mnist stand-in), one digit per client (10 clients),
  d = 64, pixels scaled to [−1, 1] like the paper's code does for mnist;
* ``w8a``: a LIBSVM file (``path``), densified to 300 columns, split into contiguous blocks (spec 003 §4.1 [code]);
* ``mnist``: the raw idx files (``path``/train-images-idx3-ubyte, train-labels-idx1-ubyte) — the first
  ``max_rows`` images (6000 in the paper), one digit per client, scaled to [−1, 1];
* ``celeba``: ``path``/identity_CelebA.txt and ``path``/img_align_celeba/*.jpg — identities 1..N, centre
  crop 148, resize 32, channels concatenated (d = 3072, spec 003 §4.1 [code]).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError

Source = Literal["synthetic", "digits", "w8a", "mnist", "celeba"]


Spectrum = list[float] | dict[str, list[float]]


def resolve_spectrum(spec: Spectrum | None, rank: int) -> Tensor:
    """The ``rank`` signal singular values: ``None`` → all 1 (spec 003 §4.2), a list, or a one-key dict
    ``{linspace: [first, last]}`` / ``{geomspace: [first, last]}``. One-line ``ConfigError`` otherwise."""
    where = "LowRankDataModule.singular_values"
    if spec is None:
        return torch.ones(rank, dtype=torch.float64)
    if isinstance(spec, dict):
        if len(spec) != 1 or next(iter(spec)) not in ("linspace", "geomspace"):
            raise ConfigError(f"{where}: use a list or {{linspace: [first, last]}} / {{geomspace: [first, last]}}, "
                              f"got {spec}")  # fmt: skip
        kind, ends = next(iter(spec.items()))
        if len(ends) != 2 or min(ends) <= 0:
            raise ConfigError(f"{where}: {kind} needs two positive values [first, last], got {ends}")
        if kind == "linspace":
            values = torch.linspace(float(ends[0]), float(ends[1]), rank, dtype=torch.float64)
        else:
            values = torch.logspace(math.log10(ends[0]), math.log10(ends[1]), rank, dtype=torch.float64)
    else:
        values = torch.tensor([float(v) for v in spec], dtype=torch.float64)
        if values.numel() != rank:
            raise ConfigError(f"{where}: {values.numel()} values for rank {rank}")
    if values.min() <= 0:
        raise ConfigError(f"{where}: singular values must be positive, got {values.tolist()}")
    return values


def synthetic_lowrank(
    num_clients: int,
    rows: int,
    dim: int,
    rank: int,
    noise: float,
    generator: torch.Generator,
    singular_values: Spectrum | None = None,
) -> Tensor:
    """S = U_X diag(σ) V_Xᵀ + E (n×d, float64), n = num_clients·rows, σ from ``resolve_spectrum``."""
    n = num_clients * rows
    sigma = resolve_spectrum(singular_values, rank)
    ux, _ = torch.linalg.qr(torch.randn(n, rank, generator=generator, dtype=torch.float64))
    vx, _ = torch.linalg.qr(torch.randn(dim, rank, generator=generator, dtype=torch.float64))
    return (ux * sigma) @ vx.T + noise * torch.randn(n, dim, generator=generator, dtype=torch.float64)


def digits_by_label() -> tuple[Tensor, Tensor]:
    """sklearn digits as rows in [−1, 1] (d = 64) and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.as_tensor(data.data / 8.0 - 1.0, dtype=torch.float64), torch.as_tensor(data.target)


def load_w8a(path: str | Path, num_features: int = 300) -> Tensor:
    """A LIBSVM-format file as a dense float64 matrix (labels dropped)."""
    from sklearn.datasets import load_svmlight_file

    x, _ = load_svmlight_file(str(path), n_features=num_features)
    return torch.as_tensor(x.toarray(), dtype=torch.float64)


def load_mnist(root: str | Path, max_rows: int = 6000) -> tuple[Tensor, Tensor]:
    """The first ``max_rows`` MNIST training images (raw idx files, read by torchvision's IDX parser) in
    [−1, 1], flattened, and labels."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    root = Path(root)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        if not (root / name).is_file():
            raise FileNotFoundError(f"MNIST file {root / name} does not exist (raw IDX files are expected there)")
    images = read_image_file(str(root / "train-images-idx3-ubyte"))[:max_rows]
    labels = read_label_file(str(root / "train-labels-idx1-ubyte"))[:max_rows]
    x = images.reshape(len(images), -1).double() / 127.5 - 1.0
    return x, labels.long()


def load_celeba(root: str | Path, num_clients: int = 25, size: int = 32, crop: int = 148) -> tuple[Tensor, Tensor]:
    """Images of identities 1..num_clients: centre crop, resize, channels concatenated → [n, 3·size²]."""
    from PIL import Image

    root = Path(root)
    rows, owners = [], []
    for line in (root / "identity_CelebA.txt").read_text().split("\n"):
        if not line.strip():
            continue
        name, ident = line.split()
        if 1 <= int(ident) <= num_clients:
            img = Image.open(root / "img_align_celeba" / name).convert("RGB")
            w, h = img.size
            left, top = (w - crop) // 2, (h - crop) // 2
            img = img.crop((left, top, left + crop, top + crop)).resize((size, size), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.float64) / 255.0  # [size, size, 3]
            rows.append(arr.transpose(2, 0, 1).reshape(-1))
            owners.append(int(ident) - 1)
    return torch.as_tensor(np.stack(rows)), torch.as_tensor(owners)


def split_rows(s: Tensor, sizes: list[int]) -> tuple[ClientSplit, ClientSplit]:
    """Train and test splits of a row-split matrix: x = local row index, y = the row of S."""
    ptr = torch.zeros(len(sizes) + 1, dtype=torch.long)
    ptr[1:] = torch.tensor(sizes).cumsum(0)
    idx = torch.cat([torch.arange(n) for n in sizes])
    split = ClientSplit(idx, s, ptr)
    return split, split


class LowRankDataModule(FederatedDataModule):
    """Spec 003's matrices, one row block per client. ``num_clients`` must match the source (digits,
    mnist: 10 — one digit per client); ``dim`` must match the source's columns (digits 64, mnist 784, w8a 300,
    celeba 3072).

    Args (synthetic; paper values from spec 003 §4.2, all listed in docs/generators.md):
        num_clients, rows_per_client, dim: N = 25, nᵢ = 200, d = 200.
        rank: r* = rank(X) = 5 (also the default factorisation rank of ``LowRankFactors``).
        singular_values: σ₁…σ_r* of X (paper: all 1); a list or ``{linspace: [a, b]}`` / ``{geomspace: [a, b]}``.
        noise: standard deviation of E (paper: 0 in Fig. 2(a), 1e-6 in Fig. 2(b), 3(a) and Table 2).
    """

    def __init__(
        self,
        source: Source = "synthetic",
        num_clients: int = 25,
        rows_per_client: int = 200,
        dim: int = 200,
        rank: int = 5,
        noise: float = 0.0,
        singular_values: Spectrum | None = None,
        path: str | None = None,
        max_rows: int = 6000,
        clients_per_round: int | None = None,
        participation: float | None = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed)
        if source not in ("synthetic", "digits", "w8a", "mnist", "celeba"):
            raise ConfigError(f"LowRankDataModule: unknown source {source!r}")
        if source in ("w8a", "mnist", "celeba") and (path is None or not Path(path).exists()):
            raise ConfigError(f"LowRankDataModule: source {source} needs an existing data.path, got {path!r}")
        if source in ("digits", "mnist") and num_clients != 10:
            raise ConfigError(f"LowRankDataModule: {source} has one client per digit, so num_clients must be 10")
        if source == "synthetic":
            if rows_per_client < 1 or dim < 1 or not 1 <= rank <= min(num_clients * rows_per_client, dim):
                raise ConfigError(
                    f"LowRankDataModule: need rows_per_client ≥ 1, dim ≥ 1 and 1 ≤ rank ≤ min(rows, dim), got "
                    f"rows_per_client={rows_per_client}, dim={dim}, rank={rank}"
                )
            if noise < 0:
                raise ConfigError(f"LowRankDataModule: noise is a standard deviation ≥ 0, got {noise}")
            resolve_spectrum(singular_values, rank)  # validate now, not at setup
        self.source, self.rows_per_client, self.dim, self.rank = source, rows_per_client, dim, rank
        self.noise, self.path, self.max_rows = noise, path, max_rows
        self.singular_values = singular_values

    def matrix(self) -> tuple[Tensor, list[int]]:
        """The whole matrix S (client-sorted rows) and the clients' row counts."""
        if self.source == "synthetic":
            g = torch.Generator().manual_seed(self.resolved_seed)
            s = synthetic_lowrank(
                self.num_clients, self.rows_per_client, self.dim, self.rank, self.noise, g, self.singular_values
            )
            return s, [self.rows_per_client] * self.num_clients
        if self.source == "w8a":
            s = load_w8a(self.path, self.dim)
            sizes = [len(b) for b in np.array_split(np.arange(len(s)), self.num_clients)]
            return s, sizes
        if self.source == "celeba":
            x, owner = load_celeba(self.path, self.num_clients)
        else:
            x, owner = digits_by_label() if self.source == "digits" else load_mnist(self.path, self.max_rows)
        order = torch.argsort(owner, stable=True)
        sizes = torch.bincount(owner, minlength=self.num_clients).tolist()
        if min(sizes) == 0:
            raise ConfigError(f"LowRankDataModule: {self.source} has clients without rows ({sizes})")
        return x[order], sizes

    def build(self) -> FederatedData:
        s, sizes = self.matrix()
        if s.shape[1] != self.dim:
            raise ConfigError(f"LowRankDataModule: {self.source} has {s.shape[1]} columns but data.dim={self.dim}")
        train, test = split_rows(s, sizes)
        return FederatedData(train, test, None, seed=self.resolved_seed)


class LowRankMetrics(Callback):
    """Logs F = ½Σ‖Sⁱ − UⁱVᵀ‖², its optimum F_min = ½Σ_{i>r}σᵢ²(S) (Eckart–Young, r = V's columns), the excess
    F − F_min and κ(V) = σ₁(V)/σ_rank(V) after every round (spec 003 §6 item 9); the last round's values go into
    the run summary (``mf_loss``, ``mf_loss_min``, ``mf_excess``, ``mf_kappa_V``)."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self.history: list[dict[str, float]] = []
        self._loss_min: float | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        v = pl_module.net.V.detach()
        train, bank = pl_module.fed.train, pl_module.bank
        loss = 0.0
        for c in range(train.num_clients):
            _, s = train.client(c)
            u = bank.row("U")[c][: s.shape[0]]
            loss += 0.5 * float(((s.to(v.dtype) - u @ v.T) ** 2).sum())
        if self._loss_min is None:
            s = torch.cat([train.client(c)[1] for c in range(train.num_clients)]).to(torch.float64)
            self._loss_min = 0.5 * float((torch.linalg.svdvals(s)[v.shape[1] :] ** 2).sum())
        sv = torch.linalg.svdvals(v)
        kappa = float(sv[0] / sv[(self.rank or v.shape[1]) - 1]) if float(sv[0]) > 0 else float("nan")
        row = {"round": float(batch["round"]), "loss": loss, "loss_min": self._loss_min, "kappa_V": kappa}
        row["excess"] = loss - self._loss_min
        self.history.append(row)
        pl_module.log_dict({f"mf/{k}": v for k, v in row.items() if k != "round"})

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """The last round's values into the run summary (after the engine has written it at the end of training)."""
        if self.history:
            pl_module.summary.update({f"mf_{k}": v for k, v in self.history[-1].items() if k != "round"})

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
