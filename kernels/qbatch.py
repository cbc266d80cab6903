"""Many agents' K/V caches in one batch, their past kept in its stored (quantized) form.

A :class:`QuantizedBatchCache` is one layer's cache for a batch of rows (agents). Each row
holds the tokens its agent had stored when its turn began, as the codec's parts (packed
values, scales, biases: never dequantized into a full float copy), and a float *tail*: the
tokens of the running turn. Attention runs over both (:meth:`QuantizedBatchCache.attend`):
scores against the quantized past come from ``mx.quantized_matmul`` (dequantization fused
into the product) or, as the pure-MLX reference, from dequantizing first; the tail is plain.
When the turn ends, the tail is quantized into a new stored range (``AgentKV``), so the
bytes kept between turns are exactly what the warm tier writes.

The layout per row, left-padded within each region so that rows of other lengths line up:

- region 0: the first ``codec.sink_tokens`` tokens (sinks: 8 bits when a role is coded below
  8 bits; a role coded at >= 8 bits or fp16 keeps its own form, cut at the same token);
- region 1: the rest of the stored tokens;
- the tail: float K/V of the running turn, right-aligned like mlx-lm's ``BatchKVCache``.

Keys and values of a rotating codec are stored in the Hadamard basis: queries are rotated
before scoring them (``(qH)(kH)ᵀ = qkᵀ``) and the weighted sum of values rotated back.

Like ``BatchKVCache`` it offers ``merge`` / ``extend`` / ``filter`` / ``extract``, so the
engine's continuous batching adds and removes agents while others decode. A model calls
:meth:`attend` once its attention is bound to this class (``kernels.attention``); keys and
values may have different widths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx

from . import stored_attend
from ._qparts import SINK as _SINK
from ._qparts import SINK_BITS as _SINK_BITS
from ._shared_kv import note_fetched
from .qattend import Coded, Kernel, attend_parts, mlx_kernel, row_parts
from .qcodec import KVCodec, Role

__all__ = ("Kernel", "QuantizedBatchCache")

_ROLES: tuple[Role, Role] = ("key", "value")


def _pad_left(a: mx.array, n: int) -> mx.array:
    if n == 0:
        return a
    return mx.pad(a, [(0, 0), (0, 0), (n, 0)] + [(0, 0)] * (a.ndim - 3))


def _region_parts(
    codec: KVCodec,
    role: Role,
    parts: Mapping[str, mx.array],
    n: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[Coded, Coded]:
    """A role's parts for tokens [0, n) of one agent, split into region 0 and region 1."""
    bits = codec.role_spec(role)[0]
    group = codec.group_for(role, head_dim)
    cut = min(codec.sink_tokens, n)
    rotated = codec.rotate and bits != 16

    def coded(b: int, arrays: tuple[mx.array, ...]) -> Coded:
        if b != 16:
            q, s, bias = arrays
            arrays = (q, s.astype(mx.float32), bias.astype(mx.float32))
        else:
            arrays = (arrays[0].astype(mx.float32),)
        return Coded(b, group, rotated, arrays)

    def empty(b: int) -> tuple[mx.array, ...]:
        h = n_kv_heads
        if b == 16:
            return (mx.zeros((1, h, 0, head_dim), mx.float32),)
        return (
            mx.zeros((1, h, 0, head_dim * b // 32), mx.uint32),
            mx.zeros((1, h, 0, head_dim // group), mx.float16),
            mx.zeros((1, h, 0, head_dim // group), mx.float16),
        )

    if bits == 16 or bits >= _SINK_BITS:
        names = ("x",) if bits == 16 else ("q", "s", "b")
        whole = tuple(parts[k] for k in names) if n else empty(bits)
        first = tuple(a[:, :, :cut] for a in whole)
        rest = tuple(a[:, :, cut:] for a in whole)
        return coded(bits, first), coded(bits, rest)
    sinks = tuple(parts[_SINK + k] for k in "qsb") if cut else empty(_SINK_BITS)
    body = tuple(parts[k] for k in "qsb") if n > cut else empty(bits)
    return coded(_SINK_BITS, sinks), coded(bits, body)


class QuantizedBatchCache:
    """One layer's K/V for a batch of agents: stored past (quantized) + float tail.

    Build one row with :meth:`from_parts`; combine rows with :meth:`merge` / :meth:`extend`;
    drop rows with :meth:`filter`; take one out with :meth:`extract`. ``kernel`` picks how
    attention reads the quantized past: ``"quantized_matmul"`` (MLX's fused kernel, on
    every backend MLX has), ``"reference"`` (dequantize, then plain matmuls), ``"stored"``
    (numba over the packed codes, on the CPU: ``kernels.stored_attend``) or ``"auto"``
    (per step, the fastest for the device, the query count and the regions).
    """

    step = 256
    rowwise = False  # each row attends alone (set per batch by QuantizedTurnCache)

    def __init__(
        self,
        codec: KVCodec,
        dims: tuple[int, int],
        regions: list[dict[Role, Coded]],
        region_lengths: list[list[int]],
        kernel: Kernel = "auto",
    ) -> None:
        if kernel not in ("auto", "quantized_matmul", "reference", "stored"):
            raise ValueError(
                "kernel must be 'auto', 'quantized_matmul', 'reference' or 'stored', "
                f"not {kernel!r}"
            )
        self.codec = codec
        self.dims = dims  # key and value widths
        self.kernel: Kernel = kernel
        self._regions = regions
        self._region_lengths = region_lengths
        rows = len(region_lengths[0])
        self._tail_lengths = [0] * rows
        self.keys: mx.array | None = None  # tail (B, H, capacity, D)
        self.values: mx.array | None = None
        self._idx = 0  # tail columns in use
        self.offset = mx.array([sum(r[i] for r in region_lengths) for i in range(rows)])
        # Waits until the regions' bytes are in (a layer-streamed load: AgentKV.landing);
        # called before anything reads them, then dropped.
        self.landing: Callable[[], None] | None = None
        # Dispatch the forward's work so far as it hands this layer new tokens
        # (TurnCache.dispatching): a turn's first forward, not a pipelined decode step.
        self.dispatch = False

    # -- building -------------------------------------------------------------------
    @classmethod
    def from_parts(
        cls,
        codec: KVCodec,
        n_kv_heads: int,
        dims: tuple[int, int],
        key_parts: Mapping[str, mx.array],
        value_parts: Mapping[str, mx.array],
        n_tokens: int,
        kernel: Kernel = "auto",
    ) -> QuantizedBatchCache:
        """One row from a layer's stored parts of tokens [0, n_tokens) (``concat_parts`` of
        its ranges); ``{}`` parts for an empty cache. ``dims``: key and value widths."""
        split = {
            role: _region_parts(codec, role, parts, n_tokens, n_kv_heads, dim)
            for role, parts, dim in zip(_ROLES, (key_parts, value_parts), dims, strict=True)
        }
        regions = [{role: split[role][r] for role in _ROLES} for r in (0, 1)]
        lengths = [[regions[r]["key"].width] for r in (0, 1)]
        if lengths[0][0] + lengths[1][0] != n_tokens:
            raise ValueError(f"the parts hold {sum(x[0] for x in lengths)} tokens, not {n_tokens}")
        return cls(codec, dims, regions, lengths, kernel)

    @property
    def rows(self) -> int:
        return len(self._tail_lengths)

    def stored_lengths(self) -> list[int]:
        """Per row, the tokens held in stored form (region 0 + region 1)."""
        return [a + b for a, b in zip(*self._region_lengths, strict=True)]

    def tail_lengths(self) -> list[int]:
        return list(self._tail_lengths)

    def tail(self, row: int) -> tuple[mx.array, mx.array]:
        """The float K and V ``(1, H, n, D)`` of a row's running turn."""
        n = self._tail_lengths[row]
        if self.keys is None or self.values is None or n == 0:
            raise ValueError(f"row {row} has no tail tokens")
        lo = self._idx - n
        return (
            self.keys[row : row + 1, :, lo : self._idx],
            self.values[row : row + 1, :, lo : self._idx],
        )

    def set_tail(self, row: int, at: int, keys: mx.array, values: mx.array) -> None:
        """Overwrite a row's tail tokens [at, at + n) with ``keys`` / ``values`` ``(1, H, n,
        D)`` (their stored values, once quantized mid-turn). Raises ValueError past its tail."""
        n = keys.shape[2]
        if self.keys is None or self.values is None or at < 0 or at + n > self._tail_lengths[row]:
            raise ValueError(f"row {row}'s tail does not hold tokens [{at}, {at + n})")
        lo = self._idx - self._tail_lengths[row] + at
        self.keys[row : row + 1, :, lo : lo + n] = keys.astype(self.keys.dtype)
        self.values[row : row + 1, :, lo : lo + n] = values.astype(self.values.dtype)

    def unfeed(self, n: int) -> None:
        """Forget the last ``n`` tokens appended to every row's tail (a pipelined step ran
        past a turn's end). Raises ValueError when a row's tail is shorter."""
        if n > min(self._tail_lengths, default=0):
            raise ValueError(f"a row's tail holds fewer than {n} tokens")
        self._idx -= n
        self._tail_lengths = [t - n for t in self._tail_lengths]
        self.offset = self.offset - n

    # -- the mlx-lm cache protocol --------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``(B, H, N, D)`` to every row's tail."""
        if self.dispatch:
            mx.async_eval(keys, values)
        n = keys.shape[2]
        prev = self._idx
        if self.keys is None or self.values is None or prev + n > self.keys.shape[2]:
            b, h, _, d = keys.shape
            grow = -(-(prev + n) // self.step) * self.step
            new_k = mx.zeros((b, h, grow, d), keys.dtype)
            new_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
            if self.keys is not None and self.values is not None and prev:
                new_k[:, :, :prev] = self.keys[:, :, :prev]
                new_v[:, :, :prev] = self.values[:, :, :prev]
            self.keys, self.values = new_k, new_v
        self.keys[:, :, prev : prev + n] = keys
        self.values[:, :, prev : prev + n] = values
        self._idx = prev + n
        self._tail_lengths = [t + n for t in self._tail_lengths]
        self.offset = self.offset + n
        self._unattended = True
        out = self.keys[:, :, : self._idx], self.values[:, :, : self._idx]
        note_fetched(self, out[0])  # a layer sharing this K/V attends through it too
        return out

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """``(B, 1, n, columns)`` bool: which cached tokens each of ``n`` new queries sees
        (every valid stored token; tail tokens up to its own position); with a
        ``window_size`` (a sliding-window layer), only the tokens less than that many
        positions behind the query, as mlx-lm's windowed causal mask."""
        parts = []
        positions = []  # each column's token position in its row's sequence
        base = mx.zeros((self.rows,), mx.int32)
        for region, lengths in zip(self._regions, self._region_lengths, strict=True):
            width = region["key"].width
            lens = mx.array(lengths, dtype=mx.int32)
            if width:
                valid = mx.arange(width)[None] >= (width - lens)[:, None]
                parts.append(mx.broadcast_to(valid[:, None, None, :], (self.rows, 1, n, width)))
                positions.append(base[:, None] + mx.arange(width)[None] - (width - lens)[:, None])
            base = base + lens
        total = self._idx + n
        cols = mx.arange(total)
        tails = mx.array(self._tail_lengths, dtype=mx.int32)
        first = total - (tails + n)
        valid = cols[None] >= first[:, None]
        causal = cols[None] <= (self._idx + mx.arange(n))[:, None]
        parts.append(valid[:, None, None, :] & causal[None, None])
        mask = mx.concatenate(parts, axis=-1)
        if window_size is None:
            return mask
        positions.append(base[:, None] + cols[None] - first[:, None])
        keys_at = mx.concatenate(positions, axis=-1)  # (B, columns)
        queries_at = (base + tails)[:, None] + mx.arange(n)[None]  # (B, n)
        near = keys_at[:, None, :] > queries_at[:, :, None] - window_size
        return mask & near[:, None]

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
        sdpa: Callable[..., mx.array] | None = None,
    ) -> mx.array:
        """Scaled dot-product attention of ``queries`` ``(B, n_heads, N, D)`` over this
        cache, after ``update_and_fetch`` of the same step (``keys`` and ``values``, its
        tails, and ``sdpa``, mlx-lm's function, are not needed: see
        ``kernels.attention.Attends``); ``mask`` from :meth:`make_mask`. In a batch of
        several rows each row attends over its own columns alone (``kernels.qattend``):
        what it computes in a batch of its own (``rowwise``, set by its TurnCache).

        Learned attention sinks (``sinks``, per head) join every row's softmax.
        Raises ValueError before ``update_and_fetch``.
        """
        if self.keys is None or self.values is None:
            raise ValueError("attend needs the step's keys and values first (update_and_fetch)")
        self._unattended = False
        if self.landing is not None:
            self.landing()
            self.landing = None
        if not isinstance(mask, mx.array):
            mask = None  # make_mask always gives an array: anything else is no mask
        kernel = self._kernel_for(queries)
        regions = [(r["key"], r["value"]) for r in self._regions]
        tail = (self.keys[:, :, : self._idx], self.values[:, :, : self._idx])
        if self.rows == 1 or not self.rowwise:
            return attend_parts(queries, scale, regions, tail, mask, kernel, sinks)
        outs = []
        for i in range(self.rows):
            mine, tail_i, mask_i = row_parts(
                i, regions, self._region_lengths, tail, self._tail_lengths[i], mask
            )
            outs.append(
                attend_parts(queries[i : i + 1], scale, mine, tail_i, mask_i, kernel, sinks)
            )
        return mx.concatenate(outs, axis=0)

    def _kernel_for(self, queries: mx.array) -> Kernel:
        """``"auto"``: on the CPU the stored-form kernel (``kernels.stored_attend``) for a
        few queries a row where it covers the regions; else the faster of MLX's own
        (``kernels.qattend.mlx_kernel``)."""
        if self.kernel != "auto":
            return self.kernel
        if mx.default_device() == mx.cpu:
            assert self.keys is not None
            per_row = queries.shape[1] // self.keys.shape[1] * queries.shape[2]
            used = [(r["key"], r["value"]) for r in self._regions if r["key"].width]
            if stored_attend.covers(used, per_row, self.dims):
                return "stored"
        return mlx_kernel(queries.shape[2])

    # -- batch edits ----------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[QuantizedBatchCache]) -> QuantizedBatchCache:
        """One batch of every row of ``caches``, in order."""
        if not caches:
            raise ValueError("nothing to merge")
        out = caches[0].extract_rows(list(range(caches[0].rows)))
        for other in caches[1:]:
            out.extend(other)
        return out

    def extend(self, other: QuantizedBatchCache) -> None:
        """Append ``other``'s rows to this batch (in place)."""
        if other.codec != self.codec or other.dims != self.dims:
            raise ValueError("cannot batch caches of another codec or head size")
        regions = []
        for mine, theirs in zip(self._regions, other._regions, strict=True):
            width = max(mine["key"].width, theirs["key"].width)
            regions.append(
                {
                    role: mine[role].replace(
                        tuple(
                            mx.concatenate(
                                [
                                    _pad_left(a, width - mine[role].width),
                                    _pad_left(c, width - theirs[role].width),
                                ]
                            )
                            for a, c in zip(mine[role].arrays, theirs[role].arrays, strict=True)
                        )
                    )
                    for role in _ROLES
                }
            )
        self._regions = regions
        self._region_lengths = [
            a + b for a, b in zip(self._region_lengths, other._region_lengths, strict=True)
        ]
        idx = max(self._idx, other._idx)
        tails = [c._padded_tail(idx) for c in (self, other)]
        if tails[0] is None and tails[1] is None:
            self.keys = self.values = None
        else:
            like = next(t for t in tails if t is not None)
            filled = [
                t if t is not None else _zeros_like_rows(like, c.rows)
                for t, c in zip(tails, (self, other), strict=True)
            ]
            self.keys = mx.concatenate([t[0] for t in filled])
            self.values = mx.concatenate([t[1] for t in filled])
        self._idx = idx
        self._tail_lengths = self._tail_lengths + other._tail_lengths
        self.offset = mx.concatenate([self.offset, other.offset])

    def _padded_tail(self, idx: int) -> tuple[mx.array, mx.array] | None:
        if self.keys is None or self.values is None:
            return None
        pad = idx - self._idx
        return (
            _pad_left(self.keys[:, :, : self._idx], pad),
            _pad_left(self.values[:, :, : self._idx], pad),
        )

    def filter(self, rows: Sequence[int] | mx.array) -> None:
        """Keep only ``rows`` (in that order), in place; padding every kept row shares is
        dropped."""
        listed = cast(list[int], rows.tolist()) if isinstance(rows, mx.array) else list(rows)
        keep = [int(i) for i in listed]
        chosen = self.extract_rows(keep)
        self.__dict__.update(chosen.__dict__)

    def extract(self, row: int) -> QuantizedBatchCache:
        """Row ``row`` alone, without padding."""
        return self.extract_rows([row])

    def extract_rows(self, rows: list[int]) -> QuantizedBatchCache:
        if not rows or min(rows) < 0 or max(rows) >= self.rows:
            raise IndexError(f"rows {rows} outside a batch of {self.rows}")
        index = mx.array(rows)
        regions = []
        lengths = []
        for region, lens in zip(self._regions, self._region_lengths, strict=True):
            kept = [lens[i] for i in rows]
            width = region["key"].width
            cut = width - max(kept, default=0)
            regions.append(
                {
                    role: coded.replace(tuple(a[index][:, :, cut:] for a in coded.arrays))
                    for role, coded in region.items()
                }
            )
            lengths.append(kept)
        out = QuantizedBatchCache(self.codec, self.dims, regions, lengths, self.kernel)
        tails = [self._tail_lengths[i] for i in rows]
        out._tail_lengths = tails
        out._idx = max(tails)
        if self.keys is not None and self.values is not None and out._idx:
            lo = self._idx - out._idx
            out.keys = self.keys[index][:, :, lo : self._idx]
            out.values = self.values[index][:, :, lo : self._idx]
        out.offset = self.offset[index]
        return out

    # -- sizes ----------------------------------------------------------------------
    def size(self) -> int:
        return max(self.stored_lengths()[i] + self._tail_lengths[i] for i in range(self.rows))

    def empty(self) -> bool:
        return self.size() == 0

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for region in self._regions for c in region.values() for a in c.arrays)
        if self.keys is not None and self.values is not None:
            total += self.keys.nbytes + self.values.nbytes
        return total

    @property
    def state(self) -> list[mx.array]:
        """Every array, for ``mx.eval``."""
        arrays = [a for region in self._regions for c in region.values() for a in c.arrays]
        if self.keys is not None and self.values is not None:
            arrays += [self.keys, self.values]
        return [*arrays, self.offset]

    def is_trimmable(self) -> bool:
        return False

    def check_attended(self) -> None:
        """Raises RuntimeError when a step's K/V went in and no attention read them through
        :meth:`attend` (the model's attention is not bound to this class)."""
        if getattr(self, "_unattended", False):
            raise RuntimeError("attention ran without reading the quantized cache")


def _zeros_like_rows(like: tuple[mx.array, mx.array], rows: int) -> tuple[mx.array, mx.array]:
    k, v = like
    return (
        mx.zeros((rows, *k.shape[1:]), k.dtype),
        mx.zeros((rows, *v.shape[1:]), v.dtype),
    )
