"""LEAF-format federated datasets (Caldas et al. 2018): FEMNIST, Shakespeare, Sent140.

``data_dir`` holds LEAF's ``train/`` and ``test/`` folders of JSON files, each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`` (the output of
LEAF's ``preprocess.sh``, e.g. ``leaf/data/femnist/data``). Users are the natural clients: the sample's
owner is passed to the partitioner as its group, so ``Natural`` keeps users intact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from datamodules.common import PartitionedDataModule, Pools
from datamodules.partition import Natural, Partitioner
from datamodules.text import CharVocab, encode_words, load_glove, train_word_tokenizer
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError

UserData = dict[str, tuple[list[Any], list[Any], Path]]


def read_leaf_split(directory: Path, convert: Callable | None = None) -> UserData:
    """``user -> (xs, ys, file)`` over every ``*.json`` file of one LEAF split folder, checked. With ``convert``
    (``(xs, ys, user, file) -> (x, y)`` tensors) every user is converted as soon as its file is read and the file's
    JSON is dropped before the next one, so memory holds one file's JSON plus the tensors (a full-size FEMNIST is
    35 files of thousands of writers), not every file's Python lists."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ConfigError(f"{directory}: no LEAF .json files")
    out: UserData = {}
    for f in files:
        try:
            with open(f, encoding="utf8") as fh:
                blob = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{f}: truncated or invalid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(blob, dict) or not {"users", "user_data"} <= set(blob):
            raise ConfigError(f"{f}: not a LEAF file (needs keys 'users' and 'user_data')")
        counts = blob.get("num_samples") or [None] * len(blob["users"])
        for user, count in zip(blob["users"], counts):
            data = blob["user_data"].get(user)
            if data is None or "x" not in data or "y" not in data:
                raise ConfigError(f"{f}: user {user!r} has no 'x'/'y' in user_data")
            if len(data["x"]) != len(data["y"]):
                raise ConfigError(f"{f}: user {user!r} has {len(data['x'])} inputs but {len(data['y'])} labels")
            if count is not None and count != len(data["y"]):
                raise ConfigError(f"{f}: user {user!r} has num_samples {count} but {len(data['y'])} samples")
            if user in out:
                raise ConfigError(f"{f}: user {user!r} appears in two files of {directory}")
            out[user] = (data["x"], data["y"], f) if convert is None else (*convert(data["x"], data["y"], user, f), f)
        del blob  # the next file's JSON replaces this one's
    return out


class LeafDataModule(PartitionedDataModule):
    """Base of the LEAF modules: reads ``train/`` and ``test/``; subclasses turn raw x/y into tensors."""

    dataset = "LEAF"
    hint = ""

    def __init__(self, partition: Partitioner | None = None, data_dir: str = "data/leaf", **kwargs: Any) -> None:
        """``partition``: default ``Natural()`` (one client per LEAF user); ``data_dir``: the folder holding
        LEAF's ``train/`` and ``test/``; the other arguments as :class:`PartitionedDataModule`."""
        super().__init__(partition=partition if partition is not None else Natural(), **kwargs)
        self.data_dir = Path(data_dir)

    def read(self, convert: Callable | None = None) -> tuple[UserData, UserData, list[str]]:
        tr_dir, te_dir = self.data_dir / "train", self.data_dir / "test"
        if not tr_dir.is_dir() or not te_dir.is_dir():
            raise ConfigError(
                f"{self.dataset} not found: expected LEAF train/ and test/ folders of .json files in {self.data_dir} "
                f"({self.hint}); LEAF data cannot be downloaded automatically"
            )
        train, test = read_leaf_split(tr_dir, convert), read_leaf_split(te_dir, convert)
        users = sorted(set(train) | set(test))
        return train, test, users

    def convert(self, xs: list[Any], ys: list[Any], user: str, file: Path) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def gather(self, split: UserData, users: list[str], convert: Callable) -> tuple[Tensor, Tensor, Tensor]:
        xs, ys, gs = [], [], []
        for gid, user in enumerate(users):
            if user not in split:
                continue
            x, y = convert(*split[user][:2], user, split[user][2])
            xs.append(x)
            ys.append(y)
            gs.append(torch.full((len(y),), gid, dtype=torch.long))
        if not xs:
            raise ConfigError(f"{self.data_dir}: no samples")
        return torch.cat(xs), torch.cat(ys), torch.cat(gs)

    def pools(self, convert: Callable, num_classes: int) -> Pools:
        """Read both splits converting each user as its file is read (``read_leaf_split``), then concatenate."""
        train, test, users = self.read(convert)
        converted = lambda x, y, user, file: (x, y)  # noqa: E731 (already tensors)
        x_tr, y_tr, g_tr = self.gather(train, users, converted)
        x_te, y_te, g_te = self.gather(test, users, converted) if test else (x_tr[:0], y_tr[:0], y_tr[:0])
        self.users = users
        return Pools(x_tr, y_tr, x_te, y_te, num_classes, g_tr, g_te, users)


