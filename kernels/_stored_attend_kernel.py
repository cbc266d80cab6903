"""The numba kernel of ``kernels.stored_attend`` (compiled on the thread of
``kernels.fused``): a layer's attention of a few queries over two regions of quantized
keys and values (a cache's sinks and body), read straight from their packed codes, and
the turn's float tail: softmax partials per chunk of tokens, joined at the end.

A row's values are unpacked in a permuted order: with 8 values to a unit (``bits`` bytes)
and ``G`` units a quantization group, value ``8 * u + k`` of group ``g`` goes to ``(8 * g
+ k) * G + u % G``. Each ``k`` is then one run over a group's units (which LLVM
vectorizes: every width 2-8 takes the same time, 23-25 ms for every layer of a 4K cache
of the default model's shape, where a 32-bit word's own layout took 61 ms at 2 bits and
37 at 5), each group's values lie together, and the queries (for the keys) and the sums
(for the values) are permuted the same way, once per chunk. The codes stay integers:
``q . (code * scale + bias)`` over a group is ``scale * (q . code) + bias * sum(q)``, and
the values' bias is summed apart (an affine pass over every value took a third of the
kernel: 976 -> 790 us a layer at 4K, one group a row; 1592 -> 1519 at two).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

__all__ = ("attend_layer",)

_NEG = np.float32(-np.inf)
# Sums may be reordered and multiply-adds fused (LLVM vectorizes the dots); infinities and
# NaNs keep their meaning (a masked column is -inf).
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@njit(inline="always")
def _unpack(
    codes: Any,
    b: int,
    h: int,
    t: int,
    bits: int,
    units: int,
    gu: int,
    mask: Any,
    out: Any,
    wide: Any,
) -> None:  # pragma: no cover
    """Row ``codes[b, h, t]`` (uint32 words, as MLX packs them: 8 values in ``bits``
    bytes, a unit) as float codes, in the permuted order (module docstring; ``gu`` units a
    group): first each unit shifted down into one 64-bit word (from the two words that
    hold it), then a run over a group's units for each of the 8 values, which LLVM
    vectorizes. (Indices, not a view of the row: a view per token costs its reference
    counting.)"""
    last = codes.shape[3] - 1
    for u in range(units):
        bit = u * 8 * bits
        w = bit >> 5
        low = np.uint64(codes[b, h, t, w])
        high = np.uint64(codes[b, h, t, min(w + 1, last)]) if w < last else np.uint64(0)
        wide[u] = ((high << np.uint64(32)) | low) >> np.uint64(bit & 31)
    if gu == units:  # one group: the same order, in the loops LLVM vectorizes best
        for k in range(8):
            shift = np.uint64(k * bits)
            for u in range(units):
                out[k * units + u] = np.float32(np.int32((wide[u] >> shift) & mask))
        return
    for g in range(units // gu):
        for k in range(8):
            shift = np.uint64(k * bits)
            base = (g * 8 + k) * gu
            for uu in range(gu):
                out[base + uu] = np.float32(np.int32((wide[g * gu + uu] >> shift) & mask))


@njit(inline="always")
def _permuted(v: int, gu: int) -> int:  # pragma: no cover
    """Where value ``v`` of a row sits in the permuted order (``gu`` units a group)."""
    u, k = v // 8, v % 8
    return ((u // gu) * 8 + k) * gu + u % gu


# exp(x) for x <= 0 in fp32, vectorizable (libm's expf, called per value, took about half of
# the kernel): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 minimax polynomial
# (Cephes' coefficients, ~1 ulp), times 2^n from a table.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = (
    np.float32(1.9875691500e-4),
    np.float32(1.3981999507e-3),
    np.float32(8.3334519073e-3),
)
_P3, _P4, _P5 = (
    np.float32(4.1665795894e-2),
    np.float32(1.6666665459e-1),
    np.float32(5.0000001201e-1),
)
_POW2 = np.ldexp(np.float32(1), np.arange(-127, 1)).astype(np.float32)  # 2^n, n = -127 .. 0


@njit(inline="always")
def _exp(x: Any) -> Any:  # pragma: no cover
    if x < np.float32(-87.0):
        return np.float32(0)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    return (p * r * r + r + np.float32(1)) * _POW2[np.int32(n) + 127]


@njit(inline="always")
def _finish(scores: Any, n: int, m_out: Any, l_out: Any) -> None:  # pragma: no cover
    """Each query's max over its ``n`` scores into ``m_out``, the scores replaced by their
    exponentials less it, their sum into ``l_out``."""
    for i in range(scores.shape[0]):
        top = _NEG
        for t in range(n):
            if scores[i, t] > top:
                top = scores[i, t]
        total = np.float32(0)
        if top != _NEG:
            for t in range(n):
                e = _exp(scores[i, t] - top)
                scores[i, t] = e
                total += e
        else:
            for t in range(n):
                scores[i, t] = np.float32(0)
        m_out[i] = top
        l_out[i] = total


@njit(inline="always")
def _coded_chunk(
    xq: Any,
    keys: Any,
    values: Any,
    mask: Any,
    col: int,
    b: int,
    h: int,
    lo: int,
    n: int,
    m_out: Any,
    l_out: Any,
    o_out: Any,
) -> None:  # pragma: no cover
    """One chunk of a quantized region, tokens ``[lo, lo + n)`` of row ``b``, head ``h``
    (its first column ``col`` of the mask): each query's partials into ``m_out``,
    ``l_out`` ``(Q,)`` and ``o_out`` ``(Q, D)``, for queries ``xq`` ``(Q, D)``. ``keys``,
    ``values``: (codes, scales, biases, bits, group)."""
    codes, scales, biases, bits, group = keys
    v_codes, v_scales, v_biases, v_bits, v_group = values
    n_q, dim = xq.shape
    units = dim // 8  # 8 values a unit, whatever the width
    k_mask = np.uint64((1 << bits) - 1)
    v_mask = np.uint64((1 << v_bits) - 1)
    k_gu, v_gu = group // 8, v_group // 8
    k_groups, v_groups = dim // group, dim // v_group
    masked = mask.shape[0] > 0
    mb, mh, mn = max(mask.shape[0], 1), max(mask.shape[1], 1), max(mask.shape[2], 1)
    # Each group's values contiguous (permuted), as (groups, group) views made once.
    xp = np.empty((n_q, k_groups, group), np.float32)
    q_sums = np.zeros((n_q, k_groups), np.float32)  # each group's sum of a query's values
    for i in range(n_q):
        for v in range(dim):
            at = _permuted(v, k_gu)
            xp[i, at // group, at % group] = xq[i, v]
            q_sums[i, at // group] += xq[i, v]
    ck = np.empty(dim, np.float32)
    cv = np.empty(dim, np.float32)
    ck_groups = ck.reshape((k_groups, group))
    cv_groups = cv.reshape((v_groups, v_group))
    wide = np.empty(units, np.uint64)
    scores = np.empty((n_q, n), np.float32)
    # q . (code * scale + bias) over a group = scale * (q . code) + bias * sum(q): the
    # affine pass over every value (a third of the kernel's time) folded into the dots.
    for t in range(n):
        _unpack(codes, b, h, lo + t, bits, units, k_gu, k_mask, ck, wide)
        for i in range(n_q):
            total = np.float32(0)
            for g in range(k_groups):
                dot = np.float32(0)
                for j in range(group):
                    dot += xp[i, g, j] * ck_groups[g, j]
                total += scales[b, h, lo + t, g] * dot + biases[b, h, lo + t, g] * q_sums[i, g]
            if masked and mask[b % mb, h % mh, i % mn, col + t] == 0:
                total = _NEG
            scores[i, t] = total
    _finish(scores, n, m_out, l_out)
    acc = np.zeros((n_q, v_groups, v_group), np.float32)
    offsets = np.zeros((n_q, v_groups), np.float32)  # the biases, weighted, per group
    for t in range(n):
        _unpack(v_codes, b, h, lo + t, v_bits, units, v_gu, v_mask, cv, wide)
        for i in range(n_q):
            w = scores[i, t]
            for g in range(v_groups):
                ws = w * v_scales[b, h, lo + t, g]
                offsets[i, g] += w * v_biases[b, h, lo + t, g]
                for j in range(v_group):
                    acc[i, g, j] += ws * cv_groups[g, j]
    for i in range(n_q):
        for v in range(dim):
            at = _permuted(v, v_gu)
            o_out[i, v] = acc[i, at // v_group, at % v_group] + offsets[i, v // v_group]


@njit(inline="always")
def _float_chunk(
    xq: Any,
    keys: Any,
    values: Any,
    mask: Any,
    col: int,
    b: int,
    h: int,
    lo: int,
    n: int,
    m_out: Any,
    l_out: Any,
    o_out: Any,
) -> None:  # pragma: no cover
    """``_coded_chunk`` of float keys and values ``(B, H, T, D)`` (the turn's tail)."""
    n_q, dim = xq.shape
    masked = mask.shape[0] > 0
    mb, mh, mn = max(mask.shape[0], 1), max(mask.shape[1], 1), max(mask.shape[2], 1)
    scores = np.empty((n_q, n), np.float32)
    for t in range(n):
        for i in range(n_q):
            total = np.float32(0)
            for j in range(dim):
                total += xq[i, j] * keys[b, h, lo + t, j]
            if masked and mask[b % mb, h % mh, i % mn, col + t] == 0:
                total = _NEG
            scores[i, t] = total
    _finish(scores, n, m_out, l_out)
    for i in range(n_q):
        for j in range(dim):
            o_out[i, j] = np.float32(0)
    for t in range(n):
        for i in range(n_q):
            w = scores[i, t]
            for j in range(dim):
                o_out[i, j] += w * values[b, h, lo + t, j]


@njit(parallel=True, nogil=True, cache=True, fastmath=_FAST)
def attend_layer(
    q: Any,
    hadamard: Any,
    a_rot: bool,
    a_keys: Any,
    a_values: Any,
    b_rot: bool,
    b_keys: Any,
    b_values: Any,
    tail_k: Any,
    tail_v: Any,
    mask: Any,
    sinks: Any,
    repeats: int,
    chunk: int,
    out: Any,
) -> None:  # pragma: no cover - compiled by numba, which coverage does not see
    """A layer's attention of queries ``q`` fp32 ``(B, H, Q, D)`` (scaled; ``Q`` =
    query-head ``repeats`` x queries, repeat-major) over two quantized regions, A then B
    (keys and values each (codes uint32 ``(B, H, W, D * bits / 32)``, scales and biases
    fp32 ``(B, H, W, D / group)``, bits, group); either may be 0 tokens wide; ``*_rot``:
    stored in the Hadamard basis, whose matrix ``hadamard`` fp32 ``(D, D)`` turns the
    queries in and the values back), then the float tail ``tail_k``, ``tail_v`` fp32
    ``(B, H, T, D)``: columns in that order, as ``mask`` uint8 ``(B or 1, H or 1, N or 1,
    C)`` has them (query ``i`` reads row ``i % N``; 0: not attended), or ``(0, 0, 0, 0)``
    for none. ``sinks`` fp32 ``(H * repeats,)``: learned logits that join each softmax as
    a column with no value (``(0,)``: none). Out: ``out`` ``(B, H, Q, D)``. Work splits
    over (row, head, chunk of ``chunk`` tokens) of the three parts; the chunks' softmax
    partials are joined at the end."""
    rows, heads, n_q, dim = q.shape
    wa, wb, wt = a_keys[0].shape[2], b_keys[0].shape[2], tail_k.shape[2]
    ca, cb, ct = (wa + chunk - 1) // chunk, (wb + chunk - 1) // chunk, (wt + chunk - 1) // chunk
    chunks = ca + cb + ct
    q_rot = _turned(q, hadamard) if a_rot or b_rot else q
    pm = np.empty((rows, heads, chunks, n_q), np.float32)
    pl = np.empty((rows, heads, chunks, n_q), np.float32)
    po = np.empty((rows, heads, chunks, n_q, dim), np.float32)
    for job in prange(rows * heads * chunks):
        b = job // (heads * chunks)
        h = (job // chunks) % heads
        c = job % chunks
        m_out, l_out, o_out = pm[b, h, c], pl[b, h, c], po[b, h, c]
        if c < ca + cb:
            first = c < ca
            lo = (c if first else c - ca) * chunk
            n = min(wa if first else wb, lo + chunk) - lo
            xq = q_rot[b, h] if (a_rot if first else b_rot) else q[b, h]
            keys, values = (a_keys, a_values) if first else (b_keys, b_values)
            col = lo if first else wa + lo
            _coded_chunk(xq, keys, values, mask, col, b, h, lo, n, m_out, l_out, o_out)
        else:
            lo = (c - ca - cb) * chunk
            n = min(wt, lo + chunk) - lo
            col = wa + wb + lo
            _float_chunk(q[b, h], tail_k, tail_v, mask, col, b, h, lo, n, m_out, l_out, o_out)
    kinds = np.zeros(chunks, np.bool_)  # a chunk whose values are in the Hadamard basis
    kinds[:ca] = a_rot
    kinds[ca : ca + cb] = b_rot
    _join(pm, pl, po, kinds, a_rot or b_rot, hadamard, sinks, repeats, out)


@njit(inline="always")
def _turned(q: Any, hadamard: Any) -> Any:  # pragma: no cover
    """``q`` ``(B, H, Q, D)`` times ``hadamard`` ``(D, D)``: the queries in the stored basis."""
    rows, heads, n_q, dim = q.shape
    out = np.empty((rows, heads, n_q, dim), np.float32)
    for b in range(rows):
        for h in range(heads):
            for i in range(n_q):
                _times(q[b, h, i], hadamard, out[b, h, i])
    return out


@njit(inline="always")
def _times(x: Any, hadamard: Any, out: Any) -> None:  # pragma: no cover
    """``out = x @ hadamard`` for a row ``x`` ``(D,)``: into or out of the stored basis."""
    for j in range(x.shape[0]):
        total = np.float32(0)
        for k in range(x.shape[0]):
            total += x[k] * hadamard[k, j]
        out[j] = total


@njit(inline="always")
def _join(
    pm: Any,
    pl: Any,
    po: Any,
    kinds: Any,
    turned: bool,
    hadamard: Any,
    sinks: Any,
    repeats: int,
    out: Any,
) -> None:  # pragma: no cover
    """The chunks' partials joined per query: each rescaled to the largest score of all
    (a learned sink's logit among them), the Hadamard-basis values turned back after
    their sum, the whole divided by the sum of the exponentials."""
    rows, heads, chunks, n_q, dim = po.shape
    per_repeat = n_q // repeats
    plain = np.empty(dim, np.float32)
    rot = np.empty(dim, np.float32)
    back = np.empty(dim, np.float32)
    for b in range(rows):
        for h in range(heads):
            for i in range(n_q):
                top = _NEG
                for c in range(chunks):
                    if pm[b, h, c, i] > top:
                        top = pm[b, h, c, i]
                sink = _NEG
                if sinks.shape[0] > 0:
                    sink = sinks[h * repeats + i // per_repeat]
                    if sink > top:
                        top = sink
                total = np.float32(0)
                for j in range(dim):
                    plain[j] = np.float32(0)
                    rot[j] = np.float32(0)
                if top != _NEG:
                    if sink != _NEG:
                        total += _exp(sink - top)
                    for c in range(chunks):
                        if pm[b, h, c, i] == _NEG:
                            continue
                        f = _exp(pm[b, h, c, i] - top)
                        total += f * pl[b, h, c, i]
                        if kinds[c]:
                            for j in range(dim):
                                rot[j] += f * po[b, h, c, i, j]
                        else:
                            for j in range(dim):
                                plain[j] += f * po[b, h, c, i, j]
                if top == _NEG:  # nothing attended (no row of ours): zeros, not NaNs
                    total = np.float32(1)
                if turned:
                    _times(rot, hadamard, back)
                    for j in range(dim):
                        plain[j] += back[j]
                for j in range(dim):
                    out[b, h, i, j] = plain[j] / total
