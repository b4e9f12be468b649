"""User-facing errors: bad configs or data. ``train.py`` prints them as one line and exits with code 2.

This module is the bottom of the import graph (standard library at the top, ``yaml`` where used): the data layer,
the CLI, the experiment runner and the run axis all take :class:`ConfigError`, :func:`one_line` (a long nested
parser error condensed into "key: value given, what is allowed, fix") and :func:`load_yaml` (YAML that refuses
duplicate keys) from here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration or data problem the user can fix (the message says how)."""


# ---- YAML without silent duplicates ------------------------------------------------------------------------------


def load_yaml(path: str | Path, text: str | None = None) -> Any:
    """``yaml.safe_load`` of a config or experiment file that refuses what PyYAML accepts silently: a key given
    twice in one mapping (PyYAML keeps the last one). Every problem is one :class:`ConfigError` naming the file and
    the line."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise ConfigError(
                        f"{path}: line {line}: key {key!r} is given twice (first at line {seen[key]}); "
                        "PyYAML would keep only the last one: delete one of them"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    text = Path(path).read_text() if text is None else text
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None


def yaml_line(path: str | Path, dotted: str) -> int | None:
    """The line (1-based) where ``dotted`` (``model.lr``; ``init_args`` levels may be left out) is set in the YAML
    file ``path``, or ``None``."""
    import yaml

    try:
        node = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        found = _child(node, part)
        if found is None:  # ``data.num_clients`` is ``data.init_args.num_clients`` in the file
            args = _child(node, "init_args")
            found = _child(args[1], part) if args is not None and isinstance(args[1], yaml.MappingNode) else None
        if found is None:
            return None
        line, node = found[0].start_mark.line + 1, found[1]
    return line


def _child(node: Any, name: str) -> tuple[Any, Any] | None:
    return next(((k, v) for k, v in node.value if getattr(k, "value", None) == name), None)


# ---- one line per error ---------------------------------------------------------------------------------------

_TYPE_WORDS = {
    "float": "a number (e.g. 0.01)",
    "int": "an integer (e.g. 10)",
    "bool": "true or false",
    "str": "a string",
    "NoneType": "null",
    "PositiveInt": "a positive integer",
    "NonNegativeInt": "an integer ≥ 0",
}


def _type_word(name: str) -> str:
    return _TYPE_WORDS.get(name, name)


def _parser_error(text: str) -> str | None:
    """jsonargparse's nested ``Parser key "a": … Parser key "b": Expected a <class 'float'>. Got value: x`` as
    ``a.b: value 'x' given, expected a number (e.g. 0.01); fix: --a.b VALUE``."""
    keys = re.findall(r'Parser key "([^"]+)"', text)
    expected = re.findall(r"Expected a <class '([^']+)'>(?:\. Got value: ([^\n]*))?", text)
    given = re.search(r"Given value: ([^\n]*)", text)
    if not keys or not expected:
        return None
    parts: list[str] = []
    for k in keys:
        parts += [p for p in k.split(".") if p != "init_args"]
    key = ".".join(parts)
    value = next((v for _, v in expected if v), None)
    nested = re.search(r"NestedArg\(key='([^']+)', val='([^']*)'\)", given.group(1)) if given else None
    if value is None and nested:
        value = nested.group(2)
    elif value is None and given:
        value = given.group(1).strip()
    types = [t for t, _ in expected if t != "NoneType"]
    if not types:  # only the "or null" branch of an optional class: the real reason is elsewhere
        return None
    allowed = " or ".join(dict.fromkeys(_type_word(t.rsplit(".", 1)[-1]) for t in types))
    shown = f"value {value!r} given" if value is not None else "a value of the wrong type given"
    return f"{key}: {shown}, expected {allowed}; fix: --{key} VALUE on the command line or {key} in the config"


def one_line(exc: BaseException) -> str:
    """Condense an error (jsonargparse nests its causes over many lines) into one readable line that names the key,
    the value given, what is allowed and the fix."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        return f"missing key {exc.args[0]!r} ({type(exc).__name__})"
    key_match = re.search(r'Parser key "([^"]+)"', text)
    key = key_match.group(1) if key_match else ""
    unknown = re.search(r"has no attribute '([^']+)'|No module named '([^']+)'|import path string: (\S+)", text)
    if unknown:  # the innermost class path before the failure, and the nested keys down to it (data.partition)
        before = text[: unknown.start()]
        names = re.findall(r"class_path '([^']+)'", before)
        shown = names[-1] if names else next(g for g in unknown.groups() if g)
        nested = [p for k in re.findall(r'Parser key "([^"]+)"', before) for p in k.split(".") if p != "init_args"]
        key = ".".join(nested) or key
        return f"{key or 'config'}: unknown class '{shown}'{_known(key)}"
    choice = re.search(r"Expected a typing\.Literal\[([^\]]*)\]\. Got value: ([^\n]*)", text)
    if choice and key:
        allowed = ", ".join(v.strip().strip("'\"") for v in choice.group(1).split(","))
        return (f"{key}: value {choice.group(2).strip()!r} given, expected one of {allowed}; fix: --{key} "
                f"{allowed.split(', ')[0]} (or {key} in the config)")
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", text)
    option = re.search(r"Option '([^']+)' is not accepted", text)
    if group or option:
        keys = [p for k in re.findall(r'Parser key "([^"]+)"', text) for p in k.split(".") if p != "init_args"]
        name = f"{group.group(1)}.{group.group(2)}" if group else ".".join([*keys, option.group(1)])
        return (f"{name}: unknown key; fix: check the spelling (python train.py fit --help lists every option with "
                "its type), or drop it")  # fmt: skip
    if text.startswith("Unexpected config"):
        given = " ".join(text.split()[2:])[:80]
        return f"a config is not a mapping of keys ({given!r}); fix: model:, data:, trainer: …"
    unexpected = re.search(r"Unexpected keys?:?\s*\n?\s*(.*)", text)
    if unexpected and not key:
        return f"unknown key(s) {' '.join(unexpected.group(1).split())[:160]}: check the spelling (train.py fit --help)"
    typed = _parser_error(text)
    if typed is not None:
        return typed
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    noise = (
        "Expected a <class 'NoneType'>",
        "Does not validate",
        "Expected a path",
        "Subtypes:",
        "Errors:",
        "Given value",
    )
    reasons = [ln.lstrip("- ") for ln in lines[1:] if ln.startswith("- ") and not ln.lstrip("- ").startswith(noise)]
    head = lines[0] if not lines[0].startswith(noise) else ""
    if reasons:
        reason = reasons[0]
        if reason.endswith(":"):  # the detail is on the next line
            after = lines[lines.index(next(ln for ln in lines if ln.lstrip("- ") == reason)) + 1 :]
            reason += " " + next((ln for ln in after if not ln.startswith(noise)), "")
        head = f"{key}: {reason}" if key else reason
    line = " ".join((head or lines[0]).split())
    # a class-with-init-args option (model.client_optimizer, …): drop the type's repr and the echoed value
    line = re.sub(r"Type .*? expects a function or a callable class: ", "", line)
    return re.sub(r"(\. )?Got value: Namespace\(class_path=.*$", "", line)


