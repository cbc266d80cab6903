"""The task that runs one actor: its loop, its thread, its supervision."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import anyio

from ._actor import Actor, ThreadActor
from ._loop import LoopCaller
from ._mailbox import Envelope, Mailbox
from ._ref import ActorRef
from ._supervision import RestartBudget, RestartPolicy
from ._thread import ActorThread

__all__ = ("STOP", "ActorCell")

log = logging.getLogger("kvactor.runtime")

#: The control message that ends an actor's loop (sent through the mailbox, so in order).
STOP = object()

AnyActor = Actor | ThreadActor


class ActorCell:
    """Owns one actor: pulls envelopes from its mailbox and supervises it."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], AnyActor],
        caller: LoopCaller,
        mailbox_size: int,
        restart: RestartPolicy,
        stop_timeout: float,
    ) -> None:
        self.name = name
        self.caller = caller
        self.mailbox = Mailbox(name, mailbox_size)
        self.ref: ActorRef[Any] = ActorRef(self)
        self.failure: BaseException | None = None
        self._factory = factory
        self._budget = RestartBudget(restart)
        self._stop_timeout = stop_timeout
        self._actor: AnyActor | None = None
        self._thread: ActorThread | None = None
        self._crash: BaseException | None = None
        self._wait_scope: anyio.CancelScope | None = None
        self._dead = anyio.Event()
        self.scope = anyio.CancelScope()

    # -- lifecycle --------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with self.scope:
            try:
                await self._start_actor()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._finish(None, run_on_stop=False)
                raise
            task_status.started()
            failure: BaseException | None = None
            try:
                failure = await self._loop()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._finish(failure, run_on_stop=True)

    async def _start_actor(self) -> None:
        actor = self._factory()
        if not isinstance(actor, (Actor, ThreadActor)):
            raise TypeError(f"spawn needs an Actor or ThreadActor, got {type(actor).__name__}")
        actor.ref = self.ref
        if isinstance(actor, ThreadActor):
            if self._thread is None:
                self._thread = ActorThread(self.name, self.caller, self._idle_failed)
            self._thread.idle = None
            await self._thread.call(actor.on_start)
            self._thread.idle = actor.on_idle
            self._thread.wake = lambda: actor.idle_wake_s
            self._thread.on_exit = actor.on_stop  # if the interpreter exits first
        else:
            await actor.on_start()
        self._actor = actor

    async def _loop(self) -> BaseException | None:
        """Handle envelopes until STOP; returns the crash that killed the actor, if any."""
        while True:
            crash, self._crash = self._crash, None
            if crash is not None:
                restarted, crash = await self._restart(crash)
                if not restarted:
                    return crash
            envelope: Envelope | None = None
            with anyio.CancelScope() as self._wait_scope:
                try:
                    envelope = await self.mailbox.get()
                except anyio.EndOfStream:
                    return None
            self._wait_scope = None
            if envelope is None:
                continue  # woken by a crash in on_idle
            if envelope.message is STOP:
                if envelope.reply is not None:
                    envelope.reply.resolve(None)
                return None
            await self._handle(envelope)

    async def stop(self) -> None:
        if not self.mailbox.closed:
            try:
                await self.mailbox.put(Envelope(STOP, None))
            except Exception:  # died meanwhile: nothing left to stop
                pass
        await self._dead.wait()

    async def wait_dead(self) -> None:
        await self._dead.wait()

    async def _finish(self, failure: BaseException | None, *, run_on_stop: bool) -> None:
        self.failure = failure
        if run_on_stop:
            await self._stop_actor()
        for envelope in self.mailbox.close():
            if envelope.reply is not None:
                envelope.reply.fail_dead(self.name, failure)
        if self._thread is not None:
            with anyio.move_on_after(self._stop_timeout):
                await self._thread.close()
        self._dead.set()

    async def _stop_actor(self) -> None:
        actor, self._actor = self._actor, None
        if actor is None:
            return
        try:
            with anyio.move_on_after(self._stop_timeout):
                if isinstance(actor, ThreadActor):
                    assert self._thread is not None
                    self._thread.idle = None
                    self._thread.on_exit = None
                    await self._thread.call(actor.on_stop)
                else:
                    await actor.on_stop()
        except Exception:
            log.exception("on_stop of actor %r failed", self.name)

    # -- supervision ------------------------------------------------------------------
    def _idle_failed(self, exc: BaseException) -> None:
        self._crash = exc
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    async def _restart(self, crash: BaseException) -> tuple[bool, BaseException]:
        log.error("actor %r crashed", self.name, exc_info=crash)
        await self._stop_actor()
        if not self._budget.allow(anyio.current_time()):
            return False, crash
        self.mailbox.restarts += 1
        try:
            await self._start_actor()
        except Exception as exc:
            log.exception("actor %r failed to restart", self.name)
            return False, exc
        log.info("actor %r restarted (%d)", self.name, self.mailbox.restarts)
        return True, crash

    # -- one message ------------------------------------------------------------------
    async def _handle(self, envelope: Envelope) -> None:
        reply = envelope.reply
        if reply is not None and reply.cancelled:
            return  # withdrawn by the asker before we got to it
        actor = self._actor
        assert actor is not None
        actor.reply = reply
        try:
            if isinstance(actor, ThreadActor):
                assert self._thread is not None
                result = await self._thread.call(_run_in_thread, actor, envelope)
            else:
                result = await _run_async(actor, envelope)
        except Exception as exc:
            self.mailbox.failed += 1
            if reply is None:
                self._crash = exc  # a failed tell has nobody to tell: the actor crashes
            else:
                reply.fail(exc)
            return
        except BaseException:
            # The actor itself is being cancelled (a stop that timed out): the asker must
            # not wait for an answer that will never come.
            if reply is not None:
                reply.fail_dead(self.name)
            raise
        finally:
            actor.reply = None
        self.mailbox.handled += 1
        if reply is not None and not reply.detached:
            reply.resolve(result)


def _run_in_thread(actor: ThreadActor, envelope: Envelope) -> Any:
    reply = envelope.reply
    result = actor.receive(envelope.message)
    if reply is not None and reply.streaming and not reply.detached and result is not None:
        if not hasattr(result, "__next__"):
            raise TypeError("a stream handler must return an iterator or detach the reply")
        for item in result:
            if reply.cancelled:
                if hasattr(result, "close"):
                    result.close()
                break
            reply.send(item)
        return None
    return result


async def _run_async(actor: Actor, envelope: Envelope) -> Any:
    reply = envelope.reply
    with anyio.CancelScope() as scope:
        if reply is not None:
            reply.set_cancel_callback(scope.cancel)
        try:
            result = await actor.receive(envelope.message)
            if reply is not None and reply.streaming and not reply.detached and result is not None:
                if not hasattr(result, "__aiter__"):
                    raise TypeError("a stream handler must return an async iterable")
                if hasattr(result, "aclose"):
                    async with aclosing(result) as items:
                        async for item in items:
                            reply.send(item)
                else:
                    async for item in result:
                        reply.send(item)
                return None
            return result
        finally:
            if reply is not None:
                reply.set_cancel_callback(None)
    return None  # the asker withdrew and the handler was cancelled
