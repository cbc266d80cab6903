"""What a turn's float working copy costs to make, with and without the inverse rotation:
``AgentKV.dequantize`` of every layer's keys and values, on a cache of the default model's
shape (30 layers, 3 KV heads, head_dim 64) stored with the default codec (keys 5-bit,
values 3-bit, group 64, Hadamard rotation, 4 sinks at 8 bits), 4096 tokens in one range.

- ``model_basis``: ``rotated=False``, the values rotated back (the working copy before the
  rotated basis);
- ``rotated_basis``: ``rotated=True``, left in the stored basis (what ``FloatTurnCache``
  reads now that attention rotates queries and outputs instead);
- ``rotated_basis_mlx_default_cache``: the same with MLX's own limit on the freed buffers
  its allocator keeps (32 MiB on CPU) instead of the engine's (``kernels.memory``): every
  array then lands on fresh pages.
- ``rotated_basis_spread``: left rotated, a layer at a time over one MLX stream per core;
- ``rotated_basis_fused``: the fused kernel (``kernels.fused``, numba: one pass over the
  codes), what a turn's working copy takes on the CPU now; ``..._fused_mlx_default_cache``
  the same into fresh pages. ``fused_equal``: its values are the plain ops', bit for bit.

The plain variants run with ``KVACTOR_FUSED=0``.

Medians of ``--rounds`` rounds that alternate the three, every array evaluated.

    python bench/dequantize.py [--tokens 4096] [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import kvactor  # noqa: F401 - first: it loads an optimized BLAS before mlx.core

# isort: split
import mlx.core as mx
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.kernels import fused
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.memory import keep_freed_buffers
from kvactor.kernels.qcodec import DEFAULT_CODEC
from kvactor.kernels.stored import StoredRange
from kvactor.kernels.workers import spread, worker_streams

LAYERS, HEADS, DIM = 30, 3, 64


def stored(n: int) -> AgentKV:
    """An agent cache of ``n`` random tokens, every layer stored in one range."""
    mx.random.seed(0)
    kv = AgentKV(DEFAULT_CODEC, CacheGeometry.uniform(LAYERS, HEADS, DIM))
    layers = []
    for _ in range(LAYERS):
        k, v = (mx.random.normal((1, HEADS, n, DIM)) for _ in range(2))
        layers.append(
            (DEFAULT_CODEC.quantize(k, 0, role="key"), DEFAULT_CODEC.quantize(v, 0, role="value"))
        )
        mx.eval(layers[-1])
    kv.ranges = [StoredRange(0, n, layers)]
    kv.tokens = list(range(n))
    return kv


def dequantize_all(kv: AgentKV, rotated: bool) -> float:
    t0 = time.perf_counter()
    arrays = [
        kv.dequantize(i, role, rotated=rotated) for i in range(LAYERS) for role in ("key", "value")
    ]
    mx.eval(arrays)
    return time.perf_counter() - t0


def dequantize_spread(kv: AgentKV) -> float:
    """``dequantize_all`` left rotated, a layer at a time over one MLX stream per core
    (``kernels.workers``: what a turn's working copy does now)."""
    t0 = time.perf_counter()
    spread(
        LAYERS,
        lambda i: [kv.dequantize(i, role, rotated=True) for role in ("key", "value")],
        lambda pair: pair,
    )
    return time.perf_counter() - t0


def main(n: int, rounds: int) -> dict[str, Any]:
    kv = stored(n)
    mlx_limit = mx.set_cache_limit(0)  # what MLX keeps by default (nothing set it yet)
    mx.set_cache_limit(mlx_limit)
    engine_limit = keep_freed_buffers()
    limits = {"engine": engine_limit, "mlx_default_cache": mlx_limit}
    if not fused.wait(300):
        raise SystemExit(f"the fused dequantize cannot run here: {fused.unavailable()}")
    variants: list[tuple[str, bool | None, str, bool]] = [
        ("model_basis", False, "engine", False),
        ("rotated_basis", True, "engine", False),
        ("rotated_basis_mlx_default_cache", True, "mlx_default_cache", False),
        ("rotated_basis_spread", None, "engine", False),  # None: over the worker streams
        ("rotated_basis_fused", None, "engine", True),
        ("rotated_basis_fused_mlx_default_cache", None, "mlx_default_cache", True),
    ]
    times: dict[str, list[float]] = {name: [] for name, *_ in variants}

    def once(rotated: bool | None, fast: bool) -> float:
        os.environ["KVACTOR_FUSED"] = "1" if fast else "0"
        return dequantize_spread(kv) if rotated is None else dequantize_all(kv, rotated)

    for _, rotated, _, fast in variants:  # warm up every path
        once(rotated, fast)
    for r in range(rounds):
        for name, rotated, limit, fast in variants if r % 2 == 0 else variants[::-1]:
            mx.set_cache_limit(limits[limit])
            times[name].append(once(rotated, fast))
    mx.set_cache_limit(engine_limit)
    out: dict[str, Any] = {
        "tokens": n,
        "layers": LAYERS,
        "codec": DEFAULT_CODEC.name,
        "stored_bytes": kv.stored_bytes,
        "rounds": rounds,
        "engine_cache_limit_bytes": limits["engine"],
        "mlx_default_cache_limit_bytes": limits["mlx_default_cache"],
    }
    for name, values in times.items():
        out[f"{name}_s"] = statistics.median(values)
    out["saved_s"] = out["model_basis_s"] - out["rotated_basis_s"]
    out["freed_buffers_speedup"] = out["rotated_basis_mlx_default_cache_s"] / out["rotated_basis_s"]
    out["worker_streams"] = len(worker_streams())
    out["spread_speedup"] = out["rotated_basis_s"] / out["rotated_basis_spread_s"]
    out["fused_speedup"] = out["rotated_basis_spread_s"] / out["rotated_basis_fused_s"]
    out["fused_equal"] = fused_equal(kv)
    return out


def fused_equal(kv: AgentKV) -> bool:
    """Whether every layer's fused values are the plain ops' values, bit for bit."""
    same = True
    for i in range(LAYERS):
        for role in ("key", "value"):
            os.environ["KVACTOR_FUSED"] = "0"
            plain = kv.dequantize(i, role, rotated=True)
            mx.eval(plain)
            os.environ["KVACTOR_FUSED"] = "1"
            same = same and bool(mx.array_equal(plain, kv.dequantize(i, role, rotated=True)))
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    result = main(args.tokens, args.rounds)
    print(
        f"{result['tokens']} tokens x {LAYERS} layers ({result['codec']}, "
        f"{result['stored_bytes'] / 1e6:.1f} MB stored), median of {result['rounds']}:\n"
        f"  dequantize into the model's basis  {result['model_basis_s'] * 1e3:7.1f} ms\n"
        f"  dequantize, left rotated           {result['rotated_basis_s'] * 1e3:7.1f} ms\n"
        f"  saved                              {result['saved_s'] * 1e3:7.1f} ms\n"
        f"  left rotated, MLX's default cache  "
        f"{result['rotated_basis_mlx_default_cache_s'] * 1e3:7.1f} ms "
        f"({result['mlx_default_cache_limit_bytes'] >> 20} MiB of freed buffers kept, "
        f"the engine keeps {result['engine_cache_limit_bytes'] >> 20} MiB: "
        f"{result['freed_buffers_speedup']:.2f}x)\n"
        f"  left rotated, over {result['worker_streams']} streams     "
        f"{result['rotated_basis_spread_s'] * 1e3:7.1f} ms ({result['spread_speedup']:.2f}x)\n"
        f"  left rotated, fused (numba)        {result['rotated_basis_fused_s'] * 1e3:7.1f} ms "
        f"({result['fused_speedup']:.2f}x the streams; same bits: {result['fused_equal']})\n"
        f"  fused, MLX's default cache         "
        f"{result['rotated_basis_fused_mlx_default_cache_s'] * 1e3:7.1f} ms"
    )
    if args.json:
        write_json(args.json, result)
