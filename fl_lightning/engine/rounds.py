"""What a DataModule's loaders yield: client sampling and the stateful round loader (one item per communication
round) for training, chunks of client ids for validation and test (``ClientChunks``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from fl_lightning.client import make_generator  # the seeded streams of the client contract

#: up to this many clients a cohort is the head of a seeded ``randperm`` (O(N), the cohorts of every earlier run);
#: above it, Floyd's algorithm draws it in O(cohort) (issue 28: a round's cost does not grow with N)
PERMUTATION_CLIENTS = 2**14


class ClientSampler:
    """Uniform sampling without replacement; the cohort of round ``t`` is a pure function of ``(seed, t)``."""

    def __init__(self, num_clients: int, clients_per_round: int, seed: int) -> None:
        if not 1 <= clients_per_round <= num_clients:
            raise ValueError(f"clients_per_round={clients_per_round} must be between 1 and num_clients={num_clients}")
        self.num_clients, self.clients_per_round, self.seed = num_clients, clients_per_round, seed

    def sample(self, round_idx: int) -> torch.Tensor:
        if self.clients_per_round == self.num_clients:
            return torch.arange(self.num_clients)
        g = make_generator(self.seed, "cohort", round_idx)
        if self.num_clients <= PERMUTATION_CLIENTS:
            perm = torch.randperm(self.num_clients, generator=g)
            return perm[: self.clients_per_round].sort().values
        return floyd_sample(self.num_clients, self.clients_per_round, g)


def floyd_sample(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers of ``[0, n)``, uniformly (Floyd's algorithm, Bentley & Floyd, CACM 1987): for
    ``j = n−k … n−1`` draw ``t`` uniform in ``[0, j]`` and take ``t``, or ``j`` when ``t`` is taken; k draws, sorted."""
    draws = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    chosen: set[int] = set()
    for i, u in enumerate(draws):
        j = n - k + i
        t = min(int(u * (j + 1)), j)
        chosen.add(j if t in chosen else t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


class RoundLoader:
    """Yields ``{"round": t, "clients": cohort}`` for ``t = next_round .. num_rounds-1``.

    It has ``state_dict``/``load_state_dict``, so Lightning stores its position in checkpoints and a
    resumed run continues with the next round instead of replaying from round 0.
    """

    def __init__(self, sampler: ClientSampler, num_rounds: int) -> None:
        self.sampler, self.num_rounds, self.next_round = sampler, num_rounds, 0

    def __len__(self) -> int:
        return self.num_rounds

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.next_round < self.num_rounds:
            r = self.next_round
            self.next_round += 1
            yield {"round": torch.tensor(r), "clients": self.sampler.sample(r)}
        self.next_round = 0

    def state_dict(self) -> dict[str, int]:
        return {"next_round": self.next_round}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_round = int(state["next_round"])


#: clients per ``validation_step`` (one progress tick); the shared-body fast path computes features per chunk
CLIENTS_PER_STEP = 256


class ClientChunks:
    """The validation/test "dataloader": this rank's clients ``c ≡ rank (mod world)`` in chunks of ``size``; of
    ``clients`` (the evaluation sample, ``model.eval_clients``) when given, else of all ``num_clients``.

    Every rank yields the same number of chunks (the last ones may be short or empty): under DDP each
    ``validation_step`` is a forward of the wrapped module, which syncs buffers across ranks.
    """

    def __init__(
        self, num_clients: int, rank: int = 0, world: int = 1, size: int = CLIENTS_PER_STEP,
        clients: list[int] | None = None,
    ) -> None:  # fmt: skip
        everyone = clients if clients is not None else range(num_clients)
        self.clients = list(everyone[rank::world])
        self.size = size
        self.num_chunks = max(1, math.ceil(math.ceil(len(everyone) / world) / size))

    def __len__(self) -> int:
        return self.num_chunks

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.num_chunks):
            yield self.clients[i * self.size : (i + 1) * self.size]


def client_chunks(num_clients: int, trainer: Any = None) -> ClientChunks:
    """``ClientChunks`` for the trainer's rank (all clients on one process); inside a fit, of the module's
    evaluation sample when it has one (``FederatedModule.evaluation_sample``, ``model.eval_clients``)."""
    if trainer is None:
        return ClientChunks(num_clients)
    sample = None
    module = getattr(trainer, "lightning_module", None)
    if getattr(getattr(trainer, "state", None), "fn", None) == "fit" and hasattr(module, "evaluation_sample"):
        sample = module.evaluation_sample()
    return ClientChunks(num_clients, trainer.global_rank, trainer.world_size, clients=sample)
