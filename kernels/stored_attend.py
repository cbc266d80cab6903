"""Attention over the stored form on the CPU: a few queries a row attend over quantized
keys and values read straight from their packed codes, with numba, instead of MLX's CPU
``quantized_matmul`` (or a float copy of the whole past).

Measured by ``bench/stored_attend.py`` (a 4K-token cache of the default model's shape
and codec, keys 5-bit and values 3-bit, every layer, 2 cores): one new token attends in
63 ms against 196 for ``quantized_matmul`` and 125 for the reference; MLX's fused
attention over a float copy takes 40 ms, or 127 with the copy made first (a warm turn's
first step). The kernel alone, 4-bit: 24 ms (8K: 47). It reads each token's codes once
for its keys and once for its values, and gives each region's softmax partials (each
query's largest score, the sum of its exponentials less that, the values weighted by
them); the float tail (the turn's own tokens), learned sinks and the join are MLX ops.

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
_WIDTHS = (2, 3, 4, 5, 6, 8)  # a unit of 8 values fits one 64-bit word at any shift

Partial = tuple[mx.array, mx.array, mx.array]  # max (B,H,R,N), sum (B,H,R,N), values (...,D)


def takes(bits: Iterable[int], widths: Iterable[int], queries: int) -> bool:
    """Whether the kernel runs now for ``queries`` queries a row over keys and values of
    these widths (``bits``) and head widths: compiled, 2-6 or 8 bits, one head width of
    whole 8-value units (none: a tail alone)."""
    if queries > MAX_QUERIES or fused.compiled("attend") is None:
        return False
    heads = set(widths)
    return all(b in _WIDTHS for b in bits) and len(heads) <= 1 and all(w % 8 == 0 for w in heads)


def covers(regions: Sequence[tuple[Coded, Coded]], queries: int) -> bool:
    """Whether :func:`attend` takes these regions (keys, values; empty ones skipped) for
    ``queries`` queries a row now (:func:`takes`)."""
    coded = [c for pair in regions for c in pair]
    widths = [c.arrays[0].shape[-1] * 32 // c.bits for c in coded if c.bits != 16]
    return takes([c.bits for c in coded], widths, queries)


def _region(kernel: Any, q: np.ndarray[Any, Any], keys: Coded, values: Coded, mask: Any) -> Partial:
    """One quantized region's partials (the kernel, its arrays made host views)."""
    b, h, n_q, d = q.shape
    m, total = np.empty((b, h, n_q), np.float32), np.empty((b, h, n_q), np.float32)
    o = np.empty((b, h, n_q, d), np.float32)
    k_q, k_s, k_b = (fused.host(a) for a in keys.arrays)
    v_q, v_s, v_b = (fused.host(a) for a in values.arrays)
    coded_k = (k_q, k_s, k_b, keys.bits, keys.group)
    coded_v = (v_q, v_s, v_b, values.bits, values.group)
    with fused.calling():
        kernel(q, *coded_k, *coded_v, mask, _CHUNK, m, total, o)
    return mx.array(m), mx.array(total), mx.array(o)


def _tail(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None) -> Partial:
    """The float tail's partials, by MLX (``q`` ``(B, H, R, N, D)``, K/V ``(B, H, T, D)``)."""
    s = q @ keys[:, :, None].swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mask[:, :, None], s, mx.finfo(s.dtype).min)
    top = s.max(axis=-1)
    p = mx.exp(s - top[..., None])
    return top, p.sum(axis=-1), p @ values[:, :, None]


def attend(
    q: mx.array,
    q_rot: mx.array | None,
    regions: Sequence[tuple[Coded, Coded]],
    tail: tuple[mx.array, mx.array],
    mask: mx.array | None,
    sinks: mx.array | None,
) -> mx.array:
    """Attention of ``q`` fp32 ``(B, H, R, N, D)`` (scaled; ``q_rot``: the same in the
    Hadamard basis, where a region is rotated) over the regions' keys and values (in that
    order; none empty) then the float tail's, columns as ``mask`` ``(B, 1 or H, N, C)``
    has them (True: attended); ``sinks``: per-head logits ``(H * R,)`` that join each
    softmax as a column with no value. Out: ``(B, H, R, N, D)`` fp32. Only where :func:`covers`."""
    kernel = fused.compiled("attend")
    assert kernel is not None, "attend runs where covers() said it can"
    b, h, r, n, d = q.shape
    flat = q.reshape(b, h, r * n, d)
    flat_rot = None if q_rot is None else q_rot.reshape(b, h, r * n, d)
    keep = None if mask is None else mask.astype(mx.uint8)
    mx.eval(  # one wait: this layer's queries, and the stored arrays the kernel reads
        flat,
        *([] if flat_rot is None else [flat_rot]),
        *([] if keep is None else [keep]),
        *(a for pair in regions for c in pair for a in c.arrays),
    )
    queries = {False: fused.host(flat), True: None if flat_rot is None else fused.host(flat_rot)}
    host_mask = None if keep is None else np.asarray(keep)
    plain: list[Partial] = []
    turned: list[Partial] = []
    at = 0
    for keys, values in regions:
        cols = _NO_MASK
        if host_mask is not None:
            cols = np.ascontiguousarray(host_mask[..., at : at + keys.width])
        query = queries[keys.rotated]
        assert query is not None
        m, total, o = _region(kernel, query, keys, values, cols)
        part = (m.reshape(b, h, r, n), total.reshape(b, h, r, n), o.reshape(b, h, r, n, d))
        (turned if keys.rotated else plain).append(part)
        at += keys.width
    tail_mask = None if mask is None else mask[..., at:]
    plain.append(_tail(q, *tail, tail_mask))
    if sinks is not None:
        logit = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, h, r, 1), (b, h, r, n))
        plain.append((logit, mx.ones_like(logit), mx.zeros((b, h, r, n, d), mx.float32)))
    return _join(plain, turned)


def _join(plain: list[Partial], turned: list[Partial]) -> mx.array:
    """The softmax over every part's columns: each part rescaled to the largest score of
    all; the rotated parts' values turned back to the stored basis after their sum."""
    top = plain[0][0]
    for m, _, _ in plain[1:] + turned:
        top = mx.maximum(top, m)
    total = mx.zeros_like(top)
    sums = [mx.zeros_like(plain[0][2]), mx.zeros_like(plain[0][2])]  # plain, turned
    for j, parts in enumerate((plain, turned)):
        for m, part_total, o in parts:
            f = mx.exp(m - top)
            total = total + f * part_total
            sums[j] = sums[j] + f[..., None] * o
    out = sums[0] + rotate(sums[1]) if turned else sums[0]
    return out / total[..., None]
