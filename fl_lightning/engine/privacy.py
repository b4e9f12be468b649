"""User-level differential privacy of what crosses the boundary (``model.privacy``; issue 30).

The mechanism is DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models",
Alg. 1 with a fixed denominator) applied to whatever an algorithm uploads:

* **clip, on the client side of the ledger** (``clip``): each client's upload delta Δ_k = upload_k − θ is scaled to
  L2 norm ≤ C, flat over all uploaded tensors or per tensor (C/√L each, so the whole is still ≤ C); the ledger
  (``CommunicationLedger``) records the clipped upload. With ``mechanism: local`` the client also adds its own
  N(0, σ²C²) before the upload (local DP, accounted per client: each client's worst case, a Gaussian of
  sensitivity 2C in every round, no amplification by sampling).
* **noise, on the server side, once** (``add_noise``): N(0, σ²C²) on each coordinate of the cohort's sum, added on
  rank 0 before the sum-all-reduce (from the seeded stream ``(seed, "dp-noise", round)``), so N processes = 1.
* **fixed denominator** (``mean_update``): the noised sum is divided by the expected cohort size m = qN, never by
  the number of clients that reported (which is itself private under Poisson sampling).
* **sampling as the accountant assumes**: ``fixed`` keeps the round loader's cohort (m of N without replacement:
  ``SampledWithoutReplacementDpEvent`` with replace-one neighbours, the relation the library supports for it; a
  replaced client moves the sum by up to 2C, so the library is given the noise multiplier σ/2);
  ``poisson`` draws each of the N clients with rate q = m/N in every round from ``(seed, "dp-poisson", round)``
  (``PoissonSampledDpEvent``, add-or-remove neighbours).
* **adaptive clipping** (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping", Alg. 1):
  each client also reports b_k = 1[‖Δ_k‖ ≤ C] (centred, b_k − ½: sensitivity ½); the server adds N(0, σ_b²) to
  Σ(b_k − ½), and C ← C·exp(−η_C (b̄ − γ)) with b̄ = (Σ(b_k − ½) + noise)/m + ½. The count is a second Gaussian
  release on the same sample, composed with the delta's in the accountant (noise multiplier 2σ_b; σ_b when
  clients are replaced, under ``fixed``).
* **accountant** from Google's ``dp-accounting`` (RDP by default, PLD for Poisson sampling): ε at δ after every
  round (``privacy/epsilon``), in the summary; ``target_epsilon`` calibrates σ for ``trainer.max_steps`` rounds
  before training (``dp_accounting.calibrate_dp_mechanism``); training stops before a round that would spend more
  than ``epsilon_budget`` (default: ``target_epsilon``).

What is refused (``check_algorithm``, one ``ConfigError`` line each), decided from declarations:

* ``model.aggregation: num_samples``: the weight would reveal a client's size and scale its contribution past C;
* an upload that is not a floating model parameter or buffer of the network: non-parameter statistics whose
  server math is not a clipped mean of model deltas (SCAFFOLD's control-variate deltas ``delta_c.``, FedProto's
  ``class_feature_sums`` and class counts, FedDyn's ``delta.``, Fed-MTL's ``delta_w.`` and L2GD's ``delta_x.``), or
  integer buffers (BatchNorm's ``num_batches_tracked``), which cannot carry Gaussian noise;
* an algorithm with its own ``server_update`` or ``needs_uniform_aggregation``: its server state reads
  ``num_aggregated``, the unnoised count of the clients that reported, or an exact mean of their uploads
  (LinearFedRep; by the same rule AlternatingGD, PowerInitLocalGD, FedMD and OneShotClustering);
* evaluation uploads that steer training: a callback that monitors client metrics (``EarlyStopping``,
  ``ModelCheckpoint(monitor="val/…")``) would choose the released model from unnoised client data.

Allowed (checked on the digits MLP): FedAvg, FedAvgSteps, FedProx, FedRep, FedPer, LG-FedAvg, FedBABU, FedRoD,
Ditto, APFL, pFedMe, Per-FedAvg, FedALA, MOON (each uploads model parameters only; personal parts and client
state never leave the client, and a client's state is a function of its own data and of earlier noised models, so
an upload that depends on it is still one user's contribution, bounded by C). LocalOnly uploads nothing.
Under DP the clients' training loss and count are not logged (``train/loss``, ``train/clients``); the evaluation
metrics (``val/…``, the summary) are the experimenter's measurement of the result, computed on the clients' data
without noise: they are outside the guarantee.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.client import Params, make_generator
from fl_lightning.engine.aggregation import Aggregation, CohortSums
from fl_lightning.engine.sequential import to_device
from fl_lightning.errors import ConfigError

__all__ = ["COUNT", "AdaptiveClip", "Privacy", "PrivacyEngine", "PrivateAggregation", "epsilon_of", "privacy_event"]

log = logging.getLogger("fl_lightning")

#: the reserved sum that carries Σ(b_k − ½) of adaptive clipping through the round's one sum-all-reduce
COUNT = "__dp_below_clip"


@dataclass
class AdaptiveClip:
    """Andrew et al. 2021, Alg. 1: the clip follows the ``target_quantile`` γ of the clients' update norms."""

    target_quantile: float = 0.5  #: γ
    lr: float = 0.2  #: η_C of the geometric update C ← C·exp(−η_C (b̄ − γ))
    count_noise_multiplier: float | None = None  #: σ_b; None: m/20, the paper's choice (§3)


