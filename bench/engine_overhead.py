"""Decode tokens/s through the actors vs mlx-lm called directly on the same model and
prompts, in the same process (``generate_step`` at batch 1, ``BatchGenerator`` at batch 8);
and the engine's pipelined decode (step n+1 built
and launched before step n's tokens are read) vs reading each step first, at batch 1 and
batch 8; and the default session (under its memory limit over everything: 3/4 of RAM) vs
one opened with ``memory_limit=None`` (only the hot budget), batch 1 and 8. Rounds alternate
the variants against drift; each figure is its best round.

    python bench/engine_overhead.py [--model PATH] [--tokens 48] [--rounds 3] [--json PATH]
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
from mlx_lm.generate import BatchGenerator, generate_step

from kvactor.actors.engine._batch import DecodeBatch
from kvactor.actors.models import LoadedModel, load_model

PROMPT = "Write a long story about a lighthouse keeper and the storm."
BATCH = 8


def direct_tok_s(lm: LoadedModel, tokens: list[int], n: int) -> float:
    """generate_step's decode rate, timed from its first token to its n-th."""
    prompt = mx.array(tokens, dtype=mx.uint32)
    stamps = []
    for _token, _ in generate_step(
        prompt, lm.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def direct_batch_tok_s(lm: LoadedModel, prompts: list[list[int]], n: int) -> float:
    """mlx-lm's BatchGenerator over ``prompts`` at once: tokens/s from the first step that
    gave every prompt its first token to the last (the first tokens come from prefill)."""
    gen = BatchGenerator(lm.model, stop_tokens=[], sampler=lambda x: mx.argmax(x, axis=-1))
    gen.insert(prompts, max_tokens=[n] * len(prompts))
    stamps: list[tuple[float, int]] = []
    while responses := gen.next_generated():
        stamps.append((time.perf_counter(), len(responses)))
    gen.close()
    tokens = sum(count for _, count in stamps) - len(prompts)
    return tokens / (stamps[-1][0] - stamps[0][0])


async def actor_tok_s(session: kvactor.Session, n: int, tag: str, agents: int = 1) -> float:
    """Tokens/s of ``agents`` agents decoding together, from the first token any of them
    got to the last one (every agent streams ``n`` tokens of its own prompt)."""
    names = [await session.spawn_agent(f"bench-{tag}-{i}") for i in range(agents)]
    stamps: list[float] = []

    async def one(i: int) -> None:
        async for _ in names[i].stream(f"{PROMPT} Chapter {i + 1}.", max_tokens=n):
            stamps.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for i in range(agents):
            tg.start_soon(one, i)
    for agent in names:
        await session.forget(agent.name)
    # The first token of each agent comes from its prefill, not a decode step.
    return (len(stamps) - agents) / (max(stamps) - min(stamps))


async def main(model: str | None, n: int, rounds: int) -> dict[str, Any]:
    lm = load_model(model)  # the direct side's own copy, on this thread
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "direct",
            "direct_b8",
            "pipelined",
            "unpipelined",
            "b8_pipelined",
            "b8_unpipelined",
            "unlimited",
            "b8_unlimited",
        )
    }
    async with (
        kvactor.open(model, max_batch=BATCH) as session,
        kvactor.open(model, max_batch=BATCH, memory_limit=None) as unlimited,
    ):
        template = session.tokenizer.apply_chat_template
        tokens = session.tokenizer.encode(template([{"role": "user", "content": PROMPT}]))
        batch = [
            session.tokenizer.encode(
                template([{"role": "user", "content": f"{PROMPT} Chapter {i + 1}."}])
            )
            for i in range(BATCH)
        ]
        await actor_tok_s(session, 4, "warmup")
        await actor_tok_s(unlimited, 4, "warmup")
        for r in range(rounds):  # alternate the variants against drift
            runs["direct"].append(direct_tok_s(lm, tokens, n))  # blocks the loop: alone
            runs["direct_b8"].append(direct_batch_tok_s(lm, batch, n))
            for pipelined in (True, False):
                DecodeBatch.pipelined = pipelined
                key = "pipelined" if pipelined else "unpipelined"
                runs[key].append(await actor_tok_s(session, n, f"{key}{r}"))
                runs[f"b8_{key}"].append(await actor_tok_s(session, n, f"b8{key}{r}", BATCH))
            runs["unlimited"].append(await actor_tok_s(unlimited, n, f"free{r}"))
            runs["b8_unlimited"].append(await actor_tok_s(unlimited, n, f"b8free{r}", BATCH))
        DecodeBatch.pipelined = True
    best = {k: max(v) for k, v in runs.items()}
    return {
        "actor_tok_s": round(best["pipelined"], 2),
        "direct_tok_s": round(best["direct"], 2),
        "ratio": round(best["pipelined"] / best["direct"], 3),
        "direct_b8_tok_s": round(best["direct_b8"], 2),
        "ratio_b8": round(best["b8_pipelined"] / best["direct_b8"], 3),
        "unpipelined_tok_s": round(best["unpipelined"], 2),
        "ratio_unpipelined": round(best["unpipelined"] / best["direct"], 3),
        "pipeline_gain_b1": round(best["pipelined"] / best["unpipelined"], 3),
        "b8_pipelined_tok_s": round(best["b8_pipelined"], 2),
        "b8_unpipelined_tok_s": round(best["b8_unpipelined"], 2),
        "pipeline_gain_b8": round(best["b8_pipelined"] / best["b8_unpipelined"], 3),
        "unlimited_tok_s": round(best["unlimited"], 2),
        "b8_unlimited_tok_s": round(best["b8_unlimited"], 2),
        "limit_vs_unlimited_b1": round(best["pipelined"] / best["unlimited"], 3),
        "limit_vs_unlimited_b8": round(best["b8_pipelined"] / best["b8_unlimited"], 3),
        "tokens": n,
        "rounds": rounds,
        "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = anyio.run(main, args.model, args.tokens, args.rounds)
    print("| path | decode tok/s | vs direct |")
    print("|---|---:|---:|")
    print(f"| mlx-lm generate_step, direct | {result['direct_tok_s']:.1f} | 1.000 |")
    print(
        f"| kvactor, pipelined decode (default) | {result['actor_tok_s']:.1f} "
        f"| {result['ratio']:.3f} |"
    )
    print(
        f"| kvactor, each step read before the next | {result['unpipelined_tok_s']:.1f} "
        f"| {result['ratio_unpipelined']:.3f} |"
    )
    print(f"| mlx-lm BatchGenerator, direct, batch {BATCH} | {result['direct_b8_tok_s']:.1f} | |")
    print(
        f"| batch {BATCH}, pipelined | {result['b8_pipelined_tok_s']:.1f} "
        f"| {result['ratio_b8']:.3f} (vs BatchGenerator) |"
    )
    print(f"| batch {BATCH}, each step read first | {result['b8_unpipelined_tok_s']:.1f} | |")
    print(f"| memory_limit=None, batch 1 | {result['unlimited_tok_s']:.1f} | |")
    print(f"| memory_limit=None, batch {BATCH} | {result['b8_unlimited_tok_s']:.1f} | |")
    print(
        f"pipelined / unpipelined: batch 1 {result['pipeline_gain_b1']:.3f}, "
        f"batch {BATCH} {result['pipeline_gain_b8']:.3f}"
    )
    print(
        f"default memory limit / memory_limit=None: batch 1 "
        f"{result['limit_vs_unlimited_b1']:.3f}, batch {BATCH} "
        f"{result['limit_vs_unlimited_b8']:.3f}"
    )
    if args.json:
        write_json(args.json, result)
