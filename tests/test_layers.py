"""The layout's rules, read from the sources (docs/layout.md): imports only go down the
layers, a package is entered through its ``__init__`` (never another package's private
module), no file is over 1,000 lines and no function over 100.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``. The
layers are a total order, so no two packages import each other, type-only imports
included. The checker is shown to fail on scratch modules that break each rule."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {
    "runtime": "kvactor.runtime",
    "kernels": "kvactor.kernels",
    "actors": "kvactor.actors",
    "kvactor": "kvactor",
}

#: The layers, lowest first: a module may import from its own layer and the ones before.
#: A layer is a package (entered through its ``__init__`` from the others) or a module.
LAYERS = (
    "kvactor.runtime",  # the actor kernel: no LLM code
    "kvactor.kernels",  # array code
    # kvactor.actors: leaves first, then its packages by concept
    "kvactor.actors.enums",
    "kvactor.actors.options",
    "kvactor.actors.records",
    "kvactor.actors.errors",
    "kvactor.actors.ids",
    "kvactor.actors.messages",
    "kvactor.actors.models",
    "kvactor.actors.tools",
    "kvactor.actors.hot",
    "kvactor.actors.warm",
    "kvactor.actors.engine",
    "kvactor.actors.agent",
    "kvactor.actors.session",
    "kvactor.actors.cluster",
    "kvactor.actors.opening",
    "kvactor.actors",  # its __init__: the LLM layer's public names
    # kvactor: the public API, the scenarios, the server and the command line
    "kvactor.text",
    "kvactor.scenario",
    "kvactor.server",
    "kvactor.cli",
    "kvactor",
)

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 100


class Source:
    """One module: its import name, whether it is a package's ``__init__``, its text."""

    def __init__(self, name: str, text: str, *, package: bool = False, path: str = "") -> None:
        self.name, self.text, self.package, self.path = name, text, package, path or name


def sources() -> list[Source]:
    """Every module of the four folders, under its import name."""
    found = []
    for folder, root in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            name = ".".join([root, *parts[:-1]] if package else [root, *parts])
            text = path.read_text(encoding="utf-8")
            found.append(Source(name, text, package=package, path=str(path.relative_to(REPO))))
    return found


def layer(module: str) -> int:
    """The index of the layer ``module`` belongs to (its longest prefix in LAYERS)."""
    best = -1
    for i, name in enumerate(LAYERS):
        if (module == name or module.startswith(name + ".")) and (
            best < 0 or len(name) > len(LAYERS[best])
        ):
            best = i
    if best < 0:
        raise ValueError(f"{module} is in no layer: add it to LAYERS and docs/layout.md")
    return best


def imports(source: Source, modules: Mapping[str, Source]) -> Iterator[tuple[int, str]]:
    """(line, module) of every kvactor module ``source`` imports, anywhere in it."""
    base = source.name.split(".")
    if not source.package:
        base = base[:-1]
    for node in ast.walk(ast.parse(source.text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                head = base[: len(base) - node.level + 1]
                target = ".".join(head + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from pkg import module`` imports the module
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in modules else target


def violations(found: list[Source]) -> list[str]:
    """What breaks the import rules, one line each (empty: none)."""
    modules = {s.name: s for s in found}
    out = []
    for source in found:
        mine = layer(source.name)
        for line, target in imports(source, modules):
            if target != "kvactor" and not target.startswith("kvactor."):
                continue
            theirs = layer(target)
            where = f"{source.path}:{line}: {source.name} imports {target}"
            if theirs > mine:
                out.append(f"{where}: up the layers ({LAYERS[mine]} < {LAYERS[theirs]})")
            elif theirs < mine:
                rest = target[len(LAYERS[theirs]) :].split(".")
                if any(part.startswith("_") for part in rest):
                    out.append(f"{where}: a private module of {LAYERS[theirs]}")
    return out


def test_imports_only_go_down_the_layers_and_through_each_package_surface() -> None:
    assert violations(sources()) == []


def _with(scratch: str, text: str) -> list[str]:
    return violations([*sources(), Source(scratch, text)])


@pytest.mark.parametrize(
    ("scratch", "text", "expected"),
    [
        ("kvactor.actors.hot._scratch", "from ..engine import EngineConfig\n", "up the layers"),
        (
            "kvactor.actors.warm._scratch",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..session import Session\n",
            "up the layers",
        ),
        (
            "kvactor.actors.models._scratch",
            "def f() -> None:\n    from ..agent import AgentActor\n",
            "up the layers",
        ),
        ("kvactor.kernels._scratch", "import kvactor.runtime\nimport kvactor.actors\n", "up"),
        ("kvactor.actors.engine._scratch", "from ..hot._pool import CachePool\n", "private"),
        ("kvactor.server._scratch", "from ..actors.warm._manifest import MANIFEST\n", "private"),
    ],
)
def test_the_checker_fails_on_a_scratch_module_that_breaks_a_rule(
    scratch: str, text: str, expected: str
) -> None:
    found = _with(scratch, text)
    assert len(found) == 1 and expected in found[0], found


def test_the_checker_passes_a_scratch_module_that_keeps_the_rules() -> None:
    text = "from ..hot import CachePool\nfrom ...kernels.qcodec import KVCodec\nfrom ._x import y\n"
    assert _with("kvactor.actors.engine._scratch", text) == []


def test_every_module_is_in_a_layer_and_the_layers_are_documented() -> None:
    for source in sources():
        layer(source.name)
    layout = (REPO / "docs/layout.md").read_text(encoding="utf-8")
    for name in LAYERS:
        assert f"`{name.removeprefix('kvactor.')}" in layout or f"`{name}`" in layout, name


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_no_file_over_1000_lines_and_no_function_over_100() -> None:
    long_files, long_functions = [], []
    for source in sources():
        lines = source.text.count("\n")
        if lines > MAX_FILE_LINES:
            long_files.append(f"{source.path}: {lines}")
        for fn in _functions(ast.parse(source.text)):
            size = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if size > MAX_FUNCTION_LINES:
                long_functions.append(f"{source.path}:{fn.lineno} {fn.name}: {size}")
    assert long_files == [] and long_functions == []
