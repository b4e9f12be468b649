"""FedRep (Collins et al. 2021; ``fl_lightning/algorithms/fedrep.py``) against references written here: its arguments
and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import torch

from fl_lightning.algorithms import FedRep
from tests.helpers.asserts import assert_close_finite, assert_params_close_finite
from tests.helpers.body_head_scalar import LR, np_loss_grads, problem
from tests.helpers.body_head_scalar import context as context_2
from tests.helpers.digits_mlp import assert_params_close, context, reference_sgd, with_state
from tests.helpers.split_models import (
    BODY,
    CIFAR_BODY_LOWER,
    CIFAR_BODY_UPPER,
    CIFAR_HEAD,
    HEAD,
    NAMES,
    far,
    rand_params,
    split_of,
)
from tests.helpers.split_models import reference_sgd as reference_sgd_2


def test_fedrep_client_update_alternates_head_then_body(digits_mlp_setup):
    net, x, y, glob, head = digits_mlp_setup
    upd = FedRep(head_epochs=4, body_epochs=2).client_update(context(net, x, y), glob, head)
    after_head = reference_sgd(with_state(net, head), x, y, ["head."], 4)  # body frozen
    after_body = reference_sgd(with_state(net, after_head), x, y, ["body."], 2)  # new head frozen
    assert set(upd.upload) == {n for n in glob if n.startswith("body.")}
    assert_params_close(upd.upload, after_body, upd.upload)
    assert_params_close(upd.state, after_head, head)  # the head the body phase saw is the one kept


def test_fedrep_head_phase_then_body_phase_and_reports_the_body_phase_loss() -> None:
    x, y, glob = problem()
    alg = FedRep(head_epochs=1, body_epochs=1)
    h_own = 1.25
    up = alg.client_update(context_2(x, y), glob, {"head.weight": torch.tensor([[h_own]], dtype=torch.float64)})

    xn, yn, w0 = x.numpy(), y.numpy(), glob["body.weight"].numpy()[0]
    _, _, gh = np_loss_grads(xn, yn, w0, h_own)
    h1 = h_own - LR * gh
    f_body, gw, _ = np_loss_grads(xn, yn, w0, h1)
    assert_close_finite(float(up.loss), f_body)
    assert set(up.upload) == {"body.weight"}
    assert_close_finite(up.upload["body.weight"], (w0 - LR * gw)[None, :])
    assert_close_finite(up.state["head.weight"], [[h1]])


def test_fedrep_default_split_personal_head():
    """FedRep (spec 000 Algorithm 1): personal heads, shared representation (body)."""
    personal, shared, upload, state = split_of(FedRep())
    assert personal == state == CIFAR_HEAD
    assert shared == upload == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER


def test_fedrep_head_phase_then_body_phase(client):
    """FedRep (spec 000 Algorithm 1): τ_h epochs on the client's head with the global body frozen, then τ_φ
    epochs on the body with the new head frozen; a fresh optimiser per phase; the body is uploaded and the
    head after the head phase is kept."""
    ctx, x, y = client
    glob, own = rand_params(6), rand_params(7)
    head0 = {n: own[n] for n in HEAD}
    upd = FedRep(head_epochs=3, body_epochs=2).client_update(ctx(), glob, head0)
    after_head = reference_sgd_2({**glob, **head0}, x, y, HEAD, 3)
    after_body = reference_sgd_2(after_head, x, y, BODY, 2)
    assert list(upd.upload) == BODY and list(upd.state) == HEAD
    assert_params_close_finite(upd.upload, after_body, BODY, rtol=1e-9, atol=1e-10)
    assert_params_close_finite(upd.state, after_head, HEAD, rtol=1e-9, atol=1e-10)
    # each swapped role gives numbers far from the update
    body_first = reference_sgd_2(reference_sgd_2({**glob, **head0}, x, y, BODY, 2), x, y, HEAD, 3)
    assert far(upd.upload, body_first, BODY) and far(upd.state, body_first, HEAD)
    joint = reference_sgd_2({**glob, **head0}, x, y, NAMES, 3)  # one phase trains everything
    assert far(upd.state, joint, HEAD)
    global_head = reference_sgd_2(reference_sgd_2(glob, x, y, HEAD, 3), x, y, BODY, 2)
    assert far(upd.upload, global_head, BODY)
    epochs_swapped = reference_sgd_2(reference_sgd_2({**glob, **head0}, x, y, HEAD, 2), x, y, BODY, 3)
    assert far(upd.upload, epochs_swapped, BODY)