def _labels(ys: list[Any], num_classes: int, user: str, file: Path) -> Tensor:
    try:
        y = np.asarray(ys, dtype=np.int64)
    except (ValueError, TypeError):
        raise ConfigError(f"{file}: user {user!r} has non-integer labels") from None
    if y.ndim != 1:
        raise ConfigError(f"{file}: user {user!r} labels have shape {list(y.shape)}, expected [{len(ys)}]")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        bad = int(y.min()) if y.min() < 0 else int(y.max())
        raise ConfigError(f"{file}: user {user!r} has label {bad} out of range 0..{num_classes - 1}")
    return torch.from_numpy(y)


class FEMNISTDataModule(LeafDataModule):
    """LEAF FEMNIST: 28×28 handwritten characters of 62 classes (0–9 digits, 10–35 upper case, 36–61 lower
    case), images ``[N, 1, 28, 28]`` with LEAF's pixel values, one LEAF writer per natural client.

    FedRep's Table 1 column (spec 000 §3.2): ``classes: [36, …, 45]`` (ten lower-case letters, relabelled
    0–9) with ``LogNormal(3, mean 148, min 50, test 10 %)`` over 150 clients. Fig. 6's digit clients:
    ``transfer_classes: [0, …, 9]``.
    """

    dataset = "FEMNIST"
    hint = "run LEAF's data/femnist/preprocess.sh and point data_dir at data/femnist/data"

    def load(self) -> Pools:
        def convert(xs, ys, user, file):
            try:
                x = np.asarray(xs, dtype=np.float32)
            except ValueError:
                lengths = sorted({len(v) for v in xs})
                raise ConfigError(f"{file}: user {user!r} has images of lengths {lengths}, expected 784") from None
            if x.size == 0:
                x = x.reshape(0, 784)
            if x.ndim != 2 or x.shape[1] != 784:
                raise ConfigError(f"{file}: user {user!r} images have shape {list(x.shape)}, expected [N, 784]")
            return torch.from_numpy(x).view(-1, 1, 28, 28), _labels(ys, 62, user, file)

        return self.pools(convert, 62)


class ShakespeareDataModule(LeafDataModule):
    """LEAF Shakespeare: next character after an 80-character line, one speaking role per client.

    Characters are mapped by a vocabulary built from the training text (``self.vocab``, id 0 = padding
    and unseen characters); ``num_classes = len(vocab)``. x is ``[N, seq_len]`` long.
    """

    dataset = "Shakespeare"
    hint = "run LEAF's data/shakespeare/preprocess.sh and point data_dir at data/shakespeare/data"

    def __init__(self, data_dir: str = "data/leaf/shakespeare/data", seq_len: int = 80, **kwargs: Any) -> None:
        """``seq_len``: characters of context per sample; the other arguments as :class:`LeafDataModule`."""
        super().__init__(data_dir=data_dir, **kwargs)
        self.seq_len = seq_len

    def load(self) -> Pools:
        train, test, users = self.read()
        texts = [s for xs, ys, _ in train.values() for s in (*xs, *ys)]
        self.vocab = vocab = CharVocab(texts)

        def convert(xs, ys, user, file):
            for v in (*xs, *ys):
                if not isinstance(v, str):
                    raise ConfigError(f"{file}: user {user!r} has a non-string sample {str(v)[:30]!r}")
            bad = next((y for y in ys if len(y) != 1), None)
            if bad is not None:
                raise ConfigError(f"{file}: user {user!r} has target {bad!r}, expected one character")
            return vocab.encode(xs, self.seq_len), vocab.encode(ys, 1)[:, 0]

        x_tr, y_tr, g_tr = self.gather(train, users, convert)
        x_te, y_te, g_te = self.gather(test, users, convert)
        self.users = users
        return Pools(x_tr, y_tr, x_te, y_te, len(vocab), g_tr, g_te, users)