@dataclass
class Privacy:
    """``model.privacy``: user-level DP of every upload (see the module docstring)."""

    mechanism: Literal["central", "local"] = "central"
    clip: float = 1.0  #: C, the L2 bound of each client's upload delta (``.inf``: no clipping)
    noise_multiplier: float = 1.0  #: σ: noise std σC on the cohort's sum (central) or on each upload (local)
    delta: float = 1e-5
    target_epsilon: float | None = None  #: calibrate σ so that ε reaches this after ``trainer.max_steps`` rounds
    epsilon_budget: float | None = None  #: stop before a round that would spend more (default: target_epsilon)
    sampling: Literal["poisson", "fixed"] = "fixed"
    clip_per_layer: bool = False
    adaptive_clip: AdaptiveClip | None = None
    accountant: Literal["rdp", "pld"] = "rdp"


def privacy_event(
    sampling: str, num_clients: int, cohort: int, sigma: float, count_sigma: float | None = None
) -> Any:
    """One round of central DP as a ``dp_accounting`` event, whose noise multipliers are noise std / L2 sensitivity
    under the event's neighbouring relation: the sampled Gaussian on the sum of clipped deltas (std σC; sensitivity
    C when a client is added or removed, 2C when one is replaced: multiplier σ, or σ/2 for ``fixed``), composed on
    the same sample with the adaptive clip's count Σ(b_k − ½) (std σ_b; sensitivity ½, or 1 when replaced)."""
    import dp_accounting as dp

    replace_one = sampling != "poisson"
    inner = dp.GaussianDpEvent(sigma / 2 if replace_one else sigma)
    if count_sigma is not None:
        count = dp.GaussianDpEvent(count_sigma if replace_one else 2 * count_sigma)
        inner = dp.ComposedDpEvent([inner, count])
    if sampling == "poisson":
        return dp.PoissonSampledDpEvent(cohort / num_clients, inner)
    if cohort == num_clients:
        return inner
    return dp.SampledWithoutReplacementDpEvent(num_clients, cohort, inner)


def make_accountant(kind: str, sampling: str) -> Any:
    """A fresh accountant for ``sampling``'s event (replace-one neighbours for sampling without replacement)."""
    import dp_accounting as dp

    relation = dp.NeighboringRelation.REPLACE_ONE if sampling == "fixed" else dp.NeighboringRelation.ADD_OR_REMOVE_ONE
    if kind == "pld":
        return dp.pld.PLDAccountant(relation)
    return dp.rdp.RdpAccountant(neighboring_relation=relation)


def epsilon_of(event: Any, rounds: int, delta: float, kind: str = "rdp", sampling: str = "poisson") -> float:
    """ε at ``delta`` after ``rounds`` self-compositions of ``event`` (the library's own computation)."""
    if rounds <= 0:
        return 0.0
    accountant = make_accountant(kind, sampling)
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(delta))


