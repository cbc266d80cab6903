"""Float working caches kept in the Hadamard basis of a rotating codec.

A codec with ``rotate`` stores K and V multiplied by the orthonormal Hadamard matrix H. A
float working copy left in that basis skips the inverse rotation when it is made (most of
the cost of dequantizing on CPU), and the turn's new tokens need no rotation when they are
quantized. Attention reads the same in either basis: q·kᵀ = (qH)·(kH)ᵀ, and since H·H = I,
softmax·V = (softmax·(VH))·H. So:

- new K/V enter the cache rotated by :func:`rotate_rows`, row by row: exactly what the
  codec's ``quantize`` computes, so the bytes stored at the turn's end do not change
  (``quantize(..., rotated=True)``);
- the model's attention, bound to these caches per model (``kernels.attention``), rotates
  the queries in, runs mlx-lm's attention over the K/V the layer fetched, and rotates the
  output back.

:class:`RotatedKVCache` is one row (an mlx-lm ``KVCache``), :class:`RotatedBatchKVCache` a
batch (a ``BatchKVCache``); merging, extending, filtering and extracting keep the basis. A
model not bound to them would attend in two bases at once: the cache notices at its next
step, or when the turn's tokens are taken, and raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ._qmath import rotate, rotate_rows
from ._shared_kv import note_fetched
from .beside import land
from .qcodec import KVCodec
from .rowwise import RowwiseBatch, attend_steps, sdpa_call

__all__ = ("RotatedBasis", "RotatedBatchKVCache", "RotatedKVCache", "works_rotated")

_UNBOUND = (
    "attention over a cache in the Hadamard basis ran without the basis change: "
    "prepare the model first (FloatTurnCache.prepare)"
)


def works_rotated(codec: KVCodec) -> bool:
    """Whether float working caches of ``codec``'s K/V stay in its stored basis: when it
    rotates both keys and values (a role stored in fp16 is not rotated)."""
    return codec.rotates("key") and codec.rotates("value")


class RotatedBasis:
    """What both caches share: attention through the basis change (the class that
    ``bind_attention`` routes), and the check that the model's attention is bound."""

    _unattended = False  # a step's K/V went in, and no bound attention has read them yet
    stepwise = False  # a row's positions attend as decode steps (``Entries.stepwise``)

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
        """``sdpa`` (mlx-lm's attention) of the queries rotated in, over the rotated ``keys``
        and ``values`` the layer fetched, rotated back (see ``kernels.attention.Attends``);
        a batch attends row by row (``kernels.rowwise``). Sinks are per-head logits: no
        basis."""
        self._unattended = False
        # A batch that attends row by row turns each row on its own too: a BLAS matmul
        # may round a row differently with the number of rows beside it (AMD EPYC here).
        turn = rotate_rows if getattr(self, "rowwise", False) else rotate
        q = turn(queries.astype(mx.float32))
        out = self._attend(q, keys, values, scale=scale, mask=mask, sinks=sinks, sdpa=sdpa)
        return turn(out).astype(queries.dtype)

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
        """One row's attention (a batch's: ``RowwiseBatch._attend``); position by position
        while ``stepwise``."""
        if self.stepwise and queries.shape[2] > 1:
            return attend_steps(queries, keys, values, scale=scale, sinks=sinks, sdpa=sdpa)
        return sdpa_call(sdpa, queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def check_attended(self) -> None:
        """Raises RuntimeError when K/V went in and the model's attention, not bound to
        this class, read them in the model's basis."""
        if self._unattended:
            raise RuntimeError(_UNBOUND)

    def _entering(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_attended()
        self._unattended = True
        return rotate_rows(keys), rotate_rows(values)


def _check_rotated(caches: Sequence[object]) -> None:
    if not all(isinstance(c, RotatedBasis) for c in caches):
        raise TypeError("a batch in the Hadamard basis takes rows in that basis only")


class RotatedKVCache(RotatedBasis, KVCache):
    """One row's float K/V (fp32) in the Hadamard basis."""

    landing: Callable[[], None] | None = None
    """Blocks until its stored tokens are in, before it first takes new ones (a copy
    filled beside the forward: ``kernels.beside``)."""
    dispatch: bool = False
    """Dispatch the forward's work so far as it hands this layer new tokens
    (``TurnCache.dispatching``)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        land(self, keys, values)
        out = super().update_and_fetch(*self._entering(keys, values))
        note_fetched(self, out[0])
        return out

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> RotatedBatchKVCache:
        """A batch of ``caches`` (rows in this basis). Raises TypeError for others."""
        return RotatedBatchKVCache.merge(caches)


class RotatedBatchKVCache(RowwiseBatch, RotatedBasis, BatchKVCache):
    """A batch of rows' float K/V (fp32) in the Hadamard basis; it attends row by row
    (``kernels.rowwise``)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().update_and_fetch(*self._entering(keys, values))
        note_fetched(self, out[0])
        return out

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> RotatedBatchKVCache:
        """A batch of ``caches`` (rows in this basis). Raises TypeError for others."""
        _check_rotated(caches)
        out = super().merge(caches)
        # mlx-lm makes a plain BatchKVCache when every row is empty: the same, in this class.
        return out if isinstance(out, cls) else cls([0] * len(caches))

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows (in place). Raises TypeError for rows in another basis."""
        _check_rotated([other])
        super().extend(other)

    def extract(self, idx: int) -> RotatedKVCache:
        """Row ``idx`` alone, in this basis (mlx-lm's would be a plain KVCache)."""
        row = RotatedKVCache()
        row.state = super().extract(idx).state
        return row
