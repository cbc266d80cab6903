"""ActorRef: the only way to talk to an actor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from ._errors import AskTimeout
from ._mailbox import Envelope, MailboxStatistics
from ._reply import Reply, ReplyStream

if TYPE_CHECKING:
    from ._cell import ActorCell

__all__ = ("ActorRef", "DEFAULT_ASK_TIMEOUT")

M = TypeVar("M")

#: Seconds an ``ask`` waits when no timeout is given.
DEFAULT_ASK_TIMEOUT = 30.0


class ActorRef(Generic[M]):
    """A handle on a running actor: ``tell`` / ``ask`` / ``stream`` / ``stop``.

    All methods raise ActorDeadError at once when the actor is dead.
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def alive(self) -> bool:
        return not self._cell.mailbox.closed

    def __repr__(self) -> str:
        return f"<ActorRef {self.name!r} {'alive' if self.alive else 'dead'}>"

    def tell_nowait(self, message: M) -> None:
        """Queue ``message`` without waiting; raises MailboxFull when there is no room."""
        self._cell.mailbox.put_nowait(Envelope(message, None))

    async def tell(self, message: M) -> None:
        """Queue ``message``, waiting for room in the mailbox (backpressure)."""
        await self._cell.mailbox.put(Envelope(message, None))

    async def ask(self, message: M, *, timeout: float | None = DEFAULT_ASK_TIMEOUT) -> Any:
        """Send ``message`` and wait for the answer.

        Raises what the handler raised, AskTimeout when ``timeout`` seconds pass first (the
        actor then skips the request, or sees ``reply.cancelled``), ActorDeadError when the
        actor dies before answering. Cancelling the caller withdraws the request likewise.
        """
        reply = Reply(self._cell.caller, streaming=False)
        with anyio.move_on_after(timeout):
            await self._cell.mailbox.put(Envelope(message, reply))
            return await reply.result()
        # Only the timeout leaves the block without returning or raising.
        reply.cancel()
        raise AskTimeout(
            f"{self.name!r} did not answer {type(message).__name__} within {timeout} s"
        )

    def stream(self, message: M, *, item_timeout: float | None = None) -> ReplyStream:
        """``async for item in ref.stream(msg)``: many answers to one message.

        Leaving the loop early, or cancelling the reader, cancels the request in the actor.
        ``item_timeout`` bounds the wait for each item (TimeoutError).
        """
        reply = Reply(self._cell.caller, streaming=True)

        async def open_(r: Reply) -> None:
            await self._cell.mailbox.put(Envelope(message, r))

        return ReplyStream(open_, reply, item_timeout)

    async def stop(self) -> None:
        """Stop after the messages queued before this call; later ones fail with ActorDeadError.

        Returns once ``on_stop`` has run. Stopping a dead actor does nothing.
        """
        await self._cell.stop()

    def statistics(self) -> MailboxStatistics:
        return self._cell.mailbox.statistics()
