"""FedDPA (``fl_lightning/algorithms/feddpa.py``): a global and a local LoRA adapter per client. References here
use peft's own per-adapter ``scaling`` to weight the adapters (not the network's weighting hooks): the local phase
(a·ΔW_l + (1 − a)·ΔW_g, only the local adapter trained), the global phase (local adapter off), and the
instance-wise weights α(x) = w · mean_j cos(e(x), e(x_j)) with the per-instance combined output."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.algorithms.feddpa import REFS, FedDPA
from fl_lightning.errors import ConfigError
from tests.helpers.lora_refs import assert_close, context, loaded, params_of, prepared, reference_sgd
from tests.helpers.tiny_lora import tiny_net, token_batch

ADAPTERS = ("global", "local")


def rescaled(net, factors: dict[str, float]):
    """A copy whose LoRA layers scale each adapter's update by ``factors`` (peft's ``scaling`` per adapter)."""
    net = copy.deepcopy(net)
    for m in net.modules():
        if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A"):
            for name, f in factors.items():
                m.scaling[name] = m.scaling[name] * f
    return net


def data():
    return token_batch(8, seed=4), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])


def test_round_zero_trains_the_global_adapter_alone_and_uploads_it():
    net = tiny_net(ADAPTERS)
    x, y = data()
    glob = params_of(net)
    alg = prepared(FedDPA(local_epochs=2), net)
    state = alg.init_client_state(glob)
    assert set(state) == {n for n in glob if ".local." in n}
    upd = alg.client_update(context(net, x, y, round_idx=0), glob, state)
    want = reference_sgd(rescaled(net, {"local": 0.0}), glob, x, y, lambda n: ".global." in n or "head." in n, 2)
    assert set(upd.upload) == {n for n in glob if ".global." in n or n.startswith("head.")}
    assert_close(upd.upload, want, upd.upload)
    assert all(torch.equal(upd.state[n], state[n]) for n in state)  # round 0: no local phase


def test_later_rounds_train_the_local_adapter_first_with_weights_a_and_1_minus_a():
    net = tiny_net(ADAPTERS)
    x, y = data()
    glob = params_of(net)
    alg = prepared(FedDPA(local_epochs=2, local_weight=0.3), net)
    state = {n: v + 0.02 for n, v in alg.init_client_state(glob).items()}
    upd = alg.client_update(context(net, x, y, round_idx=1), glob, state)
    local = reference_sgd(rescaled(net, {"local": 0.3, "global": 0.7}), {**glob, **state}, x, y,
                          lambda n: ".local." in n, 2)  # fmt: skip
    global_ = reference_sgd(rescaled(net, {"local": 0.0}), local, x, y, lambda n: ".global." in n or "head." in n, 2)
    assert_close(upd.state, local, upd.state)
    assert_close(upd.upload, global_, upd.upload)


def test_instance_weights_and_the_combined_prediction_follow_the_equation():
    net = tiny_net(ADAPTERS)
    glob = params_of(net)
    alg = prepared(FedDPA(max_weight=0.5, instances=3), net)
    own = {n: v * 1.5 for n, v in alg.init_client_state(glob).items()}
    params = {**glob, **own}
    train_x, y = data()
    ctx = context(net, train_x, y)
    adapted = alg.adapt_for_evaluation(ctx, params)
    local_only = loaded(rescaled(net, {"global": 0.0}), params).eval()
    refs = local_only.body(train_x)  # e(x_j) of every training row; FedDPA uses 3 of them
    picked = [j for j in range(8) if any(torch.allclose(refs[j], r, atol=1e-6) for r in adapted[REFS])]
    assert len(picked) == 3
    x = token_batch(5, seed=11)
    e = local_only.body(x)
    alpha = torch.stack([0.5 * sum(F.cosine_similarity(e[i], refs[j], dim=0) for j in picked) / 3 for i in range(5)])
    out = alg.predict(net.eval(), adapted, x, None)
    for i in range(5):  # row i: α_i·ΔW_l + (1 − α_i)·ΔW_g, by peft's scaling
        a = float(alpha[i])
        want = loaded(rescaled(net, {"local": a, "global": 1 - a}), params).eval()(x[i : i + 1])
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-6)
    assert alpha.std() > 0  # the weights differ per instance


def test_a_network_without_both_adapters_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="adapters") as err:
        FedDPA().check_compatible(tiny_net(("default",)), 2)
    assert "\n" not in str(err.value)
