"""``kvactor serve`` as the command line runs it: its arguments as :func:`~._serve.serve`
takes them (the parser is ``kvactor.cli``'s)."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import anyio

from ._serve import serve
from ._tenants import key_entries

# The stored forms `kvactor serve --codec` offers: None (the default), else KVCodec(bits=...).
CODECS: dict[str, int | None] = {"default": None, "q8": 8, "fp16": 16}


def _model(spec: str | None) -> Any:
    """The model ``serve`` opens: a path, None (the default model) or ``tiny`` (a random
    2-layer test model, for trying the server out)."""
    if spec == "tiny":
        from ..actors.models import make_tiny_model

        return functools.partial(make_tiny_model, 0, head_dim=64)
    return spec


def served_models(args: argparse.Namespace) -> tuple[Any, dict[str, Any] | None]:
    """The one model (``model``, or a lone ``--model PATH``) or the named ones (``--model
    NAME=PATH``, repeated) that ``serve`` opens. Raises ValueError for a mix of the two,
    a name given twice, or both the positional model and ``--model``."""
    given = list(getattr(args, "models", None) or [])
    if not given:
        return _model(args.model), None
    if args.model is not None:
        raise ValueError("give the model as the positional argument or with --model, not both")
    if len(given) == 1 and "=" not in given[0]:
        return _model(given[0]), None
    named: dict[str, Any] = {}
    for entry in given:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model {entry!r}: several models are given as NAME=PATH")
        if name in named:
            raise ValueError(f"--model: {name!r} is given twice")
        named[name] = _model(path)
    return None, named


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """``kvactor.open``'s options from the arguments."""
    from ..actors.warm import default_cache_dir

    cache_dir = None if args.no_cache_dir else (args.cache_dir or default_cache_dir())
    options: dict[str, Any] = {"cache_dir": cache_dir, "attention": args.attention}
    bits = CODECS[args.codec]
    if bits is not None:
        from ..kernels.qcodec import KVCodec

        options["codec"] = KVCodec(bits=bits)
    if args.budget is not None:
        options["budget_bytes"] = args.budget
    elif args.budget_mb is not None:
        options["budget_bytes"] = int(args.budget_mb * 1e6)
    if args.no_share_prefixes:
        options["share_prefixes"] = False
    if args.deterministic:
        options["deterministic"] = True
    if args.tool_wait_s is not None:
        options["tool_wait_s"] = args.tool_wait_s
    if getattr(args, "memory_limit", None) is not None:  # 0: 'none', no limit
        options["memory_limit"] = args.memory_limit or None
    if getattr(args, "disk_limit", None) is not None:  # 0: 'none', no limit
        options["disk_limit"] = args.disk_limit or None
    if getattr(args, "tenant_disk_quota", None) is not None:
        options["disk_quota"] = args.tenant_disk_quota
    if getattr(args, "agent_ttl", None) is not None:
        options["warm_ttl_s"] = args.agent_ttl
    if getattr(args, "write_budget", None) is not None:
        options["write_budget"], options["write_window_s"] = args.write_budget
    return options


def run_serve(args: argparse.Namespace) -> int:
    """Run ``kvactor serve``: 0 once stopped by a signal, 1 when it cannot start (model,
    cache directory, address, cluster), 2 for bad keys, a ``--tool-wait-s`` out of
    [0, 86400], ``--hosts`` or ``--replicas`` without ``--cluster``, or options that
    ``kvactor.open`` refuses."""
    from ..runtime import KvactorError
    from ._tenants import Keys

    cluster, hosts = getattr(args, "cluster", None), getattr(args, "hosts", 1)
    replicas = getattr(args, "replicas", 1)
    if hosts < 1 or ((hosts > 1 or replicas > 1) and cluster is None):
        print(
            "kvactor serve: --hosts (a number >= 1) and --replicas go with --cluster",
            file=sys.stderr,
        )
        return 2
    wait = args.tool_wait_s
    if wait is not None and not 0 <= wait <= 86_400:
        print(f"kvactor serve: --tool-wait-s must be in [0, 86400], got {wait}", file=sys.stderr)
        return 2
    try:
        model, named = served_models(args)
    except ValueError as exc:
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 2
    options = _options(args)
    if named is not None:
        options["models"] = named
    if cluster is not None:
        if options["cache_dir"] is None:
            print(
                "kvactor serve: a cluster keeps its warm tiers on disk: no --no-cache-dir",
                file=sys.stderr,
            )
            return 2
        options.update(cluster=cluster, hosts_per_node=hosts, replicas=replicas)
    try:
        entries = key_entries(args.api_key or (), args.api_key_file or ())
        Keys(entries, args.admin_key or ())
    except (OSError, ValueError) as exc:
        print(f"kvactor serve: API keys: {exc}", file=sys.stderr)
        return 2
    run = functools.partial(
        serve,
        model,
        host=args.host,
        port=args.port,
        model_id=args.model_id,
        strict_model=args.strict_model,
        max_pending=args.max_pending,
        max_import_bytes=args.max_import_bytes,
        max_anonymous=args.max_anonymous,
        json_start=args.json,
        drain_s=args.drain_seconds,
        api_keys=entries,
        admin_keys=args.admin_key or (),
        **options,
    )
    try:
        anyio.run(run)
    except KeyboardInterrupt:
        pass
    except (KvactorError, OSError) as exc:
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:  # the server's or the cluster's extra is missing
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # options kvactor.open refuses (replicas=2 on one host ...)
        print(f"kvactor serve: {exc}", file=sys.stderr)
        return 2
    return 0
