"""``fl_lightning/sizes.py``: a network's size arguments filled from the data module (given in the config, else its
signature default), a contradiction refused in one line, and the arguments that are only defaults."""

from __future__ import annotations

import pytest
from jsonargparse import Namespace

from fl_lightning.errors import ConfigError
from fl_lightning.sizes import share_sizes


def _config(network: str, net_args: dict, data: str, data_args: dict) -> Namespace:
    return Namespace(
        model=Namespace(network=Namespace(class_path=network, init_args=Namespace(**net_args))),
        data=Namespace(class_path=data, init_args=Namespace(**data_args)),
    )


LINEAR, SYNTHETIC = "fl_lightning.models.LinearRepresentation", "datamodules.SyntheticLinearDataModule"
FACTORS, LOWRANK = "fl_lightning.models.LowRankFactors", "datamodules.LowRankDataModule"


def test_unset_sizes_come_from_the_data_config_or_its_default() -> None:
    config = _config(LINEAR, {"dim": None, "rank": None}, SYNTHETIC, {"dim": 7})
    share_sizes(config)
    assert config["model.network.init_args.dim"] == 7  # given in data.init_args
    assert config["model.network.init_args.rank"] == 2  # SyntheticLinearDataModule's default rank


def test_an_equal_explicit_size_passes_a_different_one_is_one_line() -> None:
    share_sizes(_config(LINEAR, {"dim": 7, "rank": 2}, SYNTHETIC, {"dim": 7}))
    with pytest.raises(ConfigError, match=r"^model.network.init_args.dim=5 but data.init_args.dim=7: set it once"):
        share_sizes(_config(LINEAR, {"dim": 5, "rank": None}, SYNTHETIC, {"dim": 7}))


def test_defaults_only_sizes_are_filled_never_checked() -> None:
    config = _config(FACTORS, {"dim": None, "rank": 3, "max_rows": None}, LOWRANK, {"dim": 12, "rank": 2,
                     "rows_per_client": 9})  # fmt: skip
    share_sizes(config)  # the factorisation rank 3 may differ from the matrix's rank 2
    assert (config["model.network.init_args.dim"], config["model.network.init_args.rank"]) == (12, 3)
    assert config["model.network.init_args.max_rows"] == 9


def test_a_network_without_data_sizes_or_an_unknown_class_is_left_as_is() -> None:
    config = _config("fl_lightning.models.DigitsMLP", {"hidden": [4]}, SYNTHETIC, {"dim": 7})
    share_sizes(config)
    assert config["model.network.init_args"] == Namespace(hidden=[4])
    unknown = _config("no.such.Network", {"dim": None}, "no.such.Data", {})
    share_sizes(unknown)
    assert unknown["model.network.init_args.dim"] is None
