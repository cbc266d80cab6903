"""``kvactor inspect``: the warm caches on disk, one table per cache directory.

Without a directory it finds every cache directory under the default root (a folder
holding ``agents/`` or ``hosts/``: the root itself, and the scenarios' folders such as
``<root>/scenarios/demo/default``). The model shows by name where a cache directory's
``models.json`` knows it (``kvactor run`` and ``kvactor demo`` record the model they ran;
the manifests hold only its fingerprint), the codec in a short form (``K5/V3 g64 +rot
+4 sinks``) derived from the description every manifest stores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..actors.engine import read_limit
from ..actors.enums import Tier
from ..actors.warm import (
    CacheIdentity,
    contained,
    default_cache_dir,
    disk_footprint,
    list_agents,
    read_disk_limit,
    read_written,
)
from ..runtime import KvactorError
from ..text import age, printable, size, table

__all__ = (
    "MODEL_NAMES",
    "cache_dirs",
    "codec_short",
    "format_table",
    "inspect_rows",
    "model_names",
    "printable",
    "remember_model",
    "run_inspect",
)

MODEL_NAMES = "models.json"  # in a cache directory: {fingerprint: model name}
_DEPTH = 4  # how deep under the root cache directories are looked for
_NOT_CACHE_DIRS = frozenset({"agents", "hosts", "rejected"})


# ----------------------------------------------------------------------- model names
def model_names(root: str | os.PathLike[str]) -> dict[str, str]:
    """The model names recorded in ``<root>/models.json`` by fingerprint ({} if none or
    unreadable: names are a courtesy, the fingerprints decide)."""
    try:
        with open(Path(root) / MODEL_NAMES, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}


def remember_model(root: str | os.PathLike[str], fingerprint: str, name: str) -> None:
    """Record that ``fingerprint`` is the model ``name`` in ``<root>/models.json`` (replaced
    atomically), for ``inspect``. Does nothing when the folder cannot be written."""
    names = model_names(root)
    if names.get(fingerprint) == name:
        return
    names[fingerprint] = name
    path = Path(root) / MODEL_NAMES
    temporary = path.with_name(f".{MODEL_NAMES}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(names, indent=1, sort_keys=True) + "\n", "utf-8")
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- codecs
def codec_short(description: Mapping[str, object]) -> str:
    """A codec description (``KVCodec.describe``) in a few characters: ``Q4 g64``,
    ``K5/V3 g64 +rot +4 sinks``, ``fp16``. A description of another form: its entries."""
    d = dict(description)
    bits, group = d.get("bits"), d.get("group_size")
    if d.get("format") != "kvactor-kv" or not isinstance(bits, int):
        return ",".join(f"{k}={v}" for k, v in sorted(d.items()))
    key_bits = d["key_bits"] if isinstance(d.get("key_bits"), int) else bits
    key_group = d.get("key_group_size") or group
    if bits == key_bits:
        out = "fp16" if bits == 16 else f"Q{bits} g{group}"
    else:  # a group size only for the quantized sides, once when they agree
        groups = {g for b, g in ((key_bits, key_group), (bits, group)) if b != 16}
        if len(groups) == 1:
            out = f"K{key_bits}/V{bits} g{groups.pop()}"
        else:
            out = f"K{key_bits} g{key_group}/V{bits} g{group}"
    if d.get("rotate"):
        out += " +rot"
    sinks = d.get("sink_tokens")
    if isinstance(sinks, int) and sinks:
        out += f" +{sinks} sink" + ("s" if sinks > 1 else "")
    return out


# ------------------------------------------------------------------------------- rows
def inspect_rows(
    root: str | os.PathLike[str] | None = None, identity: CacheIdentity | None = None
) -> list[dict[str, Any]]:
    """One row per agent folder: agent, host, tier, tokens, bytes, model (fingerprint,
    shortened), fingerprint (whole), model_name ("" when unknown: see ``model_names``),
    codec (every entry of its description), codec_short (``codec_short``),
    codec_description, updated (unix time), status ("ok" or "rejected") and reason.

    ``host`` is "" for the root's own agents; a cluster's cache directory
    (``open(cluster=...)``) adds the agents of each engine host that ran on this
    machine, under ``<root>/hosts/<host>``. Given ``identity``, caches of another model or
    codec show as rejected. Raises UnsafeCachePath when ``agents/`` or ``hosts/`` (or a
    host's folder) is a symlink, OSError when one is unreadable."""
    root = default_cache_dir() if root is None else root
    places = [("", Path(root))]
    hosts = contained(root, "hosts")
    if hosts.is_dir():
        places += [(h, contained(root, "hosts", h)) for h in sorted(os.listdir(hosts))]
    names = model_names(root)
    rows = []
    for host, folder in places:
        if not folder.is_dir():
            continue
        known = {**names, **model_names(folder)} if host else names
        for info in list_agents(folder, identity):
            rows.append(
                {
                    "agent": info.agent,
                    "host": host,
                    "tier": Tier.WARM,
                    "tokens": info.tokens,
                    "bytes": info.nbytes,
                    "model": info.model_fingerprint[:12],
                    "fingerprint": info.model_fingerprint,
                    "model_name": known.get(info.model_fingerprint, ""),
                    "codec": ",".join(f"{k}={v}" for k, v in sorted(info.codec.items())),
                    "codec_short": codec_short(info.codec) if info.codec else "",
                    "codec_description": dict(info.codec),
                    "updated": info.updated,
                    "status": "ok" if info.rejected is None else "rejected",
                    "reason": info.rejected or "",
                }
            )
    return rows


def _model_cell(row: Mapping[str, Any], verbose: bool) -> str:
    fingerprint = str(row.get("fingerprint") or row.get("model") or "")
    name = str(row.get("model_name") or "")
    short = fingerprint if verbose else fingerprint[: 8 if name else 12]
    if not fingerprint:
        return "-"
    return printable(f"{name} ({short})" if name else short)


def format_table(rows: Sequence[Mapping[str, Any]], *, verbose: bool = False) -> str:
    """``inspect_rows`` as an aligned text table (one line saying so when empty), with a
    HOST column when some row has a host; names from disk are escaped (``printable``).
    ``verbose``: whole fingerprints and every entry of the codec's description."""
    if not rows:
        return "no warm caches"
    hosts = any(row.get("host") for row in rows)
    head = ("AGENT", "TIER", "TOKENS", "SIZE", "MODEL", "CODEC", "UPDATED", "STATUS")
    body = []
    for row in rows:
        status = row["status"] if not row.get("reason") else f"{row['status']}: {row['reason']}"
        codec = row["codec"] if verbose else row.get("codec_short") or row["codec"]
        cells = (
            printable(str(row["agent"])),
            str(row["tier"]),
            str(row["tokens"]),
            size(int(row["bytes"])),
            _model_cell(row, verbose),
            printable(str(codec)) or "-",
            age(float(row["updated"])),
            printable(status),
        )
        body.append((printable(str(row.get("host") or "-")), *cells) if hosts else cells)
    right = {3, 4} if hosts else {2, 3}  # numbers
    return "\n".join(table(("HOST", *head) if hosts else head, body, right))


# ----------------------------------------------------------------------- directories
def cache_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """Every cache directory at or under ``root`` (a few levels deep), the root first, the
    rest sorted: folders that hold ``agents/`` or ``hosts/``. Symlinked folders are not
    entered; unreadable ones are passed over."""
    top = Path(root)
    found = []
    for here, folders, _ in os.walk(top):
        path = Path(here)
        if "agents" in folders or "hosts" in folders:
            found.append(path)
        deep = len(path.relative_to(top).parts) >= _DEPTH
        folders[:] = (
            []
            if deep
            else sorted(f for f in folders if f not in _NOT_CACHE_DIRS and not f.startswith("."))
        )
    return found


def _shared_bytes(root: Path, rows: Sequence[Mapping[str, Any]]) -> int:
    """Bytes the rows count more than once: files hard-linked between agents' caches
    (a shared context, forks), per folder (the root's own agents, each host's)."""
    extra = 0
    for host in sorted({str(r["host"]) for r in rows}):
        folder = root / "hosts" / host if host else root
        names = [r["agent"] for r in rows if r["host"] == host and r["status"] == "ok"]
        _, once, each = disk_footprint(folder, names)
        extra += each - once
    return extra


def _directory(path: Path) -> dict[str, Any]:
    """One cache directory's rows and bytes (``bytes``: on disk, linked files once)."""
    try:
        rows = inspect_rows(path)
        counted = sum(int(r["bytes"]) for r in rows)
        on_disk = counted - _shared_bytes(path, rows)
    except (KvactorError, OSError) as exc:  # agents/ a symlink, unreadable...
        return {"path": str(path), "agents": [], "bytes": 0, "error": str(exc)}
    return {"path": str(path), "agents": rows, "bytes": on_disk, "bytes_per_agent": counted}


def _heading(directory: Mapping[str, Any]) -> str:
    n = len(directory["agents"])
    agents = "1 agent" if n == 1 else f"{n} agents"
    out = f"{printable(directory['path'])}: {agents}, {size(directory['bytes'])} on disk"
    if directory["bytes_per_agent"] > directory["bytes"]:
        out += f" (the agents share files: {size(directory['bytes_per_agent'])} counted apart)"
    return out


def run_inspect(args: argparse.Namespace) -> int:
    """``kvactor inspect [DIR] [--json] [--verbose]``: 0, or 2 when a cache directory
    cannot be read (its error on stderr; the others are still shown)."""
    several = args.dir is not None and (Path(args.dir) / "models").is_dir()
    if args.dir is not None and not several:
        root, places = Path(args.dir), [Path(args.dir)]
    elif several:  # a session of several models: a directory per model
        root = Path(args.dir)
        places = cache_dirs(root)
    else:
        root = default_cache_dir()
        places = cache_dirs(root) if root.is_dir() else []
    directories = [_directory(path) for path in places]
    code = 0
    for directory in directories:
        if directory.get("error"):
            print(f"kvactor inspect: {directory['error']}", file=sys.stderr)
            code = 2
    memory = read_limit(root)
    disk_limit = read_disk_limit(root)
    written = read_written(root)
    written_today = written.get(datetime.date.today().isoformat(), 0)
    if args.json:
        out = {
            "root": str(root),
            "directories": directories,
            "memory": memory,
            "disk_limit_bytes": disk_limit,
            "written_bytes": written,
            "written_today_bytes": written_today,
        }
        print(json.dumps(out, indent=2, default=str))
        return code
    if args.dir is not None and not several:  # one directory: its table alone (for scripts)
        if not directories[0].get("error"):
            print(format_table(directories[0]["agents"], verbose=args.verbose))
        return code
    shown = [d for d in directories if d["agents"]]
    if not shown and not code:
        print(f"no warm caches under {printable(str(root))} (kvactor demo makes some)")
    for i, directory in enumerate(shown):
        table_text = format_table(directory["agents"], verbose=args.verbose)
        print(*([""] if i else []), _heading(directory), table_text, sep="\n")
    if disk_limit is not None:
        used = size(sum(int(d.get("bytes", 0)) for d in directories))
        print(
            f"\nwarm tier {used} on disk of a {size(disk_limit)} limit (the last session "
            f"here), {size(written_today)} written today"
        )
    if memory is not None:
        models = ", ".join(str(m) for m in memory.get("models", []))
        limit = int(memory.get("memory_limit_bytes", 0))
        print(f"\nmemory limit {size(limit)} over models {models} (the last session here)")
    return code
