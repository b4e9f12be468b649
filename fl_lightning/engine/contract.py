"""Whether an algorithm that declares ``vectorizable = True`` keeps to what the stacked path offers, read from its
source before a run starts (instead of an ``AttributeError`` on ``VectorizedContext`` at round 1).

The stacked context implements ``fl_lightning.client.Client``; ``LoopClient`` (the raw data, the client index, the
generator) exists only in the sequential loop. ``contract_problems`` parses the methods of the algorithm's class and
of its bases (``ast``), and the module-level functions they call by name, and reports every parameter annotated with
the loop-only context and every ``ctx.<name>`` read that ``Client`` does not offer. A class whose source cannot be
read (defined in a REPL) is not checked.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from functools import cache

from fl_lightning.client import Client, LoopClient
from fl_lightning.errors import ConfigError

#: annotations that name a context only the sequential loop offers
LOOP_ONLY_TYPES = ("LoopClient", "ClientContext")
#: parameter names that hold a client context even without an annotation
CONTEXT_NAMES = ("ctx",)
#: packages whose classes (``nn.Module``, ``object``) are no algorithm's
OUTSIDE = ("builtins", "torch", "typing")


def members(protocol: type) -> frozenset[str]:
    """The attributes and methods a Protocol declares, its bases' included."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass.__module__ == "fl_lightning.client":
            names.update(getattr(klass, "__annotations__", {}))
            names.update(n for n in vars(klass) if not n.startswith("_"))
    return frozenset(names)


CLIENT = members(Client)
LOOP_ONLY = members(LoopClient) - CLIENT


def check_vectorizable(algorithm_class: type) -> None:
    """A one-line ``ConfigError`` naming the first use of what the stacked path lacks, for a class that declares
    ``vectorizable = True`` in its own body."""
    if not vars(algorithm_class).get("vectorizable", False):
        return
    problems = contract_problems(algorithm_class)
    if problems:
        raise ConfigError(
            f"{algorithm_class.__name__} declares vectorizable = True but {problems[0]}; write it against "
            "fl_lightning.client.Client only, or declare vectorizable = False"
        )


def contract_problems(algorithm_class: type) -> list[str]:
    """Every use of what ``Client`` does not offer in the methods of ``algorithm_class`` and its bases (and the
    module-level functions they call), as ``"<where> reads ctx.x, which only the sequential loop offers"``. Read
    once per class and process (a class's source does not change while it runs; every run's set-up asks)."""
    return list(_class_problems(algorithm_class))


@cache
def _class_problems(algorithm_class: type) -> tuple[str, ...]:
    problems: list[str] = []
    for klass in algorithm_class.__mro__:
        if klass.__module__.partition(".")[0] in OUTSIDE:
            continue
        found = _class_node(klass)
        tree = _module_tree(klass.__module__)
        if found is None or tree is None:
            continue
        node, first = found
        functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        called = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in functions}
        file = f"{klass.__module__.rpartition('.')[2]}.py"
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                where = f"{klass.__name__}.{item.name} ({file}:{first + item.lineno - 1})"
                problems += _function_problems(item, where)
        for name in sorted(called):
            problems += _function_problems(functions[name], f"{name} ({file}:{functions[name].lineno})")
    return tuple(dict.fromkeys(problems))


def _function_problems(function: ast.FunctionDef, where: str) -> list[str]:
    """The annotations naming a loop-only context and the context reads outside ``Client`` of one function (nested
    functions and lambdas included, which read the context as a free name)."""
    problems, contexts = [], set()
    for fn in ast.walk(function):
        if not isinstance(fn, ast.FunctionDef | ast.Lambda):
            continue
        arguments = fn.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            annotation = "" if arg.annotation is None else ast.unparse(arg.annotation)
            if any(name in annotation for name in LOOP_ONLY_TYPES):
                problems.append(f"{where} annotates {arg.arg}: {annotation}, which only the sequential loop offers")
                contexts.add(arg.arg)
            elif arg.arg in CONTEXT_NAMES or "Client" in annotation:
                contexts.add(arg.arg)
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in contexts:
            if node.attr in CLIENT:
                continue
            offered = "only the sequential loop offers" if node.attr in LOOP_ONLY else "the client contract lacks"
            problems.append(f"{where} reads {node.value.id}.{node.attr}, which {offered}")
    return problems


@cache
def _module_tree(module: str) -> ast.Module | None:
    loaded = sys.modules.get(module)
    try:
        source = inspect.getsource(loaded) if loaded is not None else None
    except (OSError, TypeError):
        return None
    return None if source is None else ast.parse(textwrap.dedent(source))


def _class_node(klass: type) -> tuple[ast.ClassDef, int] | None:
    """The class's definition and its first line in its file."""
    try:
        lines, first = inspect.getsourcelines(klass)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    return (node, first) if isinstance(node, ast.ClassDef) else None
