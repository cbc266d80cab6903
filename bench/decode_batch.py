"""Aggregate decode tokens/s of 1, 2, 4, 8 agents decoding together on one engine.

    python bench/decode_batch.py [--model PATH] [--tokens 32] [--json PATH]

Every size runs in the same process on the same engine, so the ratios compare like with
like on a noisy machine; both attention modes (float copies vs quantized caches) run
side by side, interleaved. Each agent gets a different prompt; what counts is the window in
which all n agents decode together (from the last one's first token to the first one's
last token), so the prefills of the others are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import anyio
from _results import write_json  # bench/ is the script's folder: on sys.path

import kvactor
from kvactor.actors.engine import Attention

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Describe the water cycle in detail.",
    "Explain how a steam engine works, step by step.",
    "Tell me about the history of the printing press.",
    "Write a poem about autumn leaves and rain.",
    "Describe a busy market in a coastal town.",
    "Explain why the sky is blue to a child.",
    "Write a letter to a friend about a long journey.",
]


async def measure(session: kvactor.Session, n: int, tokens: int, round_: int | str) -> float:
    """Tokens/s summed over n new agents (named after ``round_``) while all n are in the
    batch together (``bench/dashboard.py`` counts its rounds with it too)."""
    agents = [await session.spawn_agent(f"r{round_}-n{n}-{i}") for i in range(n)]
    stamps: list[list[float]] = [[] for _ in range(n)]

    async def run(i: int) -> None:
        async for _ in agents[i].stream(PROMPTS[i % len(PROMPTS)], max_tokens=tokens):
            stamps[i].append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(run, i)
    for agent in agents:
        await session.forget(agent.name)
    start = max(s[0] for s in stamps)  # the last agent's first token: all n now decode
    end = min(s[-1] for s in stamps)  # the first agent to finish leaves the batch
    produced = sum(1 for s in stamps for t in s if start < t <= end)
    if end <= start or produced < n:
        raise RuntimeError("no window where all agents decoded together: raise --tokens")
    return produced / (end - start)


MODES: tuple[Attention, ...] = ("dequantized", "quantized")


async def main(model: str | None, tokens: int, rounds: int) -> dict[str, Any]:
    sizes = [1, 2, 4, 8]
    best = {mode: {n: 0.0 for n in sizes} for mode in MODES}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            mode: await stack.enter_async_context(kvactor.open(model, max_batch=8, attention=mode))
            for mode in MODES
        }
        for r in range(rounds):  # interleave modes and sizes across rounds against drift
            for mode, session in sessions.items():
                for n in sizes:
                    best[mode][n] = max(best[mode][n], await measure(session, n, tokens, r))
    main_mode = best["dequantized"]
    return {
        "model": model or "default",
        "agents": {str(n): round(v, 2) for n, v in main_mode.items()},
        "ratio_8_vs_1": round(main_mode[8] / main_mode[1], 2),
        "attention": {
            mode: {str(n): round(v, 2) for n, v in values.items()} for mode, values in best.items()
        },
        "quantized_vs_dequantized": {
            str(n): round(best["quantized"][n] / best["dequantized"][n], 2) for n in sizes
        },
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = anyio.run(main, args.model, args.tokens, args.rounds)
    print(
        "| agents | aggregate decode tok/s | vs 1 agent | quantized attention tok/s "
        "| quantized vs dequantized |"
    )
    print("|---:|---:|---:|---:|---:|")
    one = result["agents"]["1"]
    for n, v in result["agents"].items():
        q = result["attention"]["quantized"][n]
        print(f"| {n} | {v:.1f} | {v / one:.2f}x | {q:.1f} | {q / v:.2f}x |")
    if args.json:
        write_json(args.json, result)
