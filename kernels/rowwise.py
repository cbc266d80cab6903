"""Decode steps that give a row the same bits alone and in any batch.

Two things change a row's numbers with the batch around it (``bench/invariance.py``):

- **Attention over padded rows.** A batch left-pads its rows to one length, and a masked
  padding position still moves where a row's keys fall in the softmax and the weighted
  sum over values: the sums run in another order. :func:`attend_rows` runs attention row
  by row over the row's own keys, the padding cut off: exactly the call the row makes in
  a batch of its own.
- **Matrix products of few rows.** The CPU BLAS picks its kernel by the number of rows:
  a projection of 1 to 6 rows can round differently from one of more (measured with
  OpenBLAS 0.3.21 on x86-64: every row of 7 to 24 rows gets the same bits whatever its
  position and neighbours; below that, it depends on the shape: from 2 rows for some,
  7 for others, never for the largest). :func:`bind_rows` pads a decode step's
  projections to the fewest rows from which that layer's rows come out as in any larger
  batch (probed per layer shape at start; zeros, dropped after), so a lone agent's step
  is computed as a batch's; and so are a row's few positions fed again as its decode
  steps were (:func:`attend_steps`: a cache re-prefilled after it was dropped).

Norms, embeddings, RoPE and sampling work row by row already.

:class:`PlainKVCache` / :class:`PlainBatchKVCache` are mlx-lm's float caches with that
attention (the model is bound to them per model: ``kernels.attention``); the rotated ones
(``kernels.rotated``) use the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from ._shared_kv import note_fetched
from .beside import land

__all__ = (
    "PlainBatchKVCache",
    "PlainKVCache",
    "RowwiseBatch",
    "attend_rows",
    "attend_steps",
    "bind_rows",
    "sdpa_call",
)

_ROWS = "_kvactor_rows"  # on a bound layer: the fewest rows its decode steps are computed with
_BOUND = "_kvactor_padded"  # on a bound subclass: True


def _pad_rows(x: mx.array, rows: int) -> mx.array | None:
    """``x`` of one decode step ``(B, 1, D)``, or a row's few positions ``(1, L, D)`` (fed
    as its decode steps were: ``attend_steps``), as ``(B·L, 1, D)`` with zero rows up to
    ``rows``; None for any other ``x`` (left as it is)."""
    if x.ndim != 3 or 1 not in x.shape[:2] or x.shape[0] * x.shape[1] >= rows:
        return None
    n = x.shape[0] * x.shape[1]
    flat = x.reshape(n, 1, x.shape[2])
    return mx.concatenate([flat, mx.zeros((rows - n, 1, x.shape[2]), x.dtype)])


def _project(cls: type) -> Callable[[Any, mx.array], mx.array]:
    """The unpadded projection of a layer class: ``as_linear`` for an embedding."""
    method = getattr(cls, "as_linear") if _is_embedding(cls) else cls.__call__  # noqa: B009
    return cast(Callable[[Any, mx.array], mx.array], method)


def _is_embedding(cls: type) -> bool:
    return issubclass(cls, nn.Embedding | nn.QuantizedEmbedding)


def _padded_class(cls: type) -> type:
    project = _project(cls)

    def padded(self: Any, x: mx.array) -> mx.array:
        rows = getattr(self, _ROWS, 1)
        if rows <= 1:
            return project(self, x)
        flat = _pad_rows(x, rows)
        if flat is None:
            return project(self, x)
        out = project(self, flat)
        return out[: x.shape[0] * x.shape[1]].reshape(*x.shape[:-1], out.shape[-1])

    name = "as_linear" if _is_embedding(cls) else "__call__"
    return type(cls.__name__, (cls,), {name: padded, _BOUND: True})


def _input_width(module: nn.Module) -> int | None:
    """The width of what the projection takes (None: a layer of unknown form)."""
    weight = module.get("weight") if isinstance(module, dict) else None
    if not isinstance(weight, mx.array) or weight.ndim != 2:
        return None
    bits = getattr(module, "bits", None)
    return int(weight.shape[1] * 32 // bits) if bits else int(weight.shape[1])


def _stable_rows(module: nn.Module, width: int, most: int) -> int:
    """The fewest rows from which a projection by ``module`` gives every row the bits it
    gets among ``most`` rows (a row's result depends on how many rows the BLAS is given,
    not on the others' values: measured), found by trying each count."""
    x = mx.random.normal((most, 1, width), key=mx.random.key(0))
    project = _project(
        type(module).__mro__[1] if getattr(type(module), _BOUND, False) else type(module)
    )
    full = project(module, x)
    stable = most
    for m in range(most - 1, 0, -1):
        if not mx.array_equal(project(module, x[:m]), full[:m]).item():
            break
        stable = m
    return stable


def bind_rows(model: nn.Module, max_rows: int = 8) -> int:
    """Make each projection of ``model`` (``nn.Linear``, ``nn.QuantizedLinear``, an
    embedding used as the output layer) compute a decode step of few rows as one of the
    fewest rows from which its BLAS gives every row the same bits as among ``max_rows``
    (zero rows, dropped after; probed once per layer shape), this model only. Layers whose
    one-row product is already a batch's are left unpadded. Idempotent; returns the layers
    that pad now."""
    made: dict[type, type] = {}
    probed: dict[tuple[type, tuple[int, ...], Any], int] = {}
    padded = 0
    for _, module in model.named_modules():
        cls = type(module)
        if getattr(cls, _BOUND, False):
            padded += getattr(module, _ROWS, 1) > 1
            continue
        if not isinstance(
            module, nn.Linear | nn.QuantizedLinear | nn.Embedding | nn.QuantizedEmbedding
        ):
            continue
        width = _input_width(module)
        if width is None:
            continue
        key = (cls, tuple(module["weight"].shape), module["weight"].dtype)
        if key not in probed:
            probed[key] = _stable_rows(module, width, max(max_rows, 2))
        if cls not in made:
            made[cls] = _padded_class(cls)
        module.__class__ = made[cls]
        setattr(module, _ROWS, probed[key])
        padded += probed[key] > 1
    return padded


def sdpa_call(
    sdpa: Callable[..., mx.array],
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any,
    sinks: mx.array | None,
) -> mx.array:
    """One call of ``sdpa`` (mlx-lm's attention) over the whole of ``keys``/``values``."""
    extra = {} if sinks is None else {"sinks": sinks}
    return sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, **extra)


