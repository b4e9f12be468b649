"""FedProto (Tan et al. 2022) on one client against references written here: the prototype logits
−‖φ(x) − C̄^(j)‖²₂ with unknown classes one below the farthest known one, the head path (``inference: head``, or
before any prototype exists) as the network's forward with its side information and its own buffers, the local
objective CE + λ‖φ(x) − C̄^(y)‖²₂ with per-sample side information, and one client update (the reported loss,
the SGD step, the uploaded per-class sums and counts)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from fl_lightning.algorithms.representation import features_and_outputs, require_body
from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.body_head_network import BodyHead, C, D, H, inputs, np_features, np_head, weights


# -- the representation helpers FedProto uses ----------------------------------------------------------------------
class GainSide(nn.Module):
    """``gain · z + s`` with a trained ``gain``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, z: Tensor, s: Tensor) -> Tensor:
        return self.gain * z + s


def test_features_and_outputs_use_the_given_side_parameters() -> None:
    p, (x, _) = weights(), inputs()
    side = torch.tensor([[0.5, -1.0]], dtype=torch.float64).expand(4, 2)
    net = SplitModel(nn.Linear(D, H), nn.Linear(H, C), GainSide()).double()
    feats, out = features_and_outputs(net, {**p, "side.gain": torch.tensor(3.0, dtype=torch.float64)}, x, side)
    f = np_features(p, x)
    assert_close_finite(feats, f)
    assert_close_finite(out, np_head(p, 3.0 * f + side.numpy()))  # the given gain 3, not the module's 1


def test_features_and_outputs_of_a_network_without_a_side_attribute() -> None:
    p, (x, _) = weights(), inputs()
    net = BodyHead().double()
    feats, out = features_and_outputs(net, p, x, None)
    assert_close_finite(feats, np_features(p, x))
    assert_close_finite(out, np_head(p, np_features(p, x)))


class BodyOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, H)


class HeadOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(H, C)


def test_require_body_needs_both_a_body_and_a_head() -> None:
    require_body("M", BodyHead(), "why")
    for net in (BodyOnly(), HeadOnly(), nn.Linear(D, C)):
        with pytest.raises(ConfigError, match="^M needs a network with a body and a head"):
            require_body("M", net, "why")
