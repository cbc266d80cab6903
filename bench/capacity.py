"""How many agents' KV caches fit a hot-tier byte budget, per storage codec.

    python bench/capacity.py [--budget-gib 1] [--context 4096] [--json PATH]

Bytes per agent come from the codec's arithmetic (``KVCodec.nbytes``) and are checked by
quantizing a random cache of that shape (default: SmolLM2-135M, 30 layers, 3 KV heads, head_dim
64) and summing the real ``nbytes`` of the stored parts; the two must agree to the byte.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import kvactor  # noqa: F401 - first: loads the BLAS before mlx.core

# isort: split

import mlx.core as mx

from kvactor.kernels.qcodec import DEFAULT_CODEC, FP16_CODEC, KVCodec, Role

__all__ = ("CODECS", "main", "measured_nbytes")

CODECS: dict[str, KVCodec] = {
    "fp16": FP16_CODEC,
    "q8": KVCodec(bits=8),
    "q4g64": KVCodec(),
    "default": DEFAULT_CODEC,
}
ROLES: tuple[Role, ...] = ("key", "value")


def measured_nbytes(codec: KVCodec, context: int, layers: int, kv_heads: int, head_dim: int) -> int:
    """Real bytes of the stored parts of a random ``context``-token cache of that shape."""
    total = 0
    key = mx.random.key(0)
    for _ in range(layers):
        for role in ROLES:
            key, sub = mx.random.split(key)
            x = mx.random.normal((1, kv_heads, context, head_dim), key=sub)
            parts = codec.quantize(x, 0, role=role)
            mx.eval(parts)
            total += sum(part.nbytes for part in parts.values())
    return total


def main(budget: int, context: int, layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Per codec: bytes per agent (computed and measured) and agents that fit ``budget``.

    Raises RuntimeError if the computed and measured bytes differ.
    """
    rows: dict[str, dict[str, Any]] = {}
    fp16 = FP16_CODEC.nbytes(context, kv_heads, head_dim) * layers
    for name, codec in CODECS.items():
        computed = codec.nbytes(context, kv_heads, head_dim) * layers
        measured = measured_nbytes(codec, context, layers, kv_heads, head_dim)
        if computed != measured:
            raise RuntimeError(f"{name}: computed {computed} bytes, measured {measured}")
        rows[name] = {
            "codec": codec.name,
            "bytes_ratio": round(computed / fp16, 5),
            "bytes_per_agent": computed,
            "agents": budget // computed,
        }
    return {
        "budget_bytes": budget,
        "context": context,
        "shape": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "codecs": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    budget = result["budget_bytes"] / 2**30
    shape = result["shape"]
    print(
        f"agents of {result['context']} tokens in {budget:g} GiB ({shape['layers']} layers,"
        f" {shape['kv_heads']} KV heads, head_dim {shape['head_dim']})"
    )
    print("| codec | bytes vs fp16 | MB per agent (computed = measured) | agents | vs fp16 |")
    print("|---|---:|---:|---:|---:|")
    fp16 = result["codecs"]["fp16"]["agents"]
    for name, row in result["codecs"].items():
        label = f"{name} ({row['codec']})" if name != row["codec"] else name
        mb = row["bytes_per_agent"] / 1e6
        ratio = row["agents"] / fp16 if fp16 else float("inf")
        print(f"| {label} | {row['bytes_ratio']:.4f} | {mb:.2f} | {row['agents']} | {ratio:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    outcome = main(
        int(args.budget_gib * 2**30), args.context, args.layers, args.kv_heads, args.head_dim
    )
    print_table(outcome)
    if args.json:
        Path(args.json).write_text(json.dumps(outcome, indent=2) + "\n", encoding="utf-8")
