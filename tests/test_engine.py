"""Engine invariants: sampling, FedAvg = SGD, personal state, privacy boundary, determinism, resume."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from conftest import fit, make_trainer
from helpers import assert_close_finite

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.engine.ledger import PrivacyViolation
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import DigitsMLP


def digits(num_clients=20, **kw):
    return DigitsDataModule(num_clients=num_clients, partition=Shards(2 if num_clients > 1 else 10), seed=0, **kw)


def test_sampling_is_a_pure_function_of_seed_and_round():
    a, b = ClientSampler(100, 10, seed=7), ClientSampler(100, 10, seed=7)
    late = [b.sample(r) for r in range(20, 0, -1)][::-1]  # drawn in the opposite order
    early = [a.sample(r) for r in range(1, 21)]
    assert all(torch.equal(x, y) for x, y in zip(early, late))
    assert all(len(set(s.tolist())) == 10 for s in early)  # without replacement
    assert not torch.equal(ClientSampler(100, 10, seed=8).sample(3), a.sample(3))
    assert len({tuple(s.tolist()) for s in early}) > 15  # rounds differ
    counts = torch.bincount(torch.cat([a.sample(r) for r in range(2000)]), minlength=100).float()
    assert (counts / 2000 - 0.1).abs().max() < 0.03  # uniform


def test_fedavg_one_client_one_step_equals_sgd():
    L.seed_everything(0, verbose=False)
    net = DigitsMLP()
    reference = copy.deepcopy(net)
    dm = digits(num_clients=1, clients_per_round=1)
    module = FederatedModule(FedAvg(local_epochs=1), net, lr=0.1, momentum=0.0, batch_size=10_000, eval_every=100)
    make_trainer(1).fit(module, datamodule=dm)

    x, y = dm.federated.train.client(0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()
    for (n, p), (_, q) in zip(module.net.named_parameters(), reference.named_parameters()):
        assert_close_finite(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_non_sampled_clients_personal_state_is_bit_identical():
    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 1:
                self.before = {n: module.bank.row(n).clone() for n in module.bank.names}
                self.cohort = set(batch["clients"].tolist())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.after = {n: module.bank.row(n).clone() for n in module.bank.names}

    snap = Snapshot()
    module = FederatedModule(FedRep(head_epochs=2, body_epochs=1), DigitsMLP(), eval_every=100)
    fit(module, digits(), rounds=2, callbacks=[snap])
    for c in range(20):
        same = all(torch.equal(snap.before[n][c], snap.after[n][c]) for n in snap.before)
        assert same == (c not in snap.cohort), c


@pytest.mark.parametrize(
    "algorithm", [FedAvg(1), FedRep(2, 1), FedPer(1), LGFedAvg(1, personal=("body.fc1",)), LocalOnly(1)]
)
def test_uploads_never_contain_personal_parameters(algorithm):
    dm = digits()
    module = FederatedModule(algorithm, DigitsMLP(), eval_every=100)
    seen: list[str] = []
    trainer = make_trainer(3)
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.extend(t))

    module.attach_data = attach_and_observe
    trainer.fit(module, datamodule=dm)
    personal = [n for n, _ in module.net.named_parameters() if algorithm.is_personal(n)]
    assert not set(seen) & set(personal)
    if isinstance(algorithm, LocalOnly):
        assert seen == []
    else:
        assert seen and set(seen) == {n for n, _ in module.net.named_parameters()} - set(personal)


def test_ledger_rejects_a_personal_upload():
    class Leaky(FedRep):
        def client_update(self, ctx, global_params, state):
            upd = super().client_update(ctx, global_params, state)
            return ClientUpdate({**upd.upload, "head.weight": state["head.weight"]}, upd.state, upd.num_samples)

    module = FederatedModule(Leaky(1, 1), DigitsMLP(), eval_every=100)
    with pytest.raises(PrivacyViolation, match="head.weight"):
        fit(module, digits(), rounds=1)


def test_same_seed_gives_identical_metrics():
    def run(seed):
        L.seed_everything(seed, verbose=False)
        return fit(FederatedModule(FedRep(2, 1), DigitsMLP(), eval_every=1), digits(), rounds=4, seed=seed)

    first, second = run(0), run(0)
    assert first.history == second.history
    assert run(1).history != first.history


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(FedRep(2, 1), DigitsMLP(), eval_every=1, eval_last=3)

    full = fit(module(), digits(), rounds=6)
    assert len(full.history) == 6

    ckpt = RoundCheckpoint(
        dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    first = module()
    trainer = make_trainer(6, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(first, datamodule=digits())
    path = tmp_path / "r3.ckpt"
    assert path.exists()

    resumed = module()
    L.seed_everything(123, verbose=False)  # a different process RNG state must not matter
    make_trainer(6, enable_checkpointing=False).fit(resumed, datamodule=digits(), ckpt_path=str(path))
    assert resumed.history == full.history
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n
    for n in full.bank.names:
        assert torch.equal(resumed.bank.row(n), full.bank.row(n))


def test_personal_prefix_that_matches_nothing_is_an_error():
    from fl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="matches no parameter"):
        fit(FederatedModule(FedRep(1, 1, personal=("classifier.",)), DigitsMLP()), digits(), rounds=1)


def test_aggregation_weights_uniform_vs_num_samples():
    """One round of FedAvg: the new global model is the (weighted) mean of the clients' models."""
    from datamodules import Dirichlet

    for aggregation in ("uniform", "num_samples"):
        L.seed_everything(0, verbose=False)
        dm = DigitsDataModule(num_clients=6, partition=Dirichlet(0.5), clients_per_round=3, seed=0)
        module = FederatedModule(FedAvg(1), DigitsMLP(), aggregation=aggregation, eval_every=100)
        init = {n: p.detach().clone() for n, p in module.net.named_parameters()}
        uploads = []
        original_attach = module.attach_data

        def attach_and_observe(fed, module=module, original_attach=original_attach, uploads=uploads):
            original_attach(fed)
            module.ledger.observers.append(
                lambda r, cid, t: uploads.append((cid, {k: v.clone() for k, v in t.items()}))
            )

        module.attach_data = attach_and_observe
        make_trainer(1).fit(module, datamodule=dm)
        sizes = dm.federated.train.sizes
        w = torch.tensor([1.0 if aggregation == "uniform" else float(sizes[c]) for c, _ in uploads])
        for n, p in module.net.named_parameters():
            expected = init[n] + sum(wi * (u[n] - init[n]) for wi, (_, u) in zip(w, uploads)) / w.sum()
            assert_close_finite(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_frozen_parameters_never_train_and_are_never_uploaded():
    net = DigitsMLP()
    net.body.fc1.weight.requires_grad_(False)
    frozen = net.body.fc1.weight.detach().clone()
    seen: list[str] = []
    module = FederatedModule(FedAvg(1), net, eval_every=100)
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.extend(t))

    module.attach_data = attach_and_observe
    fit(module, digits(), rounds=2)
    assert torch.equal(module.net.body.fc1.weight, frozen)
    assert seen and "body.fc1.weight" not in seen and "body.fc1.bias" in seen


def test_batchnorm_buffers_are_averaged_including_the_integer_counter():
    from collections import OrderedDict

    from torch import nn

    from fl_lightning.models.split import SplitModel

    class BNNet(SplitModel):
        def __init__(self):
            body = OrderedDict(
                conv=nn.Conv2d(1, 4, 3, padding=1), bn=nn.BatchNorm2d(4), relu=nn.ReLU(), flat=nn.Flatten()
            )
            super().__init__(nn.Sequential(body), nn.Linear(256, 10))

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    module = FederatedModule(FedAvg(1), BNNet(), aggregation="uniform", eval_every=100)
    uploads = []
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: uploads.append({k: v.clone() for k, v in t.items()}))

    module.attach_data = attach_and_observe
    fit(module, dm, rounds=1)
    mean = torch.stack([u["body.bn.running_mean"] for u in uploads]).mean(0)
    assert_close_finite(module.net.body.bn.running_mean, mean)
    counts = [int(u["body.bn.num_batches_tracked"]) for u in uploads]
    assert module.net.body.bn.num_batches_tracked.dtype == torch.long
    assert int(module.net.body.bn.num_batches_tracked) == round(sum(counts) / len(counts))
