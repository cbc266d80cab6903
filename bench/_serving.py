"""An ASGI app served in a bench's own process on 127.0.0.1, on a free port."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """``app`` served on 127.0.0.1 on a free port until the block ends; its base URL. The
    socket is closed on the way out whatever happened (a server that failed to start
    never closes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(server.serve, sockets=[sock]))
            with anyio.fail_after(30):
                while not server.started:
                    await anyio.sleep(0.01)
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
