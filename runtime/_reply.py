"""The reply channel of one ask or stream, usable from the actor's thread."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from ._errors import ActorDeadError
from ._loop import LoopCaller

__all__ = ("Reply", "ReplyStream")

_PENDING = object()


class Reply:
    """What an actor holds to answer an ``ask`` (one value) or a ``stream`` (many items).

    ``send``, ``resolve`` and ``fail`` may be called from any thread: they are carried to
    the event loop without blocking the caller. ``cancelled`` turns true when the asking
    side gave up (timeout, cancellation, or a stream it stopped reading); a long handler or
    a detached reply should check it and stop work early.
    """

    __slots__ = (
        "_caller",
        "_done",
        "_error",
        "_event",
        "_items",
        "_on_cancel",
        "_value",
        "cancelled",
        "detached",
        "streaming",
    )

    def __init__(self, caller: LoopCaller, *, streaming: bool) -> None:
        self._caller = caller
        self.streaming = streaming
        self.cancelled = False
        self.detached = False
        self._items: deque[Any] = deque()
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._done = False
        self._event: anyio.Event | None = None
        self._on_cancel: Callable[[], object] | None = None

    @property
    def done(self) -> bool:
        return self._done

    # -- the actor's side -------------------------------------------------------------
    def detach(self) -> Reply:
        """Take over answering: the kernel will not resolve this reply when the handler returns."""
        self.detached = True
        return self

    def send(self, item: Any) -> None:
        """Hand one item to a stream's reader. Raises TypeError on an ask."""
        if not self.streaming:
            raise TypeError("send() is for stream replies; an ask is answered with resolve()")
        self._caller.call_soon(self._push, item)

    def resolve(self, value: Any = None) -> None:
        """Answer an ask with ``value``, or end a stream."""
        self._caller.call_soon(self._finish, value, None)

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` in the asking task (after any items already sent)."""
        self._caller.call_soon(self._finish, _PENDING, error)

    # -- loop side --------------------------------------------------------------------
    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    def _push(self, item: Any) -> None:
        if not self._done:
            self._items.append(item)
            self._wake()

    def _finish(self, value: Any, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self._value = value
        self._error = error
        self._wake()

    def cancel(self) -> None:
        """The asking side gives up (called on the event loop)."""
        if self.cancelled:
            return
        self.cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()

    def set_cancel_callback(self, callback: Callable[[], object] | None) -> None:
        self._on_cancel = callback

    def fail_dead(self, name: str, cause: BaseException | None = None) -> None:
        error = ActorDeadError(f"actor {name!r} is dead" + (f": {cause!r}" if cause else ""))
        error.__cause__ = cause
        self._finish(_PENDING, error)

    async def _wait(self) -> None:
        self._event = anyio.Event()
        await self._event.wait()
        self._event = None

    async def result(self) -> Any:
        """Wait for an ask's answer; raise what the handler raised."""
        try:
            while not self._done:
                await self._wait()
        except BaseException:
            self.cancel()
            raise
        if self._error is not None:
            raise self._error
        return self._value

    async def next_item(self, timeout: float | None) -> Any:
        """Wait for a stream's next item; StopAsyncIteration at its end."""
        try:
            with anyio.fail_after(math.inf if timeout is None else timeout):
                while not self._items and not self._done:
                    await self._wait()
        except BaseException:
            self.cancel()
            raise
        if self._items:
            return self._items.popleft()
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration


class ReplyStream:
    """``async for item in ref.stream(msg)``: the items an actor sends back.

    Leaving the loop early (``break``, an exception, cancellation) tells the actor to stop:
    use ``async with ref.stream(msg) as items:`` to make that immediate; otherwise it
    happens when the stream is garbage-collected.
    """

    __slots__ = ("_open", "_reply", "_started", "_timeout")

    def __init__(
        self,
        open_: Callable[[Reply], Any],
        reply: Reply,
        item_timeout: float | None,
    ) -> None:
        self._open = open_
        self._reply = reply
        self._timeout = item_timeout
        self._started = False

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Any:
        if not self._started:
            self._started = True
            try:
                await self._open(self._reply)
            except BaseException:
                self._reply.cancel()
                raise
        return await self._reply.next_item(self._timeout)

    async def aclose(self) -> None:
        """Stop reading: the actor sees ``reply.cancelled``."""
        if not self._reply.done:
            self._reply.cancel()

    async def __aenter__(self) -> ReplyStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Plain attribute write: safe from the garbage collector on any thread.
        if self._started and not self._reply._done:
            self._reply.cancelled = True
