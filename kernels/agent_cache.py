"""One agent's KV cache in two forms: stored (quantized ranges) and working (fp, while active).

The stored form is what the hot tier keeps and what the warm tier writes, byte for byte:
a list of token ranges, each holding every layer's quantized K and V. While the agent
takes a turn it has a working cache per layer: either a float copy of every token
(dequantized at the start of the turn: an mlx-lm KVCache) or, with ``quantized``, a
QuantizedBatchCache that reads the stored parts as they are and keeps only the turn's new
tokens in float. When the turn ends the new tokens are quantized into a new range and the
working cache is dropped. So an agent kept hot and an agent reloaded from disk resume from
the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .qbatch import Kernel, QuantizedBatchCache
from .qcodec import KVCodec, Role, concat_parts

__all__ = ("AgentKV", "StoredRange", "segment_layout")

Parts = dict[str, mx.array]


@dataclass
class StoredRange:
    """Tokens [start, stop) of every layer, quantized: ``layers[i] = (k_parts, v_parts)``."""

    start: int
    stop: int
    layers: list[tuple[Parts, Parts]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for k, v in self.layers for a in (*k.values(), *v.values()))

    def to_numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """Host views of the arrays (zero-copy on CPU), named ``{layer}.{k|v}.{part}``."""
        arrays = [a for k, v in self.layers for a in (*k.values(), *v.values())]
        mx.eval(arrays)
        out: dict[str, np.ndarray[Any, Any]] = {}
        for i, (k, v) in enumerate(self.layers):
            for kind, parts in (("k", k), ("v", v)):
                for name, array in parts.items():
                    out[f"{i}.{kind}.{name}"] = np.array(array, copy=False)
        return out

    @classmethod
    def from_numpy(
        cls, start: int, stop: int, n_layers: int, tensors: dict[str, np.ndarray[Any, Any]]
    ) -> StoredRange:
        """The inverse of ``to_numpy`` (one copy into MLX). Raises KeyError on a missing layer."""
        layers: list[tuple[Parts, Parts]] = [({}, {}) for _ in range(n_layers)]
        for key, array in tensors.items():
            layer, kind, name = key.split(".", 2)
            layers[int(layer)][0 if kind == "k" else 1][name] = mx.array(array)
        if any(not k or not v for k, v in layers):
            raise KeyError("a stored range lacks the K or V parts of some layer")
        return cls(start, stop, layers)


class AgentKV:
    """The tokens an agent's cache holds, its stored ranges and, while active, its working copy.

    Invariant: when not active, the stored ranges cover every token.
    """

    def __init__(
        self,
        codec: KVCodec,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        quantized: bool = False,
        kernel: Kernel = "auto",
    ) -> None:
        self.codec = codec
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.quantized = quantized
        self.kernel: Kernel = kernel
        self.tokens: list[int] = []
        self.ranges: list[StoredRange] = []
        self.work: list[Any] | None = None  # KVCache, or QuantizedBatchCache when quantized

    # -- sizes ------------------------------------------------------------------------
    @property
    def stored_tokens(self) -> int:
        return self.ranges[-1].stop if self.ranges else 0

    @property
    def stored_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    @property
    def work_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.work) if self.work else 0

    @property
    def nbytes(self) -> int:
        return self.stored_bytes + self.work_bytes

    # -- transitions ------------------------------------------------------------------
    def activate(self) -> list[Any]:
        """The working cache of a turn, one per layer: with ``quantized``, a one-row
        QuantizedBatchCache over the stored parts (nothing dequantized); else an fp copy
        (an mlx-lm KVCache) dequantized from the stored ranges, once per turn."""
        if self.work is not None:
            return self.work
        if self.quantized:
            self.work = [self._quantized_layer(layer) for layer in range(self.n_layers)]
            return self.work
        work = []
        for layer in range(self.n_layers):
            cache = KVCache()
            if self.ranges:
                keys = self._dequantize(layer, 0)
                values = self._dequantize(layer, 1)
                cache.state = (keys, values, keys.shape[2])
            work.append(cache)
        if self.ranges:
            mx.eval([a for c in work for a in (c.keys, c.values)])
        self.work = work
        return work

    def _quantized_layer(self, layer: int) -> QuantizedBatchCache:
        keys = concat_parts([r.layers[layer][0] for r in self.ranges])
        values = concat_parts([r.layers[layer][1] for r in self.ranges])
        return QuantizedBatchCache.from_parts(
            self.codec,
            self.n_kv_heads,
            self.head_dim,
            keys,
            values,
            self.stored_tokens,
            self.kernel,
        )

    def _dequantize(self, layer: int, kind: int) -> mx.array:
        role: Role = "value" if kind else "key"
        pieces = [
            self.codec.dequantize(r.layers[layer][kind], r.start, r.stop - r.start, role=role)
            for r in self.ranges
        ]
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

    def deactivate(self) -> StoredRange | None:
        """Quantize the tokens added since the last range, drop the working copy.

        Returns the new range (None when nothing was added).
        """
        new = self._quantize_tail()
        self.work = None
        return new

    def _quantize_tail(self) -> StoredRange | None:
        start, stop = self.stored_tokens, len(self.tokens)
        if self.work is None or stop <= start:
            return None
        layers: list[tuple[Parts, Parts]] = []
        for cache in self.work:
            if isinstance(cache, QuantizedBatchCache):
                if cache.stored_lengths() != [start] or cache.tail_lengths() != [stop - start]:
                    raise ValueError("the working cache does not hold this agent's new tokens")
                k, v = cache.tail(0)
            else:
                k = cache.state[0][:, :, start:stop, :]
                v = cache.state[1][:, :, start:stop, :]
            layers.append(
                (
                    self.codec.quantize(k, start, role="key"),
                    self.codec.quantize(v, start, role="value"),
                )
            )
        new = StoredRange(start, stop, layers)
        mx.eval([a for k, v in layers for a in (*k.values(), *v.values())])
        self.ranges.append(new)
        return new

    def trim(self, keep: int) -> None:
        """Forget every token from ``keep`` on (a prompt that diverged there)."""
        drop = len(self.tokens) - keep
        if drop <= 0:
            return
        del self.tokens[keep:]
        if self.work is not None:
            if self.quantized:
                raise ValueError("cannot trim a quantized working cache: end the turn first")
            for cache in self.work:
                cache.trim(drop)
        kept: list[StoredRange] = []
        for r in self.ranges:
            if r.stop <= keep:
                kept.append(r)
            elif r.start < keep:
                kept.append(self._cut(r, keep))
        self.ranges = kept

    def _cut(self, r: StoredRange, keep: int) -> StoredRange:
        """The first ``keep - r.start`` tokens of a range (per-token codecs slice cleanly)."""
        n = keep - r.start
        h, d = self.n_kv_heads, self.head_dim
        k_shapes = self.codec.expected_parts(r.start, n, h, d, role="key")
        v_shapes = self.codec.expected_parts(r.start, n, h, d, role="value")
        layers = [
            (
                {
                    name: a[:, :, : k_shapes[name][0][2]]
                    for name, a in k.items()
                    if name in k_shapes
                },
                {
                    name: a[:, :, : v_shapes[name][0][2]]
                    for name, a in v.items()
                    if name in v_shapes
                },
            )
            for k, v in r.layers
        ]
        return StoredRange(r.start, keep, layers)

    def ranges_from(self, token: int) -> Sequence[StoredRange]:
        """The stored ranges that hold any token at or after ``token``."""
        return [r for r in self.ranges if r.stop > token]


def segment_layout(
    codec: KVCodec, n_layers: int, n_kv_heads: int, head_dim: int
) -> Callable[[int, int], dict[str, tuple[tuple[int, ...], str]]]:
    """``expect(start, stop)``: the exact name, shape and dtype of every array a stored range
    of tokens [start, stop) holds, as ``StoredRange.to_numpy`` names them. The warm tier
    checks untrusted files against it."""

    def expect(start: int, stop: int) -> dict[str, tuple[tuple[int, ...], str]]:
        n = stop - start
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for kind, role in (("k", "key"), ("v", "value")):
            parts = codec.expected_parts(start, n, n_kv_heads, head_dim, role=cast(Role, role))
            for layer in range(n_layers):
                for name, spec in parts.items():
                    out[f"{layer}.{kind}.{name}"] = spec
        return out

    return expect
