"""FedPer (Arivazhagan et al. 2019; ``fl_lightning/algorithms/fedper.py``) against references written here: its
arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

from fl_lightning.algorithms import FedPer
from tests.helpers.asserts import assert_params_close_finite
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


def test_fedper_client_update_is_joint_with_personal_head(digits_mlp_setup):
    net, x, y, glob, head = digits_mlp_setup
    upd = FedPer(local_epochs=2).client_update(context(net, x, y), glob, head)
    expected = reference_sgd(with_state(net, head), x, y, [""], 2)
    assert set(upd.upload) == {n for n in glob if n.startswith("body.")}
    assert_params_close({**upd.upload, **upd.state}, expected, glob)


def test_fedper_default_split_personal_head():
    """FedPer (spec 000 §2.4): the head (final layer) stays on the client, the body is averaged."""
    personal, shared, upload, state = split_of(FedPer())
    assert personal == state == CIFAR_HEAD
    assert shared == upload == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER


def test_fedper_trains_personal_head_and_global_body_jointly(client):
    ctx, x, y = client
    glob, own = rand_params(2), rand_params(3)
    head = {n: own[n] for n in HEAD}
    upd = FedPer(local_epochs=2).client_update(ctx(), glob, head)
    start = {**glob, **head}  # global body, the client's own head
    want = reference_sgd_2(start, x, y, NAMES, 2)
    assert list(upd.upload) == BODY and list(upd.state) == HEAD
    assert_params_close_finite({**upd.upload, **upd.state}, want, rtol=1e-9, atol=1e-10)
    from_global_head = reference_sgd_2(glob, x, y, NAMES, 2)  # personal/global swapped at the start
    body_only = reference_sgd_2(start, x, y, BODY, 2)  # head not trained
    assert far({**upd.upload, **upd.state}, from_global_head) and far(upd.state, body_only, HEAD)
