"""Helpers for the dataset loader tests: build a DataModule, its rows' keys, the one-line error a bad file gives, GloVe
vectors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_lightning.errors import ConfigError  # noqa: E402


def built(dm):
    dm.setup("fit")
    return dm.federated


def row_keys(x: torch.Tensor) -> list[bytes]:
    """Samples as sortable byte strings (to compare multisets of samples independently of order)."""
    return sorted(r.numpy().tobytes() for r in x.reshape(len(x), -1).float().round(decimals=4))


# ---- bad data: one-line errors that name the file -------------------------------------------------------
def one_line_error(dm, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        dm.setup("fit")
    msg = str(info.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


# ---- GloVe ----------------------------------------------------------------------------------------------
def glove_vectors(path: Path) -> dict[str, list[float]]:
    """The test's own reading of a GloVe text file: ``word v1 … vd`` per line."""
    out = {}
    for line in path.read_text(encoding="utf8").splitlines():
        word, *values = line.split(" ")
        out[word] = [float(v) for v in values]
    return out
