"""``kvactor demo`` and ``kvactor run``: run a scenario with a live view (``_scenario_view``),
then summarize it, and say how to see and delete the warm caches it left.

``--json`` alone prints a JSON summary on stdout instead (the live view goes to stderr);
``--json PATH`` writes the whole results to PATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from ..actors.enums import Tier, TurnPath
from ..actors.errors import BudgetExceeded, ModelLoadError
from ..actors.warm import default_cache_dir, list_agents
from ..runtime import KvactorError
from ..scenario import (
    CONTEXT_AGENT,
    WIDTH,
    LiveView,
    Results,
    Scenario,
    ScenarioError,
    cold_model,
    format_summary,
    resolve_scenario,
    run_scenario,
    shipped_scenario,
    turn_path,
    write_results,
)
from ..text import command, printable
from ._inspect import remember_model

__all__ = (
    "LiveView",
    "cache_commands",
    "demo_scenario",
    "format_summary",
    "json_summary",
    "next_run",
    "plot_ttft",
    "run_demo",
    "run_file",
)

STDOUT = "-"  # --json alone (or --json -): the summary as JSON on stdout


PATH_COLOURS = {
    TurnPath.COLD: "#1f77b4",
    TurnPath.WARM: "#ff7f0e",
    TurnPath.PREFETCHED: "#9467bd",
    TurnPath.HOT: "#2ca02c",
}


# ------------------------------------------------------------------------------- plot
def plot_ttft(results: Results, path: str | Path) -> None:
    """Draw TTFT per turn, coloured by path, with each turn's estimated cold TTFT.

    Raises ModuleNotFoundError when matplotlib is not installed (``kvactor[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = results.turns
    cold = cold_model(turns, results.summary.references)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(turns) + 2), 4.0))
    for label, colour in PATH_COLOURS.items():
        group = [t for t in turns if turn_path(t) is label]
        if group:
            ax.bar(
                [t.index for t in group],
                [t.ttft_s for t in group],
                color=colour,
                label=f"{label} ({len(group)})",
            )
    reused = [t for t in turns if t.path is not Tier.COLD]
    if cold is not None and reused:
        ax.scatter(
            [t.index for t in reused],
            [cold[0](t.prompt_tokens) for t in reused],
            marker="_",
            color="black",
            s=120,
            label="est. if re-prefilled",
        )
    for t in turns[1:]:
        if t.phase_index != turns[t.index - 1].phase_index:
            ax.axvline(t.index - 0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks([t.index for t in turns], [t.agent for t in turns], rotation=90, fontsize=7)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{results.scenario.name}: TTFT per turn ({results.model.name})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


# -------------------------------------------------------------------------------- CLI
class Caches(msgspec.Struct, frozen=True, kw_only=True):
    """The warm caches a run left: where, whose, and the commands that show and delete
    them (quoted for a shell)."""

    dir: str
    agents: list[str]
    inspect: str
    forget: str


def cache_commands(results: Results) -> Caches | None:
    """The run's agents (the shared context included) that have a warm cache in its cache
    directory, with the ``kvactor inspect`` / ``kvactor forget`` commands for them; None
    without a warm tier or caches. Touches files."""
    if results.cache_dir is None:
        return None
    folder = os.path.abspath(results.cache_dir)
    names = [a.name for a in results.scenario.agents]
    if results.context is not None:
        names.append(CONTEXT_AGENT)
    try:
        on_disk = {w.agent for w in list_agents(folder) if w.rejected is None}
    except (KvactorError, OSError):
        return None
    agents = [name for name in names if name in on_disk]
    if not agents:
        return None
    return Caches(
        dir=folder,
        agents=agents,
        inspect=command("kvactor", "inspect", folder),
        forget=command("kvactor", "forget", *agents, "--dir", folder),
    )


def closing_lines(caches: Caches | None) -> list[str]:
    """Where the run's warm caches are and the commands to paste."""
    if caches is None:
        return []
    n = len(caches.agents)
    return [
        f"warm caches: {n} agent{'s' if n != 1 else ''} in {printable(caches.dir)}",
        f"  see them:    {printable(caches.inspect)}",
        f"  delete them: {printable(caches.forget)}",
    ]


def json_summary(
    results: Results, caches: Caches | None, *, results_file: str | None, fresh: bool = False
) -> dict[str, Any]:
    """What ``--json`` prints for one run: the scenario, model, cache directory, the
    summary and engine statistics, and the cache commands."""
    return {
        "scenario": results.scenario.name,
        "model": {"name": results.model.name, "fingerprint": results.model.fingerprint},
        "cache_dir": os.path.abspath(results.cache_dir) if results.cache_dir else None,
        "results_file": results_file,
        "turns": len(results.turns),
        "wall_s": results.wall_s,
        "budget_bytes": results.budget_bytes,
        "resumed": results.resumed,
        "reset": results.reset,
        "summary": msgspec.to_builtins(results.summary),
        "stats": msgspec.to_builtins(results.stats),
        "next_run": next_run(results, fresh=fresh),
        "caches": msgspec.to_builtins(caches) if caches is not None else None,
    }


class _Done(msgspec.Struct, frozen=True, kw_only=True):
    results: Results
    caches: Caches | None
    results_file: str | None


def _execute(
    scenario: Scenario,
    args: argparse.Namespace,
    json_path: str | None,
    plot_path: str | None,
    out: IO[str],
) -> _Done | int:
    """Run ``scenario`` with a live view on ``out``, then print its summary there; the
    exit code when it failed."""
    if plot_path and not _plot_available():
        print("kvactor: --plot needs matplotlib: pip install 'kvactor[plot]'", file=sys.stderr)
        return 2
    view = LiveView(out)
    port = getattr(args, "dashboard", None)

    def finish(results: Results) -> _Done:
        fresh = bool(getattr(args, "fresh", False))
        view.write(["", *format_summary(results), "", next_run(results, fresh=fresh)])
        if results.cache_dir is not None:
            remember_model(results.cache_dir, results.model.fingerprint, results.model.name)
        if json_path:
            write_results(results, json_path)
            print(f"results: {json_path}", file=out)
        if plot_path:
            plot_ttft(results, plot_path)
            print(f"plot: {plot_path}", file=out)
        return _Done(results=results, caches=cache_commands(results), results_file=json_path)

    try:
        if port is None:
            results = anyio.run(lambda: run_scenario(scenario, on_event=view), backend=args.backend)
            return finish(results)
        from ._watch import dashboard_backend, port_taken, run_watched  # the server extra

        why = dashboard_backend(args.backend)
        if why is not None:
            print(f"kvactor run: {why}", file=sys.stderr)
            return 2
        try:
            return anyio.run(run_watched, scenario, view, port, out, finish)
        except OSError as exc:
            return port_taken(port, exc)
    except (ScenarioError, ModelLoadError) as exc:
        print(f"kvactor: {exc}", file=sys.stderr)
        return 2
    except BudgetExceeded as exc:
        print(f"kvactor: {exc}: raise budget_mb (or use hot_agents)", file=sys.stderr)
        return 1
    except KvactorError as exc:
        print(f"kvactor: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def next_run(results: Results, *, fresh: bool = False) -> str:
    """What running the same scenario again will do. ``fresh``: this run started over at
    the user's request (``--fresh``), which does not carry over to the next run."""
    s = results.scenario
    longest = max((t.cache_tokens for t in results.turns), default=0)
    if results.cache_dir is None:
        return "no warm tier: the next run starts cold again."
    if not s.resume and not fresh:
        return "resume = false: the next run forgets these caches and starts cold."
    if s.resume_max_tokens is not None and longest > s.resume_max_tokens:
        return (
            f"the conversations hold up to {longest} tokens, past resume_max_tokens = "
            f"{s.resume_max_tokens}: the next run starts fresh."
        )
    return "run it again: a new process resumes every agent from disk (--fresh forgets them)."


def _overrides(scenario: Scenario, args: argparse.Namespace) -> Scenario:
    changes: dict[str, object] = {}
    if getattr(args, "fresh", False):
        changes["resume"] = False
    if getattr(args, "model", None):
        changes["model"] = args.model
    if getattr(args, "cache_dir", None):
        changes["cache_dir"] = args.cache_dir
    if getattr(args, "budget_mb", None) is not None:
        changes.update(budget_mb=args.budget_mb, hot_agents=None)
    if getattr(args, "disk_limit", None) is not None:
        changes["disk_limit_mb"] = args.disk_limit / 1e6
    if getattr(args, "write_budget", None) is not None:
        nbytes, window = args.write_budget
        changes["write_budget_mb_per_day"] = nbytes / 1e6 * 86_400 / window
    return msgspec.structs.replace(scenario, **changes) if changes else scenario


def demo_scenario() -> Scenario:
    """The first scenario of ``kvactor demo`` (the shipped ``demo.toml``)."""
    return shipped_scenario("demo")


def shared_json_path(json_path: str) -> str:
    """Where ``kvactor demo --json PATH`` writes the shared-document run's results."""
    path = Path(json_path)
    return str(path.with_name(f"{path.stem}-shared{path.suffix or '.json'}"))


def _print_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2, default=str))


