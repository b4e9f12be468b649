"""``fl_lightning/errors.py``: YAML that refuses a key given twice, the line where a dotted key is set, jsonargparse's
nested errors condensed into one line (on messages written here in jsonargparse's format), and the config-file
checks that run before the parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_lightning.errors import ConfigError, check_config_files, load_yaml, one_line, yaml_line


def test_load_yaml_refuses_a_key_given_twice_and_names_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("model:\n  lr: 0.1\n  momentum: 0.5\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=rf"^{path}: line 4: key 'lr' is given twice \(first at line 2\)"):
        load_yaml(path)
    assert load_yaml(path, text="a:\n  b: 1\nc: [1, 2]\n") == {"a": {"b": 1}, "c": [1, 2]}
    assert load_yaml(path, text="a:\n  lr: 1\nb:\n  lr: 2\n") == {"a": {"lr": 1}, "b": {"lr": 2}}  # other mappings
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML at line 2, column 4: expected ',' or ']'"):
        load_yaml(path, text="a: [1\n  b: 2\n")


def test_yaml_line_finds_a_dotted_key_with_or_without_init_args(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("data:\n  class_path: X\n  init_args:\n    num_clients: 4\nmodel:\n  lr: 0.1\n")
    assert yaml_line(path, "model.lr") == 6
    assert yaml_line(path, "data.num_clients") == 4 and yaml_line(path, "data.init_args.num_clients") == 4
    assert yaml_line(path, "model.momentum") is None and yaml_line(tmp_path / "missing.yaml", "model.lr") is None


def test_one_line_names_the_key_the_value_what_is_allowed_and_the_fix() -> None:
    nested = ('Parser key "model":\n  Problem with given class_path "X":\n    Parser key "lr":\n'
              "      Expected a <class 'float'>. Got value: fast")  # fmt: skip
    assert one_line(ValueError(nested)) == (
        "model.lr: value 'fast' given, expected a number (e.g. 0.01); fix: --model.lr VALUE on the command line or "
        "model.lr in the config"
    )
    choice = 'Parser key "model.executor":\n  Expected a typing.Literal[\'auto\', \'sequential\']. Got value: fast'
    assert one_line(ValueError(choice)) == (
        "model.executor: value 'fast' given, expected one of auto, sequential; fix: --model.executor auto "
        "(or model.executor in the config)"
    )
    assert one_line(ValueError("Group 'model' does not accept option 'lrr'")).startswith("model.lrr: unknown key; fix")
    assert one_line(KeyError("seed")) == "missing key 'seed' (KeyError)"
    assert "\n" not in one_line(ValueError("first line\n  - the reason\n  - another"))


def test_config_files_are_checked_before_the_parser(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  lr: 0.1\n")
    check_config_files(["--config", str(good), f"--config={good}"])  # nothing raised
    with pytest.raises(ConfigError, match=r"does not exist$"):
        check_config_files(["--config", str(tmp_path / "missing.yaml")])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError, match=r"is a folder, not a config file \(it holds x.yaml\)"):
        check_config_files([f"--config={tmp_path / 'folder'}"])
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match=r"empty.yaml is empty; fix: a config is a mapping"):
        check_config_files(["--config", str(tmp_path / "empty.yaml")])
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"list.yaml is a list, not a mapping"):
        check_config_files(["--config", str(tmp_path / "list.yaml")])
