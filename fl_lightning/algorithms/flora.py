"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024): stacking aggregation. Each round every sampled client starts a fresh LoRA module on the
current global model (A drawn from peft's default Kaiming-uniform init, B = 0), trains it, and the server stacks
the clients' factors, A = [p₁A₁; …; p_KA_K] and B = [B₁ … B_K], so that the global update is exactly

    ΔW = s · B A = Σᵢ pᵢ · s · Bᵢ Aᵢ        (pᵢ = nᵢ / Σ n, the clients' sample shares)

which is merged into the base weights (authors' code, ATP-1010/FederatedLLM ``fed_utils/model_aggregation.py`` with
``stacking``: A rows scaled by pᵢ, B columns concatenated unscaled; ``main.py``: ``merge_and_unload`` after each
round and a new ``get_peft_model`` per client). Clients may have different ranks (``ranks``, cycled over client
ids): a rank-rᵢ client uses the first rᵢ rows of A and columns of B, the rest kept at zero (zero rows of A and zero
columns of B get zero gradients, so they stay zero: an exact rank-rᵢ adapter). The authors give a heterogeneous
client ``lora_alpha = 2 rᵢ`` (scaling 2): set the network's ``alpha`` to ``2 · rank`` for that case.

Here a client uploads its update's product ``delta.<base weight> = s Bᵢ Aᵢ`` (the dense matrix), which the engine
averages with the weights pᵢ, so the merged update is Σ pᵢ s Bᵢ Aᵢ as stacking gives it. The ledger therefore
counts d_out × d_in numbers per adapted layer where the authors' clients send rᵢ (d_in + d_out): the result is the
same, the byte count is not FLoRA's wire format (README, adapter section). The head (if any) is averaged (FedAvg).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.algorithms.lora_common import is_lora_a, is_lora_b, lora_layers, require_lora
from fl_lightning.client import LoopClient, Params, make_generator
from fl_lightning.errors import ConfigError

DELTA = "delta."


class FLoRA(Algorithm):
    vectorizable = False  # draws each client's fresh adapter from its own generator, one client at a time
    updates_frozen = True  #: the server merges ΔW into the (frozen for the clients) base weights
    supports_frozen = True
    reveals = "the product s·BᵢAᵢ of the client's freshly trained adapter (its whole low-rank update) and its head"

    def __init__(self, local_epochs: int = 1, ranks: Sequence[int] | None = None) -> None:
        super().__init__()
        self.local_epochs = local_epochs
        self.ranks = None if ranks is None else [int(r) for r in ranks]
        if self.ranks is not None and (not self.ranks or min(self.ranks) < 1):
            raise ConfigError(f"FLoRA ranks must be positive integers, got {ranks}")
        self.layers: dict[str, tuple[str, str, str, float]] = {}

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        require_lora(type(self).__name__, (n for n, p in net.named_parameters() if p.requires_grad))
        self.layers = lora_layers(net)
        rank = min(p.shape[0] for n, p in net.named_parameters() if is_lora_a(n))
        if self.ranks is not None and max(self.ranks) > rank:
            raise ConfigError(f"FLoRA ranks {self.ranks}: the network's LoRA rank is {rank}; raise model.network.rank")

    def rank_of(self, client: int, full: int) -> int:
        return full if self.ranks is None else self.ranks[client % len(self.ranks)]

    def shared_names(self, params: Params) -> list[str]:
        """Averaged as parameters: everything trained except the adapters (the head), which are re-drawn."""
        return [n for n in super().shared_names(params) if not (is_lora_a(n) or is_lora_b(n))]

    def upload_template(self, global_params: Params) -> Params:
        out = {n: global_params[n] for n in self.shared_names(global_params)}
        out.update({DELTA + base: global_params[base] for _, _, base, _ in self.layers.values()})
        return out

    download_template = upload_template  # the merged update and the head

    def fresh_adapter(self, ctx: LoopClient, params: Params) -> Params:
        """A new LoRA module: A ~ U(±1/√d_in) (peft's ``kaiming_uniform_(a=√5)``), B = 0, rows/columns beyond the
        client's rank zero; drawn from the client's own stream ``(seed, "flora", round, client)``."""
        gen = make_generator(ctx.seed, "flora", ctx.round, ctx.client)
        out = dict(params)
        for a, b, _, _ in self.layers.values():
            shape = params[a].shape
            bound = 1.0 / math.sqrt(shape[1])
            new_a = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            new_a[self.rank_of(ctx.client, shape[0]) :] = 0
            out[a] = new_a.to(params[a].dtype).to(params[a].device)
            out[b] = torch.zeros_like(params[b])
        return out

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        params = ctx.sgd(self.fresh_adapter(ctx, global_params), ctx.param_names, self.local_epochs)
        upload = {n: params[n] for n in self.shared_names(params)}
        for a, b, base, s in self.layers.values():
            upload[DELTA + base] = s * (params[b] @ params[a])
        return ClientUpdate(upload=upload, state={}, num_samples=ctx.num_samples, loss=ctx.train_loss)

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        """W ← W + Σ pᵢ s Bᵢ Aᵢ (the stacked product, merged as ``merge_and_unload`` does)."""
        for name, delta in averaged_extra.items():
            if name.startswith(DELTA):
                base = global_params[name[len(DELTA) :]]
                base.add_(delta.to(base.dtype))
