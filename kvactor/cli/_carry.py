"""``kvactor export`` and ``kvactor import``: an agent's warm cache as one portable file
(docs/moving-agents.md) out of a cache directory, and into one.

Export loads no model: it reads one committed state of the agent's folder and writes
nothing there, so it works beside a session that uses the directory (it takes no lock).
A file is written through a temporary file renamed at the end: a path never holds a
partial export. Import opens a session on the directory (it needs the model, to check the
file was made by it) and imports the file; while another session holds the directory (a
running ``kvactor serve``), import through that server (``PUT /v1/agents/{id}/cache``).

Exit codes: 0 done; 2 refused (a bad id, no such agent or file, a file refused with its
reason, a name taken); 3 the directory is in use (import only); 1 anything else that
fails (the model cannot load, the disk cannot be written)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio

from ..actors.errors import (
    AgentExists,
    CacheDirLocked,
    CacheRejected,
    InvalidAgentId,
    StoreWriteError,
    UnknownAgent,
)
from ..actors.ids import check_agent_id
from ..actors.session import kvactor_version, write_pieces
from ..actors.warm import PortableHeader, default_cache_dir, portable_chunks
from ..runtime import KvactorError

__all__ = ("SUFFIX", "run_export", "run_import")

SUFFIX = ".kvagent"


def _say(command: str, message: str) -> None:
    print(f"kvactor {command}: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ export
def _destination(output: str | None, agent: str, stdout: IO[str]) -> Path | None:
    """Where the export goes: None for stdout (``-o -``, or no ``-o`` when stdout is not
    a terminal), else the path (default: ``<agent>.kvagent`` here)."""
    if output == "-" or (output is None and not stdout.isatty()):
        return None
    return Path(output) if output is not None else Path(agent + SUFFIX)


def export_agent(root: str | os.PathLike[str], agent: str, dest: Path | None) -> PortableHeader:
    """Write agent ``agent``'s portable file from cache directory ``root`` to ``dest``
    (None: stdout); returns its header. Raises InvalidAgentId, UnknownAgent (no warm
    cache), CacheRejected (a file of it fails a check; before any byte is written when
    its manifest or sizes do), OSError."""
    check_agent_id(agent)
    if not os.path.isdir(root):
        raise UnknownAgent(f"no cache directory {root}")
    seen: list[PortableHeader] = []
    pieces = portable_chunks(root, agent, version=kvactor_version(), sizes=seen.append)
    first = next(pieces)  # its refusals come before anything is written

    def every() -> Iterator[bytes | memoryview]:
        yield first
        yield from pieces

    write_pieces(every(), sys.stdout.buffer if dest is None else dest)
    return seen[0]


def run_export(args: argparse.Namespace) -> int:
    """``kvactor export AGENT [-o FILE] [--cache-dir DIR]``."""
    root = args.cache_dir or default_cache_dir()
    dest = _destination(args.output, args.agent, sys.stdout)
    try:
        header = export_agent(root, args.agent, dest)
    except (InvalidAgentId, UnknownAgent) as exc:
        _say("export", str(exc))
        return 2
    except CacheRejected as exc:
        _say("export", f"agent {args.agent!r} cannot be exported: {exc.reason}")
        return 2
    except OSError as exc:
        _say("export", f"cannot write {dest}: {exc}")
        return 1
    where = "stdout" if dest is None else str(dest)
    _say(
        "export",
        f"exported {args.agent!r}: {header.tokens} tokens, {header.nbytes} bytes of cache "
        f"from {root} to {where}",
    )
    return 0


# ------------------------------------------------------------------------------ import
def model_spec(spec: str | None) -> Any:
    """The model ``import`` opens: None (the default model), ``tiny`` (the random test
    model ``kvactor serve tiny`` serves) or a path."""
    if spec == "tiny":
        from ..actors.models import make_tiny_model

        return functools.partial(make_tiny_model, 0, head_dim=64)
    return spec


async def import_agent(
    model: Any,
    root: str | os.PathLike[str],
    src: Any,
    name: str | None = None,
    *,
    replace: bool = False,
) -> tuple[str, int, int]:
    """Import the portable file ``src`` (a path or a binary file) into cache directory
    ``root`` through a session on ``model``; returns the agent's name, tokens and bytes of
    cache. Raises what ``kvactor.open`` and ``Session.import_agent`` raise."""
    from ..actors.opening import open as open_session

    async with open_session(model, cache_dir=root) as kv:
        agent = await kv.import_agent(src, name, replace=replace)
        warm = [w for w in await kv.warm_agents() if w.agent == agent.name]
    return agent.name, (warm[0].tokens if warm else 0), (warm[0].nbytes if warm else 0)


def _refusal(exc: Exception, args: argparse.Namespace) -> str:
    """What ``kvactor import`` says of a refused import."""
    if isinstance(exc, CacheRejected):
        return f"the file is refused: {exc.reason}"
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {args.file}"
    if isinstance(exc, AgentExists):
        name = args.name or "the agent"
        return f"{exc}: give --replace to replace {name}, or --as NAME to import it as another"
    return str(exc)


def run_import(args: argparse.Namespace) -> int:
    """``kvactor import FILE [--as NAME] [--replace] [--cache-dir DIR] [--model M]``."""
    root = args.cache_dir or default_cache_dir()
    src = sys.stdin.buffer if args.file == "-" else Path(args.file)
    run = functools.partial(
        import_agent, model_spec(args.model), root, src, args.name, replace=args.replace
    )
    try:
        name, tokens, nbytes = anyio.run(run)
    except CacheDirLocked as exc:
        _say(
            "import",
            f"{exc}. A running server imports through its own route instead: "
            "PUT /v1/agents/ID/cache with the file as the body",
        )
        return 3
    except (CacheRejected, StoreWriteError, InvalidAgentId, FileNotFoundError, ValueError) as exc:
        _say("import", _refusal(exc, args))
        return 2
    except (KvactorError, OSError) as exc:
        _say("import", str(exc))
        return 1
    source = "stdin" if args.file == "-" else args.file
    _say(
        "import",
        f"imported {name!r}: {tokens} tokens, {nbytes} bytes of cache from {source} into {root}",
    )
    return 0
