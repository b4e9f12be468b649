"""Mixed linear regression with one hidden cluster label per client (spec 001 eq. (1), App. C).

``y_ij = x_ijᵀ θ*_{z_i} + σ·ζ_ij`` with ``x ~ N(0, I_d)``, ``ζ ~ N(0, 1)``, ``z_i ~ Cat(p)``, ``θ*_j ~ c·N(0, I_d)``.
Every constant is an argument (docs/generators.md lists them with the paper's values). Presets (spec 001 §3.3,
with its resolution N = 10,000 of the paper's "N = 1000" typo):

* ``C1``: 200 clients × 50 points, p = (1/3, 1/3, 1/3);
* ``C2``: 900 clients × 10 points then 20 clients × 50 points, p = (1/3, 1/3, 1/3);
* ``C3``: as C2 with p = (0.2, 0.3, 0.5).

Documented choices for the paper's unreadable numbers (spec 001 §8 items 2–3): c = 1/√d and σ = 0.2.
Ground truth is in ``federated.extras``: ``theta_star`` [k, d], ``labels`` [M] and ``sizes`` [M].
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import cluster_model_distance

SETTINGS: dict[str, tuple[list[int], list[float]]] = {
    "C1": ([50] * 200, [1 / 3, 1 / 3, 1 / 3]),
    "C2": ([10] * 900 + [50] * 20, [1 / 3, 1 / 3, 1 / 3]),
    "C3": ([10] * 900 + [50] * 20, [0.2, 0.3, 0.5]),
}


def parse_sizes(sizes: list[int] | str) -> list[int]:
    """Client sizes as a list, or compactly as ``"COUNTxSIZE,COUNTxSIZE"`` (``"900x10,20x50"`` is C2's)."""
    if not isinstance(sizes, str):
        return [int(s) for s in sizes]
    out: list[int] = []
    for part in sizes.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)x(\d+)", part)
        if match is None:
            raise ConfigError(f"MixedRegressionDataModule.sizes: {part!r} is not COUNTxSIZE (e.g. '200x50')")
        out += [int(match.group(2))] * int(match.group(1))
    return out


