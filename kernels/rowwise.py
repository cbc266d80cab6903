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
  position and neighbours; below that, it depends on the shape). :func:`bind_rows` pads
  a decode step's projections to :data:`DECODE_ROWS` rows (zeros, dropped after), so a
  lone agent's step is computed as a batch's.

Norms, embeddings, RoPE and sampling work row by row already.

:class:`PlainKVCache` / :class:`PlainBatchKVCache` are mlx-lm's float caches with that
attention (the model is bound to them per model: ``kernels.attention``); the rotated ones
(``kernels.rotated``) use the same function.

:class:`PlainKVCache` / :class:`PlainBatchKVCache` are mlx-lm's float caches with that
attention (the model is bound to them per model: ``kernels.attention``); the rotated ones
(``kernels.rotated``) use the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

__all__ = (
    "DECODE_ROWS",
    "PlainBatchKVCache",
    "PlainKVCache",
    "RowwiseBatch",
    "attend_rows",
    "bind_rows",
)

#: The fewest rows a decode step's projections are computed with (see the module doc).
DECODE_ROWS = 8
_PADDED = "_kvactor_rows"  # on a padded subclass: the rows it pads to


def _pad_rows(x: mx.array, rows: int) -> tuple[mx.array, int]:
    """``x`` of one decode step ``(B, 1, D)`` with zero rows up to ``rows``, and ``B``."""
    n = x.shape[0]
    if x.ndim != 3 or x.shape[1] != 1 or n >= rows or not RowwiseBatch.rowwise:
        return x, n
    return mx.concatenate([x, mx.zeros((rows - n, *x.shape[1:]), x.dtype)]), n


def _padded_class(cls: type, rows: int) -> type:
    if issubclass(cls, nn.Embedding):

        def as_linear(self: Any, x: mx.array) -> mx.array:
            padded, n = _pad_rows(x, rows)
            return cast(mx.array, cls.as_linear(self, padded))[:n]

        methods: dict[str, Any] = {"as_linear": as_linear}
    else:

        def call(self: Any, x: mx.array) -> mx.array:
            padded, n = _pad_rows(x, rows)
            return cast(mx.array, cls.__call__(self, padded))[:n]

        methods = {"__call__": call}
    return type(cls.__name__, (cls,), {**methods, _PADDED: rows})


def bind_rows(model: nn.Module, rows: int = DECODE_ROWS) -> int:
    """Make every projection of ``model`` (``nn.Linear``, ``nn.QuantizedLinear``, an
    embedding used as the output layer) compute a decode step of fewer than ``rows`` rows
    as one of ``rows`` (zero rows, dropped after), this model only. Idempotent; returns
    the layers bound now."""
    made: dict[type, type] = {}
    bound = 0
    for _, module in model.named_modules():
        cls = type(module)
        if getattr(cls, _PADDED, None) is not None:
            continue
        if not isinstance(module, nn.Linear | nn.QuantizedLinear | nn.Embedding):
            continue
        if cls not in made:
            made[cls] = _padded_class(cls, rows)
        module.__class__ = made[cls]
        bound += 1
    return bound


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
    extra = {} if sinks is None else {"sinks": sinks}
    if len(pads) == 1 and pads[0] == 0:
        return sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, **extra)
    outs = []
    for i, pad in enumerate(pads):
        row_mask = mask[i : i + 1, ..., pad:] if isinstance(mask, mx.array) else mask
        outs.append(
            sdpa(
                queries[i : i + 1],
                keys[i : i + 1, :, pad:],
                values[i : i + 1, :, pad:],
                cache=None,
                scale=scale,
                mask=row_mask,
                **extra,
            )
        )
    return mx.concatenate(outs, axis=0)


class RowwiseBatch:
    """A batch whose attention runs row by row (``attend_rows``) when ``rowwise``."""

    rowwise: ClassVar[bool] = True
    """False: one attention call over the padded batch, as mlx-lm makes it, and decode
    projections of as many rows as the batch has (a row's logits may then differ in their
    last bits from its logits alone); what ``bench/invariance.py`` compares against. It
    applies to the quantized batch and ``bind_rows`` too."""

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
        if not self.rowwise or queries.shape[0] == 1:
            extra = {} if sinks is None else {"sinks": sinks}
            return sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, **extra)
        pads = cast(list[int], self.left_padding.tolist())
        return attend_rows(
            queries, keys, values, pads, scale=scale, mask=mask, sinks=sinks, sdpa=sdpa
        )


class PlainKVCache(KVCache):
    """One row's float K/V in the model's basis (an mlx-lm ``KVCache``) whose batches
    attend row by row."""

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> PlainBatchKVCache:
        return PlainBatchKVCache.merge(caches)


class PlainBatchKVCache(RowwiseBatch, BatchKVCache):
    """A batch of float rows in the model's basis (an mlx-lm ``BatchKVCache``) whose
    attention gives each row what it gives alone (``RowwiseBatch``)."""

    def attend(
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
        """What the layer's attention call returns (``kernels.attention.Attends``)."""
        return self._attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks, sdpa=sdpa)

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