class _QuietAbsl:
    """dp_accounting warns (through absl) for each fractional RDP order it excludes; the order is dropped either way."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


class PrivacyEngine(nn.Module):
    """The run's DP state: the current clip C (a buffer, so checkpoints keep it) and the accountant.

    ``prepare`` is called once the data and the planned rounds are known; then, every round: ``cohort`` (Poisson
    draw), ``clip`` for each upload (client side of the ledger), ``add_noise`` on rank 0 before the all-reduce,
    ``mean_update`` after it, and ``epsilon``."""

    def __init__(self, config: Privacy) -> None:
        super().__init__()
        self.config = config
        check_config(config)
        self.register_buffer("clip_value", torch.tensor(float(config.clip), dtype=torch.float64))
        self.sigma = float(config.noise_multiplier)
        self.num_clients, self.expected_cohort, self.seed = 0, 0, 0
        self.count_sigma: float | None = None
        self._per_round: tuple[Any, Any] | None = None  #: (orders, RDP of one round), cached
        self._pld: tuple[int, Any] | None = None
        self._below: list[Tensor] = []
        self.stopped = ""  #: why training stopped early (the budget), else ''
        self._last_epsilon: tuple[int, float, float] | None = None  #: (rounds, σ, ε) of the last ``epsilon``

    # ---- set-up -----------------------------------------------------------------------------------------------
    def setup(self, trainer: Any, datamodule: Any) -> None:
        """At the module's ``setup``: refuse callbacks that read client metrics, then ``prepare`` from the
        DataModule (N, the clients per round) and the trainer (the planned rounds)."""
        check_callbacks(trainer.callbacks)
        fed = datamodule.federated
        per_round = getattr(datamodule, "clients_per_round", None) or fed.num_clients
        self.prepare(fed.num_clients, int(per_round), trainer.max_steps, fed.seed)

    def prepare(self, num_clients: int, cohort: int, rounds: int | None, seed: int) -> None:
        """Bind the population N, the expected cohort m and the seed; calibrate σ for ``rounds`` when
        ``target_epsilon`` is set (logged once)."""
        cfg = self.config
        if (num_clients, cohort, seed) == (self.num_clients, self.expected_cohort, self.seed):
            return
        self.num_clients, self.expected_cohort, self.seed = num_clients, cohort, seed
        if cfg.adaptive_clip is not None:
            given = cfg.adaptive_clip.count_noise_multiplier
            self.count_sigma = float(given) if given is not None else cohort / 20
        self._per_round, self._pld, self._last_epsilon = None, None, None
        if cfg.target_epsilon is not None:
            if not rounds or rounds < 1:
                raise ConfigError("model.privacy.target_epsilon needs trainer.max_steps (the planned rounds) ≥ 1")
            self.sigma = self.calibrate(cfg.target_epsilon, rounds)
            log.info("privacy: noise_multiplier %.4g gives ε = %.3g at δ = %g after %d rounds",
                     self.sigma, cfg.target_epsilon, cfg.delta, rounds)  # fmt: skip

    def calibrate(self, target: float, rounds: int) -> float:
        """The smallest σ whose ε after ``rounds`` is at most ``target`` (``dp_accounting.calibrate_dp_mechanism``)."""
        import dp_accounting as dp

        cfg = self.config
        if cfg.mechanism == "local":
            def event(s: float) -> Any:
                return dp.SelfComposedDpEvent(dp.GaussianDpEvent(s / 2), rounds)

            def fresh() -> Any:
                return make_accountant(cfg.accountant, "poisson")
        else:
            def event(s: float) -> Any:
                return dp.SelfComposedDpEvent(self._event(s), rounds)

            def fresh() -> Any:
                return make_accountant(cfg.accountant, cfg.sampling)
        with _QuietAbsl():
            try:
                return float(dp.calibrate_dp_mechanism(fresh, event, target, cfg.delta,
                                                       dp.ExplicitBracketInterval(1e-3, 1e3), tol=1e-4))  # fmt: skip
            except Exception as exc:  # the target cannot be met in the bracket (the count alone spends more)
                raise ConfigError(
                    f"model.privacy.target_epsilon {target} cannot be met in {rounds} rounds at δ={cfg.delta} "
                    f"({type(exc).__name__}); fix: raise target_epsilon or the count's noise_multiplier"
                ) from None

    def _event(self, sigma: float) -> Any:
        return privacy_event(self.config.sampling, self.num_clients, self.expected_cohort, sigma, self.count_sigma)

    # ---- one round ---------------------------------------------------------------------------------------------
    def cohort(self, round_idx: int, cohort: list[int]) -> list[int]:
        """The round's clients: the loader's (``fixed``), or each of the N drawn with rate q = m/N (``poisson``)."""
        if self.config.sampling != "poisson":
            return cohort
        q = self.expected_cohort / self.num_clients
        coins = torch.rand(self.num_clients, generator=make_generator(self.seed, "dp-poisson", round_idx))
        return (coins < q).nonzero().flatten().tolist()

    def clip(self, upload: Params, glob: Params, round_idx: int, client: int) -> Params:
        """The client's upload with its delta clipped to L2 norm ≤ C (flat, or C/√L per tensor), plus its own
        N(0, σ²C²) under local DP; what the ledger records. A delta already within C is returned bit for bit."""
        cfg, bound = self.config, self.clip_value
        deltas = {n: (v - glob[n]).double() if n in glob else v.double() for n, v in upload.items()}
        if cfg.clip_per_layer:
            per = bound / math.sqrt(max(len(deltas), 1))
            scales = {n: torch.clamp(per.to(d.device) / d.norm(), max=1.0) for n, d in deltas.items()}
            norm = torch.stack([d.norm() * s for (n, d), s in zip(deltas.items(), scales.values())]).norm()
            below = torch.stack([d.norm() <= per.to(d.device) for d in deltas.values()]).all()
        else:
            norm = torch.stack([d.norm() for d in deltas.values()]).norm() if deltas else torch.zeros(())
            scale = torch.clamp(bound.to(norm.device) / norm, max=1.0)
            scales = dict.fromkeys(deltas, scale)
            below = norm <= bound.to(norm.device)
        self._below.append(torch.where(torch.isfinite(norm), below.double() - 0.5, 0.0))
        out = {}
        for n, v in upload.items():
            s = scales[n]
            clipped = glob[n].double() + deltas[n] * s if n in glob else deltas[n] * s
            out[n] = torch.where(s < 1, clipped.to(v.dtype), v)
        if cfg.mechanism == "local" and self.sigma > 0:
            g = make_generator(self.seed, "dp-local", round_idx, client)
            std = self.sigma * float(bound)
            out = {n: v + to_device(torch.randn(v.shape, generator=g, dtype=torch.float64) * std, v.device).to(v.dtype)
                   for n, v in out.items()}  # fmt: skip
        return out

    def add_noise(self, delta_sums: Params, round_idx: int, rank: int) -> Params:
        """The rank's sums plus, on rank 0 only, N(0, σ²C²) per coordinate (central DP) and the adaptive clip's
        Σ(b_k − ½) with its N(0, σ_b²); every rank adds its own clients' count. Reads the clip on the host."""
        below, self._below = self._below, []
        out = dict(delta_sums)
        if self.config.adaptive_clip is not None:
            some = next(iter(delta_sums.values()), torch.zeros(()))
            out[COUNT] = torch.stack(below).sum().to(some.device) if below else some.new_zeros((), dtype=torch.float64)
        if rank != 0:
            return out
        g = make_generator(self.seed, "dp-noise", round_idx)
        std = self.sigma * float(self.clip_value) if self.config.mechanism == "central" else 0.0
        for n, v in delta_sums.items():
            if std > 0:
                out[n] = v + to_device(torch.randn(v.shape, generator=g, dtype=torch.float64) * std, v.device)
        if COUNT in out and self.count_sigma:
            out[COUNT] = out[COUNT] + float(torch.randn((), generator=g, dtype=torch.float64)) * self.count_sigma
        return out

    def mean_update(self, sums: CohortSums, template: Params) -> Params:
        """Δ = noised sum / m (the expected cohort, a fixed denominator); updates the adaptive clip from the noised
        count. ``sums`` is the all-reduced ``CohortSums`` (``COUNT`` is taken out of it)."""
        count = sums.delta_sums.pop(COUNT, None)
        if count is not None:
            adaptive = self.config.adaptive_clip
            fraction = float(count) / self.expected_cohort + 0.5
            self.clip_value.mul_(math.exp(-adaptive.lr * (fraction - adaptive.target_quantile)))
        return replace(sums, stats=replace(sums.stats, weight=float(self.expected_cohort))).mean_update(template)

    # ---- accounting --------------------------------------------------------------------------------------------
    def epsilon(self, rounds: int) -> float:
        """ε at δ after ``rounds`` rounds (the library's accountant; per client under local DP). The last answer is
        kept: the budget check before a round and the log after it ask for the same ``rounds``."""
        if self._last_epsilon is None or self._last_epsilon[:2] != (rounds, self.sigma):
            self._last_epsilon = (rounds, self.sigma, self._epsilon(rounds))
        return self._last_epsilon[2]

    def _epsilon(self, rounds: int) -> float:
        import dp_accounting as dp

        cfg = self.config
        if rounds <= 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        with _QuietAbsl():
            if cfg.mechanism == "local":
                return epsilon_of(dp.GaussianDpEvent(self.sigma / 2), rounds, cfg.delta, cfg.accountant, "poisson")
            if cfg.accountant == "pld":
                return self._pld_epsilon(rounds)
            if self._per_round is None:  # one round's RDP curve, once; T rounds are T times it
                one = make_accountant("rdp", cfg.sampling)
                one.compose(self._event(self.sigma), 1)
                self._per_round = (one._orders, one._rdp)
            orders, rdp_one = self._per_round
            return float(dp.rdp.rdp_privacy_accountant.compute_epsilon(orders, rounds * rdp_one, cfg.delta)[0])

    def _pld_epsilon(self, rounds: int) -> float:
        if self._pld is None or self._pld[0] > rounds:
            self._pld = (0, make_accountant("pld", self.config.sampling))
        done, accountant = self._pld
        if rounds > done:
            accountant.compose(self._event(self.sigma), rounds - done)
        self._pld = (rounds, accountant)
        return float(accountant.get_epsilon(self.config.delta))

    @property
    def budget(self) -> float | None:
        cfg = self.config
        return cfg.epsilon_budget if cfg.epsilon_budget is not None else cfg.target_epsilon

    def exhausted(self, rounds_done: int) -> bool:
        """Whether one more round would spend more than the budget."""
        budget = self.budget
        return budget is not None and self.epsilon(rounds_done + 1) > budget * (1 + 1e-6)

    def stop_before(self, rounds_done: int) -> bool:
        """Whether the run stops before its next round (the budget, ``exhausted``); the reason is kept in
        ``stopped`` (the summary's ``stopped``) and logged once."""
        if not self.exhausted(rounds_done):
            return False
        if not self.stopped:
            self.stopped = (f"privacy budget spent: round {rounds_done + 1} would take ε past {self.budget:g} "
                            f"(δ={self.config.delta:g})")  # fmt: skip
            log.info("stopping after %d rounds: %s", rounds_done, self.stopped)
        return True

    def summary(self, rounds: int, final: bool = False) -> dict[str, Any]:
        """ε after ``rounds`` rounds, δ, σ and the clip (logged every round); ``final``: also why the run stopped
        early, if it did (the run summary)."""
        out: dict[str, Any] = {"epsilon": self.epsilon(rounds), "delta": self.config.delta,
                               "noise_multiplier": self.sigma, "clip": float(self.clip_value)}  # fmt: skip
        if final and self.stopped:
            out["stopped"] = self.stopped
        return out


