"""The kvactor command line: the parser, and the commands that need no module of their own
(``demo`` and ``run``: ``_demo``; ``inspect``: ``_inspect``; ``export`` and ``import``:
``_carry``; ``scenarios``: ``_scenario_shipped``)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

__all__ = ("build_parser", "main")

DESCRIPTION = (
    "kvactor runs many LLM agents on one machine and keeps each agent's KV cache (its "
    "attention state) instead of recomputing it: in memory (hot), in files on disk (warm), "
    "or as text only (cold: prefilled again).\n\n"
    "Start with kvactor demo, then kvactor inspect to see the caches it left on disk."
)
CACHE_ROOT = "$KVACTOR_CACHE_DIR, else ~/.cache/kvactor/agents-cache"


DASHBOARD_PORT = 8470  # kvactor run --dashboard without a port


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(args)


def _run(args: argparse.Namespace) -> int:
    from ._demo import run_file

    return run_file(args)


def _scenarios(args: argparse.Namespace) -> int:
    from ..scenario import run_scenarios

    return run_scenarios(args)


def _inspect(args: argparse.Namespace) -> int:
    from ._inspect import run_inspect

    return run_inspect(args)


def _export(args: argparse.Namespace) -> int:
    from ._carry import run_export

    return run_export(args)


def _import(args: argparse.Namespace) -> int:
    from ._carry import run_import

    return run_import(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from ..actors.models import fetch_default_model

    if args.force and args.mlx_dir is None:
        print("kvactor fetch-model: --force goes with --mlx-dir", file=sys.stderr)
        return 2
    gguf = fetch_default_model()
    print(gguf)
    if args.mlx_dir is None:
        return 0
    from ..actors.errors import ModelExportError, ModelLoadError
    from ..actors.models import export_mlx_dir

    def say(message: str) -> None:
        print(f"kvactor: {message}", file=sys.stderr, flush=True)

    try:
        result = export_mlx_dir(gguf, args.mlx_dir, force=args.force, progress=say)
    except (ModelExportError, ModelLoadError) as exc:
        print(f"kvactor fetch-model: {exc}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


def _forget(args: argparse.Namespace) -> int:
    import os

    from ..actors.errors import CacheDirLocked, InvalidAgentId
    from ..actors.ids import check_agent_id
    from ..actors.warm import Forgotten, default_cache_dir, forget_cache, lock_cache_dir

    root = args.dir or default_cache_dir()
    agents = list(dict.fromkeys(args.agents))
    try:
        for agent in agents:
            check_agent_id(agent)
        done = {agent: Forgotten(agent=agent) for agent in agents}
        if os.path.isdir(root):  # else nothing to forget: do not create it to lock it
            with lock_cache_dir(root):
                for agent in agents:
                    done[agent] = forget_cache(root, agent)
    except InvalidAgentId as exc:
        print(f"kvactor forget: {exc}", file=sys.stderr)
        return 2
    except CacheDirLocked as exc:
        print(f"kvactor forget: {exc}", file=sys.stderr)
        return 3
    code = 0
    for agent, gone in done.items():
        if not gone.freed and not gone.kept:
            print(f"no warm cache for {agent!r} under {root}", file=sys.stderr)
            code = 1
            continue
        print(f"forgot {agent!r}: {gone.freed} bytes deleted from {root}")
        for kept in gone.kept:
            users = ", ".join(kept.users) or "another name"
            print(f"  kept {kept.file} ({kept.nbytes} bytes): still used by {users}")
    return code


def _gc(args: argparse.Namespace) -> int:
    import os

    from ..actors.errors import CacheDirLocked
    from ..actors.warm import collect, default_cache_dir, lock_cache_dir

    root = args.dir or default_cache_dir()
    if not os.path.isdir(root):
        print(f"nothing to collect: no cache directory {root}")
        return 0
    try:
        with lock_cache_dir(root):
            done = collect(root)
    except CacheDirLocked as exc:
        print(f"kvactor gc: {exc}", file=sys.stderr)
        return 3
    for path in done.removed:
        print(f"removed {path}")
    print(f"{len(done.removed)} unreferenced files removed, {done.freed} bytes freed from {root}")
    return 0


def _size(text: str) -> int:
    """Bytes from ``1048576``, ``512M``, ``2G`` (powers of 1024) or ``1.5GB``."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = body[-1:] if body[-1:] in units else ""
    try:
        value = float(body[: len(body) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive, not {text!r}")
    return int(value * units[unit])


def _write_budget(text: str) -> tuple[int, float]:
    """Bytes and the window they are counted over from ``20G/day``, ``2G/hour`` or ``20G``
    (per day)."""
    size, _, per = text.partition("/")
    windows = {"": 86_400.0, "day": 86_400.0, "d": 86_400.0, "hour": 3_600.0, "h": 3_600.0}
    window = windows.get(per.strip().lower())
    if window is None:
        raise argparse.ArgumentTypeError(f"not a write budget: {text!r} (try 20G/day or 2G/hour)")
    return _size(size), window


def _duration(text: str) -> float:
    """Seconds from ``3600``, ``90s``, ``30m``, ``12h`` or ``7d``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body = text.strip().lower()
    unit = body[-1:] if body[-1:] in units else "s"
    try:
        value = float(body.removesuffix(unit))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (try 3600, 30m or 12h)"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the duration must be positive, not {text!r}")
    return value * units[unit]


def _memory_limit(text: str) -> int:
    """``_size``, or 0 for ``none`` (no limit over the whole: only the hot budget)."""
    return 0 if text.strip().lower() == "none" else _size(text)


_CODECS = ("default", "q8", "fp16")  # kvactor serve --codec (kvactor.server._cli.CODECS)


def _serve(args: argparse.Namespace) -> int:
    try:
        from ..server import run_serve
    except ImportError as exc:
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 2
    return run_serve(args)


# ----------------------------------------------------------------------------- parser
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvactor")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _wrap(text: str) -> str:
    return "\n\n".join(textwrap.fill(p, 80) for p in text.split("\n\n"))


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
    example: str,
) -> argparse.ArgumentParser:
    """A subcommand whose help is ``description`` in plain paragraphs and ends with one
    example."""
    return sub.add_parser(
        name,
        help=help,
        description=_wrap(description),
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _json_option(parser: argparse.ArgumentParser, path_means: str) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help=f"alone: print a JSON summary on stdout (the live view goes to stderr); "
        f"with PATH: {path_means}",
    )


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = _command(
        sub,
        "demo",
        help="run the built-in demo: six agents under a tight memory budget, then ten "
        "agents sharing one long document",
        description="Run two shipped scenarios on the default model. First six agents of "
        "a small team work in three phases under a memory budget that pushes their caches "
        "out to disk and back (kvactor scenarios show demo). Run it again: the new process "
        "resumes every agent from disk; once the conversations pass 1024 tokens the next "
        "run starts fresh. Then ten agents review one long document that is every agent's "
        "system prompt: it is prefilled once and every agent shares that cache "
        "(kvactor scenarios show shared_doc).\n\n"
        "It ends with the commands that show and delete the caches it made.",
        example="kvactor demo",
    )
    demo.add_argument("--fresh", action="store_true", help="forget earlier runs' caches first")
    demo.add_argument("--model", help="a .gguf file or model directory (or tiny)")
    demo.add_argument(
        "--cache-dir",
        help="warm tier folder, or none (default: <cache root>/scenarios/<scenario>/<model>)",
    )
    demo.add_argument(
        "--budget-mb",
        type=float,
        help="hot budget in MB of the first scenario (default: sized from the model)",
    )
    _json_option(demo, "write the full results there (the shared document's to PATH-shared.json)")
    demo.add_argument(
        "--plot", metavar="PNG", help="draw TTFT per turn of the first scenario (kvactor[plot])"
    )
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    demo.set_defaults(func=_demo)


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = _command(
        sub,
        "run",
        help="run a scenario (agents, phases, budget): a shipped one by name or a TOML file",
        description="Run SCENARIO, the name of a shipped scenario (kvactor scenarios lists "
        "them) or a TOML file, and write its results as JSON (default: ./NAME-results.json). "
        "A bad file exits with code 2 and names the field. To write your own, start from a "
        "shipped one: kvactor scenarios show demo > mine.toml.\n\n"
        "It ends with the commands that show and delete the caches it made.",
        example="kvactor run code_review --json",
    )
    run.add_argument("scenario", metavar="SCENARIO", help="a shipped scenario's name or a file")
    _json_option(run, "write the full results there (default: ./NAME-results.json)")
    run.add_argument("--plot", metavar="PNG", help="draw TTFT per turn (kvactor[plot])")
    run.add_argument("--fresh", action="store_true", help="forget earlier runs' caches first")
    run.add_argument("--model", help="override the scenario's model (a path, or tiny)")
    run.add_argument(
        "--disk-limit",
        type=_size,
        metavar="SIZE",
        help="override the scenario's disk limit on its warm tier (with K, M, G)",
    )
    run.add_argument(
        "--write-budget",
        type=_write_budget,
        metavar="SIZE[/day|/hour]",
        help="override the scenario's SSD write budget: write-back (see serve --write-budget)",
    )
    run.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    run.add_argument(
        "--dashboard",
        nargs="?",
        type=int,
        const=DASHBOARD_PORT,
        metavar="PORT",
        help=f"watch the run live at http://127.0.0.1:PORT/dashboard (default {DASHBOARD_PORT}; "
        "0: a free port); after the run it shows the final state until Ctrl-C",
    )
    run.set_defaults(func=_run)


def _add_scenarios(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    scenarios = _command(
        sub,
        "scenarios",
        help="list the shipped scenarios; show NAME prints one to start your own from",
        description="List the scenarios that come with kvactor, one line each. "
        "kvactor scenarios show NAME prints one (or a document one reads, such as "
        "shared_doc.md) to copy into a file of your own; kvactor run NAME runs it.",
        example="kvactor scenarios show demo > mine.toml",
    )
    actions = scenarios.add_subparsers(dest="action", metavar="show NAME")
    show = actions.add_parser("show", help="print a shipped scenario's file")
    show.add_argument("name", metavar="NAME")
    scenarios.set_defaults(func=_scenarios, action=None)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = _command(
        sub,
        "serve",
        help="an OpenAI- and Anthropic-compatible HTTP server; every conversation is an agent",
        description="Serve /v1/chat/completions, /v1/completions, /v1/messages, /v1/models, "
        "/v1/agents, /metrics and /health (needs the kvactor[server] extra). A request names "
        "its agent with the X-Agent-Id header (else OpenAI's user field, else Anthropic's "
        "metadata.user_id): each agent keeps its cache between requests.\n\n"
        "With API keys (--api-key, --api-key-file, $KVACTOR_API_KEYS: entries KEY or "
        "NAME:KEY, a line each in a file, comma-separated in the variable) every request "
        "needs one, and each key is a tenant that sees only its own agents; --admin-key "
        "sees all and reads /metrics. Without keys anyone who reaches the port sees "
        "everything. Without --budget the hot tier gets a quarter of the machine's memory, "
        "at most 8 GiB.",
        example="kvactor serve --port 8000 --api-key-file keys.txt",
    )
    serve.add_argument(
        "model", nargs="?", help="model path (default: the default model; tiny: a test model)"
    )
    serve.add_argument("--cache-dir", type=Path, help=f"warm tier folder (default: {CACHE_ROOT})")
    serve.add_argument("--no-cache-dir", action="store_true", help="no warm tier")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: a free port")
    serve.add_argument("--attention", choices=["auto", "quantized", "dequantized"], default="auto")
    serve.add_argument(
        "--codec",
        choices=list(_CODECS),
        default="default",
        help="how caches are stored: default (keys 5-bit, values 3-bit), q8 (8-bit), "
        "fp16 (16-bit floats, 3.6x the bytes: closest to an unquantized cache)",
    )
    serve.add_argument("--model-id", help="the id /v1/models lists (default: the model's name)")
    serve.add_argument(
        "--strict-model",
        action="store_true",
        help="a request naming another model than --model-id (or 'default') is a 404 "
        "(without it, any name is the one model served)",
    )
    serve.add_argument(
        "--model",
        dest="models",
        action="append",
        metavar="[NAME=]PATH",
        help="a model to serve; NAME=PATH, repeated, serves several (requests choose by "
        "'model'; /v1/models lists them); PATH alone: as the positional model",
    )
    serve.add_argument(
        "--tool-wait-s",
        type=float,
        metavar="SECONDS",
        help="how long a turn that ended in tool calls keeps its agent's cache hot for "
        "their results (default: 30)",
    )
    serve.add_argument(
        "--deterministic",
        action="store_true",
        help="greedy answers that do not depend on which requests run together "
        "(batch-invariant decode, ~10-15%% slower here)",
    )
    _add_serve_limits(serve.add_argument_group("limits"))
    _add_serve_cluster(serve.add_argument_group("a cluster (needs the kvactor[ray] extra)"))
    keys = serve.add_argument_group("keys (each key a tenant)")
    keys.add_argument("--api-key", action="append", metavar="KEY", help="KEY or NAME:KEY")
    keys.add_argument("--api-key-file", action="append", metavar="PATH", help="a key a line")
    keys.add_argument("--admin-key", action="append", metavar="KEY", help="sees every agent")
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, how long in-flight turns may go on (default: 10)",
    )
    serve.add_argument(
        "--no-share-prefixes",
        action="store_true",
        help="agents never share cached prefixes (even within a tenant)",
    )
    serve.add_argument(
        "--json", action="store_true", help="print a JSON line on stdout once it listens"
    )
    serve.set_defaults(func=_serve)


def _add_serve_cluster(cluster: argparse._ArgumentGroup) -> None:
    """Serving engine hosts on a Ray cluster: where, how many per node, replicas."""
    cluster.add_argument(
        "--cluster",
        metavar="auto|local|ADDRESS",
        help="run the engines as hosts of a Ray cluster: a running one (auto: else a local "
        "one on 127.0.0.1, started and stopped with the server; local: always a new one; "
        "ADDRESS or ray://HOST:PORT); new conversations go to the host that holds their "
        "prompt's prefix",
    )
    cluster.add_argument(
        "--hosts",
        type=int,
        default=1,
        metavar="N",
        help="engine hosts per node of the cluster (default: 1); each gets its share of the "
        "node's memory and of the default hot budget",
    )
    cluster.add_argument(
        "--replicas",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: a second copy of every agent's warm cache on another host, updated after "
        "each turn, so that a host lost for good loses no cache (default: 1)",
    )


def _add_serve_limits(limits: argparse._ArgumentGroup) -> None:
    """What the server may hold: memory, the hot budget, the disk, requests in flight."""
    limits.add_argument(
        "--budget",
        type=_size,
        help="hot budget in bytes, or with K, M, G (default: 1/4 of memory, at most 8G)",
    )
    limits.add_argument("--budget-mb", type=float, help=argparse.SUPPRESS)
    limits.add_argument(
        "--memory-limit",
        type=_memory_limit,
        help="bytes the session may hold for models, caches and MLX, with K, M, G "
        "(default: 3/4 of memory; 'none': one model bounded by its hot budget only)",
    )
    limits.add_argument(
        "--disk-limit",
        type=_memory_limit,
        help="bytes the warm tier may hold on disk, with K, M, G; past it agents go cold "
        "(their conversation kept) by the eviction policy (default: the smaller of 30 GiB "
        "and a quarter of the free disk; 'none': no limit)",
    )
    limits.add_argument(
        "--tenant-disk-quota",
        type=_size,
        metavar="SIZE",
        help="bytes each key's tenant may hold in the warm tier, with K, M, G; a tenant over "
        "it makes its own agents cold, never another's (default: only the disk limit)",
    )
    limits.add_argument(
        "--write-budget",
        type=_write_budget,
        metavar="SIZE[/day|/hour]",
        help="bytes the warm tier may write to the SSD per day or hour (20G/day, 2G/hour): "
        "caches are written when they leave memory instead of at every turn, while the "
        "budget has room (else they go cold, their conversation kept); a crash loses the "
        "caches of turns since the last write, not their text (default: every turn written)",
    )
    limits.add_argument(
        "--agent-ttl",
        type=_duration,
        metavar="DURATION",
        help="an agent unused this long (seconds, or 30m, 12h, 7d) goes cold: its "
        "conversation kept, its warm cache removed (default: only the disk limit)",
    )
    limits.add_argument(
        "--max-pending", type=int, default=64, help="requests in flight before 429s"
    )
    limits.add_argument(
        "--max-anonymous", type=int, default=16, help="id-less conversations kept per tenant"
    )
    limits.add_argument(
        "--max-import-bytes",
        type=_size,
        default=16 << 30,
        metavar="SIZE",
        help="the largest agent file PUT /v1/agents/ID/cache takes, with K, M, G (default: 16G)",
    )


def _add_fetch_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fetch = _command(
        sub,
        "fetch-model",
        help="download and verify the default model now (else on first use)",
        description="Download and verify the default model (a GGUF file) and print its path. "
        "With --mlx-dir, also write it as an mlx-lm model folder (config.json, float32 "
        "model.safetensors, tokenizer files) for tools that load only such folders "
        "(mlx_lm.load, mlx-lm's server), and print that path too. Exits with 1 when the "
        "export is refused or fails.",
        example="kvactor fetch-model --mlx-dir ./smollm2",
    )
    fetch.add_argument(
        "--mlx-dir",
        metavar="DIR",
        type=Path,
        help="write the model to DIR in mlx-lm's format (kept if already exported there)",
    )
    fetch.add_argument(
        "--force",
        action="store_true",
        help="with --mlx-dir: export again, even into a non-empty DIR that is not an export "
        "(its other files are left alone)",
    )
    fetch.set_defaults(func=_fetch_model)


def _add_cache_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = _command(
        sub,
        "inspect",
        help="list the warm caches on disk: agents, tokens, size, model, codec, age",
        description="Without DIR, find every cache directory under the default root "
        f"({CACHE_ROOT}), the scenarios' folders included, and show one table per "
        "directory. With DIR, show that directory's caches.",
        example="kvactor inspect",
    )
    inspect.add_argument("dir", nargs="?", metavar="DIR", help="one cache directory")
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")
    inspect.add_argument(
        "--verbose", action="store_true", help="whole fingerprints and codec descriptions"
    )
    inspect.set_defaults(func=_inspect)
    forget = _command(
        sub,
        "forget",
        help="delete every byte of some agents' warm caches",
        description="Delete every byte of each named agent's warm cache (files it shares "
        "with another agent's cache stay until that one goes too). Exits with 1 when one "
        "has none, 2 for a bad agent id, 3 while a session uses the cache directory.",
        example="kvactor forget planner coder --dir ./warm",
    )
    forget.add_argument("agents", nargs="+", metavar="AGENT")
    forget.add_argument("--dir", help=f"cache directory (default: {CACHE_ROOT})")
    forget.set_defaults(func=_forget)
    gc = _command(
        sub,
        "gc",
        help="remove cache files no agent uses (left by killed processes)",
        description="Remove the segment and temporary files that no agent's manifest names "
        "(a process killed mid-write, mid-fork or mid-share leaves them; a session also does "
        "this when it opens). Safe to run again. Exits with 3 while a session uses the "
        "directory.",
        example="kvactor gc --dir ./warm",
    )
    gc.add_argument("--dir", help=f"cache directory (default: {CACHE_ROOT})")
    gc.set_defaults(func=_gc)


def _add_carry_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = _command(
        sub,
        "export",
        help="write an agent's warm cache as one portable file (to move it elsewhere)",
        description="Write AGENT's warm cache (its conversation and every cache file, "
        "checksummed, with the model, codec and format it was made with) as one file that "
        "kvactor import, Session.import_agent or a server's PUT /v1/agents/ID/cache takes "
        "on another machine. Loads no model, and works while a session uses the cache "
        "directory. Without -o it writes AGENT.kvagent here, or to stdout when stdout is "
        "not a terminal. Exits with 2 for a bad id, an agent without a warm cache or a "
        "cache that fails its checks.",
        example="kvactor export planner -o planner.kvagent --cache-dir ./warm",
    )
    export.add_argument("agent", metavar="AGENT")
    export.add_argument("-o", "--output", metavar="FILE", help="where to write it; - for stdout")
    export.add_argument("--cache-dir", type=Path, help=f"cache directory (default: {CACHE_ROOT})")
    export.set_defaults(func=_export)
    imp = _command(
        sub,
        "import",
        help="import an agent's portable file (kvactor export) into a cache directory",
        description="Verify FILE (- for stdin) as a warm load would and move it into the "
        "cache directory, where the agent resumes warm. Needs the model the file was made "
        "with (--model; default: the default model). Exits with 2 when the file is refused "
        "(another model, truncated or altered, a name taken: --replace or --as), 3 while a "
        "session uses the directory: import through that server's PUT /v1/agents/ID/cache "
        "instead.",
        example="kvactor import planner.kvagent --as planner2 --cache-dir ./warm",
    )
    imp.add_argument("file", metavar="FILE", help="an agent file, or - for stdin")
    imp.add_argument("--as", dest="name", metavar="NAME", help="import under this name")
    imp.add_argument("--replace", action="store_true", help="replace an agent of that name")
    imp.add_argument("--cache-dir", type=Path, help=f"cache directory (default: {CACHE_ROOT})")
    imp.add_argument(
        "--model", help="model path (default: the default model; tiny: the test model)"
    )
    imp.set_defaults(func=_import)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvactor",
        description=_wrap(DESCRIPTION),
        epilog="example:\n  kvactor demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvactor {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_run, _add_scenarios, _add_serve, _add_fetch_model):
        add(sub)
    _add_cache_commands(sub)
    _add_carry_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (kvactor inspect | head): no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
