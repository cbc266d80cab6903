"""Actor messaging overhead: ``ask`` round trip and ``tell`` throughput of an echo actor,
next to a bare anyio memory-object-stream round trip measured in the same run.

    python bench/actor_overhead.py [--backend asyncio|trio] [--n 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
import msgspec
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.runtime import Actor, Runtime


class Echo(msgspec.Struct, frozen=True, tag=True):
    value: int


class EchoActor(Actor):
    def __init__(self) -> None:
        self.seen = 0

    async def receive(self, message: Echo) -> int:
        self.seen += 1
        return message.value


async def raw_rtt_us(n: int) -> float:
    """Request/reply over two bare memory object streams and an echo task."""
    req_send, req_recv = anyio.create_memory_object_stream[int](16)
    rep_send, rep_recv = anyio.create_memory_object_stream[int](16)

    async def echo() -> None:
        async with req_recv, rep_send:
            async for value in req_recv:
                await rep_send.send(value)

    samples: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(echo)
        for i in range(n):
            t0 = time.perf_counter()
            await req_send.send(i)
            await rep_recv.receive()
            samples.append(time.perf_counter() - t0)
        await req_send.aclose()
    return statistics.median(samples) * 1e6


async def actor_numbers(n: int) -> tuple[float, float]:
    async with Runtime(mailbox_size=16) as rt:
        ref = await rt.spawn(EchoActor)
        samples: list[float] = []
        for i in range(n):
            t0 = time.perf_counter()
            await ref.ask(Echo(i))
            samples.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            await ref.tell(Echo(i))
        await ref.ask(Echo(-1))  # everything told before it has been handled
        tell_per_s = n / (time.perf_counter() - t0)
    return statistics.median(samples) * 1e6, tell_per_s


async def main(n: int) -> dict[str, Any]:
    # Interleave the two measurements so drift on a noisy machine hits both alike.
    raw, ask, tells = [], [], []
    for _ in range(3):
        raw.append(await raw_rtt_us(n))
        a, t = await actor_numbers(n)
        ask.append(a)
        tells.append(t)
    raw_us, ask_us = min(raw), min(ask)
    return {
        "ask_rtt_us": round(ask_us, 2),
        "raw_rtt_us": round(raw_us, 2),
        "ratio": round(ask_us / raw_us, 3),
        "tell_per_s": round(max(tells)),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = anyio.run(main, args.n, backend=args.backend)
    result["backend"] = args.backend
    print("| backend | ask round trip (µs) | raw stream round trip (µs) | ratio | tell/s |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| {args.backend} | {result['ask_rtt_us']} | {result['raw_rtt_us']} | "
        f"{result['ratio']} | {result['tell_per_s']:,} |"
    )
    if args.json:
        write_json(args.json, result)
