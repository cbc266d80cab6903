"""Attention over the stored form on the CPU: a few queries a row attend over quantized
keys and values read straight from their packed codes, with numba, instead of MLX's CPU
``quantized_matmul`` (or a float copy of the whole past).

Measured by ``bench/stored_attend.py`` (a 4K-token cache of the default model's shape
and codec, keys 5-bit and values 3-bit, every layer, 2 cores): one new token attends in
56 ms against 226 for ``quantized_matmul`` and 143 for the reference; MLX's fused
attention over a float copy takes 43 ms, or 140 with the copy made first (a warm turn's
first step). The kernel alone: 790 us a layer. It reads each token's codes once
for its keys and once for its values, gives each chunk of tokens its softmax partials
(each query's largest score, the sum of its exponentials less that, the values weighted
by them), the float tail's (the turn's own tokens) too, and joins them with learned
sinks: one call a layer (a call per region and MLX ops for the tail and the join cost
~0.7 ms a layer more: 1.84-2.16x attention over a float copy, 1.20-1.34x in one call).

Not bit for bit what the other kernels give (sums run in another order, exp is a
polynomial of ~1 ulp): within fp32 rounding (``tests/test_stored_attend.py``), and greedy
answers the same (``tests/test_invariance.py``). It compiles beside the fused dequantize
(``kernels.fused``: the same thread, switch and lock); until then, and where numba is
missing, ``KVACTOR_FUSED=0`` is set or the device is a GPU, :func:`covers` is False and
``kernels.qattend`` takes MLX's kernels. The engine's thread calls it, inside the model's
forward: the layer's queries are evaluated there, the kernel reads their memory and the
stored arrays', and its outputs become new MLX arrays on that thread.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from . import fused
from ._qmath import rotate

if TYPE_CHECKING:
    from .qattend import Coded

__all__ = ("MAX_QUERIES", "attend", "covers", "takes")

MAX_QUERIES = 16
"""Queries a row (query-head repeats x new tokens) up to which the kernel runs: at 15 it
took 119 ms where the reference took 277 (``bench/stored_attend.py``, 4K); its cost grows
with the queries, and a prefill chunk is faster dequantizing the past once for BLAS."""
_CHUNK = 256  # tokens a job: 16 jobs a head at 4K, work enough for every core
_NO_MASK = np.zeros((0, 0, 0, 0), np.uint8)
_NO_SINKS = np.zeros((0,), np.float32)
_NO_TURN = np.zeros((0, 0), np.float32)
_WIDTHS = (2, 3, 4, 5, 6, 8)  # a unit of 8 values fits one 64-bit word at any shift


def takes(bits: Iterable[int], widths: Iterable[int], queries: int) -> bool:
    """Whether the kernel runs now for ``queries`` queries a row over keys and values of
    these widths (``bits``) and head widths: compiled, 2-6 or 8 bits, one head width of
    whole 8-value units (its outputs are as wide as its queries: MLA's keys and values
    differ)."""
    if queries > MAX_QUERIES or fused.compiled("attend") is None:
        return False
    heads = set(widths)
    return all(b in _WIDTHS for b in bits) and len(heads) <= 1 and all(w % 8 == 0 for w in heads)


def covers(regions: Sequence[tuple[Coded, Coded]], queries: int, tail: tuple[int, int]) -> bool:
    """Whether :func:`attend` takes these regions (keys, values; none empty, at most two:
    a quantized cache's sinks and body) and a float tail of these key and value widths
    for ``queries`` queries a row now (:func:`takes`)."""
    coded = [c for pair in regions for c in pair]
    widths = [c.arrays[0].shape[-1] * 32 // c.bits for c in coded if c.bits != 16]
    return len(regions) <= 2 and takes([c.bits for c in coded], [*widths, *tail], queries)


def attend(
    q: mx.array,
    regions: Sequence[tuple[Coded, Coded]],
    tail: tuple[mx.array, mx.array],
    mask: mx.array | None,
    sinks: mx.array | None,
) -> mx.array:
    """Attention of ``q`` fp32 ``(B, H, R, N, D)`` (scaled) over the regions' keys and
    values (in that order; none empty; a region in the Hadamard basis gets the queries
    turned in there and its values turned back) then the float tail's, columns as
    ``mask`` ``(B, 1 or H, N, C)`` has them (True: attended); ``sinks``: per-head logits
    ``(H * R,)`` that join each softmax as a column with no value. Out: ``(B, H, R, N,
    D)`` fp32. Only where :func:`covers`. One kernel call: the regions, the tail, the
    sinks and the join of their softmax partials (each a call and MLX ops of their own
    took ~0.7 ms a layer more, ``bench/stored_attend.py``)."""
    kernel = fused.compiled("attend")
    assert kernel is not None, "attend runs where covers() said it can"
    b, h, r, n, d = q.shape
    flat = q.reshape(b, h, r * n, d)
    keep = None if mask is None else mask.astype(mx.uint8)
    extra = [] if keep is None else [keep]
    if sinks is not None:
        extra.append(sinks := sinks.astype(mx.float32))
    mx.eval(  # one wait: this layer's queries and tail, and the stored arrays the kernel reads
        flat, *tail, *extra, *(a for pair in regions for c in pair for a in c.arrays)
    )
    coded = [_coded_pair(keys, values) for keys, values in regions]
    coded += [_empty(b, h, d)] * (2 - len(coded))
    out = np.empty((b, h, r * n, d), np.float32)
    turned = any(keys.rotated for keys, _ in regions)
    with fused.calling():
        kernel(
            fused.host(flat),
            _hadamard(d) if turned else _NO_TURN,
            *coded[0],
            *coded[1],
            *(fused.host(a, np.float32) for a in tail),
            _NO_MASK if keep is None else fused.host(keep),
            _NO_SINKS if sinks is None else fused.host(sinks),
            r,
            _CHUNK,
            out,
        )
    return mx.array(out).reshape(b, h, r, n, d)


def _coded_pair(keys: Coded, values: Coded) -> tuple[Any, ...]:
    """A region's arguments: rotated or not, then keys' and values' (codes, scales,
    biases as host arrays, bits, group)."""
    parts: list[Any] = [keys.rotated]
    for c in (keys, values):
        codes, scales, biases = c.arrays
        sides = (fused.host(scales, np.float32), fused.host(biases, np.float32))
        parts.append((fused.host(codes), *sides, c.bits, c.group))
    return tuple(parts)


def _empty(b: int, h: int, d: int) -> tuple[Any, ...]:
    """A region of no tokens (the kernel takes two)."""
    codes = np.zeros((b, h, 0, d // 8), np.uint32)  # 4-bit words: any width the kernel takes
    side = np.zeros((b, h, 0, 1), np.float32)
    return (False, (codes, side, side, 4, d), (codes, side, side, 4, d))


@functools.cache
def _hadamard(d: int) -> np.ndarray[Any, Any]:
    """The ``(d, d)`` matrix of ``_qmath.rotate``: orthonormal Hadamard blocks on the
    diagonal."""
    eye = mx.eye(d, dtype=mx.float32)
    return np.ascontiguousarray(np.asarray(rotate(eye)), np.float32)
