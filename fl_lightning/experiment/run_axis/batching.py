"""Which runs may share a batched job: the key derived from each run's identity (``fl_lightning.identity``).

Runs share a job only when their identities are equal except in the keys the run axis carries per run
(``CARRIED_PER_RUN``). Nothing else is listed: a key that the config gains later separates runs that differ in it
until the run axis is shown to carry it per run (``tests/experiment/run_axis/test_batching.py`` varies every leaf
of representative configs and trains the ones that share a job against each run alone).
"""

from __future__ import annotations

import json
from typing import Any

from fl_lightning.identity import identity_differences, run_identity, under

#: what a batched job's runs may differ in beyond what a resume may change: the seed, and with it each run's
#: partition, cohorts, data order and generators (``RunsContext`` holds each client's own run seed and round;
#: each run has its own ``FederatedData``, global model, client states and server step)
CARRIED_PER_RUN = ("seed_everything", "data.seed")


def batch_key(config: dict[str, Any]) -> str:
    """The identity of the resolved ``config`` less ``CARRIED_PER_RUN``, as one string: equal keys may batch."""
    leaves = {k: v for k, v in run_identity(config).items() if not under(k, CARRIED_PER_RUN)}
    return json.dumps(leaves, sort_keys=True, default=str)


def batch_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``key a -> b`` for every key that keeps two runs out of one batched job."""
    return identity_differences(a, b, ignore=CARRIED_PER_RUN)


def multi_process(config: dict[str, Any]) -> str | None:
    """Why a run's trainer needs one process per device (a batched job trains in one process), or None."""
    trainer = config.get("trainer") or {}
    devices, nodes, strategy = trainer.get("devices"), trainer.get("num_nodes") or 1, str(trainer.get("strategy"))
    many = (isinstance(devices, int) and devices > 1) or (isinstance(devices, list) and len(devices) > 1)
    if many or nodes > 1 or "ddp" in strategy or "fsdp" in strategy:
        return f"trainer.devices={devices}, num_nodes={nodes}, strategy={strategy} needs one process per device"
    return None
