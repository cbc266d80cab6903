"""The one OS thread a ThreadActor owns."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio

from ._loop import LoopCaller

__all__ = ("ActorThread", "stop_threads")

log = logging.getLogger("kvactor.runtime")

_Job = tuple[Callable[..., Any], tuple[Any, ...], Callable[[bool, Any], None]]
_EXIT = object()  # the job that runs on_exit on the thread and ends it
_live: weakref.WeakSet[ActorThread] = weakref.WeakSet()


def stop_threads(timeout: float = 30.0) -> int:
    """For interpreter exit, when no event loop is left: end every actor thread still
    alive after its current job, running its ``on_exit`` there first (a ThreadActor's
    ``on_stop`` that never ran: its native resources go with the thread that made them),
    and wait up to ``timeout`` seconds for all of them. Returns how many were alive."""
    threads = [t for t in list(_live) if t._thread.is_alive()]
    for t in threads:
        t._jobs.put(_EXIT)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    for t in threads:
        t._thread.join(max(deadline - time.monotonic(), 0))
    return len(threads)


_registered = False


def _watch(thread: ActorThread) -> None:
    """Track ``thread`` for ``stop_threads``, which runs at interpreter exit (registered
    when the first actor thread starts, so it runs before the exit handlers of libraries
    imported earlier: theirs are registered first and run last)."""
    global _registered
    _live.add(thread)
    if not _registered:
        _registered = True
        atexit.register(stop_threads)


class ActorThread:
    """Runs jobs one at a time on a dedicated thread; results come back to the event loop.

    When the job queue is empty and ``idle`` is set, the thread calls ``idle()`` repeatedly
    while it returns True, checking for new jobs between calls; otherwise it sleeps until a
    job arrives. An exception from ``idle`` is handed to ``on_idle_error`` on the loop.
    """

    def __init__(
        self,
        name: str,
        caller: LoopCaller,
        on_idle_error: Callable[[BaseException], object],
    ) -> None:
        self._caller = caller
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._on_idle_error = on_idle_error
        self.idle: Callable[[], bool] | None = None
        # Seconds after which the thread runs ``idle`` though no job came (None: never).
        self.wake: Callable[[], float | None] | None = None
        # What the thread runs if the interpreter exits before close(): stop_threads.
        self.on_exit: Callable[[], object] | None = None
        self._exited: anyio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=f"kvactor:{name}", daemon=True)
        self._thread.start()
        _watch(self)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread and return (or raise) its result.

        Cancelling the awaiting task stops the wait, not the job already on the thread.
        """
        done = anyio.Event()
        outcome: list[tuple[bool, Any]] = []

        def finish(ok: bool, value: Any) -> None:
            outcome.append((ok, value))
            done.set()

        self._jobs.put((fn, args, finish))
        await done.wait()
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    async def close(self) -> None:
        """Let the thread exit after the jobs already queued, and wait until it is gone.

        Waiting matters: a thread still inside a native library (MLX's thread-local
        teardown) when the interpreter finalizes is killed mid-C++ and aborts the process.
        """
        exited = anyio.Event()
        self._exited = exited
        self._jobs.put(None)
        if self._thread.is_alive():
            await exited.wait()
        # The last callback ran just before the thread returned: wait out its teardown
        # without blocking the loop.
        delay = 0.0005
        while self._thread.is_alive():
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _exit_now(self) -> None:
        on_exit, self.on_exit = self.on_exit, None
        if on_exit is not None:
            try:
                on_exit()
            except Exception:
                log.exception("stopping actor thread %s at exit", self._thread.name)

    def _mark_exited(self) -> None:
        if self._exited is not None:
            self._exited.set()

    def _run_idle(self) -> bool:
        idle = self.idle
        if idle is None:
            return False
        try:
            return bool(idle())
        except BaseException as exc:  # handed to the supervisor
            self.idle = None
            self._caller.call_soon(self._on_idle_error, exc)
            return False

    def _main(self) -> None:
        busy = False
        while True:
            job: _Job | None
            if busy:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    busy = self._run_idle()
                    continue
            else:
                wake = self.wake() if self.wake is not None else None
                try:
                    job = self._jobs.get(timeout=wake)
                except queue.Empty:  # the wake-up came first
                    busy = self._run_idle()
                    continue
            if job is None:
                self._caller.call_soon(self._mark_exited)
                return
            if job is _EXIT:
                self._exit_now()
                return
            fn, args, finish = job
            try:
                result = fn(*args)
            except BaseException as exc:  # re-raised in the awaiting task
                self._caller.call_soon(finish, False, exc)
            else:
                self._caller.call_soon(finish, True, result)
            # A message may have brought new background work.
            busy = self.idle is not None