class PrivateAggregation(Aggregation):
    """DP as a stage that wraps an ``Aggregation`` (as Flower's differential-privacy strategies wrap a strategy):
    each upload is clipped (plus the client's own noise under local DP) before the ledger records it, the central
    noise is added to the sums on rank 0 before the sum over ranks, and the mean divides the noised sum by the
    expected cohort (``PrivacyEngine``'s ``clip``, ``add_noise``, ``mean_update``)."""

    def __init__(self, inner: Aggregation, engine: PrivacyEngine) -> None:
        super().__init__(inner.ledger, inner.weighting, inner.algorithm_name)
        self.inner, self.engine = inner, engine

    def clip(self, upload: Params, glob: Params, round_idx: int, client: int) -> Params:
        return self.engine.clip(self.inner.clip(upload, glob, round_idx, client), glob, round_idx, client)

    def noise(self, delta_sums: Params, round_idx: int, rank: int) -> Params:
        return self.engine.add_noise(self.inner.noise(delta_sums, round_idx, rank), round_idx, rank)

    def mean(self, sums: CohortSums, template: Params) -> Params:
        return self.engine.mean_update(sums, template)


def check_config(cfg: Privacy) -> None:
    """The ranges of ``model.privacy``."""
    if not cfg.clip > 0:
        raise ConfigError(f"model.privacy.clip must be positive (.inf: no clipping), got {cfg.clip}")
    if cfg.noise_multiplier < 0:
        raise ConfigError(f"model.privacy.noise_multiplier must be ≥ 0, got {cfg.noise_multiplier}")
    if not 0 < cfg.delta < 1:
        raise ConfigError(f"model.privacy.delta must be in (0, 1), got {cfg.delta}")
    for name in ("target_epsilon", "epsilon_budget"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"model.privacy.{name} must be positive or null, got {value}")
    if cfg.accountant == "pld" and cfg.sampling == "fixed":
        raise ConfigError("model.privacy.accountant pld supports sampling: poisson only; fix: use rdp or poisson")
    adaptive = cfg.adaptive_clip
    if adaptive is not None:
        if cfg.mechanism == "local":
            raise ConfigError("model.privacy.adaptive_clip needs mechanism: central (the count is noised centrally)")
        if not 0 < adaptive.target_quantile < 1 or adaptive.lr <= 0:
            raise ConfigError(f"model.privacy.adaptive_clip: target_quantile in (0, 1) and lr > 0, got {adaptive}")
        if adaptive.count_noise_multiplier is not None and adaptive.count_noise_multiplier <= 0:
            raise ConfigError("model.privacy.adaptive_clip.count_noise_multiplier must be positive or null")


