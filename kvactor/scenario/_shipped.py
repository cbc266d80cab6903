"""The scenarios shipped inside the package (``kvactor/scenarios/*.toml``): listed, shown and
run by name (``kvactor scenarios``, ``kvactor scenarios show NAME``, ``kvactor run NAME``).

They are read through ``importlib.resources``, so they are found wherever the package is
installed. Each file's first comment line is its one-line summary.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

from ._format import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = (
    "resolve_scenario",
    "run_scenarios",
    "shipped_file",
    "shipped_names",
    "shipped_scenario",
    "summary_line",
)


def _folder() -> importlib.resources.abc.Traversable:
    return importlib.resources.files("kvactor").joinpath("scenarios")


def shipped_names() -> list[str]:
    """The shipped scenarios' names (their file names without ``.toml``), sorted."""
    return sorted(
        entry.name.removesuffix(".toml")
        for entry in _folder().iterdir()
        if entry.name.endswith(".toml") and entry.is_file()
    )


def _unknown(name: str) -> ScenarioError:
    names = ", ".join(shipped_names())
    return ScenarioError(
        f"no shipped scenario named {name!r}: the shipped ones are {names} "
        "(kvactor scenarios lists them)"
    )


def _entry(name: str) -> importlib.resources.abc.Traversable:
    """The shipped file ``name`` (``demo``, ``demo.toml``, ``shared_doc.md``; ``-`` for
    ``_`` also works). Raises ScenarioError naming the shipped scenarios when none is."""
    folder = _folder()
    base = name.replace("-", "_")
    for candidate in (name, base, f"{base}.toml"):
        if "/" in candidate or candidate.startswith("."):
            continue
        entry = folder.joinpath(candidate)
        if entry.is_file():
            return entry
    raise _unknown(name)


def shipped_file(name: str) -> str:
    """The text of a shipped scenario (or of a document one reads, ``shared_doc.md``).
    Raises ScenarioError naming the shipped scenarios when there is none of that name."""
    return _entry(name).read_text(encoding="utf-8")


def shipped_scenario(name: str) -> Scenario:
    """A shipped scenario by name (``demo``, ``shared_doc``...), checked. Raises
    ScenarioError when there is none of that name."""
    entry = _entry(name)
    if not entry.name.endswith(".toml"):
        raise _unknown(name)
    if isinstance(entry, Path):  # installed as files: documents it reads sit beside it
        return load_scenario(entry)
    return parse_scenario(entry.read_text(encoding="utf-8"), source=entry.name)


def summary_line(name: str) -> str:
    """A shipped scenario's first comment line: what it is, in one line."""
    for line in shipped_file(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def resolve_scenario(spec: str) -> Scenario:
    """``kvactor run SPEC``: the scenario file ``SPEC``, or (a bare name, no such file) the
    shipped scenario of that name. Raises ScenarioError for a bad file, or for a file or
    name that does not exist (the message lists the shipped names)."""
    path = Path(spec)
    names = shipped_names()
    if not path.exists() and "/" not in spec and not spec.endswith(".toml"):
        if spec in names or spec.replace("-", "_") in names:
            return shipped_scenario(spec)
        raise ScenarioError(
            f"{spec}: no such scenario file, and no shipped scenario of that name "
            f"(shipped: {', '.join(names)}; kvactor scenarios lists them)"
        )
    try:
        return load_scenario(path)
    except ScenarioError as exc:
        if path.exists():
            raise
        raise ScenarioError(f"{exc} (shipped scenarios run by name: {', '.join(names)})") from None


def run_scenarios(args: argparse.Namespace) -> int:
    """``kvactor scenarios`` (one line per shipped scenario) and ``kvactor scenarios show
    NAME`` (its file, to start one from). 2 for an unknown name."""
    if args.action == "show":
        try:
            text = shipped_file(args.name)
            scenario = shipped_scenario(args.name) if _is_scenario(args.name) else None
        except ScenarioError as exc:
            print(f"kvactor scenarios: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        context = scenario.shared_context if scenario is not None else None
        if context is not None and context.file is not None:
            document = Path(context.file).name
            print(
                f"kvactor: this scenario reads {document} beside it: "
                f"kvactor scenarios show {document} > {document}",
                file=sys.stderr,
            )
        return 0
    names = shipped_names()
    width = max(map(len, names), default=0)
    for name in names:
        s = shipped_scenario(name)
        shape = f"{len(s.agents)} agents, {len(s.phases)} phases"
        print(f"{name:<{width}}  {shape:<19}  {summary_line(name)}")
    print("\nrun one: kvactor run NAME; start your own: kvactor scenarios show NAME > mine.toml")
    return 0


def _is_scenario(name: str) -> bool:
    return _entry(name).name.endswith(".toml")
