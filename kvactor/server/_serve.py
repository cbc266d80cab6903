"""``kvactor serve``: open a session, run its app under uvicorn until SIGINT / SIGTERM, and
say where it listens (the start line)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from anyio.abc import TaskStatus

from ._app import create_app
from ._state import ServerState


def start_line(
    host: str, port: int, model_id: str, cache_dir: Any, *, as_json: bool = False
) -> str:
    """The line ``serve`` prints once it listens: text for people, or one JSON object
    (``as_json``) for programs: ``{"event": "serving", "url", "host", "port", "model",
    "cache_dir", "pid"}``."""
    url = f"http://{host}:{port}/v1"
    if as_json:
        fields = {
            "event": "serving",
            "url": url,
            "host": host,
            "port": port,
            "model": model_id,
            "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
            "pid": os.getpid(),
        }
        return json.dumps(fields)
    where = f"cache {cache_dir}" if cache_dir else "no warm tier"
    return f"kvactor serving on {url} ({where}); Ctrl-C stops"


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _uvicorn_server(app: Any) -> Any:
    """A uvicorn server for ``app`` that leaves the signals to ``serve``."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the signals are handled by serve
            yield

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, lifespan="off")
    return Server(config)


async def _stop_on_signals(server: Any, *, task_status: TaskStatus[None]) -> None:
    """The first SIGINT / SIGTERM stops the server gracefully, a second one at once."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            if server.should_exit:
                server.force_exit = True
            server.should_exit = True


async def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[int], None] | None = None,
    model_id: str | None = None,
    max_pending: int = 64,
    json_start: bool = False,
    **options: Any,
) -> None:
    """Open a session (``model`` and ``options`` as ``kvactor.open`` takes them) and serve
    it until SIGINT / SIGTERM: then the server stops taking connections, lets in-flight
    turns finish (their warm writes included) for up to 10 s, cancels the rest, and the
    session closes (a second signal stops at once). ``port`` 0 picks a free one. Once it
    listens it prints its start line on stderr (:func:`start_line`; one JSON object with
    ``json_start``) and calls ``ready(port)``. Raises what ``kvactor.open`` raises, and
    OSError when the address cannot be bound."""
    from ..actors import open as open_session

    async with open_session(model, **options) as session:
        app = create_app(session, model_id=model_id, max_pending=max_pending)
        state = app.state.kvactor
        assert isinstance(state, ServerState)
        sock = _bound(host, port)
        server = _uvicorn_server(app)

        async def announce() -> None:
            while not server.started:  # uvicorn offers no event for it
                await anyio.sleep(0.01)
            bound = sock.getsockname()[1]
            cache_dir = options.get("cache_dir")
            line = start_line(host, bound, state.model_id, cache_dir, as_json=json_start)
            print(line, file=sys.stderr, flush=True)
            if ready is not None:
                ready(bound)

        async with anyio.create_task_group() as tg:
            await tg.start(_stop_on_signals, server)
            tg.start_soon(announce)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