def check_algorithm(algorithm: Algorithm, net: nn.Module, template: Params, aggregation: str) -> None:
    """Refuse what breaks the user-level argument (module docstring), from the algorithm's declarations."""
    name = type(algorithm).__name__
    if aggregation != "uniform":
        raise ConfigError(
            f"model.privacy needs model.aggregation: uniform, got {aggregation} (a num_samples weight reveals the "
            "client's size and scales its contribution past the clip C)"
        )
    model = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}
    for n, t in template.items():
        if n not in model:
            raise ConfigError(
                f"model.privacy: {name} uploads '{n}', a non-parameter statistic whose server math is not a clipped "
                "mean of model deltas; use an algorithm that uploads model parameters only (FedAvg, FedRep, Ditto…)"
            )
        if not t.is_floating_point():
            raise ConfigError(
                f"model.privacy: {name} uploads the integer buffer '{n}', which cannot carry Gaussian noise; keep "
                "BatchNorm personal (FedBN) or use a network without it"
            )
    if type(algorithm).server_update is not Algorithm.server_update or algorithm.needs_uniform_aggregation:
        raise ConfigError(
            f"model.privacy: {name}'s server state reads the unnoised count of clients (num_aggregated) or their "
            "exact mean (server_update); use an algorithm without server-side state (FedAvg, FedRep, Ditto…)"
        )


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuse evaluation uploads that steer training: a callback that monitors client metrics (anything but the
    round counters and ``privacy/``)."""
    for cb in callbacks:
        monitor = getattr(cb, "monitor", None)
        if monitor and monitor not in ("step", "epoch", "round") and not str(monitor).startswith("privacy/"):
            raise ConfigError(
                f"model.privacy: {type(cb).__name__} monitors '{monitor}', an unnoised client evaluation that would "
                "choose the released model; remove the callback (or its monitor) under DP"
            )
