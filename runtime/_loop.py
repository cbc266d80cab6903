"""Calling into the event loop from another OS thread without waiting for it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import sniffio

__all__ = ("LoopCaller",)


class LoopCaller:
    """Schedules plain callbacks on the event loop that created it, from any thread.

    ``anyio.from_thread.run_sync`` blocks the calling thread until the loop has run the
    callback; a thread that owns compute (the engine) must never wait on the loop, so this
    posts and returns at once.
    """

    __slots__ = ("_closed_errors", "_post", "_thread_id")

    def __init__(self) -> None:
        library = sniffio.current_async_library()
        self._thread_id = threading.get_ident()
        closed: tuple[type[BaseException], ...] = (RuntimeError,)
        if library == "trio":
            import trio

            self._post: Callable[..., Any] = trio.lowlevel.current_trio_token().run_sync_soon
            closed = (RuntimeError, trio.RunFinishedError)
        else:
            import asyncio

            self._post = asyncio.get_running_loop().call_soon_threadsafe
        self._closed_errors = closed

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop: now if already there, else as soon as it can."""
        if threading.get_ident() == self._thread_id:
            fn(*args)
            return
        try:
            self._post(fn, *args)
        except self._closed_errors:
            pass  # the loop is gone: nobody is left to receive the result
