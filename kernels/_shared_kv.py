"""Layers that attend over another layer's K/V (Gemma 4's KV-sharing layers).

Such a layer keeps no cache: the model hands it the keys and values an earlier layer's
cache returned from ``update_and_fetch`` and calls attention with ``cache=None``. When
that cache runs attention itself (a quantized batch over stored parts, a float cache in
the Hadamard basis, a batch attending row by row), the shared layer must attend through
the same cache: its keys are not plain K/V of the model's basis. Such caches note what
they returned (:func:`note_fetched`); the attention router asks who returned an array
(:func:`fetched_by`). Only ids and weak references are kept: no array is held.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx

__all__ = ("fetched_by", "note_fetched")

_OWNERS: dict[int, weakref.ref[Any]] = {}  # id of the keys a cache returned -> the cache
_FETCHED = "_kvactor_fetched"  # on a cache: id, shape and dtype of the keys it returned last


def _mark(keys: mx.array) -> tuple[int, tuple[int, ...], Any]:
    return id(keys), tuple(keys.shape), keys.dtype


def note_fetched(cache: Any, keys: mx.array) -> None:
    """``cache``'s ``update_and_fetch`` returned ``keys`` (for this forward). Only the
    array's id is kept: a reference would keep its buffer from being written in place."""
    before = getattr(cache, _FETCHED, None)
    if before is not None:
        ref = _OWNERS.get(before[0])
        if ref is not None and ref() is cache:
            del _OWNERS[before[0]]
    mark = _mark(keys)
    setattr(cache, _FETCHED, mark)

    def gone(ref: weakref.ref[Any], key: int = mark[0]) -> None:
        if _OWNERS.get(key) is ref:  # not a later array's entry under the same id
            del _OWNERS[key]

    _OWNERS[mark[0]] = weakref.ref(cache, gone)


def fetched_by(keys: Any) -> Any | None:
    """The cache whose last ``update_and_fetch`` returned ``keys`` (None: no such cache).
    The layer handing them on holds them, so their id is theirs."""
    if not isinstance(keys, mx.array):
        return None
    ref = _OWNERS.get(id(keys))
    cache = ref() if ref is not None else None
    if cache is None or getattr(cache, _FETCHED, None) != _mark(keys):
        return None
    return cache
