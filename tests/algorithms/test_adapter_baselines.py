"""The framework's own personalized methods on LoRA adapters (issue 43): FedRep alternates (the personal head first
with the adapters frozen, then the adapters with the new head frozen), FedPer trains them jointly with a personal
head, Ditto keeps a personal copy of the trained tensors only (never of the frozen base); references in plain torch."""

from __future__ import annotations

import torch

from fl_lightning.algorithms import Ditto, FedPer, FedRep
from tests.helpers.lora_refs import assert_close, context, params_of, prepared, reference_sgd
from tests.helpers.tiny_lora import tiny_net, token_batch


def data():
    return token_batch(8, seed=2), torch.tensor([1, 1, 0, 0, 1, 0, 1, 0])


def test_fedrep_on_adapters_alternates_head_then_adapters():
    net = tiny_net()
    x, y = data()
    glob = params_of(net)
    alg = prepared(FedRep(head_epochs=3, body_epochs=2), net)
    head = {n: glob[n] + 0.1 for n in alg.init_client_state(glob)}
    assert set(head) == {"head.weight", "head.bias"}
    upd = alg.client_update(context(net, x, y), glob, head)
    first = reference_sgd(net, {**glob, **head}, x, y, lambda n: n.startswith("head."), 3)
    second = reference_sgd(net, first, x, y, lambda n: ".lora_" in n, 2)
    assert set(upd.upload) == {n for n, p in net.named_parameters() if ".lora_" in n}
    assert_close({**upd.upload, **upd.state}, second, [*upd.upload, *upd.state])
    joint = reference_sgd(net, {**glob, **head}, x, y, lambda n: ".lora_" in n or n.startswith("head."), 5)
    assert any(not torch.allclose(upd.upload[n], joint[n], atol=1e-6) for n in upd.upload)  # not joint SGD


def test_fedper_with_patterns_keeps_b_and_the_head_personal():
    net = tiny_net()
    x, y = data()
    glob = params_of(net)
    alg = prepared(FedPer(local_epochs=2, personal=["*.lora_B", "head.*"]), net)
    state = alg.init_client_state(glob)
    assert set(state) == {n for n in glob if ".lora_B." in n or n.startswith("head.")}
    upd = alg.client_update(context(net, x, y), glob, state)
    want = reference_sgd(net, glob, x, y, lambda n: ".lora_" in n or n.startswith("head."), 2)
    assert set(upd.upload) == {n for n in glob if ".lora_A." in n}
    assert_close({**upd.upload, **upd.state}, want, [*upd.upload, *upd.state])


def test_ditto_keeps_a_personal_copy_of_the_adapters_and_head_only():
    net = tiny_net()
    alg = prepared(Ditto(lam=0.5), net)
    state = alg.init_client_state(params_of(net))
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert {n.removeprefix("v.") for n in state} == trained
    assert sum(v.numel() for v in state.values()) < 0.5 * sum(p.numel() for p in net.parameters())
