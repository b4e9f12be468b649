"""The body's representation φ(x), for methods that act on it (MOON's contrastive loss, FedProto's prototypes).

``features_and_outputs`` runs a ``SplitModel`` once and returns both φ(x) (flattened to ``[batch, features]``)
and the network's output ``head(side(φ(x), z))``, from a ``name -> tensor`` dict as every client holds.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning.client import Params
from fl_lightning.errors import ConfigError


def require_body(method: str, net: nn.Module, what: str) -> None:
    """A one-line ``ConfigError`` unless ``net`` is a ``SplitModel`` (a ``body`` and a ``head`` module)."""
    if not isinstance(getattr(net, "body", None), nn.Module) or not isinstance(getattr(net, "head", None), nn.Module):
        raise ConfigError(
            f"{method} needs a network with a body and a head (a SplitModel): {what}; "
            f"{type(net).__name__} has no body"
        )


def _part(params: Params, prefix: str) -> Params:
    return {n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}


def body_features(net: nn.Module, params: Params, x: Tensor) -> Tensor:
    """φ(x) with the body parameters of ``params``, flattened to ``[batch, features]``."""
    return functional_call(net.body, _part(params, "body."), (x,)).flatten(1)


def features_and_outputs(net: nn.Module, params: Params, x: Tensor, side: Tensor | None) -> tuple[Tensor, Tensor]:
    """(φ(x) flattened, the network's output) in one pass through the body."""
    features = functional_call(net.body, _part(params, "body."), (x,))
    hidden = features
    if getattr(net, "side", None) is not None:
        hidden = functional_call(net.side, _part(params, "side."), (features, side))
    return features.flatten(1), functional_call(net.head, _part(params, "head."), (hidden,))