def run_demo(args: argparse.Namespace) -> int:
    """``kvactor demo``: the built-in six-agent scenario, then many agents over one shared
    document (``shared_doc.toml``), on the default model. ``--budget-mb`` and ``--plot``
    apply to the first; ``--json PATH`` writes the second's results to PATH-shared.json."""
    if args.budget_mb is not None and args.budget_mb <= 0:
        print("kvactor demo: --budget-mb must be > 0", file=sys.stderr)
        return 2
    as_json = args.json == STDOUT
    out = sys.stderr if as_json else sys.stdout
    json_path = None if as_json else args.json
    started = time.perf_counter()
    first = _execute(_overrides(demo_scenario(), args), args, json_path, args.plot, out)
    if isinstance(first, int):
        return first
    # Its own budget; resume = false already, so --fresh changes nothing there.
    rest = argparse.Namespace(**{**vars(args), "budget_mb": None, "fresh": False})
    shared = _overrides(shipped_scenario("shared_doc"), rest)
    intro = (
        f"Shared prefixes: {len(shared.agents)} agents review one long design document "
        "(shared_doc.md, kvactor scenarios show shared_doc.md prints it), each from its own "
        "angle. The document is every agent's system prompt, prefilled once as a shared "
        "context: each agent's first turn shares that cache (one copy in memory, hard links "
        "on disk) instead of prefilling the document again."
    )
    print("", *textwrap.wrap(intro, WIDTH), "", sep="\n", file=out)
    second = _execute(shared, rest, shared_json_path(json_path) if json_path else None, None, out)
    if isinstance(second, int):
        return second
    wall = time.perf_counter() - started
    print(f"demo done in {wall:.0f} s", file=out)
    lines = [line for done in (first, second) for line in closing_lines(done.caches)]
    folders = [Path(done.caches.dir) for done in (first, second) if done.caches is not None]
    if folders and all(f.is_relative_to(default_cache_dir()) for f in folders):
        lines.append("every cache directory under the default root: kvactor inspect")
    if lines:
        print("", *lines, sep="\n", file=out)
    if as_json:
        fresh = bool(args.fresh)
        runs = [
            json_summary(first.results, first.caches, results_file=first.results_file, fresh=fresh),
            json_summary(second.results, second.caches, results_file=second.results_file),
        ]
        _print_json({"runs": runs, "wall_s": wall})
    return 0


def run_file(args: argparse.Namespace) -> int:
    """``kvactor run SCENARIO``: a scenario file, or a shipped scenario by name; exit code
    2 with a clear message for a bad file or an unknown name."""
    try:
        scenario = _overrides(resolve_scenario(args.scenario), args)
    except ScenarioError as exc:
        print(f"kvactor run: {exc}", file=sys.stderr)
        return 2
    as_json = args.json == STDOUT
    out = sys.stderr if as_json else sys.stdout
    json_path = args.json if args.json and not as_json else f"{scenario.name}-results.json"
    done = _execute(scenario, args, json_path, args.plot, out)
    if isinstance(done, int):
        return done
    lines = closing_lines(done.caches)
    if lines:
        print("", *lines, sep="\n", file=out)
    if as_json:
        summary = json_summary(
            done.results, done.caches, results_file=json_path, fresh=bool(args.fresh)
        )
        _print_json(summary)
    return 0
