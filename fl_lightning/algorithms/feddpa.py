"""FedDPA (Yang et al., "Dual-Personalizing Adapter for Federated Foundation Models", NeurIPS 2024): each client
has a global adapter (LoRA, averaged by the server: FedAvg) and a local adapter (LoRA, kept on the client), on one
frozen base. FedDPA-T, the iterative variant of the authors' code (Lydia-yang/FedDPA ``code/main.py`` with
``local_model=True``; ``fed_utils/client.py`` ``set_local``), per round from round 1 on:

1. the local adapter trains with the received global adapter frozen, the two combined as
   h = W₀x + a·ΔW_l x + (1 − a)·ΔW_g x   (``local_weight`` a = 0.5);
2. the global adapter (and the head) trains alone, h = W₀x + ΔW_g x, and is uploaded.

At inference the two are combined per instance (instance-wise dynamic weighting; ``GlobalModel_generated.py``
``get_weight``): with e(·) the pooled last hidden state under the local adapter and x₁…x_k the client's reference
training instances (k = ``instances``),

    α(x) = w · (1/k) Σⱼ cos(e(x), e(xⱼ)),     h = W₀x + α(x)·ΔW_l x + (1 − α(x))·ΔW_g x      (w = ``max_weight``)

so a test instance like the client's own data leans on its local adapter (the paper's reading; in the authors'
script the weight goes to whichever adapter is loaded as the active one). The authors sample the k references at
random per test instance; here they are the first k of the client's training data in a seeded order, fixed per
client and evaluation. The network needs two adapters: ``model.network.init_args.adapters: [global, local]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, LoopClient, Params, make_generator
from fl_lightning.errors import ConfigError

REFS = "feddpa_refs"  #: the reference instances' embeddings, carried in the evaluated parameters ``[k, D]``


class FedDPA(Algorithm):
    vectorizable = False  # per-instance adapter weights are set on the network (hooks), one client at a time
    reveals = "the global adapter and head after training with the global adapter alone; the local adapter never"
    state_dependent_uploads = ()  # the global phase runs with the local adapter switched off

    def __init__(
        self,
        local_epochs: int = 1,
        local_weight: float = 0.5,
        max_weight: float = 1.0,
        instances: int = 5,
        global_adapter: str = "global",
        local_adapter: str = "local",
    ) -> None:
        super().__init__(personal=(f"*.lora_A.{local_adapter}", f"*.lora_B.{local_adapter}"))
        if not 0 <= local_weight <= 1 or not 0 <= max_weight <= 1:
            raise ConfigError(f"FedDPA local_weight and max_weight must be in [0, 1], got {local_weight}, {max_weight}")
        if instances < 1:
            raise ConfigError(f"FedDPA instances must be ≥ 1, got {instances}")
        self.local_epochs, self.local_weight, self.max_weight, self.instances = (
            local_epochs, local_weight, max_weight, instances)  # fmt: skip
        self.global_adapter, self.local_adapter = global_adapter, local_adapter

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        adapters = tuple(getattr(net, "adapters", ()))
        if self.global_adapter not in adapters or self.local_adapter not in adapters:
            pair = f"[{self.global_adapter}, {self.local_adapter}]"
            raise ConfigError(
                f"FedDPA needs a network with adapters {pair} (has {list(adapters)}); "
                f"set model.network.init_args.adapters: {pair}"
            )

    def _weights(self, net: nn.Module, local: Tensor | float):
        """The adapters' weights inside the block: local·ΔW_l + (1 − local)·ΔW_g."""
        return net.adapter_weights({self.local_adapter: local, self.global_adapter: 1 - local})

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        params = self.client_model(global_params, state)
        local = ctx.params_with(self.personal)
        if ctx.round > 0:  # 1. the local adapter, with the global one frozen (weights a, 1 − a)
            with self._weights(ctx.net, self.local_weight):
                params = ctx.sgd(params, local, self.local_epochs)
        with ctx.net.adapter_weights({self.local_adapter: 0.0}):  # 2. the global adapter alone
            params = ctx.sgd(params, ctx.params_without(self.personal), self.local_epochs)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)

    # ---- evaluation: instance-wise dynamic weighting -----------------------------------------------------------
    def embed(self, net: nn.Module, params: Params, x: Tensor) -> Tensor:
        """e(x): the pooled last hidden state with only the local adapter on."""
        with torch.no_grad(), net.adapter_weights({self.global_adapter: 0.0, self.local_adapter: 1.0}):
            return functional_call(net.body, {k[5:]: v for k, v in params.items() if k.startswith("body.")}, (x,))

    def adapt_for_evaluation(self, ctx: LoopClient, params: Params) -> Params:
        """Attach the embeddings of the client's k reference training instances (a seeded choice)."""
        n = ctx.num_samples
        order = torch.randperm(n, generator=make_generator(ctx.seed, "feddpa", ctx.client))[: self.instances]
        refs = self.embed(ctx.net, params, ctx.x[order.to(ctx.x.device)])
        return {**params, REFS: refs}

    def instance_weights(self, features: Tensor, refs: Tensor) -> Tensor:
        """α(x) = w · mean_j cos(e(x), e(x_j)) for each row of ``features`` ``[B, D]`` → ``[B]``."""
        cos = F.cosine_similarity(features.unsqueeze(1), refs.unsqueeze(0), dim=-1)  # [B, k]
        return self.max_weight * cos.mean(1)

    def predict(self, net: nn.Module, params: Params, x: Tensor, side: Tensor | None) -> Tensor:
        params = dict(params)
        refs = params.pop(REFS, None)
        if refs is None:  # scored without adaptation (e.g. class shares): the paper's training-time weights
            with self._weights(net, self.local_weight):
                return functional_call(net, params, (x,), strict=False)
        alpha = self.instance_weights(self.embed(net, params, x), refs)
        with self._weights(net, alpha):
            return functional_call(net, params, (x,), strict=False)

    def finetune(self, ctx: Client, params: Params, epochs: int, prefixes: Sequence[str]) -> Params:
        params = {n: v for n, v in params.items() if n != REFS}
        with self._weights(ctx.net, self.local_weight):
            return ctx.sgd(params, ctx.params_with(prefixes), epochs)
