"""FFA-LoRA (``fl_lightning/algorithms/ffa_lora.py``): A frozen at its initialisation. The client trains B and the
head only (plain-torch reference), its upload holds no A, and through the engine A never changes."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.ffa_lora import FFALoRA
from fl_lightning.engine.aggregation import CommunicationLedger
from tests.helpers.lora_refs import assert_close, context, params_of, prepared, reference_sgd
from tests.helpers.lora_runs import module, text_data
from tests.helpers.tiny_lora import tiny_net, token_batch
from tests.helpers.training import fit


def test_client_trains_b_and_head_and_uploads_no_a():
    net = tiny_net()
    x, y = token_batch(8), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    glob = params_of(net)
    upd = prepared(FFALoRA(local_epochs=2), net).client_update(context(net, x, y), glob, {})
    want = reference_sgd(net, glob, x, y, lambda n: ".lora_B." in n or n.startswith("head."), 2)
    assert upd.upload and not any(".lora_A." in n for n in upd.upload)
    assert {n for n in upd.upload} == {n for n, p in net.named_parameters() if p.requires_grad and ".lora_A." not in n}
    assert_close(upd.upload, want, upd.upload)
    moved = [n for n in upd.upload if ".lora_B." in n and not torch.equal(upd.upload[n], glob[n])]
    assert moved


def test_a_never_changes_and_is_never_uploaded_through_the_engine(tmp_path, monkeypatch):
    net = tiny_net()
    start = params_of(net)
    uploaded: set[str] = set()
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda ledger, r, c, up: uploaded.update(up)])
    run = fit(module(FFALoRA(), net), text_data(tmp_path), rounds=2, limit_val_batches=0)
    now = params_of(run.net)
    a_names = [n for n in now if ".lora_A." in n]
    assert a_names and all(torch.equal(now[n], start[n]) for n in a_names)
    assert uploaded and not any(".lora_A." in n for n in uploaded)
    assert any(not torch.equal(now[n], start[n]) for n in now if ".lora_B." in n)  # B moved


def test_ffa_lora_under_user_level_dp_clips_the_b_upload_as_written_here(tmp_path):
    """FFA-LoRA with DP (the paper's case) through the engine's privacy stage unchanged: each client's upload delta
    (B and the head; no A) is clipped to L2 norm C as a whole, the server takes the uniform mean (σ = 0 here, so the
    result is exact), and A stays at its initialisation."""
    from fl_lightning.engine.privacy import Privacy

    clip = 0.05
    dm = text_data(tmp_path, clients=4)
    net = tiny_net()
    start = params_of(net)
    privacy = Privacy(clip=clip, noise_multiplier=0.0, delta=1e-3, sampling="fixed")
    run = fit(module(FFALoRA(), net, aggregation="uniform", privacy=privacy), dm, rounds=1, limit_val_batches=0)
    fed = dm.federated
    upload = [n for n, p in net.named_parameters() if p.requires_grad and ".lora_A." not in n]
    mean = {n: torch.zeros_like(start[n], dtype=torch.float64) for n in upload}
    norms = []
    for c in range(4):
        x, y = fed.train.client(c)
        trained = reference_sgd(tiny_net(), start, x, y, lambda n: ".lora_B." in n or n.startswith("head."), 1)
        delta = {n: (trained[n] - start[n]).double() for n in upload}
        norm = torch.sqrt(sum((d**2).sum() for d in delta.values()))
        norms.append(float(norm))
        for n in upload:
            mean[n] += delta[n] * min(1.0, clip / float(norm)) / 4
    assert max(norms) > clip  # the clip binds
    now = params_of(run.net)
    for n in upload:
        torch.testing.assert_close((now[n] - start[n]).double(), mean[n], rtol=1e-4, atol=1e-7, msg=n)
    assert all(torch.equal(now[n], start[n]) for n in now if ".lora_A." in n)
