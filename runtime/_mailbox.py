"""A bounded mailbox on an anyio memory object stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._errors import ActorDeadError, MailboxFull
from ._reply import Reply

__all__ = ("Envelope", "Mailbox", "MailboxStatistics")


class Envelope:
    """A message in transit, with the channel its answer goes back on (None for a tell)."""

    __slots__ = ("message", "reply")

    def __init__(self, message: Any, reply: Reply | None) -> None:
        self.message = message
        self.reply = reply


@dataclass(frozen=True)
class MailboxStatistics:
    """A snapshot of one actor's mailbox."""

    capacity: int
    queued: int
    senders_waiting: int
    handled: int
    failed: int
    restarts: int
    alive: bool


class Mailbox:
    """Bounded FIFO of envelopes: ``put`` waits for room, ``put_nowait`` raises when full."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"mailbox capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        send, receive = anyio.create_memory_object_stream[Envelope](capacity)
        self._send: MemoryObjectSendStream[Envelope] = send
        self._receive: MemoryObjectReceiveStream[Envelope] = receive
        self.closed = False
        self.handled = 0
        self.failed = 0
        self.restarts = 0

    def _dead(self) -> ActorDeadError:
        return ActorDeadError(f"actor {self.name!r} is dead")

    def put_nowait(self, envelope: Envelope) -> None:
        """Raises MailboxFull when at capacity, ActorDeadError when the actor is gone."""
        if self.closed:
            raise self._dead()
        try:
            self._send.send_nowait(envelope)
        except anyio.WouldBlock:
            raise MailboxFull(
                f"mailbox of {self.name!r} is full ({self.capacity} messages)"
            ) from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._dead() from None

    async def put(self, envelope: Envelope) -> None:
        """Wait for room; raises ActorDeadError when the actor is gone (also while waiting)."""
        if self.closed:
            raise self._dead()
        try:
            await self._send.send(envelope)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._dead() from None

    async def get(self) -> Envelope:
        """The next envelope; raises anyio.EndOfStream once closed and empty."""
        return await self._receive.receive()

    def close(self) -> list[Envelope]:
        """Refuse new messages and return those still queued (their senders are failed)."""
        self.closed = True
        left: list[Envelope] = []
        while True:
            try:
                left.append(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        self._receive.close()
        self._send.close()
        return left

    def statistics(self) -> MailboxStatistics:
        stats = self._send.statistics()
        return MailboxStatistics(
            capacity=self.capacity,
            queued=stats.current_buffer_used,
            senders_waiting=stats.tasks_waiting_send,
            handled=self.handled,
            failed=self.failed,
            restarts=self.restarts,
            alive=not self.closed,
        )
