"""What a turn's whole-cache copies cost: one agent's turns of a few tokens at several
contexts, its float K/V kept in one buffer from the turn's start to its ready copy (the
default, ``FloatTurnCache.keeps_buffers``) against the copies mlx-lm's ``merge`` and
``extract`` make at the decode batch's door, the grow of the batch's first step, and a
ready copy settled into a new array (``keeps_buffers = False``, the code before it).

One agent per context (default model, dequantized attention, no warm tier), prefilled
once; then ``--rounds`` rounds that alternate the two ways, each ``--turns`` turns of
``--tokens`` tokens in a row (the same raw prompt, so every turn reuses all but its last
token). Per way, medians of: a turn's wall time (``turn_s``), its wait for the previous
turn's end (``queue_s``: the engine parks the previous turn after its answer is out), and
its decode step (``decode_step_s``).

    python bench/turn_buffers.py [--contexts 1024 2048 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.kernels.float_turn import FloatTurnCache

TEXT = Path(__file__).with_name("data") / "fidelity.txt"
WAYS = {"kept": True, "copied": False}


async def measure(n: int, rounds: int, turns: int, tokens: int) -> dict[str, Any]:
    async with kvactor.open(cache_dir=None, attention="dequantized") as kv:
        prompt = kv.tokenizer.decode(kv.tokenizer.encode(TEXT.read_text())[:n])
        agent = await kv.spawn_agent(f"buffers-{n}")
        await agent.complete(prompt, max_tokens=1)
        samples: dict[str, dict[str, list[float]]] = {
            way: {"turn_s": [], "queue_s": [], "decode_step_s": []} for way in WAYS
        }
        for r in range(rounds):
            for way in list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]:
                FloatTurnCache.keeps_buffers = WAYS[way]
                await agent.complete(prompt, max_tokens=tokens)  # the way's first turn end
                for _ in range(turns):
                    t0 = time.perf_counter()
                    done = await agent.complete(prompt, max_tokens=tokens)
                    samples[way]["turn_s"].append(time.perf_counter() - t0)
                    samples[way]["queue_s"].append(done.timings.queue_s)
                    steps = done.timings.generated_tokens - 1
                    samples[way]["decode_step_s"].append(done.timings.decode_s / steps)
        FloatTurnCache.keeps_buffers = True
    out: dict[str, Any] = {"context": n}
    for way, values in samples.items():
        for key, xs in values.items():
            out[f"{way}_{key}"] = statistics.median(xs)
    out["turn_ratio"] = out["kept_turn_s"] / out["copied_turn_s"]
    return out


def main(contexts: list[int], rounds: int, turns: int, tokens: int) -> dict[str, Any]:
    rows = [anyio.run(measure, n, rounds, turns, tokens) for n in contexts]
    return {"rounds": rounds, "turns": turns, "tokens": tokens, "contexts": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    out = main(args.contexts, args.rounds, args.turns, args.tokens)
    print(
        "| context | turn, buffers kept | turn, copied | ratio | wait for the previous turn, "
        "kept / copied | decode step, kept / copied |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for row in out["contexts"]:
        print(
            f"| {row['context']} | {row['kept_turn_s'] * 1e3:.0f} ms "
            f"| {row['copied_turn_s'] * 1e3:.0f} ms | {row['turn_ratio']:.2f}x "
            f"| {row['kept_queue_s'] * 1e3:.0f} / {row['copied_queue_s'] * 1e3:.0f} ms "
            f"| {row['kept_decode_step_s'] * 1e3:.0f} / "
            f"{row['copied_decode_step_s'] * 1e3:.0f} ms |"
        )
    if args.json:
        write_json(args.json, out)
