"""Attention of a turn's new tokens over a stored cache, every layer, by each kernel: on a
cache of the default model's shape (30 layers, 3 KV heads of 64, 9 query heads) stored
with the default codec (keys 5-bit, values 3-bit, group 64, Hadamard rotation, 4 sinks
at 8 bits), ``--tokens`` tokens, for 1 to 8 new tokens (3 to 24 queries a KV head):

- ``stored``: numba over the packed codes (``kernels.stored_attend``), no float copy;
- ``quantized_matmul``: MLX's ``quantized_matmul`` over the codes;
- ``reference``: the past dequantized by MLX's ops each step, then matmuls;
- ``float``: MLX's fused attention over a float copy made before (a ready copy's step);
- ``float_with_copy``: the same with the copy made in the step (the fused dequantize: a
  warm turn's first step).

What sets ``MAX_QUERIES`` (the queries a row up to which ``"auto"`` takes the stored
kernel on the CPU). Medians of ``--rounds`` rounds that alternate the kernels.

    python bench/stored_attend.py [--tokens 4096] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import kvactor  # noqa: F401 - first: it loads an optimized BLAS before mlx.core

# isort: split
import mlx.core as mx
from _results import write_json  # bench/ is the script's folder: on sys.path
from dequantize import DIM, HEADS, LAYERS, stored

from kvactor.kernels import fused, stored_attend
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.quantized_turn import QuantizedTurnCache

REPEATS = 3  # query heads a KV head (the default model: 9 over 3)
NEW = (1, 2, 4, 5, 6, 8)
KERNELS = ("stored", "quantized_matmul", "reference", "float", "float_with_copy")


def _new(n: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, HEADS * REPEATS, n, DIM), key=keys[0])
    k, v = (mx.random.normal((1, HEADS, n, DIM), key=key) for key in keys[1:])
    mx.eval(q, k, v)
    return q, k, v


def quantized(kv: AgentKV, kernel: str, n: int) -> Callable[[], float]:
    q, k, v = _new(n, 1)

    def run() -> float:
        layers = QuantizedTurnCache.with_kernel(kernel).start(kv).layers  # type: ignore[arg-type]
        mx.eval([a for layer in layers for a in layer.state])
        t0 = time.perf_counter()
        outs = []
        for cache in layers:
            mask = cache.make_mask(n)  # before the new tokens go in, as a model makes it
            cache.update_and_fetch(k, v)
            outs.append(cache.attend(q, k, v, scale=DIM**-0.5, mask=mask))
            mx.eval(outs[-1])  # layer by layer, as a model's forward needs them
        return time.perf_counter() - t0

    return run


def floating(kv: AgentKV, n: int, copy: bool) -> Callable[[], float]:
    """(The copy left in the stored basis, as a turn keeps it, with room for the new
    tokens, written in place: the queries are not turned in here, which changes no time.)"""
    q, k, v = _new(n, 1)
    made = kv.dequantize_layers(range(LAYERS), rotated=True, room=n)
    assert made is not None, "the fused dequantize must run here"
    mx.eval(made)

    def run() -> float:
        t0 = time.perf_counter()
        pairs = kv.dequantize_layers(range(LAYERS), rotated=True, room=n) if copy else made
        assert pairs is not None
        for keys, values in pairs:
            keys[:, :, -n:] = k
            values[:, :, -n:] = v
            mask = "causal" if n > 1 else None
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIM**-0.5, mask=mask)
            mx.eval(out)
        return time.perf_counter() - t0

    return run


def main(tokens: int, rounds: int) -> dict[str, Any]:
    if not fused.wait(300):
        raise SystemExit(f"the numba kernels cannot run here: {fused.unavailable()}")
    kv = stored(tokens)
    out: dict[str, Any] = {
        "tokens": tokens,
        "rounds": rounds,
        "max_queries": stored_attend.MAX_QUERIES,
        "new": {},
    }
    for n in NEW:
        runs = {
            "stored": quantized(kv, "stored", n),
            "quantized_matmul": quantized(kv, "quantized_matmul", n),
            "reference": quantized(kv, "reference", n),
            "float": floating(kv, n, copy=False),
            "float_with_copy": floating(kv, n, copy=True),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm up
        for r in range(rounds):
            for name in KERNELS if r % 2 == 0 else KERNELS[::-1]:
                times[name].append(runs[name]())
        row = {f"{name}_s": statistics.median(ts) for name, ts in times.items()}
        row["queries_a_row"] = n * REPEATS
        row["stored_vs_float"] = row["stored_s"] / row["float_s"]
        row["stored_vs_float_with_copy"] = row["stored_s"] / row["float_with_copy_s"]
        row["stored_vs_quantized_matmul"] = row["stored_s"] / row["quantized_matmul_s"]
        out["new"][str(n)] = row
    return out


def table(results: dict[str, Any]) -> None:
    print(f"\n{results['tokens']} stored tokens, every layer (medians of {results['rounds']})\n")
    print("| new tokens | queries a row | " + " | ".join(KERNELS) + " | stored vs float |")
    print("|---:|---:|" + "---:|" * (len(KERNELS) + 1))
    for n, row in results["new"].items():
        cells = " | ".join(f"{row[f'{k}_s'] * 1e3:.0f} ms" for k in KERNELS)
        print(f"| {n} | {row['queries_a_row']} | {cells} | {row['stored_vs_float']:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = main(args.tokens, args.rounds)
    table(results)
    if args.json:
        write_json(args.json, results)
