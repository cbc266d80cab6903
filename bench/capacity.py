"""How many agents' KV caches fit a hot-tier byte budget, per storage codec.

    python bench/capacity.py [--budget-gib 1] [--context 4096] [--json PATH]

Bytes per agent come from the codec's arithmetic (``KVCodec.nbytes``) and are checked by
quantizing a random cache of that shape (default: SmolLM2-135M, 30 layers, 3 KV heads, head_dim
64) and summing the real ``nbytes`` of the stored parts; the two must agree to the byte.

A second table does the same with the default codec for the cache geometry of each model
family of the research, taken from the models' public configs (no weights needed): Llama 3.1
8B, Gemma 3 12B (40 sliding-window layers of 1024 tokens, 8 global layers) and
DeepSeek-Coder-V2-Lite (multi-head latent attention as mlx-lm runs it: per head, keys of
128 + 64 and values of 128). For Gemma 3, beside the bytes of every token, the bytes when its
sliding layers keep only their window (``windowed``: what kvactor's tiers keep, give or
take the last turn's range, which they keep whole).

A third table sizes the 2026 lineup (``bench/_lineup.py``: Qwen3.5 in two sizes, LFM2,
Nemotron-H, Granite 4, gpt-oss-20b, Gemma 4, from their published configs): per agent at
4K and 32K tokens with the default codec, sliding layers windowed, plus the recurrent
layers' checkpoints (``checkpoints`` of them, 4 by default: ``state_bytes`` each), and
how many such agents fit in 16 / 64 GB beside the weights (4-bit). ``--json`` has, per
model under ``lineup``: ``bytes_per_agent_4k``, ``bytes_per_agent_32k``, ``state_bytes``,
``checkpoint_bytes`` and the counts.
"""

from __future__ import annotations

import argparse
from typing import Any

import kvactor  # noqa: F401 - first: loads the BLAS before mlx.core

# isort: split

import mlx.core as mx
from _lineup import LINEUP  # bench/ is the script's folder: on sys.path
from _results import write_json

from kvactor.kernels.agent_cache import DEFAULT_CHECKPOINTS
from kvactor.kernels.geometry import CacheGeometry, LayerGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC, FP16_CODEC, KVCodec, Role
from kvactor.kernels.stored import cache_nbytes

__all__ = ("CODECS", "main", "measured_nbytes")

CODECS: dict[str, KVCodec] = {
    "fp16": FP16_CODEC,
    "q8": KVCodec(bits=8),
    "q4g64": KVCodec(),
    "default": DEFAULT_CODEC,
}
ROLES: tuple[Role, ...] = ("key", "value")


def _gemma3_12b() -> CacheGeometry:
    # text_config: 48 layers, 8 KV heads, head_dim 256, sliding_window 1024, every 6th global.
    return CacheGeometry(
        tuple(LayerGeometry(8, 256, 256, None if (i + 1) % 6 == 0 else 1024) for i in range(48))
    )


#: Cache geometries of the research's model families, from their public configs.
FAMILIES: dict[str, CacheGeometry] = {
    "SmolLM2-135M (default, llama)": CacheGeometry.uniform(30, 3, 64),
    "Llama 3.1 8B": CacheGeometry.uniform(32, 8, 128),
    "Gemma 3 12B": _gemma3_12b(),
    # 27 layers, 16 heads; keys qk_nope 128 + qk_rope 64, values v_head_dim 128.
    "DeepSeek-Coder-V2-Lite": CacheGeometry((LayerGeometry(16, 192, 128),) * 27),
}


def family_nbytes(codec: KVCodec, geometry: CacheGeometry, context: int, windowed: bool) -> int:
    """Stored bytes of a ``context``-token cache; ``windowed``: sliding layers keep only
    their last ``window`` tokens."""
    total = 0
    for g in (geometry.layer(i) for i in geometry.kv_layers):
        one = CacheGeometry((g,))
        if windowed and g.window is not None and g.window < context:
            total += cache_nbytes(codec, one, g.window, start=context - g.window)
        else:
            total += cache_nbytes(codec, one, context)
    return total


def measured_family_nbytes(codec: KVCodec, geometry: CacheGeometry, context: int) -> int:
    """Real bytes of the stored parts of a random cache of that geometry."""
    total = 0
    key = mx.random.key(1)
    for g in (geometry.layer(i) for i in geometry.kv_layers):
        for role in ROLES:
            key, sub = mx.random.split(key)
            x = mx.random.normal((1, g.n_kv_heads, context, g.dim(role)), key=sub)
            parts = codec.quantize(x, 0, role=role)
            mx.eval(parts)
            total += sum(part.nbytes for part in parts.values())
    return total