KNOWN = {"model.algorithm": "fl_lightning.algorithms", "model.network": "fl_lightning.models", "data": "datamodules"}


def _known(key: str) -> str:
    import importlib

    if key.endswith(".partition"):  # a partition class, not a DataModule
        partition = importlib.import_module("datamodules.partition")
        names = [n for n, c in vars(partition).items() if isinstance(c, type) and issubclass(c, partition.Partitioner)
                 and c is not partition.Partitioner and not n.startswith("_")]  # fmt: skip
        return f" (known partitions: {', '.join(sorted(names))})"
    for prefix, module in KNOWN.items():
        if key.startswith(prefix):
            mod = importlib.import_module(module)
            names = getattr(mod, "__all__", None) or [n for n in dir(mod) if n[:1].isupper()]
            return f" (known: {', '.join(sorted(names))})"
    return ""


def check_config_files(args: list[str]) -> None:
    """Missing or unparsable ``--config`` files (and keys given twice in one of them), named, before jsonargparse
    reports them less clearly."""
    paths = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    for path in paths:
        if Path(path).is_dir():
            inside = sorted(p.name for p in Path(path).glob("*.yaml"))[:4]
            hint = f" (it holds {', '.join(inside)}{', …' if len(inside) == 4 else ''})" if inside else ""
            raise ConfigError(f"--config {path} is a folder, not a config file{hint}; fix: --config FOLDER/NAME.yaml")
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        data = load_yaml(path)
        if not isinstance(data, dict):
            what = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
            raise ConfigError(f"config file {path} is {what}; fix: a config is a mapping of sections (model:, data:, "
                              f"trainer:, …), or drop --config {path}")  # fmt: skip
