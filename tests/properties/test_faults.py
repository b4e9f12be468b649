"""Client faults (dropout, stragglers), the non-finite guard, the privacy ledger under faults, and server means that
stay exact with a dropped client."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from datamodules import DigitsDataModule, Dirichlet
from fl_lightning.algorithms import APFL, L2GD, SCAFFOLD, Ditto, FedAvg, FedMTL, FedProx, PerFedAvg
from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.engine.module import FederatedModule, TrainingDiverged
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.functional_mlp import run_digits
from tests.helpers.training import make_trainer

ALGORITHMS = {
    "fedprox": lambda: FedProx(mu=0.1),
    "scaffold": lambda: SCAFFOLD(),
    "ditto": lambda: Ditto(lam=0.75),
    "apfl": lambda: APFL(alpha=0.25),
    "l2gd": lambda: L2GD(p=0.5),
    "perfedavg": lambda: PerFedAvg(),
    "fedmtl": lambda: FedMTL(),
}


def poison_first_client(algorithm, round_idx):
    """The first client of the round's cohort sends NaN: the engine drops it, and it keeps its old state."""
    victim = int(ClientSampler(10, 3, 0).sample(round_idx)[0])
    original = algorithm.client_update

    def client_update(ctx, global_params, state):
        upd = original(ctx, global_params, state)
        if ctx.round == round_idx and ctx.client == victim:
            upd.upload = {n: torch.full_like(v, float("nan")) for n, v in upd.upload.items()}
        return upd

    algorithm.client_update = client_update


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_end_to_end_with_a_dropped_client_keeps_the_server_means_exact(name):
    """|S| in SCAFFOLD's, L2GD's and Fed-MTL's server steps counts the uploads the engine aggregated: with one
    client dropped for NaN, c = mean_i c_i and x̄ = mean_i x_i still hold exactly (L2GD: in its round 1, a local
    round with p = 0.5 and seed 0, since in an aggregation round from equal models every Δx_i is 0)."""
    algorithm = ALGORITHMS[name]()
    poison_first_client(algorithm, 1 if name == "l2gd" else 0)
    assert name != "l2gd" or not algorithm.aggregation_round(0, 1)
    # the poisoning wrapper reads ctx.client: the reference loop's context
    module, seen = run_digits(algorithm, aggregation="uniform", executor="sequential")
    assert len(seen) == 3 * 3  # 3 clients per round, 3 rounds (the poisoned upload passes the ledger first)
    acc = module.summary["final"]
    assert 0.0 <= acc <= 1.0 and module.summary["rounds"] == 3
    if isinstance(algorithm, (L2GD, FedMTL)):  # the server's global model is the population mean exactly
        for n, p in module.net.named_parameters():
            prefix = "x." if isinstance(algorithm, L2GD) else "w."
            assert_close_finite(p.detach(), module.bank.row(prefix + n).mean(0), rtol=1e-4, atol=1e-6)
    if isinstance(algorithm, SCAFFOLD):  # c = mean_i c_i (all start at 0, uniform means)
        for n, c in algorithm.server_variate().items():
            assert_close_finite(c, module.bank.row("c_i." + n).mean(0), rtol=1e-4, atol=1e-6)


def observed_round(module, dm, rounds=1, **trainer_kwargs):
    """Train and record (round, client, upload) for every upload the ledger sees, plus logged metrics."""
    uploads, logged = [], []
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: uploads.append((r, c, {k: v.clone() for k, v in t.items()})))

    module.attach_data = attach_and_observe
    original_log_scalars = module.log_scalars  # the module's one logging call per round
    module.log_scalars = lambda metrics, **kw: (logged.append(dict(metrics)), original_log_scalars(metrics, **kw))
    init = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    trainer = make_trainer(rounds, **trainer_kwargs)
    trainer.fit(module, datamodule=dm)
    return init, uploads, logged


def weighted_average(init, uploads, weights):
    return {
        n: init[n] + sum(w * (u[n] - init[n]) for w, (_, _, u) in zip(weights, uploads)) / sum(weights) for n in init
    }


def datamodule():
    return DigitsDataModule(num_clients=10, partition=Dirichlet(1.0), clients_per_round=8, seed=3)


