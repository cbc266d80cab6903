"""Picking the next token from logits, for a batch of rows with their own settings."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

__all__ = ("sample_rows", "top_p_filter")


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


def sample_rows(
    logits: mx.array,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    keys: Sequence[mx.array | None],
) -> mx.array:
    """One token id per row of ``logits`` (B, V): argmax where temperature is 0, else a draw
    from softmax(logits / temperature) restricted to the top-p nucleus, with that row's key."""
    greedy = mx.argmax(logits, axis=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    picks = []
    for i, (temp, top_p, key) in enumerate(zip(temperatures, top_ps, keys, strict=True)):
        if temp == 0:
            picks.append(greedy[i])
            continue
        row = top_p_filter(logits[i].astype(mx.float32) / temp, top_p)
        picks.append(mx.random.categorical(row, key=key))
    return mx.stack(picks).astype(greedy.dtype)
