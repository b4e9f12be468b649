"""LocalOnly (``fl_lightning/algorithms/local_only.py``) against references written here: its arguments and defaults,
its client update on one client, and its runs through the engine."""

from __future__ import annotations

from fl_lightning.algorithms import FedAvg, LocalOnly
from tests.helpers.asserts import assert_params_close_finite
from tests.helpers.digits_mlp import assert_params_close, context, reference_sgd, with_state
from tests.helpers.split_models import NAMES, cifar_params, far, rand_params, split_of
from tests.helpers.split_models import reference_sgd as reference_sgd_2


def test_local_only_uploads_nothing(digits_mlp_setup):
    net, x, y, glob, _ = digits_mlp_setup
    own = {n: v * 0.5 for n, v in glob.items()}
    upd = LocalOnly(local_epochs=2).client_update(context(net, x, y), glob, own)
    assert upd.upload == {}
    assert_params_close(upd.state, reference_sgd(with_state(net, own), x, y, [""], 2), glob)


def test_local_only_keeps_everything_and_fedavg_nothing():
    params = cifar_params()
    personal, shared, upload, state = split_of(LocalOnly())
    assert personal == state == list(params) and shared == upload == []
    personal, shared, upload, state = split_of(FedAvg())
    assert personal == state == [] and shared == upload == list(params)


def test_local_only_trains_its_own_model_and_uploads_nothing(client):
    ctx, x, y = client
    glob, own = rand_params(8), rand_params(9)
    upd = LocalOnly(local_epochs=2).client_update(ctx(), glob, own)
    assert upd.upload == {} and list(upd.state) == NAMES
    want = reference_sgd_2(own, x, y, NAMES, 2)
    assert_params_close_finite(upd.state, want, rtol=1e-9, atol=1e-10)
    assert far(upd.state, reference_sgd_2(glob, x, y, NAMES, 2))
