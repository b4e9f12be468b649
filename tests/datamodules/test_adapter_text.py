"""``TextClassificationDataModule`` (``datamodules/adapter_text.py``) on small files written here in the real
formats: ``datasets`` save_to_disk folders per client and FedDPA's per-client JSON files, tokenised with a
WordLevel tokenizer trained here and saved as a ``PreTrainedTokenizerFast``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from datamodules.adapter_text import TextClassificationDataModule
from fl_lightning.errors import ConfigError
from tests.helpers.tiny_lora import client_records, write_clients_hf, write_clients_json, write_tokenizer


def built(dm: TextClassificationDataModule):
    dm.setup("fit")
    return dm.federated


def test_hf_folders_per_client_are_tokenised_with_the_models_tokenizer(tmp_path):
    root, tok = write_clients_hf(tmp_path / "d", clients=3, train=5, test=2), write_tokenizer(tmp_path / "t")
    fed = built(TextClassificationDataModule(str(root), str(tok), num_clients=3, max_length=9))
    assert fed.num_clients == 3 and fed.num_classes == 2
    assert fed.train.sizes.tolist() == [5, 5, 5] and fed.test.sizes.tolist() == [2, 2, 2]
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    for c in range(3):
        x, y = fed.train.client(c)
        records = client_records(c, 5, 0)
        want = [tokenizer(r["text"], padding="max_length", max_length=9)["input_ids"] for r in records]
        assert x.tolist() == want and y.tolist() == [r["label"] for r in records]
    x, _ = fed.train.client(0)
    assert x.shape == (5, 9) and (x[:, -1] == tokenizer.pad_token_id).all()  # 6 words, padded to 9
    assert x.dtype == torch.long and not (x == tokenizer.unk_token_id).any()


def test_fedDPA_json_layout_with_string_labels(tmp_path):
    root = write_clients_json(tmp_path / "d", clients=2, train=4, test=3)
    tok = write_tokenizer(tmp_path / "t")
    dm = TextClassificationDataModule(str(root), str(tok), format="json", num_clients=2, text_column="instruction",
                                      label_column="output", max_length=4)  # fmt: skip
    fed = built(dm)
    records = json.loads((root / "local_training_1.json").read_text())
    _, y = fed.train.client(1)
    assert y.tolist() == [["no", "yes"].index(r["output"]) for r in records]  # sorted labels: no=0, yes=1
    x, _ = fed.test.client(0)
    assert x.shape == (3, 4)  # truncated to max_length


def test_bad_data_is_refused_in_one_line(tmp_path):
    root, tok = write_clients_hf(tmp_path / "d", clients=2, train=3, test=1), write_tokenizer(tmp_path / "t")
    cases = [
        dict(num_clients=3),  # no client_2 folder
        dict(num_clients=2, text_column="sentence"),  # no such field
        dict(num_clients=2, format="json"),  # no JSON files there
    ]
    for kw in cases:
        with pytest.raises(ConfigError) as err:
            built(TextClassificationDataModule(str(root), str(tok), **kw))
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no such folder"):
        built(TextClassificationDataModule(str(root), str(tmp_path / "nothing"), num_clients=2))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "local_training_0.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        built(TextClassificationDataModule(str(tmp_path / "j"), str(tok), format="json", num_clients=1))