def mixed_regression_problem(
    sizes: list[int],
    probs: list[float],
    dim: int,
    noise: float,
    generator: torch.Generator,
    theta_scale: float | None = None,
    test_samples_per_client: int = 0,
) -> dict[str, Tensor]:
    """Draw θ*, labels and every client's (x, y) in float64. Rows are sorted by client (``ptr``)."""
    k = len(probs)
    scale = dim**-0.5 if theta_scale is None else theta_scale
    theta_star = scale * torch.randn(k, dim, generator=generator, dtype=torch.float64)
    labels = torch.multinomial(torch.tensor(probs, dtype=torch.float64), len(sizes), True, generator=generator)
    n = torch.tensor(sizes, dtype=torch.long)

    def draw(counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        total = int(counts.sum())
        x = torch.randn(total, dim, generator=generator, dtype=torch.float64)
        owner = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        y = (x * theta_star[labels[owner]]).sum(1) + noise * torch.randn(
            total, generator=generator, dtype=torch.float64
        )
        ptr = torch.zeros(len(sizes) + 1, dtype=torch.long)
        ptr[1:] = counts.cumsum(0)
        return x, y, ptr

    x, y, ptr = draw(n)
    xt, yt, ptrt = draw(torch.full_like(n, test_samples_per_client))
    return {"theta_star": theta_star, "labels": labels, "sizes": n, "x": x, "y": y, "ptr": ptr} | {
        "x_test": xt,
        "y_test": yt,
        "ptr_test": ptrt,
    }


def permutation_distance(theta: Tensor, theta_star: Tensor) -> tuple[float, tuple[int, ...]]:
    """d(θ̂, θ*) of spec 001 eq. (6) and the matching; see ``fl_lightning.metrics.cluster_model_distance`` (also
    defined with fewer models than clusters)."""
    return cluster_model_distance(theta, theta_star)


def clustering_error(assigned: Tensor, labels: Tensor, perm: tuple[int, ...]) -> float:
    """Fraction of clients whose chosen model is not the one matched to their true cluster by ``perm``."""
    target = torch.tensor(perm, dtype=torch.long)[labels.long()]
    return float((assigned.long() != target).double().mean())


def resolve_setting(
    setting: str | None,
    sizes: list[int] | str | None,
    probs: list[float] | None,
    num_clusters: int | None,
) -> tuple[list[int], list[float]]:
    """Client sizes and cluster probabilities from a preset, overridden by any explicit value; ``num_clusters``
    alone means uniform probabilities. Raises ``ConfigError`` (one line) for impossible combinations."""
    if setting is not None and setting not in SETTINGS:
        raise ConfigError(
            f"MixedRegressionDataModule: setting must be one of {sorted(SETTINGS)} or null, got {setting!r}"
        )
    preset_sizes, preset_probs = SETTINGS[setting] if setting is not None else (None, None)
    out_sizes = parse_sizes(sizes) if sizes is not None else preset_sizes
    if out_sizes is None:
        raise ConfigError("MixedRegressionDataModule: give sizes (e.g. '200x50') or a preset setting (C1, C2, C3)")
    if probs is not None:
        out_probs = [float(p) for p in probs]
    elif num_clusters is not None and (preset_probs is None or num_clusters != len(preset_probs)):
        out_probs = [1.0 / num_clusters] * num_clusters
    elif preset_probs is not None:
        out_probs = list(preset_probs)
    else:
        raise ConfigError("MixedRegressionDataModule: give probs or num_clusters (or a preset setting)")
    if num_clusters is not None and num_clusters != len(out_probs):
        raise ConfigError(f"MixedRegressionDataModule: num_clusters={num_clusters} but {len(out_probs)} probs")
    if not out_sizes or min(out_sizes) < 1:
        raise ConfigError("MixedRegressionDataModule: every client needs ≥ 1 sample")
    if min(out_probs) < 0 or abs(sum(out_probs) - 1) > 1e-6:
        raise ConfigError(f"MixedRegressionDataModule: probs must be a distribution, got {out_probs}")
    return out_sizes, out_probs


class MixedRegressionDataModule(FederatedDataModule):
    """Spec 001's synthetic mixed regression, at the paper's settings or any other.

    Args:
        setting: a preset (``C1``, ``C2``, ``C3``) or ``null``; any explicit ``sizes``/``probs``/``num_clusters``
            overrides it.
        sizes: points per client, a list or ``"COUNTxSIZE,…"`` (``"200x50"`` = 200 clients × 50 points).
        probs: cluster probabilities p (k = len(p)).
        num_clusters: k with uniform p (when ``probs`` is not given).
        dim: d (paper: 100).
        noise: σ, the noise standard deviation (paper: unreadable, 0.2 chosen).
        theta_scale: c in θ*_j ~ c·N(0, I_d) (paper: unreadable; default 1/√d).
        test_samples_per_client: fresh points of the client's own cluster for its test split.
        val_fraction: a validation split carved from each client's training points (``FederatedDataModule``).
    """

    def __init__(
        self,
        setting: str | None = "C1",
        sizes: list[int] | str | None = None,
        probs: list[float] | None = None,
        num_clusters: int | None = None,
        dim: int = 100,
        noise: float = 0.2,
        theta_scale: float | None = None,
        test_samples_per_client: int = 10,
        num_clients: int | None = None,
        clients_per_round: int | None = None,
        participation: float | None = 1.0,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        self.sizes, self.probs = resolve_setting(setting, sizes, probs, num_clusters)
        if num_clients is not None and num_clients != len(self.sizes):
            raise ConfigError(f"MixedRegressionDataModule: num_clients={num_clients} but {len(self.sizes)} sizes")
        if dim < 1 or noise < 0 or (theta_scale is not None and theta_scale <= 0) or test_samples_per_client < 0:
            raise ConfigError(
                f"MixedRegressionDataModule: need dim ≥ 1, noise ≥ 0, theta_scale > 0 and test_samples_per_client ≥ 0,"
                f" got {dim}, {noise}, {theta_scale}, {test_samples_per_client}"
            )
        super().__init__(len(self.sizes), clients_per_round, participation, seed, val_fraction)
        self.num_clusters = len(self.probs)
        self.dim, self.noise, self.theta_scale = dim, noise, theta_scale
        self.test_samples_per_client = test_samples_per_client

    def build(self) -> FederatedData:
        g = torch.Generator().manual_seed(self.resolved_seed)
        p = mixed_regression_problem(
            self.sizes, self.probs, self.dim, self.noise, g, self.theta_scale, self.test_samples_per_client
        )
        train = ClientSplit(p["x"], p["y"], p["ptr"])
        test = ClientSplit(p["x_test"], p["y_test"], p["ptr_test"])
        extras = {"theta_star": p["theta_star"], "labels": p["labels"], "sizes": p["sizes"]}
        return FederatedData(train, test, None, seed=self.resolved_seed, extras=extras)


class StartFromGroundTruth(Callback):
    """Oracle comparators (spec 001 §2.4 item 4): before the first round, set the network's ``parameter`` to the
    data module's ground truth ``federated.extras[key]`` (default: ``theta`` ← ``theta_star``, IFCA started at the
    true models). A resumed run keeps its checkpointed parameters."""

    def __init__(self, key: str = "theta_star", parameter: str = "theta") -> None:
        self.key, self.parameter = key, parameter

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step > 0:
            return
        extras = pl_module.fed.extras
        if self.key not in extras:
            raise ConfigError(f"StartFromGroundTruth: the data module has no ground truth '{self.key}'")
        target = dict(pl_module.net.named_parameters()).get(self.parameter)
        if target is None or target.shape != extras[self.key].shape:
            shape = None if target is None else tuple(target.shape)
            raise ConfigError(
                f"StartFromGroundTruth: network parameter '{self.parameter}' {shape} cannot take "
                f"'{self.key}' {tuple(extras[self.key].shape)} (does the model have as many clusters as the data?)"
            )
        with torch.no_grad():
            target.copy_(extras[self.key].to(target))


class MixedRegressionMetrics(Callback):
    """Logs d(θ̂, θ*) and the clustering error after every round (spec 001 §6a item 8); the last round's values go
    into the run summary (``mr_dist_theta``, ``mr_cluster_error``).

    A callback because the engine has no per-round metric hook yet; it reads the global ``theta`` and
    the clients' ``label`` rows from the bank (clients that have not chosen yet count as errors).
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        extras = pl_module.fed.extras
        theta = pl_module.net.theta.detach().cpu()
        dist, perm = permutation_distance(theta, extras["theta_star"].cpu())
        row = {"round": float(batch["round"]), "dist_theta": dist}
        if "label" in pl_module.bank.names:
            row["cluster_error"] = clustering_error(pl_module.bank.row("label").cpu(), extras["labels"].cpu(), perm)
        self.history.append(row)
        pl_module.log_dict({f"mr/{k}": v for k, v in row.items() if k != "round"})

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """The last round's values into the run summary (after the engine has written it at the end of training)."""
        if self.history:
            pl_module.summary.update({f"mr_{k}": v for k, v in self.history[-1].items() if k != "round"})

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
