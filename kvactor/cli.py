"""The ``kvactor`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ("main",)


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(args)


def _run(args: argparse.Namespace) -> int:
    from ._demo import run_file

    return run_file(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from .actors.model import fetch_default_model

    if args.force and args.mlx_dir is None:
        print("kvactor fetch-model: --force goes with --mlx-dir", file=sys.stderr)
        return 2
    gguf = fetch_default_model()
    print(gguf)
    if args.mlx_dir is None:
        return 0
    from .actors._export import export_mlx_dir
    from .actors.errors import ModelExportError, ModelLoadError

    def say(message: str) -> None:
        print(f"kvactor: {message}", file=sys.stderr, flush=True)

    try:
        result = export_mlx_dir(gguf, args.mlx_dir, force=args.force, progress=say)
    except (ModelExportError, ModelLoadError) as exc:
        print(f"kvactor fetch-model: {exc}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .actors.errors import KvactorError
    from .actors.store import format_table, inspect_rows

    try:
        rows = inspect_rows(args.dir)
    except (KvactorError, OSError) as exc:  # agents/ a symlink, unreadable...
        print(f"kvactor inspect: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


def _forget(args: argparse.Namespace) -> int:
    import os

    from .actors.errors import CacheDirLocked, InvalidAgentId
    from .actors.protocol import check_agent_id
    from .actors.store import Forgotten, default_cache_dir, forget_cache, lock_cache_dir

    root = args.dir or default_cache_dir()
    try:
        check_agent_id(args.agent)
        done = Forgotten(agent=args.agent)
        if os.path.isdir(root):  # else nothing to forget: do not create it to lock it
            with lock_cache_dir(root):
                done = forget_cache(root, args.agent)
    except InvalidAgentId as exc:
        print(f"kvactor forget: {exc}", file=sys.stderr)
        return 2
    except CacheDirLocked as exc:
        print(f"kvactor forget: {exc}", file=sys.stderr)
        return 3
    if not done.freed and not done.kept:
        print(f"no warm cache for {args.agent!r} under {root}", file=sys.stderr)
        return 1
    print(f"forgot {args.agent!r}: {done.freed} bytes deleted from {root}")
    for kept in done.kept:
        users = ", ".join(kept.users) or "another name"
        print(f"  kept {kept.file} ({kept.nbytes} bytes): still used by {users}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    import os

    from .actors.errors import CacheDirLocked
    from .actors.store import collect, default_cache_dir, lock_cache_dir

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


# The stored forms `kvactor serve --codec` offers: DEFAULT_CODEC, else KVCodec(bits=...) (MLX
# is not imported to parse arguments).
_CODECS: dict[str, int | None] = {"default": None, "q8": 8, "fp16": 16}


def _serve(args: argparse.Namespace) -> int:
    try:
        import anyio

        from .server import serve
    except ImportError as exc:
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 2
    from .actors.errors import KvactorError
    from .actors.store import default_cache_dir

    cache_dir = None if args.no_cache_dir else (args.cache_dir or default_cache_dir())
    options = {"cache_dir": cache_dir, "attention": args.attention}
    bits = _CODECS[args.codec]
    if bits is not None:
        from .kernels.qcodec import KVCodec

        options["codec"] = KVCodec(bits=bits)
    if args.budget is not None:
        options["budget_bytes"] = args.budget
    elif args.budget_mb is not None:
        options["budget_bytes"] = int(args.budget_mb * 1e6)

    try:
        anyio.run(
            lambda: serve(
                args.model,
                host=args.host,
                port=args.port,
                model_id=args.model_id,
                max_pending=args.max_pending,
                **options,
            )
        )
    except KeyboardInterrupt:
        pass
    except (KvactorError, OSError) as exc:
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvactor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="six agents, three phases, a hot budget that forces demotions; then ten agents "
        "over one shared document; run it twice",
        description="Run the built-in scenarios on the default model: six agents under a hot "
        "budget that forces demotions (kvactor/scenarios/demo.toml; a second run resumes "
        "every agent from disk, and once the conversations pass 1024 tokens the next run "
        "starts fresh), then ten agents over one long shared document "
        "(kvactor/scenarios/shared_doc.toml), with what sharing its cache saved.",
    )
    demo.add_argument("--fresh", action="store_true", help="forget earlier runs' caches first")
    demo.add_argument("--model", help="a .gguf file or model directory (or 'tiny')")
    demo.add_argument(
        "--cache-dir",
        help="warm tier folder, or 'none' (default: <cache dir>/scenarios/demo/<model>)",
    )
    demo.add_argument(
        "--budget-mb",
        type=float,
        help="hot budget in MB of the first scenario (default: sized from the model)",
    )
    demo.add_argument(
        "--json",
        metavar="PATH",
        help="write the results as JSON (the shared document's to PATH-shared.json)",
    )
    demo.add_argument(
        "--plot", metavar="PNG", help="draw TTFT per turn of the first scenario (kvactor[plot])"
    )
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    demo.set_defaults(func=_demo)
    run = sub.add_parser(
        "run",
        help="run a scenario file (agents, phases, budget...) and write JSON results",
        description="Run SCENARIO.toml (see kvactor/scenarios/ for examples) and write its "
        "results as JSON. A bad file exits with code 2 and names the field.",
    )
    run.add_argument("scenario", metavar="SCENARIO.toml")
    run.add_argument("--json", metavar="PATH", help="results file (default: ./<name>-results.json)")
    run.add_argument("--plot", metavar="PNG", help="draw TTFT per turn (kvactor[plot])")
    run.add_argument("--fresh", action="store_true", help="forget earlier runs' caches first")
    run.add_argument("--model", help="override the scenario's model (a path, or 'tiny')")
    run.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    run.set_defaults(func=_run)
    serve = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server; every conversation is an agent",
        description="Serve /v1/chat/completions, /v1/completions, /v1/messages, /v1/models, "
        "/v1/agents, /metrics and /health (needs the kvactor[server] extra). A request "
        "names its agent with the X-Agent-Id header (else OpenAI's user, else Anthropic's "
        "metadata.user_id).",
    )
    serve.add_argument("model", nargs="?", help="model path (default: the default model)")
    serve.add_argument("--cache-dir", type=Path, help="warm tier (default: the user cache)")
    serve.add_argument("--no-cache-dir", action="store_true", help="no warm tier")
    serve.add_argument(
        "--budget", type=_size, help="hot budget in bytes, or with K, M, G (default: none)"
    )
    serve.add_argument("--budget-mb", type=float, help=argparse.SUPPRESS)
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
    serve.add_argument("--model-id", help="the id clients name (default: the model's name)")
    serve.add_argument("--max-pending", type=int, default=64, help="requests in flight before 429s")
    serve.set_defaults(func=_serve)
    fetch = sub.add_parser(
        "fetch-model",
        help="download and verify the default model now (else on first use)",
        description="Download and verify the default model (a GGUF file) and print its path. "
        "With --mlx-dir, also write it as an mlx-lm model directory (config.json, float32 "
        "model.safetensors, tokenizer files) for tools that load only such folders "
        "(mlx_lm.load, mlx-lm's server), and print that path too. Exits with 1 when the "
        "export is refused or fails.",
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
    inspect = sub.add_parser("inspect", help="list the warm caches: agents, tokens, bytes, model")
    inspect.add_argument(
        "dir",
        nargs="?",
        help="cache directory (default: $KVACTOR_CACHE_DIR or ~/.cache/kvactor/agents-cache)",
    )
    inspect.set_defaults(func=_inspect)
    forget = sub.add_parser(
        "forget",
        help="delete every byte of one agent's warm cache",
        description="Delete every byte of one agent's warm cache. Exits with 1 when it has "
        "none, 2 for a bad agent id, 3 while a session uses the cache directory.",
    )
    forget.add_argument("agent")
    forget.add_argument("--dir", help="cache directory (default as for inspect)")
    forget.set_defaults(func=_forget)
    gc = sub.add_parser(
        "gc",
        help="remove cache files no manifest names (left by killed processes)",
        description="Remove the segment and temporary files that no agent's manifest names "
        "(a process killed mid-write, mid-fork or mid-share leaves them; a session also does "
        "this when it opens). Idempotent. Exits with 3 while a session uses the directory.",
    )
    gc.add_argument("--dir", help="cache directory (default as for inspect)")
    gc.set_defaults(func=_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
