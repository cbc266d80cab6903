"""The actor kernel, on asyncio and trio: ordering, backpressure, timeouts, cancellation,
supervision, dead actors, thread ownership and shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint

from kvactor.runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    AskTimeout,
    MailboxFull,
    MailboxStatistics,
    RestartPolicy,
    Runtime,
    ThreadActor,
)


class Put(msgspec.Struct, frozen=True, tag=True):
    value: int


class Get(msgspec.Struct, frozen=True, tag=True):
    pass


class Boom(msgspec.Struct, frozen=True, tag=True):
    pass


class Block(msgspec.Struct, frozen=True, tag=True):
    pass


class Count(msgspec.Struct, frozen=True, tag=True):
    n: int


Msg = Put | Get | Boom | Block | Count


class Recorder(Actor):
    """Keeps what it was told; Block waits for ``gate``; Boom raises."""

    starts = 0

    def __init__(self, log: list[Any], gate: anyio.Event | None = None) -> None:
        self.log = log
        self.gate = gate
        self.values: list[int] = []
        self.cancelled = 0

    async def on_start(self) -> None:
        Recorder.starts += 1
        self.log.append("start")

    async def on_stop(self) -> None:
        self.log.append("stop")

    async def receive(self, message: Msg) -> Any:
        match message:
            case Put(value):
                self.values.append(value)
                self.log.append(value)
            case Get():
                return list(self.values)
            case Boom():
                raise ValueError("boom")
            case Block():
                assert self.gate is not None
                try:
                    await self.gate.wait()
                except anyio.get_cancelled_exc_class():
                    self.log.append("cancelled")
                    raise
                return "unblocked"
            case Count(n):
                return self._count(n)
        return None

    async def _count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
            await checkpoint()


async def test_messages_are_handled_in_order() -> None:
    log: list[Any] = []
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log)
        for i in range(10):
            await ref.tell(Put(i))
        assert await ref.ask(Get()) == list(range(10))
    assert log == ["start", *range(10), "stop"]


async def test_tell_nowait_raises_when_full_and_tell_waits_for_room() -> None:
    gate = anyio.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [], gate, mailbox_size=2)
        ref.tell_nowait(Block())
        await wait_all_tasks_blocked()  # the actor is now inside Block
        ref.tell_nowait(Put(1))
        ref.tell_nowait(Put(2))
        with pytest.raises(MailboxFull):
            ref.tell_nowait(Put(3))
        async with anyio.create_task_group() as tg:
            tg.start_soon(ref.tell, Put(3))
            await wait_all_tasks_blocked()
            stats = ref.statistics()
            assert (stats.queued, stats.senders_waiting, stats.capacity) == (2, 1, 2)
            gate.set()
        assert await ref.ask(Get()) == [1, 2, 3]


async def test_statistics_is_an_immutable_record() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [])
        await ref.ask(Get())
        stats = ref.statistics()
        assert isinstance(stats, MailboxStatistics)
        assert stats.handled == 1 and stats.alive
        with pytest.raises(AttributeError):
            stats.handled = 5  # type: ignore[misc]


async def test_ask_times_out_and_the_actor_is_cancelled_and_keeps_serving() -> None:
    log: list[Any] = []
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log, anyio.Event())
        with pytest.raises(AskTimeout):
            await ref.ask(Block(), timeout=0.05)
        assert await ref.ask(Get()) == []
        assert "cancelled" in log


async def test_a_withdrawn_ask_still_queued_is_skipped() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log, gate)
        ref.tell_nowait(Block())
        await wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ref.ask, Put(7))
                await wait_all_tasks_blocked()
                scope.cancel()
        gate.set()
        assert await ref.ask(Get()) == []


async def test_cancelling_the_caller_cancels_the_handler() -> None:
    log: list[Any] = []
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log, anyio.Event())
        with anyio.move_on_after(0.05):
            await ref.ask(Block(), timeout=None)
        await ref.ask(Get())
        assert "cancelled" in log


async def test_an_error_in_ask_goes_to_the_caller_and_the_actor_lives_on() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [])
        with pytest.raises(ValueError, match="boom"):
            await ref.ask(Boom())
        await ref.tell(Put(1))
        assert await ref.ask(Get()) == [1]
        assert ref.statistics().failed == 1


async def test_stream_yields_items_in_order() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [])
        assert [i async for i in ref.stream(Count(5))] == [0, 1, 2, 3, 4]


async def test_a_crash_in_tell_kills_the_actor_and_fails_queued_asks() -> None:
    gate = anyio.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [], gate)
        ref.tell_nowait(Block())
        await wait_all_tasks_blocked()
        ref.tell_nowait(Boom())
        results: list[BaseException] = []

        async def ask_later() -> None:
            try:
                await ref.ask(Get())
            except ActorDeadError as exc:
                results.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_later)
            await wait_all_tasks_blocked()
            gate.set()
        assert len(results) == 1
        assert not ref.alive
        with anyio.fail_after(1):
            with pytest.raises(ActorDeadError):
                await ref.ask(Get())
        with pytest.raises(ActorDeadError):
            ref.tell_nowait(Put(1))


async def test_restart_on_failure_builds_a_fresh_actor_up_to_the_limit() -> None:
    log: list[Any] = []
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log, restart=RestartPolicy.on_failure(max_restarts=2))
        await ref.tell(Put(1))
        await ref.tell(Boom())
        assert await ref.ask(Get()) == []  # new instance: state reset, ref still valid
        assert ref.statistics().restarts == 1
        await ref.tell(Boom())
        assert await ref.ask(Get()) == []
        await ref.tell(Boom())  # third crash within the window: past the limit
        with anyio.fail_after(1), pytest.raises(ActorDeadError):
            await ref.ask(Get())
    assert log.count("start") == 3


async def test_a_failing_on_start_fails_spawn() -> None:
    class Broken(Actor):
        async def on_start(self) -> None:
            raise OSError("no model here")

    async with Runtime() as rt:
        with pytest.raises(OSError, match="no model here"):
            await rt.spawn(Broken)
        ref = await rt.spawn(Recorder, [])  # the runtime is unharmed
        assert await ref.ask(Get()) == []


async def test_stop_handles_earlier_messages_then_fails_later_ones() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, log, gate)
        ref.tell_nowait(Block())
        await wait_all_tasks_blocked()
        ref.tell_nowait(Put(1))
        outcome: list[Any] = []

        async def stop() -> None:
            await ref.stop()
            outcome.append("stopped")

        async def late_ask() -> None:
            try:
                await ref.ask(Get())
            except ActorDeadError:
                outcome.append("dead")

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            await wait_all_tasks_blocked()
            tg.start_soon(late_ask)
            await wait_all_tasks_blocked()
            gate.set()
        assert sorted(outcome) == ["dead", "stopped"]
    assert log == ["start", 1, "stop"]


async def test_runtime_exit_stops_actors_last_spawned_first() -> None:
    log: list[Any] = []

    class Named(Actor):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        async def on_stop(self) -> None:
            log.append(self.tag)

    async with Runtime() as rt:
        for tag in "abc":
            await rt.spawn(Named, tag, name=tag)
        with pytest.raises(ValueError, match="already running"):
            await rt.spawn(Named, "x", name="a")
    assert log == ["c", "b", "a"]


async def test_shutdown_with_work_in_flight_answers_or_fails_every_ask() -> None:
    gate = anyio.Event()
    results: list[Any] = []

    async def ask(ref: ActorRef[Any], msg: Msg) -> None:
        try:
            results.append(await ref.ask(msg, timeout=None))
        except ActorDeadError:
            results.append("dead")

    async with anyio.create_task_group() as tg, Runtime(stop_timeout=0.2) as rt:
        ref = await rt.spawn(Recorder, [], gate, mailbox_size=8)
        tg.start_soon(ask, ref, Block())  # never released: cancelled at stop_timeout
        await wait_all_tasks_blocked()
        for _ in range(3):
            tg.start_soon(ask, ref, Get())
        await wait_all_tasks_blocked()
    assert len(results) == 4
    assert results == ["dead"] * 4


async def test_a_hung_actor_is_cancelled_after_stop_timeout() -> None:
    log: list[Any] = []
    with anyio.fail_after(5):
        async with Runtime(stop_timeout=0.1) as rt:
            ref = await rt.spawn(Recorder, log, anyio.Event())
            ref.tell_nowait(Block())
            await wait_all_tasks_blocked()
    assert "cancelled" in log and not ref.alive


# -- thread-owning actors ----------------------------------------------------------------


class Ping(msgspec.Struct, frozen=True, tag=True):
    pass


class Sleep(msgspec.Struct, frozen=True, tag=True):
    pass


class Work(msgspec.Struct, frozen=True, tag=True):
    steps: int


class Tokens(msgspec.Struct, frozen=True, tag=True):
    n: int


class Crash(msgspec.Struct, frozen=True, tag=True):
    pass


class Worker(ThreadActor):
    """Records the thread of every call; Sleep blocks its thread until released."""

    def __init__(
        self,
        release: threading.Event,
        finished: threading.Event,
        sleeping: threading.Event | None = None,
    ) -> None:
        self.release = release
        self.finished = finished
        self.sleeping = sleeping or threading.Event()  # set once Sleep blocks
        self.threads: set[int] = set()
        self.pending: list[Any] = []
        self.steps = 0
        self.crash_in_idle = False

    def on_start(self) -> None:
        self.threads.add(threading.get_ident())

    def receive(self, message: Any) -> Any:
        self.threads.add(threading.get_ident())
        match message:
            case Ping():
                return sorted(self.threads), self.steps
            case Sleep():
                self.sleeping.set()
                self.release.wait(10)
                self.finished.set()
                return "slept"
            case Work(steps):
                assert self.reply is not None
                self.pending.append([steps, self.reply.detach()])
            case Tokens(n):
                return iter(range(n))
            case Crash():
                self.crash_in_idle = True
        return None

    def on_idle(self) -> bool:
        self.threads.add(threading.get_ident())
        if self.crash_in_idle:
            raise RuntimeError("idle crash")
        for job in self.pending:
            job[0] -= 1
            self.steps += 1
            if job[0] == 0:
                job[1].resolve(self.steps)
        self.pending = [job for job in self.pending if job[0] > 0]
        return bool(self.pending)


async def test_thread_actor_runs_every_handler_on_its_own_thread() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Worker, threading.Event(), threading.Event())
        await ref.ask(Work(3))
        threads, steps = await ref.ask(Ping())
        assert steps == 3
        assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_a_blocking_handler_does_not_delay_other_actors() -> None:
    release, finished = threading.Event(), threading.Event()
    async with Runtime() as rt:
        slow = await rt.spawn(Worker, release, finished)
        other = await rt.spawn(Recorder, [])
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow.ask, Sleep())
            await other.tell(Put(1))
            assert await other.ask(Get()) == [1]
            # The other actor answered while the thread was still blocked.
            assert not finished.is_set()
            release.set()
        assert finished.is_set()


async def test_a_two_second_handler_leaves_the_loop_free() -> None:
    # The case: a handler that holds its thread, asks elsewhere meanwhile. It holds
    # it until the asks are answered (no timer): a loop it blocked answers none of them.
    release, finished, sleeping = threading.Event(), threading.Event(), threading.Event()
    async with Runtime() as rt:
        slow = await rt.spawn(Worker, release, finished, sleeping)
        other = await rt.spawn(Recorder, [])
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow.ask, Sleep())
            assert await anyio.to_thread.run_sync(sleeping.wait, 10)
            with anyio.fail_after(5):  # the handler holds its thread for up to 10 s
                for _ in range(10):
                    await other.ask(Get())
            answered_during = not finished.is_set()
            release.set()
        assert answered_during and finished.is_set()


async def test_idle_work_interleaves_with_messages() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Worker, threading.Event(), threading.Event())
        results: list[int] = []

        async def work(n: int) -> None:
            results.append(await ref.ask(Work(n)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(work, 50)
            tg.start_soon(work, 2)
        # The short job was admitted while the long one was stepping and finished first.
        assert results[0] < results[1]


async def test_thread_actor_streams_and_stops_when_the_reader_leaves() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Worker, threading.Event(), threading.Event())
        assert [i async for i in ref.stream(Tokens(4))] == [0, 1, 2, 3]
        async with ref.stream(Tokens(10**9)) as items:
            async for i in items:
                if i == 3:
                    break
        assert await ref.ask(Ping()) is not None  # not stuck in the endless stream


async def test_a_crash_in_on_idle_restarts_the_thread_actor() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(
            Worker, threading.Event(), threading.Event(), restart=RestartPolicy.on_failure()
        )
        await ref.tell(Crash())
        with anyio.fail_after(5):  # a poll: nothing signals a restart but the count
            while ref.statistics().restarts == 0:
                await anyio.sleep(0.01)
        threads, _ = await ref.ask(Ping())
        assert len(threads) == 1  # the same OS thread serves the new instance


# -- embedding ------------------------------------------------------------------------------


async def _echo_session() -> list[int]:
    async with Runtime() as rt:
        ref = await rt.spawn(Recorder, [])
        await ref.tell(Put(42))
        worker = await rt.spawn(Worker, threading.Event(), threading.Event())
        await worker.ask(Work(2))
        values: list[int] = await ref.ask(Get())
        return values


def test_embedded_in_a_plain_asyncio_application() -> None:
    async def app() -> list[int]:
        other = asyncio.create_task(asyncio.sleep(0))  # the app's own asyncio work
        result = await _echo_session()
        await other
        return result

    assert asyncio.run(app()) == [42]


def test_embedded_in_a_plain_trio_application() -> None:
    import trio

    assert trio.run(_echo_session) == [42]


def test_spawn_outside_a_running_runtime_is_an_error() -> None:
    async def main() -> None:
        rt = Runtime()
        with pytest.raises(RuntimeError, match="async with"):
            await rt.spawn(Recorder, [])

    anyio.run(main)


class Timer(ThreadActor):
    """Counts the on_idle calls that its wake-up brought (no message, no work)."""

    def __init__(self, woke: threading.Event, wake_s: float | None) -> None:
        self.woke = woke
        self.wakes = 0
        self.idle_wake_s = wake_s

    def receive(self, message: Any) -> Any:
        return self.wakes

    def on_idle(self) -> bool:
        self.wakes += 1
        if self.wakes >= 3:
            self.woke.set()
        return False  # no work: only the wake-up calls it again


async def test_a_thread_actor_with_idle_wake_s_runs_on_idle_without_messages() -> None:
    woke = threading.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Timer, woke, 0.01, name="timer")
        await ref.ask(Ping())  # started, then left alone
        assert await anyio.to_thread.run_sync(woke.wait, 10)
        assert await ref.ask(Ping()) >= 3
    plain = threading.Event()
    async with Runtime() as rt:
        ref = await rt.spawn(Timer, plain, None, name="plain")  # nothing wakes it
        await ref.ask(Ping())
        assert await ref.ask(Ping()) <= 2  # on_idle only after each message
