"""``fl_lightning/client.py`` (the client contract): the client optimiser's settings and ``build``, ``per_client``,
the seeds, ``Penalty`` and ``Objective``, against hand-computed values."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fl_lightning.client import (
    ClientOptimizer,
    Objective,
    Penalty,
    derive_seed,
    factory_name,
    make_generator,
    per_client,
    select,
)
from tests.helpers.asserts import assert_close_finite


def test_decay_bias_false_decays_weights_but_not_biases() -> None:
    """``decay_bias=False``: the weight steps with weight decay, the bias without; each parameter is in exactly one
    group (plain SGD, no momentum, so one step is ``p − lr·(g + wd·p)`` for the weight and ``p − lr·g`` for the
    bias)."""
    lr, wd = 0.1, 0.5
    w = torch.tensor([[1.0, -2.0], [0.5, 3.0]], requires_grad=True)
    b = torch.tensor([2.0, -1.0], requires_grad=True)
    opt = ClientOptimizer(lr=lr, momentum=0.0, weight_decay=wd, decay_bias=False).build({"fc.weight": w, "fc.bias": b})
    gw, gb = torch.tensor([[0.1, 0.2], [0.3, 0.4]]), torch.tensor([1.0, 2.0])
    w0, b0 = w.detach().clone(), b.detach().clone()
    w.grad, b.grad = gw.clone(), gb.clone()
    opt.step()
    assert_close_finite(w.detach(), w0 - lr * (gw + wd * w0))
    assert_close_finite(b.detach(), b0 - lr * gb)
    counts = [len(g["params"]) for g in opt.param_groups]
    assert counts == [1, 1]


def test_build_lr_argument_sets_every_group() -> None:
    """``build(params, lr)`` puts ``lr`` in every group (also with a factory and a bias group); without it the
    round's ``self.lr``."""
    w, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)
    for factory in (None, functools.partial(torch.optim.Adam, lr=0.5)):
        opt = ClientOptimizer(lr=0.2, decay_bias=False, factory=factory)
        assert [g["lr"] for g in opt.build({"a.weight": w, "a.bias": b}, 0.07).param_groups] == [0.07, 0.07]
        assert [g["lr"] for g in opt.build({"a.weight": w, "a.bias": b}).param_groups] == [0.2, 0.2]


def test_from_config_without_a_factory_keeps_the_given_settings() -> None:
    """No factory: the given settings, and the spec defaults (lr 0.01, momentum 0.5, no decay, batch 10, every
    partial batch trained)."""
    assert ClientOptimizer.from_config(None) == ClientOptimizer(0.01, 0.5, 0.0, 10, True, None)
    got = ClientOptimizer.from_config(None, 0.2, 0.8, 0.1, 7, False, drop_last=True)
    assert (got.lr, got.momentum, got.weight_decay, got.batch_size, got.decay_bias, got.factory, got.drop_last) == (
        0.2, 0.8, 0.1, 7, False, None, True)  # fmt: skip


def test_from_config_with_sgd_reads_its_init_args() -> None:
    """A factory (SGD with lr 0.3, momentum 0.9, weight decay 0.1): those three are its own, batch size,
    ``decay_bias`` and ``drop_last`` the given ones, the factory kept."""
    factory = functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9, weight_decay=0.1)
    got = ClientOptimizer.from_config(factory, 0.01, 0.5, 0.3, 7, False, drop_last=True)
    assert (got.lr, got.momentum, got.weight_decay) == pytest.approx((0.3, 0.9, 0.1))
    assert (got.batch_size, got.decay_bias, got.factory, got.drop_last) == (7, False, factory, True)


# a factory's (lr, momentum, weight decay): Adam has no momentum, Rprop neither momentum nor weight decay (torch's
# defaults name no such key), which read as 0
FACTORIES = [
    (functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9, weight_decay=0.1), (0.3, 0.9, 0.1)),
    (functools.partial(torch.optim.Adam, lr=0.002), (0.002, 0.0, 0.0)),
    (functools.partial(torch.optim.Rprop, lr=0.04), (0.04, 0.0, 0.0)),
]


def test_from_config_with_a_factory_reads_its_init_args() -> None:
    """With a factory, lr / momentum / weight decay are the optimiser's own (0 where it has none); batch size,
    ``decay_bias`` and ``drop_last`` are the given ones; the factory is kept. (One test for all factories: each
    one's case runs under ``make mutation``'s per-function test cap.)"""
    assert {"momentum", "weight_decay"}.isdisjoint(torch.optim.Rprop([torch.zeros(1)]).defaults)
    for factory, expected in FACTORIES:
        got = ClientOptimizer.from_config(factory, lr=0.01, momentum=0.5, weight_decay=0.3, batch_size=7,
                                          decay_bias=False, drop_last=True)  # fmt: skip
        assert (got.lr, got.momentum, got.weight_decay) == pytest.approx(expected), factory
        assert (got.batch_size, got.decay_bias, got.factory, got.drop_last) == (7, False, factory, True)


def test_a_0d_number_per_client_stays_0d() -> None:
    got = per_client(torch.tensor(2, dtype=torch.long), torch.ones((), dtype=torch.float64))
    assert got.shape == () and got.dtype == torch.float64 and got.item() == 2.0
    assert per_client(torch.tensor([1.0, 2.0]), torch.ones(2, 3)).shape == (2, 1)