def families(budget: int, context: int) -> dict[str, dict[str, Any]]:
    """Per family: stored bytes per token and agents of ``context`` tokens in ``budget``,
    every token stored and with sliding layers windowed. The arithmetic is checked against
    real quantized parts at 64 tokens (a full cache of the big models would not fit here).

    Raises RuntimeError if the computed and measured bytes differ.
    """
    rows = {}
    for name, geometry in FAMILIES.items():
        computed = cache_nbytes(DEFAULT_CODEC, geometry, 64)
        measured = measured_family_nbytes(DEFAULT_CODEC, geometry, 64)
        if computed != measured:
            raise RuntimeError(f"{name}: computed {computed} bytes, measured {measured}")
        full = family_nbytes(DEFAULT_CODEC, geometry, context, windowed=False)
        windowed = family_nbytes(DEFAULT_CODEC, geometry, context, windowed=True)
        fp16 = family_nbytes(FP16_CODEC, geometry, context, windowed=False)
        rows[name] = {
            "geometry": geometry.describe(),
            "bytes_per_token": full / context,
            "fp16_bytes_per_token": fp16 / context,
            "bytes_per_agent": full,
            "agents": budget // full,
            "windowed_bytes_per_agent": windowed,
            "windowed_agents": budget // windowed,
        }
    return rows


def lineup(checkpoints: int = DEFAULT_CHECKPOINTS) -> dict[str, dict[str, Any]]:
    """Per model of the lineup: bytes of an agent at 4K and 32K tokens (the default codec,
    sliding layers windowed, ``checkpoints`` recurrent states), one state, and agents that
    fit in 16 / 64 GB beside the weights. The K/V arithmetic is checked against real
    quantized parts at 64 tokens. Raises RuntimeError if they differ."""
    rows = {}
    for name, model in LINEUP.items():
        g = model.geometry
        if g.kv_layers:
            computed = cache_nbytes(DEFAULT_CODEC, g, 64)
            measured = measured_family_nbytes(DEFAULT_CODEC, g, 64)
            if computed != measured:
                raise RuntimeError(f"{name}: computed {computed} bytes, measured {measured}")
        row: dict[str, Any] = {
            "source": model.source,
            "stores": g.summary(),
            "weights_bytes": model.weights_bytes,
            "state_bytes": g.state_bytes,
            "checkpoint_bytes": checkpoints * g.state_bytes,
        }
        for label, context in (("4k", 4096), ("32k", 32768)):
            per_agent = family_nbytes(DEFAULT_CODEC, g, context, windowed=True)
            per_agent += row["checkpoint_bytes"]
            row[f"bytes_per_agent_{label}"] = per_agent
            for gb in (16, 64):
                room = max(gb * 10**9 - model.weights_bytes, 0)
                row[f"agents_{gb}gb_{label}"] = room // per_agent
        rows[name] = row
    return rows


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
        "families": families(budget, context),
        "lineup": lineup(),
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
    print()
    print(f"model families, default codec ({DEFAULT_CODEC.name}), {result['context']} tokens:")
    print(
        "| family | KB per token (fp16) | MB per agent | agents in "
        f"{budget:g} GiB | sliding layers windowed: MB per agent | agents |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in result["families"].items():
        kb, fp16_kb = row["bytes_per_token"] / 1e3, row["fp16_bytes_per_token"] / 1e3
        cells = [name, f"{kb:.1f} ({fp16_kb:.1f})", f"{row['bytes_per_agent'] / 1e6:.1f}"]
        cells.append(str(row["agents"]))
        if row["windowed_bytes_per_agent"] != row["bytes_per_agent"]:
            cells += [f"{row['windowed_bytes_per_agent'] / 1e6:.1f}", str(row["windowed_agents"])]
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")


def print_lineup(rows: dict[str, dict[str, Any]]) -> None:
    print()
    print(f"the 2026 lineup, default codec, {DEFAULT_CHECKPOINTS} checkpoints, weights at 4 bits:")
    print(
        "| model | stores | state MB | MB per agent 4K / 32K | weights GB "
        "| agents in 16 GB, 4K / 32K | in 64 GB, 4K / 32K |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        cells = [
            name,
            r["stores"],
            f"{r['state_bytes'] / 1e6:.2f}",
            f"{r['bytes_per_agent_4k'] / 1e6:.1f} / {r['bytes_per_agent_32k'] / 1e6:.1f}",
            f"{r['weights_bytes'] / 1e9:.1f}",
            f"{r['agents_16gb_4k']} / {r['agents_16gb_32k']}",
            f"{r['agents_64gb_4k']} / {r['agents_64gb_32k']}",
        ]
        print("| " + " | ".join(cells) + " |")


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
    print_lineup(outcome["lineup"])
    if args.json:
        write_json(args.json, outcome)
