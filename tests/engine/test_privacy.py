"""User-level differential privacy (``model.privacy``, ``fl_lightning/engine/privacy.py``; issue 30).

Each reference is computed here independently: the non-DP run, the clip bound read off the ledger's uploads, the
noise's standard deviation from its samples, ε from ``dp_accounting`` called directly, the Poisson cohort from the
seeded coins, the adaptive clip's update by hand.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import dp_accounting as dp
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping

from fl_lightning import algorithms
from fl_lightning.client import make_generator
from fl_lightning.engine.aggregation import CohortSums, RoundStats
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.privacy import COUNT, AdaptiveClip, Privacy, PrivacyEngine
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.digits_runs import digits
from tests.helpers.training import fit

N, M = 20, 4  #: the digits split's clients and cohort


def dp_module(algorithm, privacy: Privacy | None, executor: str = "sequential", **kw) -> FederatedModule:
    torch.manual_seed(0)
    return FederatedModule(algorithm, DigitsMLP(), aggregation="uniform", batch_size=10, eval_every=100,
                           eval_last=0, executor=executor, privacy=privacy, **kw)  # fmt: skip


def watch_uploads(module: FederatedModule) -> list[tuple[int, dict, dict]]:
    """(round, upload, the global model it left from) of every upload the ledger records."""
    seen: list[tuple[int, dict, dict]] = []
    original = module.attach_data

    def attach_and_observe(fed):
        original(fed)
        module.ledger.observers.append(
            lambda r, c, t: seen.append((r, {k: v.clone() for k, v in t.items()},
                                         {k: v.clone() for k, v in module.global_params().items()}))
        )

    module.attach_data = attach_and_observe
    return seen


def params(module: FederatedModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


# ---- the mechanism --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: algorithms.FedAvg(1), lambda: algorithms.FedRep(2, 1)],
                         ids=["fedavg", "fedrep"])
def test_sigma_zero_and_no_clip_reproduce_the_non_dp_run_exactly(make) -> None:
    plain = fit(dp_module(make(), None), digits(clients_per_round=M), rounds=3)
    off = Privacy(clip=math.inf, noise_multiplier=0.0)
    private = fit(dp_module(make(), off), digits(clients_per_round=M), rounds=3)
    for n, p in params(plain).items():
        assert torch.equal(params(private)[n], p), n
    for n in plain.bank.names:
        assert torch.equal(private.bank.row(n), plain.bank.row(n)), n


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_every_upload_the_ledger_records_is_within_the_clip(per_layer: bool) -> None:
    clip = 0.05
    module = dp_module(algorithms.FedAvg(1), Privacy(clip=clip, noise_multiplier=0.5, clip_per_layer=per_layer))
    seen = watch_uploads(module)
    fit(module, digits(clients_per_round=M), rounds=2)
    assert len(seen) == 2 * M
    for _, upload, glob in seen:
        norms = torch.stack([(upload[n].double() - glob[n].double()).norm() for n in upload])
        assert float(norms.norm()) <= clip * (1 + 1e-5)
        if per_layer:
            assert float(norms.max()) <= clip / math.sqrt(len(upload)) * (1 + 1e-5)
        else:  # one local epoch moves the model far more than 0.05: every delta is clipped to exactly C
            assert float(norms.norm()) == pytest.approx(clip, rel=1e-4)


def test_the_noise_on_the_aggregate_has_the_configured_std() -> None:
    """One round with a clip no client reaches: the difference to the σ = 0 run is the noise / m. 17226 coordinates:
    the sample std is within 3% of σC/m (its own relative std is 1/√(2n) ≈ 0.5%), the mean within 4 std errors."""
    sigma, clip = 0.3, 50.0
    runs = [fit(dp_module(algorithms.FedAvg(1), Privacy(clip=clip, noise_multiplier=s)), digits(clients_per_round=M),
                rounds=1) for s in (0.0, sigma)]  # fmt: skip
    diff = torch.cat([(params(runs[1])[n] - p).double().flatten() for n, p in params(runs[0]).items()])
    expected = sigma * clip / M
    assert diff.numel() == 17226
    assert float(diff.std()) == pytest.approx(expected, rel=0.03)
    assert abs(float(diff.mean())) < 4 * expected / math.sqrt(diff.numel())


def test_noise_is_added_once_on_rank_zero_from_the_seeded_stream() -> None:
    engine = PrivacyEngine(Privacy(clip=2.0, noise_multiplier=1.5))
    engine.prepare(N, M, None, seed=3)
    sums = {"w": torch.zeros(400, 50, dtype=torch.float64)}
    rank0 = engine.add_noise(sums, round_idx=7, rank=0)["w"]
    rank1 = engine.add_noise(sums, round_idx=7, rank=1)["w"]
    assert torch.equal(rank1, sums["w"])  # the other ranks add nothing: N processes add the noise once
    expected = torch.randn(400, 50, generator=make_generator(3, "dp-noise", 7), dtype=torch.float64) * 3.0
    assert torch.equal(rank0, expected)
    assert float(rank0.std()) == pytest.approx(3.0, rel=0.03)


def test_the_mean_has_a_fixed_denominator_whoever_reported() -> None:
    engine = PrivacyEngine(Privacy(clip=1.0, noise_multiplier=0.0))
    engine.prepare(N, M, None, seed=0)
    sums = CohortSums({"w": torch.tensor([3.0, 6.0], dtype=torch.float64)}, {}, [], RoundStats(weight=2.0))
    mean = engine.mean_update(sums, {"w": torch.zeros(2)})
    assert_close_finite(mean["w"], [3.0 / M, 6.0 / M], rtol=0, atol=1e-7)  # by m = 4, not by the 2 that reported


def test_local_dp_noises_each_upload_and_the_server_adds_nothing() -> None:
    engine = PrivacyEngine(Privacy(mechanism="local", clip=0.5, noise_multiplier=2.0))
    engine.prepare(N, M, None, seed=0)
    glob = {"w": torch.zeros(20000)}
    out = engine.clip({"w": torch.zeros(20000)}, glob, round_idx=0, client=5)["w"]
    assert float(out.std()) == pytest.approx(1.0, rel=0.03)  # σC
    other = engine.clip({"w": torch.zeros(20000)}, glob, round_idx=0, client=6)["w"]
    assert not torch.equal(out, other)  # each client's own stream
    sums = {"w": torch.ones(3, dtype=torch.float64)}
    assert torch.equal(engine.add_noise(sums, 0, rank=0)["w"], sums["w"])


def test_the_adaptive_clip_follows_the_noised_fraction_under_it() -> None:
    """Andrew et al. 2021 Alg. 1 with σ_b ≈ 0: 3 of 4 clients under C → b̄ = 0.75, C ← C·exp(−η(b̄ − γ))."""
    gamma, lr, clip = 0.5, 0.2, 1.0
    engine = PrivacyEngine(Privacy(clip=clip, noise_multiplier=0.0,
                                   adaptive_clip=AdaptiveClip(gamma, lr, count_noise_multiplier=1e-12)))  # fmt: skip
    engine.prepare(N, M, None, seed=0)
    glob = {"w": torch.zeros(2)}
    for norm in (0.1, 0.5, 0.9, 4.0):
        engine.clip({"w": torch.tensor([norm, 0.0])}, glob, 0, 0)
    noised = engine.add_noise({"w": torch.zeros(2, dtype=torch.float64)}, 0, rank=0)
    assert float(noised[COUNT]) == pytest.approx(3 * 0.5 - 0.5)  # Σ(b_k − ½)
    engine.mean_update(CohortSums(noised, {}, [], RoundStats()), {"w": torch.zeros(2)})
    assert float(engine.clip_value) == pytest.approx(clip * math.exp(-lr * (0.75 - gamma)), rel=1e-9)


def test_poisson_sampling_draws_each_client_with_rate_q() -> None:
    module = dp_module(algorithms.FedAvg(1), Privacy(clip=1.0, noise_multiplier=1.0, sampling="poisson"))
    seen: list[tuple[int, int]] = []
    original = module.attach_data

    def attach(fed):
        original(fed)
        module.ledger.observers.append(lambda r, c, t: seen.append((r, c)))

    module.attach_data = attach
    fit(module, digits(clients_per_round=M), rounds=4)
    for r in range(4):
        coins = torch.rand(N, generator=make_generator(0, "dp-poisson", r))
        assert sorted(c for rr, c in seen if rr == r) == (coins < M / N).nonzero().flatten().tolist()


# ---- the accountant -------------------------------------------------------------------------------------------
def library_epsilon(event, rounds: int, delta: float, relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE, pld=False):
    accountant = dp.pld.PLDAccountant(relation) if pld else dp.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    ("num", "cohort", "sigma", "rounds", "delta"),
    [(20, 4, 1.0, 50, 1e-3), (1000, 10, 0.8, 200, 1e-5), (100, 30, 2.0, 7, 1e-6)],
)
def test_poisson_epsilon_is_the_librarys(num: int, cohort: int, sigma: float, rounds: int, delta: float) -> None:
    engine = PrivacyEngine(Privacy(noise_multiplier=sigma, delta=delta, sampling="poisson"))
    engine.prepare(num, cohort, None, seed=0)
    event = dp.PoissonSampledDpEvent(cohort / num, dp.GaussianDpEvent(sigma))
    assert engine.epsilon(rounds) == pytest.approx(library_epsilon(event, rounds, delta), rel=1e-9)


def test_fixed_size_epsilon_is_the_librarys() -> None:
    """Replace-one neighbours: a replaced client moves the clipped sum by up to 2C, so std σC is multiplier σ/2."""
    fixed = PrivacyEngine(Privacy(noise_multiplier=1.2, delta=1e-4, sampling="fixed"))
    fixed.prepare(50, 5, None, seed=0)
    event = dp.SampledWithoutReplacementDpEvent(50, 5, dp.GaussianDpEvent(0.6))
    expected = library_epsilon(event, 30, 1e-4, dp.NeighboringRelation.REPLACE_ONE)
    assert fixed.epsilon(30) == pytest.approx(expected, rel=1e-9)
    adaptive = PrivacyEngine(Privacy(noise_multiplier=1.2, delta=1e-4, sampling="fixed",
                                     adaptive_clip=AdaptiveClip(count_noise_multiplier=3.0)))  # fmt: skip
    adaptive.prepare(50, 5, None, seed=0)
    both = dp.ComposedDpEvent([dp.GaussianDpEvent(0.6), dp.GaussianDpEvent(3.0)])  # the count's sensitivity: 1
    event = dp.SampledWithoutReplacementDpEvent(50, 5, both)
    expected = library_epsilon(event, 30, 1e-4, dp.NeighboringRelation.REPLACE_ONE)
    assert adaptive.epsilon(30) == pytest.approx(expected, rel=1e-9)


def test_pld_epsilon_is_the_librarys() -> None:
    pld = PrivacyEngine(Privacy(noise_multiplier=1.0, delta=1e-5, sampling="poisson", accountant="pld"))
    pld.prepare(100, 10, None, seed=0)
    event = dp.PoissonSampledDpEvent(0.1, dp.GaussianDpEvent(1.0))
    pld.epsilon(5)  # composed in steps, as in a run
    assert pld.epsilon(15) == pytest.approx(library_epsilon(event, 15, 1e-5, pld=True), rel=1e-3)


def test_adaptive_clip_and_local_epsilons_are_the_librarys() -> None:
    adaptive = PrivacyEngine(Privacy(noise_multiplier=1.0, delta=1e-5, sampling="poisson",
                                     adaptive_clip=AdaptiveClip(count_noise_multiplier=3.0)))  # fmt: skip
    adaptive.prepare(100, 10, None, seed=0)
    both = dp.PoissonSampledDpEvent(0.1, dp.ComposedDpEvent([dp.GaussianDpEvent(1.0), dp.GaussianDpEvent(6.0)]))
    alone = library_epsilon(dp.PoissonSampledDpEvent(0.1, dp.GaussianDpEvent(1.0)), 25, 1e-5)
    assert adaptive.epsilon(25) == pytest.approx(library_epsilon(both, 25, 1e-5), rel=1e-9)
    assert adaptive.epsilon(25) > alone  # the count's release costs privacy

    local = PrivacyEngine(Privacy(mechanism="local", noise_multiplier=4.0, delta=1e-5))
    local.prepare(100, 10, None, seed=0)
    assert local.epsilon(12) == pytest.approx(library_epsilon(dp.GaussianDpEvent(2.0), 12, 1e-5), rel=1e-9)


def test_target_epsilon_calibrates_sigma_for_the_planned_rounds() -> None:
    engine = PrivacyEngine(Privacy(target_epsilon=3.0, delta=1e-5, sampling="poisson"))
    engine.prepare(1000, 20, rounds=40, seed=0)
    sigma = engine.sigma

    def eps(s: float) -> float:
        return library_epsilon(dp.PoissonSampledDpEvent(0.02, dp.GaussianDpEvent(s)), 40, 1e-5)

    assert 3.0 * (1 - 1e-3) <= eps(sigma) <= 3.0  # the smallest σ that meets the target (to the calibration's 1e-4)


def test_training_stops_when_the_budget_is_spent() -> None:
    sigma, delta = 1.0, 1e-3

    def eps(t: int) -> float:
        return library_epsilon(dp.PoissonSampledDpEvent(M / N, dp.GaussianDpEvent(sigma)), t, delta)

    budget = (eps(2) + eps(3)) / 2
    privacy = Privacy(noise_multiplier=sigma, delta=delta, sampling="poisson", epsilon_budget=budget)
    module = fit(dp_module(algorithms.FedAvg(1), privacy), digits(clients_per_round=M), rounds=6)
    assert module.rounds_trained == 2
    assert module.summary["rounds"] == 2 and "privacy budget spent" in module.summary["stopped"]
    assert module.summary["epsilon"] == pytest.approx(eps(2), rel=1e-9) and module.summary["epsilon"] <= budget


# ---- both executors, both process counts ----------------------------------------------------------------------
def test_the_stacked_path_equals_the_loop_with_dp_on() -> None:
    privacy = Privacy(clip=0.3, noise_multiplier=0.7, adaptive_clip=AdaptiveClip(count_noise_multiplier=0.5))
    runs = {}
    for executor in ("sequential", "vectorized"):
        module = dp_module(algorithms.FedRep(2, 1), privacy, executor=executor)
        runs[executor] = (fit(module, digits(clients_per_round=M), rounds=3), watch_uploads(module))
    loop, stacked = runs["sequential"][0], runs["vectorized"][0]
    for n, p in params(loop).items():
        assert_close_finite(params(stacked)[n], p, rtol=1e-5, atol=1e-5, msg=n)
    assert float(stacked.privacy.clip_value) == pytest.approx(float(loop.privacy.clip_value), rel=1e-9)
    assert float(loop.privacy.clip_value) != 0.3  # the adaptive clip moved


HELPER = Path(__file__).with_name("dp_ddp_script.py")


@pytest.mark.slow  # DDP in subprocesses
def test_two_processes_equal_one_with_dp_on(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    results = []
    for devices in (1, 2):
        out = tmp_path / f"{devices}.pt"
        proc = subprocess.run([sys.executable, str(HELPER), str(devices), str(out)], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(torch.load(out, weights_only=False))
    one, two = results
    assert one["world"] == 1 and two["world"] == 2
    for n, p in one["params"].items():
        assert_close_finite(two["params"][n], p, rtol=0, atol=1e-6, msg=n)
    assert two["clip"] == pytest.approx(one["clip"], rel=1e-9) and one["clip"] != 0.3
    assert two["epsilon"] == one["epsilon"]


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: algorithms.SCAFFOLD(), "non-parameter statistic"),
        (lambda: algorithms.FedProto(), "non-parameter statistic"),
        (lambda: algorithms.FedDyn(), "non-parameter statistic"),
        (lambda: algorithms.FedMTL(), "non-parameter statistic"),
        (lambda: algorithms.L2GD(), "non-parameter statistic"),
    ],
    ids=["scaffold", "fedproto", "feddyn", "fedmtl", "l2gd"],
)
def test_uploads_that_break_the_user_level_argument_are_refused(make, words: str) -> None:
    module = dp_module(make(), Privacy())
    dm = digits(clients_per_round=M)
    dm.setup()
    with pytest.raises(ConfigError, match=words) as info:
        module.attach_data(dm.federated)
    assert "\n" not in str(info.value)


class CountingFedAvg(algorithms.FedAvg):
    """FedAvg uploads with server math that reads the number of clients that reported."""

    vectorizable = True

    def server_update(self, global_params, averaged_extra, facts) -> None:
        self.seen = facts.num_aggregated


def test_server_state_that_reads_the_unnoised_count_is_refused() -> None:
    dm = digits(clients_per_round=M)
    dm.setup()
    with pytest.raises(ConfigError, match="CountingFedAvg's server state reads the unnoised count"):
        dp_module(CountingFedAvg(1), Privacy()).attach_data(dm.federated)


@pytest.mark.parametrize("make", [lambda: algorithms.FedAvg(1), lambda: algorithms.FedRep(2, 1),
                                  lambda: algorithms.Ditto()], ids=["fedavg", "fedrep", "ditto"])  # fmt: skip
def test_parameter_uploads_are_allowed(make) -> None:
    dm = digits(clients_per_round=M)
    dm.setup()
    dp_module(make(), Privacy()).attach_data(dm.federated)


def test_num_samples_weights_and_monitoring_callbacks_are_refused() -> None:
    dm = digits(clients_per_round=M)
    dm.setup()
    module = FederatedModule(algorithms.FedAvg(1), DigitsMLP(), aggregation="num_samples", privacy=Privacy())
    with pytest.raises(ConfigError, match="model.aggregation: uniform"):
        module.attach_data(dm.federated)
    module = dp_module(algorithms.FedAvg(1), Privacy())
    with pytest.raises(ConfigError, match="EarlyStopping monitors 'val/acc_mean'"):
        fit(module, digits(clients_per_round=M), rounds=1, callbacks=[EarlyStopping("val/acc_mean", mode="max")])


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (dict(clip=0.0), "clip must be positive"),
        (dict(noise_multiplier=-1.0), "noise_multiplier must be ≥ 0"),
        (dict(delta=1.0), "delta must be in"),
        (dict(accountant="pld", sampling="fixed"), "pld supports sampling: poisson"),
        (dict(mechanism="local", adaptive_clip=AdaptiveClip()), "adaptive_clip needs mechanism: central"),
    ],
)
def test_bad_privacy_settings_are_one_line_errors(config: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        PrivacyEngine(Privacy(**config))


# ---- the command line ---------------------------------------------------------------------------------------------
def test_train_py_prints_epsilon_beside_the_accuracy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from fl_lightning.cli import train_config

    root = Path(__file__).resolve().parents[2]
    summary = train_config([root / "configs/dp/digits_fedrep.yaml"],
                           ["--trainer.max_steps=2", "--model.eval_last=1"], run_dir=tmp_path / "run")  # fmt: skip
    event = dp.SampledWithoutReplacementDpEvent(N, M, dp.GaussianDpEvent(0.5))  # σ = 1, replace-one: σ/2
    assert summary["epsilon"] == pytest.approx(
        library_epsilon(event, 2, 1e-3, dp.NeighboringRelation.REPLACE_ONE), rel=1e-9
    )
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("algorithm"))
    assert header.split()[:3] == ["algorithm", "metric", "final"] and "epsilon" in header.split()
    assert (tmp_path / "run" / "summary.json").read_text().count('"epsilon"') == 1
    metrics = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert "privacy/epsilon" in metrics[0].split(",")


@pytest.mark.slow  # four short train.py runs
def test_runs_batched_on_the_run_axis_equal_solo_runs_with_dp_on(tmp_path: Path) -> None:
    from fl_lightning.cli import train_config
    from fl_lightning.experiment.run_axis import BatchedRuns
    from fl_lightning.experiment.run_axis.__main__ import seed_runs

    config = str(Path(__file__).resolve().parents[2] / "configs/dp/digits_fedrep.yaml")
    args = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "1", "--checkpoint_every", "1",
            "--model.algorithm.init_args.head_epochs", "2", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    job = BatchedRuns(seed_runs(["--config", config, *args, "--run_dir", str(tmp_path / "batched")], [0, 1]))
    outcomes = job.run()
    assert [o.status for o in outcomes] == ["done"] * 2, [o.error for o in outcomes]
    for s in (0, 1):
        solo = train_config([config], [*args, "--seed_everything", str(s)], run_dir=tmp_path / "solo" / f"s{s}")
        batched = outcomes[s].summary
        assert batched["epsilon"] == solo["epsilon"] and batched["rounds"] == solo["rounds"] == 3
        assert abs(batched["final"] - solo["final"]) < 1e-5
        sb = torch.load(tmp_path / "batched" / f"s{s}" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        ss = torch.load(tmp_path / "solo" / f"s{s}" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for name, value in ss.items():
            if value.is_floating_point():
                assert_close_finite(sb[name], value, rtol=0, atol=1e-5, msg=name)
