"""``kvactor demo``: actors sharing one thread-owning worker, with live mailbox statistics."""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import msgspec

from .runtime import Actor, ActorRef, Runtime, ThreadActor

__all__ = ("run_demo",)


class Square(msgspec.Struct, frozen=True, tag=True):
    value: int


class Ask(msgspec.Struct, frozen=True, tag=True):
    rounds: int


class Compute(ThreadActor):
    """Stands in for the engine: blocking work on its own OS thread."""

    def receive(self, message: Square) -> int:
        time.sleep(0.01)  # blocking work; the event loop stays free
        return message.value * message.value


class Agent(Actor):
    def __init__(self, compute: ActorRef[Any]) -> None:
        self.compute = compute

    async def receive(self, message: Ask) -> int:
        total = 0
        for i in range(message.rounds):
            total += await self.compute.ask(Square(i))
        return total


async def _main(n_agents: int, rounds: int) -> None:
    async with Runtime() as rt:
        compute = await rt.spawn(Compute, name="compute")
        agents = [await rt.spawn(Agent, compute, name=f"agent-{i}") for i in range(n_agents)]
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(agent.ask, Ask(rounds))
        elapsed = time.perf_counter() - t0
        print(f"{n_agents} agents x {rounds} asks through one compute thread: {elapsed:.2f} s")
        print(f"{'actor':<10} {'handled':>8} {'failed':>7} {'queued':>7}")
        for name, stats in rt.statistics().items():
            print(f"{name:<10} {stats.handled:>8} {stats.failed:>7} {stats.queued:>7}")


def run_demo(args: argparse.Namespace) -> int:
    anyio.run(_main, 6, 20, backend=args.backend)
    return 0
