"""The algorithm interface: only the math of a method (personal parameters, local update, server update).

The engine (``fl_lightning.engine.module.FederatedModule``) owns sampling, aggregation, the server optimiser,
client-state storage, logging and distribution. What a client can do, the ``ctx`` its hooks receive, is the client
contract ``fl_lightning.client.Client``: forward passes with given parameters, losses, ``sgd`` (with a ``Penalty``,
a ``Gradient`` step direction or an ``Objective``), per-client counts and sums, the kept optimiser state. Written
against it alone, a method runs on both executors (one client at a time, or K clients stacked ``[K, ...]``):
declare ``vectorizable = True``. An algorithm says:

* ``personal``: name prefixes of parameters that never leave a client (kept in the client bank);
* ``state_prefixes``: name prefixes of other per-client state in the bank (Ditto's ``v.``); with ``personal`` they
  are what the ledger (``CommunicationLedger`` in ``fl_lightning/engine/aggregation.py``) refuses to see in an
  upload, whatever the code does;
* ``reveals`` and ``state_dependent_uploads``: what an upload may tell the server about the client, in words and
  as the upload names whose values may depend on the client's personal state (``tests/properties/test_privacy.py``);
* ``init_client_state``: the per-client state template (by default the personal parameters);
* ``client_update``: one client's local work → what it uploads and its new state;
* ``server_update``: optional extra server math after the weighted average is applied;
* ``client_model``: the parameters a client evaluates with (``adapt_for_evaluation`` may adapt them);
* ``check_compatible``: a one-line ``ConfigError`` when the method cannot use the network or the task;
* ``predict`` and ``finetune``: how a client's outputs are computed when it is scored, and how it fine-tunes
  ("+FT", held-out new clients); by default the network's forward and plain local SGD (FedProto changes both).

Uploads whose names are model parameters or buffers are averaged and applied to the global model
through the server optimiser (the pseudo-gradient is the negative averaged delta). Any other upload
name (e.g. a control-variate delta) is averaged and handed to ``server_update``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning.client import Client, Params, name_matches
from fl_lightning.errors import ConfigError


@dataclass(frozen=True)
class RoundFacts:
    """What the server knows of a round when ``server_update`` runs."""

    round: int  #: the communication round
    #: how many client uploads entered this round's average (all ranks; stragglers included, clients that failed or
    #: sent non-finite values not)
    num_aggregated: int


@dataclass
class ClientUpdate:
    """What one client returns: ``upload`` goes to the server, ``state`` back into the client bank."""

    upload: Params
    state: Params
    num_samples: int
    loss: float = 0.0


class Algorithm(nn.Module):
    """Base class. Subclasses are ``nn.Module`` only so that server state (e.g. SCAFFOLD's ``c``) is
    checkpointed with the model; they hold no model weights themselves."""

    personal: tuple[str, ...] = ()
    #: Prefixes of per-client state kept in the bank under names that are not model parameters (Ditto's ``v.``,
    #: SCAFFOLD's ``c_i.``). Never uploaded: the ledger refuses them like the ``personal`` prefixes.
    state_prefixes: tuple[str, ...] = ()
    #: What a client's upload may tell the server beyond the model it received (one line; README table).
    reveals: str = ""
    #: Upload-name prefixes whose values may depend on the client's personal state (``""``: every upload). Every
    #: other upload must be bit-identical whatever the client's state (tests/properties/test_privacy.py perturbs it).
    state_dependent_uploads: tuple[str, ...] = ()
    #: Upload-name prefixes whose values may depend on the client's side information when the network has a
    #: side branch (``Concat``/``Mask``): by default every upload, since every gradient flows through it.
    side_dependent_uploads: tuple[str, ...] = ("",)
    #: True when the server math needs the plain mean of the uploads (``model.aggregation: uniform``).
    needs_uniform_aggregation: bool = False
    #: False for closed-form client updates that would move a parameter frozen with ``requires_grad=False``.
    supports_frozen: bool = True
    #: True when ``client_update`` uses only dict operations and the client contract (``fl_lightning.client.Client``),
    #: so the vectorized executor can run it on stacked parameters. Each class must declare it itself (it is not
    #: inherited).
    vectorizable: bool = False
    #: True when ``client_update`` reads its server state (the algorithm's buffers, SCAFFOLD's ``c``) only in
    #: arithmetic that broadcasts against per-client ``[K, ...]`` tensors: batched runs (the run axis) then stack the
    #: clients of runs whose server states differ in one call, each client holding its own run's buffers ``[K, ...]``.
    #: False: a run with server state trains its clients in a call of its own.
    server_state_broadcasts: bool = False
    #: True to keep each client's optimiser state (momentum, Adam moments) across rounds in the client-state
    #: bank, as ``model.keep_client_optimizer_state: true`` does; False: a fresh optimiser per phase.
    keep_client_optimizer_state: bool = False
    #: The expected fraction of rounds in which a sampled client runs local SGD (the method's own math: L2GD's
    #: clients train in a round with probability 1 − p, and only mix their models otherwise). ``model.executor:
    #: auto`` reads it (``executor.auto_rule``).
    local_training_rate: float = 1.0
    #: True when ``client_update`` has a phase that trains only the ``head.`` parameters with a plain ``ctx.sgd`` (no
    #: ``gradient``, no ``objective``), as FedRep's head epochs do: the stacked path trains such a phase on the frozen
    #: body's features computed once (``VectorizedContext.sgd``'s ``head_only``), which wins even where the
    #: network's other phases run their clients in turn. ``model.executor: auto`` reads it (``executor.auto_rule``).
    head_only_phase: bool = False

    def __init__(self, personal: Sequence[str] | None = None) -> None:
        super().__init__()
        if personal is not None:
            self.personal = tuple(personal)

    # -- naming -----------------------------------------------------------------------------------------
    def is_personal(self, name: str) -> bool:
        """Under a ``personal`` prefix or glob pattern (``*.lora_B``, ``classifier.*``; ``client.name_matches``)."""
        return any(name_matches(name, p) for p in self.personal)

    #: parameters with ``requires_grad=False`` (e.g. frozen GloVe embeddings); set by the engine through
    #: ``set_frozen``. They never change, so they are neither uploaded nor sent.
    frozen: frozenset[str] = frozenset()

    def set_frozen(self, names: Collection[str]) -> None:
        if names and not self.supports_frozen:
            raise ConfigError(
                f"{type(self).__name__} updates its parameters in closed form and cannot keep "
                f"{sorted(names)[0]} frozen (requires_grad=False); unfreeze it"
            )
        self.frozen = frozenset(names)

    def shared_names(self, params: Params) -> list[str]:
        return [n for n in params if not self.is_personal(n) and n not in self.frozen]

    def personal_names(self, params: Params) -> list[str]:
        """Personal names except frozen ones (never changed, so not worth a copy per client)."""
        return [n for n in params if self.is_personal(n) and n not in self.frozen]

    # -- hooks ------------------------------------------------------------------------------------------
    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        """Raise ``ConfigError`` (one line naming the method and what it needs) when the method cannot run on
        ``net`` or on the task (``num_classes`` is None for regression). Called by the engine before ``setup``."""

    def setup(self, global_params: Params, num_clients: int) -> None:
        """Called once before training with the initial global parameters (to size server state)."""

    def bind_ground_truth(self, extras: dict[str, Tensor]) -> None:
        """Called with the DataModule's ground truth (``FederatedData.extras``, e.g. ``B_star``). Only algorithms
        with an exact (population-gradient) option use it; they must never upload it."""

    def init_client_state(self, global_params: Params) -> Params:
        """Per-client state template, copied to every client. Default: the personal parameters."""
        return {n: global_params[n] for n in self.personal_names(global_params)}

    def upload_template(self, global_params: Params) -> Params:
        """Names and shapes of what every client uploads (the aggregation input). Default: shared parts."""
        return {n: global_params[n] for n in self.shared_names(global_params)}

    def download_template(self, global_params: Params) -> Params:
        """What the server sends to each sampled client (for the byte counts). Default: shared parts."""
        return {n: global_params[n] for n in self.shared_names(global_params)}

    def client_model(self, global_params: Params, state: Params) -> Params:
        """Parameters a client uses: global shared parts overlaid with its own personal parts."""
        return {**global_params, **{n: v for n, v in state.items() if n in global_params}}

    def adapt_for_evaluation(self, ctx: Client, params: Params) -> Params:
        """Optional local adaptation on the client's training data before it is evaluated (Per-FedAvg)."""
        return params

    def predict(self, net: nn.Module, params: Params, x: Tensor, side: Tensor | None) -> Tensor:
        """The outputs a client is scored on (logits, or predictions for regression): the network's forward."""
        return functional_call(net, params, (x,), {"side": side}, strict=False)

    def finetune(self, ctx: Client, params: Params, epochs: int, prefixes: Sequence[str]) -> Params:
        """ "+FT" and held-out new clients: ``epochs`` epochs of local SGD on the parameters under ``prefixes``."""
        return ctx.sgd(params, ctx.params_with(prefixes), epochs)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        raise NotImplementedError

    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        """Optional server math after aggregation; may modify ``global_params`` tensors in place. ``facts`` are the
        round's (its index, how many uploads entered the average)."""

    def trained_names(self, params: Params) -> list[str]:
        """Every name of ``params`` except the frozen parameters (what a full-model upload carries)."""
        return [n for n in params if n not in self.frozen]

    def upload_shared(self, params: Params, ctx: Client, state: Params, loss: float = 0.0) -> ClientUpdate:
        """Common ending: upload the shared parameters, keep the personal ones as the new state."""
        return ClientUpdate(
            upload={n: params[n] for n in self.shared_names(params)},
            state={**state, **{n: params[n] for n in self.personal_names(params) if n in state}},
            num_samples=ctx.num_samples,
            loss=loss,
        )


class PersonalModels(Algorithm):
    """A method whose every client keeps a whole personal model in the bank (names ``local_prefix + parameter``)
    and uploads how it changed (``delta_prefix + parameter``): Fed-MTL and L2GD. The server sends the global model;
    a client trains and is evaluated with its own model (the global one until it has trained)."""

    local_prefix: str = "local."
    delta_prefix: str = "delta."

    def init_client_state(self, global_params: Params) -> Params:
        return {self.local_prefix + n: global_params[n] for n in self.trained_names(global_params)}

    def upload_template(self, global_params: Params) -> Params:
        return {
            self.delta_prefix + n: global_params[n]
            for n in self.trained_names(global_params)
            if global_params[n].is_floating_point()
        }

    def download_template(self, global_params: Params) -> Params:
        return {n: global_params[n] for n in self.trained_names(global_params)}

    def client_model(self, global_params: Params, state: Params) -> Params:
        return {n: state.get(self.local_prefix + n, t) for n, t in global_params.items()}

    def personal_update(self, ctx: Client, start: Params, new: Params, loss: Tensor | float) -> ClientUpdate:
        """Upload Δ = new − start (floating parameters) and keep ``new`` as the client's personal model."""
        kept = [n for n in self.trained_names(start) if start[n].is_floating_point()]
        return ClientUpdate(
            upload={self.delta_prefix + n: new[n] - start[n] for n in kept},
            state={self.local_prefix + n: new[n] for n in self.trained_names(new)},
            num_samples=ctx.num_samples,
            loss=loss,
        )

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        """w̄ ← w̄ + (|S|/N)·mean_{i∈S} Δ_i: the global model stays the mean of all N personal models (only the
        cohort's changed; ``num_clients`` is set in ``setup``)."""
        cohort = facts.num_aggregated
        for n, t in global_params.items():
            if self.delta_prefix + n in averaged_extra:
                t.add_(averaged_extra[self.delta_prefix + n].to(t.dtype), alpha=cohort / self.num_clients)