class Sent140DataModule(LeafDataModule):
    """LEAF Sent140: binary tweet sentiment, one Twitter user per natural client.

    Tweets (LEAF's raw x is ``[id, date, query, user, text]``; the text is used) are tokenised by a
    WordLevel tokenizer trained on the training tweets (``self.tokenizer``, ``[PAD]`` = 0, ``[UNK]`` = 1)
    to ``seq_len`` = 25 ids (spec 000 §8.2). FedRep's column: ``Natural(min_samples=50)`` with
    ``num_clients: 183`` (a random 183 of the users with ≥ 50 tweets, train + test) and LEAF's own 80/20
    per-user split.

    ``glove_path``: a GloVe text file (``glove.6B.300d.txt``, FedRep's frozen GloVe-300, spec 000 §3.2);
    ``self.embedding`` / ``federated.extras["embedding"]`` is then the ``[vocab_size, d]`` matrix of the
    tokenizer's words (zeros for words GloVe lacks; ``self.glove_found`` counts the others). When a trainer
    sets the module up, the matrix is copied into the network's ``body.embedding`` (``Sent140LSTM``; its
    ``freeze_embedding: true`` keeps it fixed), before the engine reads the model.
    """

    dataset = "Sent140"
    hint = "run LEAF's data/sent140/preprocess.sh and point data_dir at data/sent140/data"

    def __init__(
        self,
        num_clients: int = 183,
        partition: Partitioner | None = None,
        data_dir: str = "data/leaf/sent140/data",
        seq_len: int = 25,
        vocab_size: int = 10000,
        glove_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``partition``: default ``Natural(min_samples=50)``; the other arguments as :class:`LeafDataModule`."""
        partition = partition if partition is not None else Natural(min_samples=50)
        super().__init__(num_clients=num_clients, partition=partition, data_dir=data_dir, **kwargs)
        self.seq_len, self.vocab_size, self.glove_path = seq_len, vocab_size, glove_path
        self.embedding: Tensor | None = None

    @staticmethod
    def _text(v: Any) -> str | None:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and isinstance(v[-1], str):
            return v[-1]
        return None

    def load(self) -> Pools:
        train, test, users = self.read()
        texts = []
        for xs, _, f in train.values():
            for v in xs:
                t = self._text(v)
                if t is None:
                    raise ConfigError(f"{f}: sample {str(v)[:40]!r} is not a tweet (a string or [.., text] list)")
                texts.append(t)
        self.tokenizer = tok = train_word_tokenizer(texts, self.vocab_size, self.seq_len)

        def convert(xs, ys, user, file):
            batch = [self._text(v) for v in xs]
            if any(t is None for t in batch):
                raise ConfigError(f"{file}: user {user!r} has a sample that is not a tweet")
            return encode_words(tok, batch), _labels(ys, 2, user, file)

        x_tr, y_tr, g_tr = self.gather(train, users, convert)
        x_te, y_te, g_te = self.gather(test, users, convert)
        self.users = users
        if self.glove_path:
            self.embedding, self.glove_found = load_glove(self.glove_path, tok.get_vocab(), rows=self.vocab_size)
        return Pools(x_tr, y_tr, x_te, y_te, 2, g_tr, g_te, users)

    def build(self) -> FederatedData:
        fed = super().build()
        if self.embedding is not None:
            fed.extras["embedding"] = self.embedding
        return fed

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        trainer = getattr(self, "trainer", None)
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        net = getattr(module, "net", None)
        emb = getattr(getattr(net, "body", None), "embedding", None)
        if self.embedding is not None and net is not None:
            if not isinstance(emb, torch.nn.Embedding):
                raise ConfigError(
                    f"Sent140: glove_path is set but the network {type(net).__name__} has no body.embedding to "
                    "initialise (use fl_lightning.models.Sent140LSTM or set data.init_args.glove_path: null)"
                )
            if emb.weight.shape != self.embedding.shape:
                raise ConfigError(
                    f"Sent140: GloVe matrix {list(self.embedding.shape)} does not fit the network's embedding "
                    f"{list(emb.weight.shape)}; set model.network.init_args.vocab_size/embed_dim to match"
                )
            with torch.no_grad():
                emb.weight.copy_(self.embedding)
