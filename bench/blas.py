"""fp32 matmul GFLOP/s under MLX with and without the optimized BLAS, in one run.

Each variant runs in its own subprocess (a BLAS can only be interposed before MLX loads):
one with ``KVACTOR_BLAS=off`` (the wheel's reference BLAS), one with the default selection.

    python bench/blas.py [--sizes 1024 2048] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any

__all__ = ("main",)


def _worker(sizes: list[int], min_seconds: float) -> None:
    # Select the BLAS before anything imports mlx.core; the reference run warns by design.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kvactor.kernels.blas import ensure_blas

        info = ensure_blas()
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    results: dict[str, float] = {}
    for n in sizes:
        a = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(0))
        b = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(1))
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up: first call pays for thread pools and allocations
        reps = 0
        start = time.perf_counter()
        while True:
            mx.eval(a @ b)
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        results[str(n)] = 2.0 * n**3 * reps / elapsed / 1e9
    json.dump({"blas": info.name, "reason": info.reason, "gflops": results}, sys.stdout)


def _run_variant(sizes: list[int], min_seconds: float, blas_off: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if blas_off:
        env["KVACTOR_BLAS"] = "off"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--min-seconds", str(min_seconds)]
    cmd += ["--sizes", *map(str, sizes)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> None:
    """Run both variants, print a markdown table, and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--min-seconds", type=float, default=1.0, help="timing per size")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.sizes, args.min_seconds)
        return

    # Sequential on purpose: two BLAS jobs sharing the cores would measure each other.
    reference = _run_variant(args.sizes, args.min_seconds, blas_off=True)
    optimized = _run_variant(args.sizes, args.min_seconds, blas_off=False)

    print(f"BLAS: {optimized['blas']} ({optimized['reason']})\n")
    print("| size | reference GFLOP/s | optimized GFLOP/s | speedup |")
    print("|---:|---:|---:|---:|")
    for n in args.sizes:
        ref, opt = reference["gflops"][str(n)], optimized["gflops"][str(n)]
        print(f"| {n} | {ref:.1f} | {opt:.1f} | {opt / ref:.1f}x |")

    largest = str(max(args.sizes))
    ref, opt = reference["gflops"][largest], optimized["gflops"][largest]
    record = {
        "reference_gflops": ref,
        "optimized_gflops": opt,
        "ratio": opt / ref,
        "blas": optimized["blas"],
        "size": int(largest),
        "by_size": {
            n: {"reference_gflops": reference["gflops"][n], "optimized_gflops": g}
            for n, g in optimized["gflops"].items()
        },
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
