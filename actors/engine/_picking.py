"""Picking a batch's next tokens from its logits, with what only the host knows: each
row's tokens so far (repetition, presence and frequency penalties) and its grammar's
mask. Rows without either are picked as ``kernels.sampling.sample_rows`` always picked
them, in the same graph as the forward pass (``in_graph``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ...kernels.sampling import adjust_logits, apply_bitmask, sample_rows
from ..tools import mask_words

if TYPE_CHECKING:
    from ._generation import Generation

__all__ = ("host_bound", "pick", "pick_in_graph")


def host_bound(rows: Sequence[Generation]) -> bool:
    """Whether a step's picks need the rows' tokens read on the host first."""
    return any(r.grammar is not None or r.sampling.penalized for r in rows)


def pick_in_graph(logits: mx.array, rows: Sequence[Generation]) -> mx.array:
    """The rows' picks from their own settings alone (no host state)."""
    return sample_rows(
        logits,
        [r.sampling.temperature for r in rows],
        [r.sampling.top_p for r in rows],
        [r.next_key() for r in rows],
        top_ks=[r.sampling.top_k for r in rows],
        min_ps=[r.sampling.min_p for r in rows],
    )


def pick(logits: mx.array, rows: Sequence[Generation], live: Sequence[bool]) -> mx.array:
    """The rows' picks: their penalties and biases, then their grammars' masks (rows
    with ``live`` False ended meanwhile: their pick is dropped, so nothing is masked),
    then ``pick_in_graph``. An unconstrained, unpenalized row keeps its logits' bits."""
    if any(r.sampling.penalized for r, ok in zip(rows, live, strict=True) if ok):
        logits = _penalized(logits, rows, live)
    if any(r.grammar is not None for r, ok in zip(rows, live, strict=True) if ok):
        bitmask = np.full((len(rows), mask_words(logits.shape[-1])), -1, dtype=np.int32)
        for i, (r, ok) in enumerate(zip(rows, live, strict=True)):
            if ok and r.grammar is not None:
                r.grammar.fill(bitmask[i, : r.grammar.mask.shape[0]])
                bitmask[i, r.grammar.mask.shape[0] :] = 0
        logits = apply_bitmask(logits, mx.array(bitmask))
    return pick_in_graph(logits, rows)


def _penalized(logits: mx.array, rows: Sequence[Generation], live: Sequence[bool]) -> mx.array:
    """``logits`` with each live row's penalties and biases applied at its tokens."""
    at: list[int] = []
    ids: list[int] = []
    scale: list[float] = []
    shift: list[float] = []
    for i, (r, ok) in enumerate(zip(rows, live, strict=True)):
        s = r.sampling
        if not ok or not s.penalized:
            continue
        changes: dict[int, list[float]] = {}  # token -> [scale, shift]
        if s.repetition_penalty != 1.0:
            window = s.repetition_context_size
            recent = r.generated[-window:]
            if len(recent) < window:
                recent = r.prompt[len(recent) - window :] + recent
            for token in set(recent):
                changes[token] = [s.repetition_penalty, 0.0]
        if s.presence_penalty or s.frequency_penalty:
            for token, count in r.counts.items():
                change = changes.setdefault(token, [1.0, 0.0])
                change[1] -= s.presence_penalty + s.frequency_penalty * count
        for token, bias in s.logit_bias:
            changes.setdefault(token, [1.0, 0.0])[1] += bias
        for token, (mul, add) in changes.items():
            at.append(i)
            ids.append(token)
            scale.append(mul)
            shift.append(add)
    if not at:
        return logits
    return adjust_logits(
        logits,
        mx.array(at, dtype=mx.int32),
        mx.array(ids, dtype=mx.int32),
        mx.array(scale, dtype=mx.float32),
        mx.array(shift, dtype=mx.float32),
    )
