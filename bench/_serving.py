"""An ASGI app served in this process on 127.0.0.1, on a free port (for benches, and for
tests: ``tests/serving.py``)."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn


@contextlib.asynccontextmanager
async def served(app: Any, start_s: float = 30) -> AsyncIterator[str]:
    """``app`` served on 127.0.0.1 on a free port until the block ends (started within
    ``start_s`` seconds); its base URL. The socket is closed on the way out whatever
    happened (a server that failed to start never closes it, and a socket left to the
    collector fails a later test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))  # the protocol named: asyncio sets TCP_NODELAY
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(server.serve, sockets=[sock]))
            with anyio.fail_after(start_s):
                while not server.started:
                    await anyio.sleep(0.01)
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
