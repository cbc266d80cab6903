"""Picking the next token from logits, for a batch of rows with their own settings:
sparse per-row logit adjustments (penalties, biases), grammar bitmasks, and the draw."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

__all__ = (
    "adjust_logits",
    "apply_bitmask",
    "min_p_filter",
    "sample_rows",
    "top_k_filter",
    "top_p_filter",
)


def top_p_filter(logits: mx.array, top_p: float) -> mx.array:
    """Logits of one row with everything outside the top-p nucleus set to -inf."""
    if top_p >= 1.0:
        return logits
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # Keep a token while the mass strictly before it is below top_p (the first always stays).
    before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = before < top_p
    keep = mx.zeros_like(keep_sorted)
    keep = mx.put_along_axis(keep, order, keep_sorted, axis=-1)
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))


def top_k_filter(logits: mx.array, top_k: int) -> mx.array:
    """Logits of one row with all but its ``top_k`` largest set to -inf (ties at the
    k-th value stay); ``top_k`` 0 or past the row's width: unchanged."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = mx.min(mx.topk(logits, top_k, axis=-1), axis=-1, keepdims=True)
    return mx.where(logits >= kth, logits, mx.array(-mx.inf, dtype=logits.dtype))


def min_p_filter(logits: mx.array, min_p: float) -> mx.array:
    """Logits of one row without the tokens whose probability is below ``min_p`` times
    the most likely one's (in logits: below the largest plus log(min_p))."""
    if min_p <= 0.0:
        return logits
    floor = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= floor, logits, mx.array(-mx.inf, dtype=logits.dtype))


def adjust_logits(
    logits: mx.array, rows: mx.array, ids: mx.array, scale: mx.array, shift: mx.array
) -> mx.array:
    """``logits`` (B, V) with entry ``(rows[j], ids[j])`` (pairs distinct) made
    ``v / scale[j] if v > 0 else v * scale[j]``, then ``+ shift[j]``: a repetition
    penalty (scale) and presence / frequency penalties and biases (shift), for a few
    tokens of a few rows in one gather and one scatter; every other entry keeps its bits."""
    values = logits[rows, ids]
    scale = scale.astype(logits.dtype)
    scaled = mx.where(values > 0, values / scale, values * scale)
    out = mx.array(logits)
    out[rows, ids] = scaled + shift.astype(logits.dtype)
    return out


def apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """``logits`` (B, V) with the tokens a row's bitmask (B, W int32: bit ``t % 32`` of
    word ``t // 32`` set when token ``t`` is allowed) disallows set to -inf. Tokens past
    32 * W are disallowed; an all-ones row keeps its bits."""
    rows, vocab = logits.shape
    words = bitmask.shape[1]
    shifts = mx.arange(32, dtype=mx.int32)
    bits = mx.right_shift(bitmask[:, :, None], shifts) & 1
    allowed = bits.reshape(rows, words * 32).astype(mx.bool_)
    if words * 32 >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = mx.concatenate(
            [allowed, mx.zeros((rows, vocab - words * 32), dtype=mx.bool_)], axis=1
        )
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def sample_rows(
    logits: mx.array,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    keys: Sequence[mx.array | None],
    *,
    top_ks: Sequence[int] | None = None,
    min_ps: Sequence[float] | None = None,
) -> mx.array:
    """One token id per row of ``logits`` (B, V): argmax where temperature is 0, else a draw
    from softmax(logits / temperature) after the row's top-k, top-p and min-p filters,
    with that row's key."""
    greedy = mx.argmax(logits, axis=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    n = len(temperatures)
    ks = top_ks if top_ks is not None else [0] * n
    mins = min_ps if min_ps is not None else [0.0] * n
    picks = []
    for i, (temp, top_p, key) in enumerate(zip(temperatures, top_ps, keys, strict=True)):
        if temp == 0:
            picks.append(greedy[i])
            continue
        row = top_k_filter(logits[i].astype(mx.float32) / temp, ks[i])
        row = min_p_filter(top_p_filter(row, top_p), mins[i])
        picks.append(mx.random.categorical(row, key=key))
    return mx.stack(picks).astype(greedy.dtype)
