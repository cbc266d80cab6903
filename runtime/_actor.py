"""The actor base classes: what user code subclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ._reply import Reply

if TYPE_CHECKING:
    from ._ref import ActorRef

__all__ = ("Actor", "ThreadActor")


class _ActorBase:
    #: Set by the kernel before ``on_start``.
    ref: ActorRef[Any]
    #: The reply of the message being handled (None for a tell or between messages).
    reply: Reply | None = None
    #: True for actors whose handlers run on one dedicated OS thread.
    owns_thread: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.ref.name


class Actor(_ActorBase):
    """An actor whose handlers are coroutines running on the event loop.

    Messages are handled one at a time, in mailbox order. ``receive`` returns the answer of
    an ask; for a stream it returns an async iterable whose items are sent back (or detaches
    ``self.reply`` and answers later). An exception raised while handling an ask or a stream
    goes back to the caller; one raised while handling a tell crashes the actor, and its
    supervisor decides whether to restart it.
    """

    async def on_start(self) -> None:
        """Runs before the first message; an exception here fails ``spawn``."""

    async def on_stop(self) -> None:
        """Runs after the last message (also after a crash)."""

    async def receive(self, message: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} handles no messages")


class ThreadActor(_ActorBase):
    """An actor that owns one OS thread: all of its handlers run there, one at a time.

    The event loop is never blocked by them. Between messages, while ``on_idle`` returns
    True, the thread calls it again instead of sleeping: that is where an actor does
    background work in small steps (say, one decode step) and still sees new messages
    between steps. Answers may be sent from the thread through ``self.reply``.
    """

    owns_thread: ClassVar[bool] = True
    #: When set, ``on_idle`` also runs after this many seconds without a message or other
    #: idle work (a timer: say, unloading what stayed unused too long).
    idle_wake_s: float | None = None

    def on_start(self) -> None:
        """Runs on the actor's thread before the first message; raising fails ``spawn``."""

    def on_stop(self) -> None:
        """Runs on the actor's thread after the last message."""

    def receive(self, message: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} handles no messages")

    def on_idle(self) -> bool:
        """One step of background work; return True while there is more to do."""
        return False
