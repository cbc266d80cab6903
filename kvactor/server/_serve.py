"""``kvactor serve``: open a session, run its app under uvicorn until SIGINT / SIGTERM, and
say where it listens (the start line) and whether it asks for keys.

Without a budget, :func:`serve` bounds the hot tier at :func:`default_budget_bytes`: a
quarter of the machine's memory, at most 8 GiB, so that a server left to its defaults
never grows past what the machine has."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from ..actors.cluster import ServedCluster
from ..actors.session import Session
from ._app import create_app
from ._board import Board
from ._dashboard import create_dashboard_app
from ._state import DEFAULT_MAX_IMPORT_BYTES, ServerState
from ._tenants import Keys

BUDGET_FRACTION = 4  # the default hot budget is 1/4 of the machine's memory...
BUDGET_CAP = 8 << 30  # ... at most 8 GiB
BUDGET_UNKNOWN = 1 << 30  # where the machine's memory cannot be read
BUDGET_FLOOR = 64 << 20

NO_KEYS = (
    "no API keys: every client can use, list and forget every agent "
    "(give --api-key, --api-key-file or $KVACTOR_API_KEYS)"
)


def total_memory() -> int | None:
    """The machine's memory in bytes (``os.sysconf``, else ``/proc/meminfo``); None when
    neither says."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            return total
    except (ValueError, OSError, AttributeError):
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_budget_bytes() -> int:
    """The hot budget ``serve`` takes when given none: a quarter of the machine's memory,
    at most 8 GiB (at least 64 MiB; 1 GiB where the memory cannot be read)."""
    total = total_memory()
    if total is None:
        return BUDGET_UNKNOWN
    return max(BUDGET_FLOOR, min(total // BUDGET_FRACTION, BUDGET_CAP))


def start_line(
    host: str,
    port: int,
    model_id: str,
    cache_dir: Any,
    *,
    as_json: bool = False,
    auth: bool | None = None,
    tenants: int | None = None,
    budget_bytes: int | None = None,
    models: Sequence[str] = (),
    hosts: Sequence[str] | None = None,
) -> str:
    """The line ``serve`` prints once it listens: text for people, or one JSON object
    (``as_json``) for programs: ``{"event": "serving", "url", "host", "port", "model",
    "cache_dir", "pid"}``, with ``"auth"`` (whether keys are needed), ``"tenants"``,
    ``"budget_bytes"`` and ``"models"`` (every model served; ``"dashboard"``: its page)
    when given."""
    url = f"http://{host}:{port}/v1"
    if as_json:
        fields: dict[str, Any] = {
            "event": "serving",
            "url": url,
            "host": host,
            "port": port,
            "model": model_id,
            "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
            "pid": os.getpid(),
        }
        if auth is not None:
            fields["auth"] = auth
        if tenants is not None:
            fields["tenants"] = tenants
        if budget_bytes is not None:
            fields["budget_bytes"] = budget_bytes
        if models:
            fields["models"] = list(models)
            fields["dashboard"] = f"http://{host}:{port}/dashboard"
        if hosts is not None:
            fields["hosts"] = list(hosts)
        return json.dumps(fields)
    where = f"cache {cache_dir}" if cache_dir else "no warm tier"
    if len(models) > 1:
        where = f"models {', '.join(models)}; {where}"
    if budget_bytes is not None:
        where += f", hot budget {budget_bytes / (1 << 30):.2f} GiB"
    if tenants:
        where += f", {tenants} tenant{'s' * (tenants > 1)}"
    if hosts is not None:
        where += f", engine hosts {', '.join(hosts)}"
    board = f"; dashboard http://{host}:{port}/dashboard" if models else ""
    return f"kvactor serving on {url} ({where}){board}; Ctrl-C stops"


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``. Its protocol is named, so that asyncio sets
    TCP_NODELAY on every connection it accepts: without it a response written in two parts
    (uvicorn writes the head, then the body) waits ~40 ms for the client's delayed ACK on
    a kept-alive connection, and so does every event of a stream."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def _uvicorn_server(app: Any, drain_s: float) -> Any:
    """A uvicorn server for ``app`` that leaves the signals to ``serve``; once told to
    stop it waits ``drain_s`` seconds and a little more for in-flight requests to end
    (``serve`` ends their turns at ``drain_s``, so they do: none is cancelled mid-way)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the signals are handled by serve
            yield

    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=math.ceil(drain_s) + 5, lifespan="off"
    )
    return Server(config)


async def _stop_on_signals(
    server: Any, state: ServerState, drain_s: float, *, task_status: TaskStatus[None]
) -> None:
    """The first SIGINT / SIGTERM stops the server gracefully: no new connections, and
    in-flight turns end within ``drain_s`` (then the server ends them, each answered in
    its API's shape); a second signal stops it at once."""
    async with anyio.create_task_group() as tg:

        async def end_turns() -> None:
            await anyio.sleep(drain_s)
            await state.end_turns()

        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for _ in signals:
                if server.should_exit:
                    server.force_exit = True
                else:
                    tg.start_soon(end_turns)
                state.dashboard.close()  # the pages' streams end: uvicorn waits for them
                server.should_exit = True


async def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[int], None] | None = None,
    model_id: str | None = None,
    strict_model: bool = False,
    max_pending: int = 64,
    max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
    json_start: bool = False,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    max_anonymous: int = 16,
    drain_s: float = 10.0,
    **options: Any,
) -> None:
    """Open a session (``model`` and ``options`` as ``kvactor.open`` takes them; without
    ``budget_bytes``, :func:`default_budget_bytes`, shared by a cluster's
    ``hosts_per_node``; with ``cluster``, a :class:`~kvactor.actors.cluster.ServedCluster`
    over its hosts) and serve it until SIGINT / SIGTERM:
    then the server stops taking connections, lets in-flight turns finish (their warm
    writes included) for up to ``drain_s`` seconds, ends the rest
    (``Session.end_turns``: a decoding turn at its next step, saved; one not decoding
    yet unrun), and the session closes (a second signal stops at once). ``api_keys`` /
    ``admin_keys``, ``strict_model``, ``max_import_bytes``: as ``create_app`` takes them
    (no keys: no authentication, said at start). ``port`` 0 picks a free one. Once it
    listens it prints its start line on stderr (:func:`start_line`; one JSON object with
    ``json_start``) and calls ``ready(port)``. Raises ValueError for a malformed key
    entry (before anything starts), what ``kvactor.open`` raises, and OSError when the
    address cannot be bound."""
    from ..actors.opening import open as open_session

    keys = Keys(api_keys, admin_keys)  # malformed entries fail before the model loads
    hosts = options.get("hosts_per_node", 1) if options.get("cluster") is not None else 1
    options.setdefault("budget_bytes", default_budget_bytes() // hosts)
    async with open_session(model, **options) as opened:
        session = opened if isinstance(opened, Session) else await ServedCluster.over(opened)
        app = create_app(
            session,
            model_id=model_id,
            strict_model=strict_model,
            max_pending=max_pending,
            max_import_bytes=max_import_bytes,
            max_anonymous=max_anonymous,
            api_keys=api_keys,
            admin_keys=admin_keys,
        )
        state = app.state.kvactor
        assert isinstance(state, ServerState)
        # What the process holds by now (the model, the libraries) is never collected:
        # out of the collector's sight, so a full collection walks only what requests
        # made, not the whole server, and holds the event loop that much less.
        gc.collect()
        gc.freeze()
        sock = _bound(host, port)
        server = _uvicorn_server(app, drain_s)

        async def announce() -> None:
            while not server.started:  # uvicorn offers no event for it
                await anyio.sleep(0.01)
            bound = sock.getsockname()[1]
            cache_dir, budget = options.get("cache_dir"), options["budget_bytes"]
            engine_hosts = None
            if isinstance(session, ServedCluster):
                engine_hosts = [h.name for h in session.cluster.engine_hosts.live()]
            line = start_line(
                host,
                bound,
                state.model_id,
                cache_dir,
                as_json=json_start,
                auth=bool(keys),
                tenants=keys.tenants,
                budget_bytes=budget,
                models=state.models or (state.model_id,),
                hosts=engine_hosts,
            )
            print(line, file=sys.stderr, flush=True)
            if not keys:
                warning = {"event": "warning", "message": NO_KEYS}
                print(json.dumps(warning) if json_start else NO_KEYS, file=sys.stderr, flush=True)
            if ready is not None:
                ready(bound)

        async with anyio.create_task_group() as tg:
            await tg.start(_stop_on_signals, server, state, drain_s)
            tg.start_soon(announce)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()


async def serve_dashboard(
    board: Board,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ready: Callable[[int], None] | None = None,
    stop: anyio.Event,
) -> None:
    """Serve the dashboard alone over ``board`` (``kvactor run --dashboard``) on
    ``host:port`` (0: a free port) until ``stop`` is set; ``ready(port)`` once it
    listens. Raises OSError when the address cannot be bound."""
    sock = _bound(host, port)
    app = create_dashboard_app(board)
    server = _uvicorn_server(app, drain_s=0.0)

    async def watch() -> None:
        while not server.started:  # uvicorn offers no event for it
            await anyio.sleep(0.01)
        if ready is not None:
            ready(sock.getsockname()[1])
        await stop.wait()
        app.state.dashboard.close()  # the pages' streams end: uvicorn waits for them
        server.should_exit = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()
