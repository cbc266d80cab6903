"""Perplexity of the default model when its past K/V goes through each storage codec.

    python bench/fidelity.py [--tokens 4096] [--variants fp q8 q4g64 ...|all] [--json PATH]

The text (``bench/data/fidelity.txt``) is scored in chunks of 256 tokens the way the engine
runs turns: chunk i attends to the K/V of chunks < i as stored (quantized, then dequantized)
and to its own K/V exactly (fp32), then its K/V is quantized and appended to the past. Chunk
0 has no past, so its scores are the same for every codec; ``ppl`` leaves them out (what the
quantized context costs), ``ppl_all`` keeps them. All variants run in this one process, one
after another (~100 s each for 4096 tokens on 2 CPU cores: the default set takes ~14 min,
``--variants all`` ~30 min). ``"q4"`` in the JSON repeats the result of the default codec.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvactor  # noqa: F401 - first: loads the BLAS before mlx.core

# isort: split

import mlx.core as mx
import numpy as np
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.actors.models import load_model
from kvactor.kernels.qcodec import DEFAULT_CODEC, FP16_CODEC, KVCodec, Role

__all__ = ("VARIANTS", "RoundTrip", "StoredPastCache", "main", "score")

TEXT = Path(__file__).parent / "data" / "fidelity.txt"
CHUNK = 256

RoundTrip = Callable[[mx.array, int, Role], mx.array]
"""(x, start, role) -> what comes back after storing x: the codec round trip."""


def _codec(codec: KVCodec) -> RoundTrip:
    def round_trip(x: mx.array, start: int, role: Role) -> mx.array:
        parts = codec.quantize(x, start, role=role)
        return codec.dequantize(parts, start, x.shape[2], role=role)

    return round_trip


def _fp32_scales(bits: int, group: int) -> RoundTrip:
    # Reference only: scales and biases kept in fp32 (not a stored form) to price the fp16 ones.
    def round_trip(x: mx.array, start: int, role: Role) -> mx.array:
        q, s, b = mx.quantize(x, group_size=group, bits=bits)
        return mx.dequantize(q, s, b, group_size=group, bits=bits)

    return round_trip


# name -> (codec for byte counts, round trip); None = the fp baseline (no quantization).
VARIANTS: dict[str, tuple[KVCodec, RoundTrip] | None] = {"fp": None}
for _name, _c in {
    "fp16": FP16_CODEC,
    "q8": KVCodec(bits=8),
    "q4g64": KVCodec(),
    "q4g32": KVCodec(group_size=32),
    "q4g64+h": KVCodec(rotate=True),
    "q4g64+h+s4": KVCodec(rotate=True, sink_tokens=4),
    "q4g64+h+s32": KVCodec(rotate=True, sink_tokens=32),
    "q4g64+s4": KVCodec(sink_tokens=4),
    "k8v4g64": KVCodec(key_bits=8),
    "k8v4g64+h": KVCodec(key_bits=8, rotate=True),
    "k4g32v4g64+h+s4": KVCodec(key_group_size=32, rotate=True, sink_tokens=4),
    "k5v3g64+h": KVCodec(bits=3, key_bits=5, rotate=True),
    "k5v3g64+h+s4": KVCodec(bits=3, key_bits=5, rotate=True, sink_tokens=4),
    "k5g32v3g64+h+s4": KVCodec(bits=3, key_bits=5, key_group_size=32, rotate=True, sink_tokens=4),
    "k6v2g64+h+s4": KVCodec(bits=2, key_bits=6, rotate=True, sink_tokens=4),
    "q4g32+h+s4": KVCodec(group_size=32, rotate=True, sink_tokens=4),
}.items():
    VARIANTS[_name] = (_c, _codec(_c))
VARIANTS["q4g64-fp32scales"] = (KVCodec(), _fp32_scales(4, 64))

DEFAULT_SET = (
    "fp",
    "q8",
    "q4g64",
    "q4g32",
    "q4g64+h+s4",
    "k5v3g64+h+s4",
    "k5g32v3g64+h+s4",
    "k8v4g64+h",
)


def _is_default(name: str) -> bool:
    variant = VARIANTS[name]
    return variant is not None and variant[0] == DEFAULT_CODEC


class StoredPastCache:
    """One layer's cache as the engine keeps it during a turn: the past as stored (round
    tripped through a codec), the current chunk exact. ``commit()`` ends the chunk (turn)."""

    def __init__(self, round_trip: RoundTrip | None) -> None:
        self.round_trip = round_trip
        self.offset = 0
        self.past_keys: mx.array | None = None
        self.past_values: mx.array | None = None
        self._current: tuple[mx.array, mx.array, int] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._current = (keys, values, self.offset)
        self.offset += keys.shape[2]
        if self.past_keys is None or self.past_values is None:
            return keys, values
        return (
            mx.concatenate([self.past_keys, keys], axis=2),
            mx.concatenate([self.past_values, values], axis=2),
        )

    def commit(self) -> list[mx.array]:
        """Store the current chunk's K/V; returns the new past arrays (to evaluate)."""
        if self._current is None:
            return []
        keys, values, start = self._current
        self._current = None
        if self.round_trip is not None:
            keys = self.round_trip(keys, start, "key")
            values = self.round_trip(values, start, "value")
        if self.past_keys is None or self.past_values is None:
            self.past_keys, self.past_values = keys, values
        else:
            self.past_keys = mx.concatenate([self.past_keys, keys], axis=2)
            self.past_values = mx.concatenate([self.past_values, values], axis=2)
        return [self.past_keys, self.past_values]

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        if window_size is not None or return_array:
            rows = mx.arange(self.offset, self.offset + n)[:, None]
            cols = mx.arange(self.offset + n)[None]
            mask = rows >= cols
            if window_size is not None:
                mask = mask & (rows < cols + window_size)
            return mask
        return None if n == 1 else "causal"

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.past_keys, self.past_values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state if a is not None)


