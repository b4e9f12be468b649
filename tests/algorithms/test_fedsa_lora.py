"""FedSA-LoRA (``fl_lightning/algorithms/fedsa_lora.py``): A shared, B and the classifier personal. The client update
is joint SGD from the global A and its own B and head (plain-torch reference); it uploads A only, and through the
engine the ledger never sees a B or a head tensor leave a client, while each client's B is its own."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.fedsa_lora import FedSALoRA
from fl_lightning.engine.aggregation import CommunicationLedger
from tests.helpers.lora_refs import assert_close, context, params_of, prepared, reference_sgd
from tests.helpers.lora_runs import module, text_data
from tests.helpers.tiny_lora import tiny_net, token_batch
from tests.helpers.training import fit


def test_client_update_trains_jointly_and_uploads_a_only():
    net = tiny_net()
    x, y = token_batch(8), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    glob = params_of(net)
    alg = prepared(FedSALoRA(local_epochs=2), net)
    own = {n: glob[n] + 0.05 for n in glob if ".lora_B." in n or n.startswith("head.")}
    assert set(own) == set(alg.init_client_state(glob))  # the personal names the patterns select
    upd = alg.client_update(context(net, x, y), glob, own)
    want = reference_sgd(net, {**glob, **own}, x, y, lambda n: ".lora_" in n or n.startswith("head."), 2)
    assert set(upd.upload) == {n for n in glob if ".lora_A." in n}
    assert set(upd.state) == set(own)
    assert_close({**upd.upload, **upd.state}, want, [*upd.upload, *upd.state])


def test_b_and_the_head_never_leave_a_client(tmp_path, monkeypatch):
    net = tiny_net()
    uploaded: set[str] = set()
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda ledger, r, c, up: uploaded.update(up)])
    run = fit(module(FedSALoRA(), net), text_data(tmp_path), rounds=2, limit_val_batches=0)
    assert uploaded == {n for n, p in net.named_parameters() if ".lora_A." in n}
    assert all(run.ledger.is_private(n) for n, _ in net.named_parameters() if ".lora_B." in n or "head." in n)
    bank = run.bank
    b_name = next(n for n in bank.names if ".lora_B." in n)
    rows = bank.gather(torch.arange(4))[b_name]
    assert not torch.equal(rows[0], rows[1])  # each client's own B
