"""Attention over quantized parts (the past, stored) and a float tail (the running turn),
for :class:`~kvactor.kernels.qbatch.QuantizedBatchCache`: a batch at once, or one row of
it over its own columns (:func:`row_parts`), which computes exactly what that row computes
in a batch of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import mlx.core as mx

from . import stored_attend
from ._qmath import dequantize_reference, rotate

__all__ = ("Coded", "Kernel", "attend_parts", "mlx_kernel", "row_parts")

Kernel = Literal["auto", "quantized_matmul", "reference", "stored"]
Regions = list[tuple["Coded", "Coded"]]  # per region: keys, values (width 0: none)
Tail = tuple[mx.array, mx.array]  # the float K, V of the turn, (B, H, T, D)
_CPU_FUSED_MAX_QUERIES = 2


def mlx_kernel(n_queries: int) -> Kernel:
    """Of MLX's own kernels, the faster for ``n_queries`` queries a row on this device:
    the fused one on a GPU; on the CPU only for one or two (MLX's CPU quantized matmul
    costs in proportion to the queries, so a prefill chunk is faster dequantizing the past
    once: bench/ttft.py)."""
    if mx.default_device() != mx.cpu or n_queries <= _CPU_FUSED_MAX_QUERIES:
        return "quantized_matmul"
    return "reference"


class Coded:
    """One role's tokens of one region for every row: packed values with fp32 scales and
    biases (``bits`` < 16), or plain fp32 values (``bits`` == 16). Arrays are
    ``(B, H, W, ...)``; ``rotated`` tells whether they are in the Hadamard basis."""

    __slots__ = ("arrays", "bits", "group", "rotated")

    def __init__(self, bits: int, group: int, rotated: bool, arrays: tuple[mx.array, ...]):
        self.bits, self.group, self.rotated, self.arrays = bits, group, rotated, arrays

    def replace(self, arrays: tuple[mx.array, ...]) -> Coded:
        return Coded(self.bits, self.group, self.rotated, arrays)

    @property
    def width(self) -> int:
        return self.arrays[0].shape[2]

    def dequantized(self) -> mx.array:
        """``(B, H, W, D)`` fp32, still in the stored basis (the reference path)."""
        if self.bits == 16:
            return self.arrays[0]
        q, s, b = self.arrays
        return dequantize_reference(q, s, b, self.group, self.bits)


def _product(x: mx.array, coded: Coded, kernel: Kernel, *, transpose: bool) -> mx.array:
    """``x @ Cᵀ`` (transpose) or ``x @ C`` for the coded ``C`` of every row, broadcast over
    the query-head repeats."""
    if coded.bits == 16 or kernel == "reference":
        c = coded.dequantized()[:, :, None]
        return x @ (c.swapaxes(-1, -2) if transpose else c)
    q, s, b = (a[:, :, None] for a in coded.arrays)
    return mx.quantized_matmul(
        x, q, s, b, transpose=transpose, group_size=coded.group, bits=coded.bits
    )


def attend_parts(
    queries: mx.array,
    scale: float,
    regions: Regions,
    tail: Tail,
    mask: mx.array | None,
    kernel: Kernel,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of ``queries`` ``(B, n_heads, N, D)`` over the regions' keys and values
    then the tail's (their columns in that order, as ``mask`` has them); ``sinks``: learned
    per-head logits ``(n_heads,)`` that join each softmax as one more column with no value
    (gpt-oss), as mlx's ``scaled_dot_product_attention`` takes them."""
    b, n_heads, n, d = queries.shape
    tail_k, tail_v = (a.astype(mx.float32) for a in tail)
    h = tail_k.shape[1]
    out_dtype = queries.dtype
    q = (queries.astype(mx.float32) * scale).reshape(b, h, n_heads // h, n, d)
    q_rot: mx.array | None = None
    scores = []
    used = [(k, v) for k, v in regions if k.width]
    if kernel == "stored":  # numba over the packed codes (CPU), where it covers them
        widths = (tail_k.shape[-1], tail_v.shape[-1])
        if stored_attend.covers(used, n_heads // h * n, widths):
            out = stored_attend.attend(q, used, (tail_k, tail_v), mask, sinks)
            return out.reshape(b, n_heads, n, out.shape[-1]).astype(out_dtype)
        kernel = mlx_kernel(n)
    for coded, _ in used:
        if coded.rotated and q_rot is None:
            q_rot = rotate(q)
        query = q_rot if coded.rotated else q
        assert query is not None
        scores.append(_product(query, coded, kernel, transpose=True))
    width = tail_k.shape[2]
    assert width, "attention runs after the step's keys went into the tail"
    scores.append(q @ tail_k[:, :, None].swapaxes(-1, -2))
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    if mask is not None:
        s = mx.where(mask[:, :, None], s, mx.finfo(s.dtype).min)
    if sinks is not None:
        sink = sinks.astype(s.dtype).reshape(1, h, n_heads // h, 1, 1)
        s = mx.concatenate([mx.broadcast_to(sink, (*s.shape[:-1], 1)), s], axis=-1)
    p = mx.softmax(s, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    out = p[..., -width:] @ tail_v[:, :, None]
    rotated_sum: mx.array | None = None
    at = 0
    for key, coded in used:
        part = _product(p[..., at : at + key.width], coded, kernel, transpose=False)
        at += key.width
        if coded.rotated:
            rotated_sum = part if rotated_sum is None else rotated_sum + part
        else:
            out = out + part
    if rotated_sum is not None:
        out = out + rotate(rotated_sum)
    return out.reshape(b, n_heads, n, out.shape[-1]).astype(out_dtype)


def row_parts(
    row: int,
    regions: Regions,
    lengths: Sequence[Sequence[int]],
    tail: Tail,
    tail_length: int,
    mask: mx.array | None,
) -> tuple[Regions, Tail, mx.array | None]:
    """Row ``row``'s own regions, tail and mask columns in a batch (its left padding in
    each region, and the tail columns before its own, cut off): what it holds in a batch
    of its own. ``lengths[r][row]``: its tokens in region ``r``."""
    mine: Regions = []
    columns = []
    at = 0
    for (key, value), held in zip(regions, lengths, strict=True):
        width = key.width
        n = held[row]
        cut = width - n
        key_i, value_i = (
            c.replace(tuple(a[row : row + 1, :, cut:] for a in c.arrays)) for c in (key, value)
        )
        mine.append((key_i, value_i))
        if n:
            columns.append((at + cut, at + width))
        at += width
    tail_k, tail_v = tail
    idx = tail_k.shape[2]
    columns.append((at + idx - tail_length, at + idx))
    own = (
        tail_k[row : row + 1, :, idx - tail_length :],
        tail_v[row : row + 1, :, idx - tail_length :],
    )
    if mask is None:
        return mine, own, None
    picked = [mask[row : row + 1, ..., lo:hi] for lo, hi in columns]
    return mine, own, picked[0] if len(picked) == 1 else mx.concatenate(picked, axis=-1)