def test_derive_seed_is_a_63_bit_function_of_the_parts() -> None:
    """Seeds are non-negative 63-bit integers (``manual_seed`` of a signed 64-bit value); about half of all 8-byte
    digests have their top bit set, so 64 different parts would show a 64-bit seed."""
    seeds = [derive_seed(7, "train", r, c) for r in range(8) for c in range(8)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 64
    assert derive_seed(7, "train", 3, 2) == seeds[3 * 8 + 2]


def test_min_batch_is_two_only_for_batchnorm1d_networks_and_the_batch_with_drop_last() -> None:
    """A BatchNorm1d network cannot train on a batch of one sample (min 2); any other network, or none, trains on
    every batch (min 1); ``drop_last`` keeps only full batches."""
    bn1d = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert ClientOptimizer().min_batch(10, bn1d) == 2
    assert ClientOptimizer().min_batch(10, nn.Sequential(nn.Linear(3, 4), nn.BatchNorm2d(4))) == 1
    assert ClientOptimizer().min_batch(10, nn.Linear(3, 4)) == 1
    assert ClientOptimizer().min_batch(10) == 1
    assert ClientOptimizer(drop_last=True).min_batch(10, bn1d) == 10


def test_factory_name_names_the_class_a_factory_builds() -> None:
    """None is the default SGD; a class, a ``partial`` of it, or a LightningCLI-style ``partial(instantiator, cls)``
    give the class's name; anything else its ``repr``."""

    def instantiate(cls: type, **kwargs: object) -> object:
        return cls(**kwargs)

    assert factory_name(None) == "SGD"
    assert factory_name(torch.optim.Adam) == "Adam"
    assert factory_name(functools.partial(torch.optim.RMSprop, lr=0.1)) == "RMSprop"
    assert factory_name(functools.partial(instantiate, torch.optim.Adagrad, lr=0.1)) == "Adagrad"
    assert factory_name("adam") == repr("adam")


def test_select_keeps_the_names_under_any_prefix() -> None:
    names = ["body.0.weight", "body.0.bias", "head.weight", "headless"]
    assert select(names, ["head."]) == ["head.weight"]
    assert select(names, ["body.0.w", "head"]) == ["body.0.weight", "head.weight", "headless"]
    assert select(names, [""]) == names and select(names, []) == []


def test_a_penalty_evaluates_its_function_on_its_own_data() -> None:
    """``penalty(params)`` is ``fn(params, data)``: here μ/2·‖w − a‖² = 0.5·2·(1 + 4) = 5."""
    penalty = Penalty(lambda p, d: 0.5 * 2.0 * ((p["w"] - d["a"]) ** 2).sum(), {"a": torch.tensor([1.0, 0.0])})
    assert float(penalty({"w": torch.tensor([2.0, 2.0])})) == 5.0
    assert penalty.gradient is None and Penalty(lambda p, d: p["w"].sum()).data == {}


def test_an_objectives_losses_are_its_values_the_logged_ones_and_what_it_collects() -> None:
    """``losses`` returns (losses, logged[, collected]): the logged values are the losses themselves (the same
    object) when ``fn`` returns one tensor or ``(losses, None)``; ``data`` defaults to the objective's own."""
    per = torch.tensor([1.0, 2.0])
    single = Objective(lambda p, x, y, d: per * d["s"], {"s": torch.tensor(3.0)})
    losses, logged = single.losses({}, torch.zeros(2), torch.zeros(2))
    assert logged is losses and losses.tolist() == [3.0, 6.0]
    assert single.losses({}, torch.zeros(2), torch.zeros(2), {"s": torch.tensor(-1.0)})[0].tolist() == [-1.0, -2.0]
    feats = torch.ones(2, 4)
    with_none = Objective(lambda p, x, y, d: (per, None, feats), collect=(3, 4))
    out = with_none.losses({}, torch.zeros(2), torch.zeros(2))
    assert out[0] is per and out[1] is per and out[2] is feats and with_none.collect == (3, 4)
    paired = Objective(lambda p, x, y, d: (per, per / 2))
    assert paired.losses({}, torch.zeros(2), torch.zeros(2))[1].tolist() == [0.5, 1.0]


def test_make_generator_is_a_cpu_stream_seeded_by_the_parts() -> None:
    a, b = make_generator(7, "train", 3, 2), make_generator(7, "train", 3, 2)
    assert a.device.type == "cpu" and a.initial_seed() == derive_seed(7, "train", 3, 2)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(7, "train", 3, 1).initial_seed() != a.initial_seed()


def test_name_matches_prefixes_and_glob_patterns():
    """``client.name_matches``: a plain prefix as before; a pattern with a wildcard matches the name or one of its
    dotted prefixes (LoRA names: ``….query.lora_B.default.weight``)."""
    from fl_lightning.client import name_matches, select

    b = "body.lm.base_model.model.encoder.layer.0.attention.self.query.lora_B.default.weight"
    assert name_matches(b, "body.") and name_matches(b, "") and not name_matches(b, "head.")
    assert name_matches(b, "*.lora_B") and not name_matches(b, "*.lora_A") and not name_matches(b, "lora_B")
    assert name_matches(b, "*.layer.0.*") and not name_matches(b, "*.layer.1.*")
    assert name_matches("head.weight", "head.*") and not name_matches("headx.weight", "head.*")
    assert name_matches("classifier.weight", "classifier.*") and name_matches(b, "*.lora_[AB]")
    assert select(["head.weight", b, "body.x"], ["*.lora_B", "head."]) == ["head.weight", b]