def attend_rows(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    pads: Sequence[int],
    *,
    scale: float,
    mask: Any,
    sinks: mx.array | None,
    sdpa: Callable[..., mx.array],
) -> mx.array:
    """``sdpa`` (mlx-lm's attention) of each row of ``queries`` over its own keys and
    values (``pads[i]`` padding columns cut off, and the mask's), the rows joined again.
    A mask that is not an array (``"causal"``, None) applies to every row alike."""
    if len(pads) == 1 and pads[0] == 0:
        return sdpa_call(sdpa, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    outs = []
    for i, pad in enumerate(pads):
        row_mask = mask[i : i + 1, ..., pad:] if isinstance(mask, mx.array) else mask
        k, v = keys[i : i + 1, :, pad:], values[i : i + 1, :, pad:]
        outs.append(
            sdpa_call(sdpa, queries[i : i + 1], k, v, scale=scale, mask=row_mask, sinks=sinks)
        )
    return mx.concatenate(outs, axis=0)


def attend_steps(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    sinks: mx.array | None,
    sdpa: Callable[..., mx.array],
) -> mx.array:
    """``sdpa`` of a row's last ``L`` positions (``queries`` ``(1, H, L, D)``, causal), each
    over the keys up to itself: exactly the call each made as a decode step, so that tokens
    that were decoded one a step can be fed again ``L`` at a time with the same bits."""
    n, count = keys.shape[2], queries.shape[2]
    outs = [
        sdpa_call(
            sdpa,
            queries[:, :, i : i + 1],
            keys[:, :, : n - count + i + 1],
            values[:, :, : n - count + i + 1],
            scale=scale,
            mask=None,
            sinks=sinks,
        )
        for i in range(count)
    ]
    return mx.concatenate(outs, axis=2)


class RowwiseBatch:
    """A batch whose attention runs row by row (``attend_rows``) when ``rowwise``."""

    rowwise: bool = False
    """True (set on each batch by its ``TurnCache``, per engine: ``deterministic``): each row
    attends over its own keys. False: one attention call over the padded batch, as mlx-lm
    makes it (a row's logits may then differ in their last bits from its logits alone)."""

    left_padding: mx.array

    def _attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
        sdpa: Callable[..., mx.array],
    ) -> mx.array:
        """Attention of the batch, row by row (``attend_rows``) while ``rowwise``."""
        if not self.rowwise or queries.shape[0] == 1:
            return sdpa_call(sdpa, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        pads = cast(list[int], self.left_padding.tolist())
        return attend_rows(
            queries, keys, values, pads, scale=scale, mask=mask, sinks=sinks, sdpa=sdpa
        )


class PlainKVCache(KVCache):
    """One row's float K/V in the model's basis (an mlx-lm ``KVCache``) whose batches
    attend row by row."""

    landing: Callable[[], None] | None = None
    """Blocks until its stored tokens are in, before it first takes new ones (a copy
    filled beside the forward: ``kernels.beside``)."""
    dispatch: bool = False
    """Dispatch the forward's work so far as it hands this layer new tokens
    (``TurnCache.dispatching``)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        land(self, keys, values)
        out: tuple[mx.array, mx.array] = super().update_and_fetch(keys, values)
        return out

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> PlainBatchKVCache:
        return PlainBatchKVCache.merge(caches)


class PlainBatchKVCache(RowwiseBatch, BatchKVCache):
    """A batch of float rows in the model's basis (an mlx-lm ``BatchKVCache``) whose
    attention gives each row what it gives alone (``RowwiseBatch``)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out: tuple[mx.array, mx.array] = super().update_and_fetch(keys, values)
        note_fetched(self, out[0])  # a layer sharing this K/V attends through it too
        return out

    attend = RowwiseBatch._attend  # what the layer's attention call returns (Attends)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> PlainBatchKVCache:
        out = super().merge(caches)
        # mlx-lm makes a plain BatchKVCache when every row is empty: the same, in this class.
        if isinstance(out, cls):
            return out
        return cls([0] * len(caches))

    def extract(self, idx: int) -> PlainKVCache:
        """Row ``idx`` alone (mlx-lm's would be a KVCache, whose batches attend padded)."""
        row = PlainKVCache()
        row.state = super().extract(idx).state
        return row
