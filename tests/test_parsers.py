"""``fl_lightning/parsers.py``: train.py's parser built once per process and reused by later runs, one run at a time,
with the same configs, ``config.yaml`` texts and hyper-parameters as a parser built for each run alone."""

from __future__ import annotations

import threading

import pytest

from tests.cli.test_cli import DIGITS, ROOT, _cli_args, _what_lightning_dumped


def test_a_reused_parser_gives_what_a_fresh_parser_gives(tmp_path, monkeypatch):
    """Runs of every digits method, overrides, and refused commands in between, parsed by parsers that earlier runs
    used: the same config, config.yaml text, checkpoint hyper-parameters and full config as a parser built for the
    run alone (and as the three separate dumps of before); every run after the first takes the idle parser."""
    import lightning.pytorch.cli as lightning_cli
    from jsonargparse import ArgumentError

    import fl_lightning.cli as cli_module
    import fl_lightning.parsers as parsers
    from fl_lightning.errors import ConfigError

    methods = sorted(p.stem for p in DIGITS.glob("*.yaml") if p.stem != "base")
    runs = [_cli_args(tmp_path, m) for m in methods]
    runs.insert(3, _cli_args(tmp_path, "fedrep", "--model.lr", "-1"))  # refused by the range check
    runs.insert(6, _cli_args(tmp_path, "ditto", "--model.no_such_option", "1"))  # refused by the parser
    runs.insert(9, _cli_args(tmp_path, "fedavg", "--model.lr", "0.05", "--seed_everything", "3",
                             "--data.init_args.num_clients", "10", "--wandb.tags", "[a, b]"))  # fmt: skip
    built = []
    real_setup = lightning_cli.LightningCLI.setup_parser
    monkeypatch.setattr(lightning_cli.LightningCLI, "setup_parser", lambda *a: built.append(1) or real_setup(*a))
    shared: dict = {}
    used, refused = set(), 0
    for args in runs:
        monkeypatch.setattr(parsers, "_IDLE_PARSERS", {})  # a parser for this run alone
        try:
            fresh = cli_module.make_cli("fit", args)
        except (ConfigError, ArgumentError) as error:
            refused += 1
            monkeypatch.setattr(parsers, "_IDLE_PARSERS", shared)
            with pytest.raises(type(error)) as again:
                cli_module.make_cli("fit", args)
            assert str(again.value) == str(error)
            continue
        monkeypatch.setattr(parsers, "_IDLE_PARSERS", shared)
        reused = cli_module.make_cli("fit", args)
        used.add(id(reused.parser))
        assert reused.config == fresh.config
        assert (reused.config_text, reused.config_dump, reused.full_config) == _what_lightning_dumped(fresh)
        assert reused.model.hparams == fresh.model.hparams
    assert refused == 2
    assert len(used) == 1 and [len(idle) for idle in shared.values()] == [1]
    assert len(built) == len(runs) + 1  # one per fresh run, one for all the runs that reuse


def test_a_parser_in_use_is_not_given_to_another_run(tmp_path, monkeypatch):
    """A run that starts while another is being set up (the batched runner's threads take turns, but nothing else
    promises it) gets a parser of its own; both go back to the idle list, and the next run takes one of them."""
    import fl_lightning.cli as cli_module
    import fl_lightning.parsers as parsers
    import fl_lightning.sizes as sizes

    monkeypatch.setattr(parsers, "_IDLE_PARSERS", {})
    inner, started = [], []
    real_share = sizes.share_sizes

    def nested(config):
        real_share(config)
        if not started:  # inside the outer run's set-up: a second run is set up, whole, in another thread
            started.append(1)
            args = _cli_args(tmp_path, "fedrep")
            other = threading.Thread(target=lambda: inner.append(cli_module.make_cli("fit", args)))
            other.start()
            other.join()

    monkeypatch.setattr(sizes, "share_sizes", nested)
    outer = cli_module.make_cli("fit", _cli_args(tmp_path, "fedavg"))
    assert inner[0].parser is not outer.parser
    assert inner[0].config.model.algorithm.class_path.endswith("FedRep")
    assert outer.config.model.algorithm.class_path.endswith("FedAvg")
    (idle,) = parsers._IDLE_PARSERS.values()
    assert {id(p) for p in idle} == {id(outer.parser), id(inner[0].parser)}
    monkeypatch.setattr(sizes, "share_sizes", real_share)
    later = cli_module.make_cli("fit", _cli_args(tmp_path, "ditto"))
    assert later.parser is outer.parser or later.parser is inner[0].parser
    assert len(idle) == 2


def test_a_parse_only_cli_and_the_run_cli_build_different_parsers(tmp_path, monkeypatch):
    """The experiment runner's parse-only check (``seed_everything`` default 0) and train.py (default: a random seed)
    differ in a default of the parser: they never share one."""
    import fl_lightning.cli as cli_module
    import fl_lightning.parsers as parsers
    from fl_lightning.experiment.validation import parse_train_args

    monkeypatch.setattr(parsers, "_IDLE_PARSERS", {})
    args = ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--run_dir", str(tmp_path / "q")]
    parse_train_args(args)
    cli_module.make_cli("fit", args)
    assert sorted(len(idle) for idle in parsers._IDLE_PARSERS.values()) == [1, 1]


def test_an_idle_parser_keeps_no_run_alive(tmp_path, monkeypatch):
    """LightningCLI registers instantiators that hold the CLI (model, data, trainer) on its parser: once the parser
    is idle, nothing of the run that used it is kept."""
    import gc
    import weakref

    import fl_lightning.cli as cli_module
    import fl_lightning.parsers as parsers

    monkeypatch.setattr(parsers, "_IDLE_PARSERS", {})
    cli = cli_module.make_cli("fit", _cli_args(tmp_path, "fedavg"))
    gone = [weakref.ref(cli), weakref.ref(cli.model), weakref.ref(cli.datamodule)]
    del cli
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]
    (idle,) = parsers._IDLE_PARSERS.values()
    assert len(idle) == 1
