"""Who writes what: no function in ``fl_lightning/`` writes a private attribute (``x._name = …``) of an object it does
not own, and no engine function takes the module untyped (a parameter named ``module`` annotated ``Any``).
Both are read from the source with ``ast``; the few exceptions below each say why they are still there."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fl_lightning"
#: (file name, target) writes that remain, each with its reason
KNOWN_WRITES: dict[tuple[str, str], str] = {
    ("client_data.py", "moved._offsets"): "a ClientSplit that ``ClientSplit.to`` itself built: it owns it",
    ("lightning_logging.py", "trainer._logger_connector._current_fx"): "the last line of Lightning "
    "2.6's own ``LightningModule.log``, which ``log_scalars`` stands in for (version-gated; "
    "tests/engine/test_lightning_logging.py checks that the two give the same metrics)",
}
#: file name -> engine functions that still take the module untyped, each with its reason
KNOWN_UNTYPED: dict[str, list[str]] = {}


def private_writes(source: str) -> list[str]:
    """``owner._name`` targets of assignments (plain, augmented, annotated, tuple) whose owner is not ``self`` or
    ``cls``; dunder names (``__dict__``) are not private attributes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif isinstance(target, ast.Subscript):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute):
                owner = ast.unparse(target.value)
                name = target.attr
                if name.startswith("_") and not name.startswith("__") and owner not in ("self", "cls"):
                    found.append(f"{owner}.{name}")
    return found


def untyped_module_parameters(source: str) -> list[str]:
    """Functions with a parameter named ``module`` (or ``run``) annotated ``Any`` or an alias of it."""
    tree = ast.parse(source)
    aliases = {"Any"} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.value) == "Any"
        for t in n.targets if isinstance(t, ast.Name)
    }  # fmt: skip
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                annotation = "" if arg.annotation is None else ast.unparse(arg.annotation)
                if arg.arg in ("module", "run") and annotation in aliases:
                    out.append(f"{node.name}({arg.arg}: {annotation})")
    return out


def test_the_scans_find_what_they_look_for() -> None:
    source = (
        "def f(module: Any, other: Any):\n"
        "    module._x = 1\n    self._y = 2\n    a, module.b._c = 3, 4\n    module._d[0] = 5\n    obj.__dict__ = {}\n"
        "Module = Any\n"
        "def g(module: Module): pass\n"
        "def h(module: 'Typed', run: int): pass\n"
    )
    assert sorted(private_writes(source)) == ["module._d", "module._x", "module.b._c"]
    assert untyped_module_parameters(source) == ["f(module: Any)", "g(module: Module)"]


def test_no_function_writes_a_private_attribute_of_an_object_it_does_not_own() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    found = {(path.name, target) for path in files for target in private_writes(path.read_text())}
    assert found - set(KNOWN_WRITES) == set()


def test_every_known_write_is_still_there() -> None:
    """An exception that is gone leaves the list (so that it cannot come back unnoticed)."""
    files = {path.name: path for path in PACKAGE.rglob("*.py")}
    for file, target in KNOWN_WRITES:
        assert target in private_writes(files[file].read_text()), (file, target)


def test_no_engine_function_takes_the_module_untyped() -> None:
    files = sorted((PACKAGE / "engine").rglob("*.py"))
    found = {path.name: untyped_module_parameters(path.read_text()) for path in files}
    assert {file: names for file, names in found.items() if names} == KNOWN_UNTYPED
