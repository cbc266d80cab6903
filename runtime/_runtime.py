"""The runtime: a task group that owns actors, spawns them and stops them in order."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from ._actor import Actor, ThreadActor
from ._cell import ActorCell
from ._loop import LoopCaller
from ._mailbox import MailboxStatistics
from ._ref import ActorRef
from ._supervision import RestartPolicy

__all__ = ("Runtime",)

A = TypeVar("A", bound=Actor | ThreadActor)

_ids = itertools.count(1)


class Runtime:
    """``async with Runtime() as rt:`` owns every actor spawned in it.

    Runs inside whatever event loop is already running (asyncio or trio, through anyio):
    it never starts one of its own. Leaving the block stops the actors in reverse order of
    spawning (each after the messages already queued to it), so an actor that others use
    should be spawned first.
    """

    def __init__(self, *, mailbox_size: int = 16, stop_timeout: float = 10.0) -> None:
        self.mailbox_size = mailbox_size
        self.stop_timeout = stop_timeout
        self._cells: dict[str, ActorCell] = {}
        self._tg: TaskGroup | None = None
        self._caller: LoopCaller | None = None

    async def __aenter__(self) -> Runtime:
        if self._tg is not None:
            raise RuntimeError("this Runtime is already running")
        self._caller = LoopCaller()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.stop_all()
        finally:
            # Every actor task has ended, so the group closes at once. The body's own
            # exception propagates as it is, not wrapped in an exception group.
            await tg.__aexit__(None, None, None)
        return None

    async def spawn(
        self,
        factory: Callable[..., A],
        *args: Any,
        name: str | None = None,
        mailbox_size: int | None = None,
        restart: RestartPolicy | None = None,
        **kwargs: Any,
    ) -> ActorRef[Any]:
        """Create an actor with ``factory(*args, **kwargs)`` and start it.

        Returns once ``on_start`` has run; an exception raised there is raised here. The
        factory is called again with the same arguments on each restart. Raises ValueError
        when ``name`` belongs to a live actor, RuntimeError outside ``async with``.
        """
        if self._tg is None or self._caller is None:
            raise RuntimeError("spawn() needs a running Runtime: use 'async with Runtime()'")
        if name is None:
            name = f"{getattr(factory, '__name__', 'actor')}-{next(_ids)}"
        old = self._cells.get(name)
        if old is not None and not old.mailbox.closed:
            raise ValueError(f"an actor named {name!r} is already running")
        cell = ActorCell(
            name,
            lambda: factory(*args, **kwargs),
            self._caller,
            self.mailbox_size if mailbox_size is None else mailbox_size,
            restart or RestartPolicy.never(),
            self.stop_timeout,
        )
        self._cells[name] = cell
        try:
            await self._tg.start(self._run, cell)
        except BaseException:
            self._cells.pop(name, None)
            raise
        return cell.ref

    async def _run(self, cell: ActorCell, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run ``cell`` and let go of it once its actor is dead (its refs still say so):
        a runtime that spawns and stops actors all day keeps only the live ones."""
        try:
            await cell.run(task_status=task_status)
        finally:
            if self._cells.get(cell.name) is cell:
                del self._cells[cell.name]

    def get(self, name: str) -> ActorRef[Any]:
        """The ref of the live actor called ``name``; raises KeyError for an unknown name
        (or one whose actor has stopped)."""
        return self._cells[name].ref

    def statistics(self) -> dict[str, MailboxStatistics]:
        return {name: cell.mailbox.statistics() for name, cell in self._cells.items()}

    async def stop_all(self) -> None:
        """Stop every actor, the last spawned first; one that hangs is cancelled."""
        for cell in reversed(list(self._cells.values())):
            with anyio.move_on_after(self.stop_timeout):
                await cell.stop()
            if not cell.mailbox.closed:
                cell.scope.cancel()
                await cell.wait_dead()
