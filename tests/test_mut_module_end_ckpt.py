"""FederatedModule's checkpoint hooks, driven directly with a stand-in trainer: ``identity``,
``checkpoint_mismatch`` (each reason, with the exact message), ``validates_after`` (every branch),
``on_save_checkpoint`` (what it writes, and when it marks a skipped validation) and ``on_load_checkpoint``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.engine.checkpoint import checkpoint_mismatch, identity
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP

FEDAVG = "fl_lightning.algorithms.fedavg.FedAvg"
DIGITS = "fl_lightning.models.digits.DigitsMLP"


def split(rows: list[int]) -> ClientSplit:
    n = sum(rows)
    x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64) / 100.0
    ptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return ClientSplit(x, torch.arange(n) % 10, ptr)


def fed(clients: int) -> FederatedData:
    return FederatedData(split([2] * clients), split([1] * clients), 10)


def fedrep(clients: int, hidden: int = 4) -> FederatedModule:
    module = FederatedModule(FedRep(1, 1), DigitsMLP(hidden=(hidden,)))
    module.attach_data(fed(clients))
    return module


class Nets:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)


# ---- identity ----------------------------------------------------------------------------------------------
def test_identity_names_the_algorithm_and_network_classes_in_full() -> None:
    assert identity(FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))) == {"algorithm": FEDAVG, "network": DIGITS}
    tiny = identity(FederatedModule(FedAvg(1), Nets.Tiny()))
    assert tiny == {"algorithm": FEDAVG, "network": f"{__name__}.Nets.Tiny"}


# ---- checkpoint_mismatch -----------------------------------------------------------------------------------
def test_a_checkpoint_of_the_same_model_fits() -> None:
    module = fedrep(4)
    state = fedrep(4).state_dict()
    assert checkpoint_mismatch(module, {"state_dict": state}) is None  # older checkpoints: no identity
    assert checkpoint_mismatch(module, {"state_dict": state, "fl_identity": identity(module)}) is None


def test_a_checkpoint_of_another_algorithm_and_network_names_both_short() -> None:
    module = fedrep(4)
    theirs = {"algorithm": "pkg.algos.fedavg.FedAvg", "network": "pkg.models.cnn.Nets.CNN"}
    message = checkpoint_mismatch(module, {"state_dict": module.state_dict(), "fl_identity": theirs})
    assert message == "the checkpoint was trained with FedAvg on CNN, this config is FedRep on DigitsMLP"


def test_a_checkpoint_identity_without_module_paths_is_named_as_is() -> None:
    module = fedrep(4)
    theirs = {"algorithm": "FedAvg", "network": "CNN"}  # written by hand, not by identity()
    message = checkpoint_mismatch(module, {"state_dict": module.state_dict(), "fl_identity": theirs})
    assert message == "the checkpoint was trained with FedAvg on CNN, this config is FedRep on DigitsMLP"


def test_a_checkpoint_with_missing_or_unexpected_entries() -> None:
    module = fedrep(4)
    keys = list(module.state_dict())  # net.body.fc1.weight, net.body.fc1.bias, net.head.weight, ...
    assert len(keys) >= 4
    assert checkpoint_mismatch(module, {}) == (
        f"the checkpoint does not fit this model (missing: {keys[:3]}, unexpected: [])"
    )
    saved = dict(module.state_dict())
    del saved[keys[1]]
    assert checkpoint_mismatch(module, {"state_dict": saved}) == (
        f"the checkpoint does not fit this model (missing: {[keys[1]]}, unexpected: [])"
    )
    extra = {**module.state_dict(), **{f"x{i}": torch.zeros(1) for i in range(5)}}
    assert checkpoint_mismatch(module, {"state_dict": extra}) == (
        "the checkpoint does not fit this model (missing: [], unexpected: ['x0', 'x1', 'x2'])"
    )


def test_a_checkpoint_with_another_number_of_clients() -> None:
    assert checkpoint_mismatch(fedrep(4), {"state_dict": fedrep(5).state_dict()}) == (
        "the checkpoint has 5 clients, this config 4"
    )


def test_a_checkpoint_with_another_layer_size_names_the_first_entry() -> None:
    message = checkpoint_mismatch(fedrep(4, hidden=4), {"state_dict": fedrep(4, hidden=5).state_dict()})
    assert message == (
        "the checkpoint does not fit this model: net.body.fc1.weight has shape [5, 64] there and [4, 64] here"
    )


def test_a_bank_entry_whose_row_shape_differs_is_a_shape_error() -> None:
    module = fedrep(4)
    saved = dict(module.state_dict())
    saved["bank.head__weight"] = torch.zeros(4, 10, 3)
    assert checkpoint_mismatch(module, {"state_dict": saved}) == (
        "the checkpoint does not fit this model: bank.head__weight has shape [4, 10, 3] there and [4, 10, 4] here"
    )


# ---- validates_after ---------------------------------------------------------------------------------------
def validating(every: float | None, enabled: bool = True, eval_last: int = 0, max_steps: int = 10) -> FederatedModule:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), eval_last=eval_last)
    module.trainer = SimpleNamespace(
        enable_validation=enabled,
        max_steps=max_steps,
        val_check_batch=every,
        state=SimpleNamespace(fn=TrainerFn.FITTING),
    )
    return module


def test_validates_after_every_interval() -> None:
    module = validating(3)
    assert [r for r in range(10) if module.validates_after(r)] == [2, 5, 8]


def test_validates_after_the_last_rounds_whatever_the_interval() -> None:
    module = validating(4, eval_last=3)
    assert [r for r in range(10) if module.validates_after(r)] == [3, 7, 8, 9]
    assert [r for r in range(10) if validating(None, eval_last=2).validates_after(r)] == [8, 9]


def test_validates_after_an_infinite_interval_only_the_last_round() -> None:
    module = validating(float("inf"))
    assert [r for r in range(10) if module.validates_after(r)] == [9]


def test_validates_after_a_time_based_interval_is_unknown() -> None:
    module = validating(None)
    assert not any(module.validates_after(r) for r in range(10))


def test_no_validation_when_disabled() -> None:
    module = validating(1, enabled=False, eval_last=5)
    assert not any(module.validates_after(r) for r in range(10))
    assert validating(1).validates_after(0)


# ---- on_save_checkpoint ------------------------------------------------------------------------------------
def saving(rounds: int, history_rounds: list[int], every: int = 2, fn: TrainerFn = TrainerFn.FITTING) -> dict:
    module = validating(every)
    module.trainer.state.fn = fn
    module.rounds_trained = rounds
    module.history = [{"round": float(r), "val/acc_mean": 0.5} for r in history_rounds]
    module.upload_bytes = 321.0
    module._wall_before = 2.5
    checkpoint: dict[str, Any] = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["fl_history"] == module.history and checkpoint["fl_history"] is not module.history
    return checkpoint


def test_save_checkpoint_writes_history_bytes_time_and_identity() -> None:
    checkpoint = saving(4, [1, 3])
    assert checkpoint["fl_upload_bytes"] == 321.0
    assert checkpoint["fl_wall_s"] == 2.5
    assert checkpoint["fl_identity"] == {"algorithm": FEDAVG, "network": DIGITS}
    assert len(checkpoint["fl_history"]) == 2


def test_save_checkpoint_marks_a_round_saved_before_its_validation() -> None:
    assert saving(4, [1])["fl_skips_validation_of"] == 3  # round 3 validates, last evaluated round 1
    assert saving(2, [])["fl_skips_validation_of"] == 1  # nothing evaluated yet
    assert saving(1, [], every=1)["fl_skips_validation_of"] == 0  # round 0 counts too


def test_save_checkpoint_after_the_validation_or_between_validations_skips_nothing() -> None:
    assert saving(4, [1, 2, 3])["fl_skips_validation_of"] is None  # round 3 (the last entry) is evaluated already
    assert saving(4, [1, 3])["fl_skips_validation_of"] is None
    assert saving(3, [])["fl_skips_validation_of"] is None  # round 2 does not validate (every 2)


def test_save_checkpoint_outside_fit_or_before_any_round_has_no_mark() -> None:
    assert "fl_skips_validation_of" not in saving(4, [1], fn=TrainerFn.VALIDATING)
    assert "fl_skips_validation_of" not in saving(0, [], every=1)


# ---- on_load_checkpoint ------------------------------------------------------------------------------------
def test_load_checkpoint_restores_the_run_state(caplog: pytest.LogCaptureFixture) -> None:
    module = fedrep(4)
    module.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))
    history = [{"round": 1.0, "val/acc_mean": 0.25}]
    checkpoint = {
        "state_dict": module.state_dict(), "fl_identity": identity(module), "fl_history": history,
        "global_step": 7, "fl_upload_bytes": 99.0, "fl_wall_s": 12.5, "fl_skips_validation_of": None,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        module.on_load_checkpoint(checkpoint)
    assert caplog.records == []
    assert module.history == history and module.history is not history
    assert module.rounds_trained == 7 and isinstance(module.rounds_trained, int)
    assert module.upload_bytes == 99.0 and module._wall_before == 12.5


def test_load_checkpoint_defaults_for_an_old_checkpoint() -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))  # no bank yet: nothing to compare
    module.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))
    module.history, module.rounds_trained, module.upload_bytes, module._wall_before = [{"round": 0.0}], 3, 5.0, 6.0
    module.on_load_checkpoint({"fl_identity": {"algorithm": "x.Other", "network": "y.Net"}})
    assert module.history == [] and module.rounds_trained == 0
    assert module.upload_bytes == 0.0 and module._wall_before == 0.0


def test_load_checkpoint_refuses_another_model() -> None:
    module = fedrep(4)
    module.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))
    with pytest.raises(ConfigError) as error:
        module.on_load_checkpoint({"state_dict": fedrep(5).state_dict(), "global_step": 3})
    assert str(error.value) == "the checkpoint has 5 clients, this config 4"
    assert module.rounds_trained == 0


@pytest.mark.parametrize(("skipped", "fn", "warned"), [(3, TrainerFn.FITTING, True), (3, TrainerFn.TESTING, False),
                                                       (None, TrainerFn.FITTING, False)])  # fmt: skip
def test_load_checkpoint_warns_about_a_skipped_validation_when_fitting(
    caplog: pytest.LogCaptureFixture, skipped: int | None, fn: TrainerFn, warned: bool
) -> None:
    module = fedrep(4)
    module.trainer = SimpleNamespace(state=SimpleNamespace(fn=fn))
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        module.on_load_checkpoint({"state_dict": module.state_dict(), "fl_skips_validation_of": skipped})
    assert len(caplog.records) == int(warned)
    if warned:
        assert "before the validation of round 3" in caplog.records[0].getMessage()
