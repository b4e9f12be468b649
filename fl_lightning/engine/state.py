"""ClientStateBank: every per-client tensor as one client-indexed buffer ``[num_clients, ...]``."""

from __future__ import annotations

from torch import Tensor, nn


def _key(name: str) -> str:
    return name.replace(".", "__")


class ClientStateBank(nn.Module):
    """Per-client state (personal layers, control variates, personal models…) as registered buffers.

    Buffers are in the module's ``state_dict``, so checkpoints carry every client's state, and they
    are plain tensors, so a cohort's rows are gathered and scattered with one index operation.
    """

    def __init__(self, template: dict[str, Tensor], num_clients: int) -> None:
        super().__init__()
        self.names = list(template)
        self.num_clients = num_clients
        for name, value in template.items():
            self.register_buffer(_key(name), value.detach().unsqueeze(0).repeat(num_clients, *[1] * value.dim()))

    def row(self, name: str) -> Tensor:
        return getattr(self, _key(name))

    def get(self, client: int) -> dict[str, Tensor]:
        """Client ``client``'s state (views into the bank; callers must not modify them in place)."""
        return {n: self.row(n)[client] for n in self.names}

    def gather(self, clients: Tensor) -> dict[str, Tensor]:
        return {n: self.row(n)[clients] for n in self.names}

    def scatter(self, clients: Tensor, values: dict[str, Tensor]) -> None:
        for n in self.names:
            self.row(n)[clients] = values[n].to(self.row(n).dtype)

    def bytes_per_client(self) -> int:
        return sum(self.row(n)[0].numel() * self.row(n).element_size() for n in self.names)
