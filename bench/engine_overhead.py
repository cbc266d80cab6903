"""Decode tokens/s of one agent through the actors vs mlx-lm's generate_step called
directly on the same model and prompt, in the same process.

    python bench/engine_overhead.py [--model PATH] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
import mlx.core as mx
from _results import write_json  # bench/ is the script's folder: on sys.path
from mlx_lm.generate import generate_step

from kvactor.actors.model import LoadedModel, load_model

PROMPT = "Write a long story about a lighthouse keeper and the storm."


def direct_tok_s(lm: LoadedModel, tokens: list[int], n: int) -> float:
    """generate_step's decode rate, timed from its first token to its n-th."""
    prompt = mx.array(tokens, dtype=mx.uint32)
    stamps = []
    for _token, _ in generate_step(
        prompt, lm.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def actor_tok_s(session: kvactor.Session, n: int, i: int) -> float:
    agent = await session.spawn_agent(f"bench-{i}")
    stamps = []
    async for _ in agent.stream(PROMPT, max_tokens=n):
        stamps.append(time.perf_counter())
    await session.forget(agent.name)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def main(model: str | None, n: int, rounds: int) -> dict[str, Any]:
    lm = load_model(model)  # the direct side's own copy, on this thread
    async with kvactor.open(model) as session:
        tokens = session.tokenizer.encode(
            session.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        )
        actor, direct = [], []
        for i in range(rounds):  # alternate the two against drift
            direct.append(direct_tok_s(lm, tokens, n))  # blocks the loop: nothing else runs
            actor.append(await actor_tok_s(session, n, i))
    a, d = max(actor), max(direct)
    return {"actor_tok_s": round(a, 2), "direct_tok_s": round(d, 2), "ratio": round(a / d, 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = anyio.run(main, args.model, args.tokens, args.rounds)
    print("| path | decode tok/s |")
    print("|---|---:|")
    print(f"| kvactor agent → engine actor | {result['actor_tok_s']:.1f} |")
    print(f"| mlx-lm generate_step, direct | {result['direct_tok_s']:.1f} |")
    print(f"| ratio | {result['ratio']:.3f} |")
    if args.json:
        write_json(args.json, result)