def score(model: Any, n_layers: int, ids: list[int], round_trip: RoundTrip | None) -> np.ndarray:
    """Negative log-likelihood (nats) of ``ids[1:]``, chunk by chunk as the module docstring
    says; entry j is the NLL of ``ids[j + 1]``."""
    caches = [StoredPastCache(round_trip) for _ in range(n_layers)]
    tokens = mx.array(ids, dtype=mx.int32)
    nll: list[np.ndarray] = []
    for begin in range(0, len(ids) - 1, CHUNK):
        end = min(begin + CHUNK, len(ids) - 1)  # the last token is only ever a target
        logits = model(tokens[None, begin:end], cache=caches)[0].astype(mx.float32)
        targets = tokens[begin + 1 : end + 1]
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        chunk_nll = mx.logsumexp(logits, axis=-1) - picked
        past = [a for cache in caches for a in cache.commit()]
        mx.eval(chunk_nll, *past)
        nll.append(np.array(chunk_nll, dtype=np.float64))
    return np.concatenate(nll)


def main(
    model_spec: str | None, n_tokens: int, names: list[str], offset: int = 0
) -> dict[str, Any]:
    """Scores every variant in ``names`` (plus the default codec's if none of them is it)."""
    if not any(map(_is_default, names)):
        VARIANTS.setdefault(DEFAULT_CODEC.name, (DEFAULT_CODEC, _codec(DEFAULT_CODEC)))
        names = [*names, DEFAULT_CODEC.name]
    loaded = load_model(model_spec)
    ids = loaded.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    if len(ids) < offset + n_tokens:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than --offset + --tokens")
    ids = ids[offset : offset + n_tokens]
    result: dict[str, Any] = {
        "model": loaded.name,
        "tokens": n_tokens,
        "offset": offset,
        "chunk": CHUNK,
        "ppl": {},
        "ppl_all": {},
        "bytes_ratio": {},
        "codec": {},
        "seconds": {},
    }
    for name in names:
        variant = VARIANTS[name]
        started = time.perf_counter()
        nll = score(loaded.model, loaded.n_layers, ids, None if variant is None else variant[1])
        result["seconds"][name] = round(time.perf_counter() - started, 1)
        result["ppl"][name] = round(math.exp(float(nll[CHUNK - 1 :].mean())), 4)
        result["ppl_all"][name] = round(math.exp(float(nll.mean())), 4)
        if variant is None:
            result["bytes_ratio"][name] = 2.0  # the working cache itself: fp32
        else:
            codec = variant[0]
            ratio = codec.nbytes(n_tokens, loaded.n_kv_heads, loaded.head_dim) / (
                4 * n_tokens * loaded.n_kv_heads * loaded.head_dim
            )
            result["bytes_ratio"][name] = round(ratio, 5)
            result["codec"][name] = codec.describe()
        print(f"  {name}: ppl {result['ppl'][name]} ({result['seconds'][name]} s)", flush=True)
    default = next(filter(_is_default, names))
    result["default"] = default
    for key in ("ppl", "ppl_all", "bytes_ratio"):
        result[key]["q4"] = result[key][default]  # "q4" always names the default codec's result
    return result


def print_table(result: dict[str, Any]) -> None:
    fp = result["ppl"].get("fp")
    print(
        f"{result['tokens']} tokens of bench/data/fidelity.txt from token {result['offset']},"
        f" chunks of {result['chunk']}"
    )
    print("| variant | bytes vs fp16 | ppl (chunks >= 1) | Δ vs fp | ppl (all) |")
    print("|---|---:|---:|---:|---:|")
    for name, ppl in result["ppl"].items():
        if name == "q4":
            continue
        delta = "" if fp is None else f"{100 * (ppl / fp - 1):+.2f}%"
        mark = " (default)" if name == result["default"] else ""
        ratio = result["bytes_ratio"][name]
        print(
            f"| {name}{mark} | {ratio:.4f} | {ppl:.3f} | {delta} | {result['ppl_all'][name]:.3f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or model directory")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--offset", type=int, default=0, help="first token of the text to use")
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_SET), help=f"'all' or any of {list(VARIANTS)}"
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    chosen = list(VARIANTS) if args.variants == ["all"] else args.variants
    unknown = [n for n in chosen if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.tokens < 2 * CHUNK:
        parser.error(f"--tokens must be at least {2 * CHUNK}")
    outcome = main(args.model, args.tokens, chosen, args.offset)
    print_table(outcome)
    if args.json:
        write_json(args.json, outcome)