def test_dropout_aggregates_survivors_with_renormalised_weights():
    L.seed_everything(0, verbose=False)
    dm = datamodule()
    module = FederatedModule(FedAvg(1), DigitsMLP(), client_dropout=0.5, eval_every=100)
    init, uploads, logged = observed_round(module, dm)
    assert 0 < len(uploads) < 8, "with p=0.5 some of the 8 clients fail and some survive (fixed seed)"
    sizes = dm.federated.train.sizes
    expected = weighted_average(init, uploads, [float(sizes[c]) for _, c, _ in uploads])
    for n, p in module.net.named_parameters():
        assert_close_finite(p.detach(), expected[n], rtol=1e-5, atol=1e-6)
    faults = next(m for m in logged if "faults/dropped" in m)
    assert float(faults["faults/dropped"]) == 8 - len(uploads)


def test_round_without_survivors_leaves_the_global_model_unchanged(caplog):
    L.seed_everything(0, verbose=False)
    module = FederatedModule(FedAvg(1), DigitsMLP(), client_dropout=1.0, eval_every=100)
    init, uploads, _ = observed_round(module, datamodule())
    assert uploads == []
    for n, p in module.net.named_parameters():
        assert torch.equal(p.detach(), init[n])
    assert "no client survived" in caplog.text


def test_straggler_stops_after_its_budget_of_local_steps():
    """A straggler with budget ½ of 2 epochs uploads exactly what 1 epoch gives (same data order)."""
    from fl_lightning.client import ClientOptimizer
    from fl_lightning.engine.rounds import make_generator
    from fl_lightning.engine.sequential import loss_fn_for

    torch.manual_seed(0)
    net = DigitsMLP()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    x, y = torch.rand(30, 1, 8, 8), torch.randint(0, 10, (30,))

    def ctx(budget):
        opt = ClientOptimizer(lr=0.05, batch_size=10)
        return client_context(
            net, x, y, optimizer=opt, loss=loss_fn_for(10), generator=make_generator(1, 2), step_budget=budget,
        )

    straggler = FedAvg(local_epochs=2).client_update(ctx(0.5), glob, {})
    one_epoch = FedAvg(local_epochs=1).client_update(ctx(1.0), glob, {})
    two_epochs = FedAvg(local_epochs=2).client_update(ctx(1.0), glob, {})
    for n in glob:
        assert torch.equal(straggler.upload[n], one_epoch.upload[n])
    assert any(not torch.equal(straggler.upload[n], two_epochs.upload[n]) for n in glob)


class PoisonedFedAvg(FedAvg):
    """Client 0 (or every client) sends a poisoned update."""

    def __init__(self, value: float, everyone: bool = False) -> None:
        super().__init__(1)
        self.value, self.everyone = value, everyone

    def client_update(self, ctx, global_params, state):
        upd = super().client_update(ctx, global_params, state)
        if self.everyone or ctx.client == min(self.cohort):
            upd = ClientUpdate({n: torch.full_like(v, self.value) for n, v in upd.upload.items()}, {}, upd.num_samples)
        return upd


def test_non_finite_client_update_is_dropped_and_logged(caplog):
    L.seed_everything(0, verbose=False)
    dm = datamodule()
    algorithm = PoisonedFedAvg(float("nan"))
    module = FederatedModule(algorithm, DigitsMLP(), eval_every=100)
    algorithm.cohort = ClientSampler(10, 8, 3).sample(0).tolist()  # round 0's cohort
    init, uploads, logged = observed_round(module, dm)
    finite = [u for u in uploads if all(torch.isfinite(v).all() for v in u[2].values())]
    assert len(finite) == 7 and len(uploads) == 8
    sizes = dm.federated.train.sizes
    expected = weighted_average(init, finite, [float(sizes[c]) for _, c, _ in finite])
    for n, p in module.net.named_parameters():
        assert_close_finite(p.detach(), expected[n], rtol=1e-5, atol=1e-6)
    assert f"client {algorithm.cohort[0]} sent a non-finite update" in caplog.text and "round 0" in caplog.text
    assert float(next(m for m in logged if "faults/non_finite" in m)["faults/non_finite"]) == 1


def test_global_model_turning_non_finite_stops_with_a_checkpoint(tmp_path):
    L.seed_everything(0, verbose=False)
    algorithm = PoisonedFedAvg(3e38, everyone=True)  # finite uploads whose average overflows to inf
    module = FederatedModule(algorithm, DigitsMLP(), server_lr=10.0, eval_every=100)
    with pytest.raises(TrainingDiverged, match="round 0: the global model became non-finite"):
        observed_round(module, datamodule(), default_root_dir=str(tmp_path))
    saved = list((tmp_path / "checkpoints").glob("last_good_round00000.ckpt"))
    assert saved and all(torch.isfinite(p).all() for p in module.net.parameters())
    state = torch.load(saved[0], weights_only=True, map_location="cpu")["state_dict"]
    assert all(torch.isfinite(v).all() for k, v in state.items() if k.startswith("net."))
