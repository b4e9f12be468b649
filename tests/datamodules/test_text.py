"""Dataset loaders on files written in their real on-disk formats, through the public DataModules."""

from __future__ import annotations

import pytest
import torch

from datamodules import Natural, Sent140DataModule
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.data_fixtures import write_glove, write_sent140
from tests.helpers.loaders import glove_vectors


def test_sent140_glove_initialises_the_network_embedding(tmp_path):
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import Sent140LSTM
    from tests.helpers.training import fit

    write_sent140(tmp_path, users=4, per_user=(6, 10))
    glove = tmp_path / "glove.txt"
    glove.write_text("good 1 2 3\nbad -1 -2 -3\n")
    dm = Sent140DataModule(num_clients=4, partition=Natural(), data_dir=str(tmp_path), vocab_size=40,
                           glove_path=str(glove), participation=1.0, seed=0)  # fmt: skip
    module = FederatedModule(FedAvg(), Sent140LSTM(vocab_size=40, embed_dim=3, hidden=4, fc=4), lr=1e-9)
    fit(module, dm, rounds=1)
    weight = module.net.body.embedding.weight.detach()
    vocab = dm.tokenizer.get_vocab()
    assert_close_finite(weight[vocab["good"]], torch.tensor([1.0, 2.0, 3.0]), rtol=1e-5, atol=1e-6)
    assert_close_finite(weight[vocab["bad"]], torch.tensor([-1.0, -2.0, -3.0]), rtol=1e-5, atol=1e-6)


def test_glove_reader_and_its_errors(tmp_path):
    from datamodules.text import load_glove

    path = write_glove(tmp_path / "glove.6B.16d.txt", dim=16)
    ref = glove_vectors(path)
    vocab = {"[PAD]": 0, "[UNK]": 1, "good": 2, "zebra": 3, "notinglove": 4}
    matrix, found = load_glove(path, vocab, rows=8)
    assert matrix.shape == (8, 16) and matrix.dtype == torch.float32 and found == 2
    assert torch.equal(matrix[2], torch.tensor(ref["good"])) and torch.equal(matrix[3], torch.tensor(ref["zebra"]))
    assert matrix[[0, 1, 4, 5, 6, 7]].abs().sum() == 0  # padding, unknown, words GloVe lacks, unused rows
    with pytest.raises(ConfigError) as info:
        load_glove(tmp_path / "glove.6B.300d.txt", vocab)
    assert "glove.6B.300d.txt" in str(info.value) and "\n" not in str(info.value)
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([lines[0], "good 1.0 oops" + " 0.5" * 14, *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: not a number in the vector of 'good'"):
        load_glove(bad, vocab)
    bad.write_text("\n".join([lines[0], "good 1.0 2.0", *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: 2 values for 'good', expected 16"):
        load_glove(bad, vocab)
