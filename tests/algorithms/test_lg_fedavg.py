"""LG-FedAvg (Liang et al. 2020; ``fl_lightning/algorithms/lg_fedavg.py``) against references written here: its
arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import yaml

from fl_lightning.algorithms import FedPer, LGFedAvg
from tests.helpers.asserts import assert_params_close_finite
from tests.helpers.digits_mlp import assert_params_close, context, reference_sgd, with_state
from tests.helpers.split_models import (
    BODY,
    CIFAR_BODY_LOWER,
    CIFAR_BODY_UPPER,
    CIFAR_HEAD,
    HEAD,
    NAMES,
    ROOT,
    far,
    rand_params,
    split_of,
)
from tests.helpers.split_models import reference_sgd as reference_sgd_2


def test_lg_fedavg_keeps_lower_layers_personal(digits_mlp_setup):
    net, x, y, glob, _ = digits_mlp_setup
    alg = LGFedAvg(local_epochs=2, personal=("body.fc1",))
    personal = {n: v + 0.05 for n, v in glob.items() if n.startswith("body.fc1")}
    upd = alg.client_update(context(net, x, y), glob, personal)
    expected = reference_sgd(with_state(net, personal), x, y, [""], 2)
    assert set(upd.state) == set(personal) and not set(upd.upload) & set(personal)
    assert_params_close({**upd.upload, **upd.state}, expected, glob)


def test_lg_fedavg_default_split_is_personal_lower_layers_and_shared_head():
    """LG-FedAvg (spec 000 §2.4 table: "own local repr. + global head"): the lower layers (the body) are
    personal and the upper layers (the head) shared, the opposite of FedPer's split."""
    personal, shared, upload, state = split_of(LGFedAvg())
    assert personal == state == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER
    assert shared == upload == CIFAR_HEAD
    assert personal != split_of(FedPer())[0]


def test_lg_fedavg_table1_config_keeps_the_two_conv_layers_local():
    """configs/methods/lg_fedavg.yaml (spec 000 §2.4: "the first two convolutional layers … as the local
    representation, and the fully-connected layers as the global parameters")."""
    cfg = yaml.safe_load((ROOT / "configs" / "methods" / "lg_fedavg.yaml").read_text())
    algorithm = cfg["model"]["algorithm"]
    assert algorithm["class_path"] == "fl_lightning.algorithms.LGFedAvg"
    personal, shared, upload, state = split_of(LGFedAvg(personal=algorithm["init_args"]["personal"]))
    assert personal == state == CIFAR_BODY_LOWER
    assert shared == upload == CIFAR_BODY_UPPER + CIFAR_HEAD


def test_lg_fedavg_default_trains_personal_body_and_global_head_jointly(client):
    ctx, x, y = client
    glob, own = rand_params(4), rand_params(5)
    body = {n: own[n] for n in BODY}
    upd = LGFedAvg(local_epochs=2).client_update(ctx(), glob, body)
    start = {**glob, **body}  # the client's own lower layers, the global head
    want = reference_sgd_2(start, x, y, NAMES, 2)
    assert list(upd.upload) == HEAD and list(upd.state) == BODY
    assert_params_close_finite({**upd.upload, **upd.state}, want, rtol=1e-9, atol=1e-10)
    assert far({**upd.upload, **upd.state}, reference_sgd_2(glob, x, y, NAMES, 2))  # global body at the start
