"""Reading a model's cache geometry from the model itself (``probe_geometry``)."""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ...kernels.geometry import CacheGeometry, LayerGeometry, StateGeometry

__all__ = ("failing_layer", "first_differing_layer", "probe_geometry")

_KINDS = "KVCache, RotatingKVCache, ArraysCache and CacheList of those"


def failing_layer(exc: BaseException, layers: Any) -> int | None:
    """The index in ``layers`` (a model's layers) of the innermost one running where
    ``exc`` was raised (None: not inside one): its traceback's frames name ``self``."""
    ids = {id(layer): i for i, layer in enumerate(layers or [])}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in ids:
            found = ids[id(owner)]
        tb = tb.tb_next
    return found


def _traced_forward(
    model: nn.Module, caches: Any, tokens: mx.array, outputs: list[Any] | None = None
) -> list[int | None]:
    """Run ``model`` over ``tokens`` with ``caches`` and say, per model layer, which cache
    (its index in ``caches``) it was handed (None: none); layers that never ran are -1.
    ``outputs``: filled with each layer's output (its first array). Each layer's class is
    swapped for a recording subclass during the call only."""
    layers = list(getattr(model, "layers", None) or [])
    index = {id(c): i for i, c in enumerate(caches)}
    seen: list[int | None] = [-1] * len(layers)
    if outputs is not None:
        outputs[:] = [None] * len(layers)
    swapped = []
    for j, layer in enumerate(layers):
        cls = type(layer)

        def call(self: Any, *args: Any, _j: int = j, _cls: type = cls, **kwargs: Any) -> Any:
            handed = [index[id(a)] for a in (*args, *kwargs.values()) if id(a) in index]
            seen[_j] = handed[0] if handed else None
            out = _cls.__call__(self, *args, **kwargs)
            if outputs is not None:
                outputs[_j] = out[0] if isinstance(out, tuple) else out
            return out

        layer.__class__ = types.new_class(cls.__name__, (cls,), exec_body=_body(call))
        swapped.append((layer, cls))
    try:
        model(tokens, cache=caches)
    finally:
        for layer, cls in swapped:
            layer.__class__ = cls
    return seen


def first_differing_layer(
    model: nn.Module, tokens: mx.array, caches: Any, reference: Any
) -> int | None:
    """The first model layer whose output over ``caches`` differs from its output over
    ``reference`` (mlx-lm's own caches) beyond rounding; None: none does."""
    ours: list[Any] = []
    theirs: list[Any] = []
    _traced_forward(model, caches, tokens, ours)
    _traced_forward(model, reference, tokens, theirs)
    for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if isinstance(a, mx.array) and isinstance(b, mx.array) and a.shape == b.shape:
            scale = float(mx.abs(b).max().astype(mx.float32).item()) + 1e-6  # type: ignore[arg-type]
            if not mx.allclose(a, b, rtol=1e-3, atol=1e-3 * scale).item():
                return j
    return None


def _body(call: Any) -> Any:
    def fill(ns: dict[str, Any]) -> None:
        ns["__call__"] = call

    return fill


def _members(cache: Any) -> tuple[Any, ...]:
    return tuple(cache.caches) if type(cache) is CacheList else (cache,)


def _check_kinds(caches: list[Any], where: Any) -> None:
    for i, cache in enumerate(caches):
        for c in _members(cache):
            kind = type(c)
            if kind is RotatingKVCache and c.keep:
                raise ValueError(
                    f"{where(i)} keeps {c.keep} tokens at the start of its sliding window "
                    "(not supported)"
                )
            if kind not in (KVCache, RotatingKVCache, ArraysCache):
                raise ValueError(
                    f"{where(i)} keeps a {kind.__name__}, not supported (kvactor stores {_KINDS})"
                )


def _state_of(cache: ArraysCache, where: str) -> StateGeometry:
    arrays: list[Any] = list(cache.cache)
    if not arrays or any(a is None or a.ndim < 1 or a.shape[0] != 1 for a in arrays):
        raise ValueError(f"{where}: its recurrent state is not one row of arrays after a forward")
    return StateGeometry(
        tuple(tuple(int(x) for x in a.shape) for a in arrays),
        tuple(str(a.dtype).rsplit(".", 1)[-1] for a in arrays),
    )


def probe_geometry(model: nn.Module, family: str) -> CacheGeometry:
    """Every cache the model keeps, as the model itself makes and fills it:
    ``make_prompt_cache`` (the model's own ``make_cache`` when it has one), two tokens
    through the model and one more, and the shapes each cache took: K/V heads, key and
    value widths (MLA keys and values differ) and, for an mlx-lm ``RotatingKVCache``, its
    window; a recurrent layer's ``ArraysCache`` state (fixed-size: the same after the third
    token); both for a ``CacheList``. Which model layers keep no cache of their own (MLP
    layers, layers reusing another's K/V) is read from what each layer is handed.

    Raises ValueError naming the family and the layer when a layer keeps a cache kvactor
    cannot store (chunked, pre-quantized or other caches, a rotating cache that keeps
    tokens at its start, a state that grows), when a layer does not run with the model's
    own caches, or when the forward fails. Whether the codec can store the widths is the
    engine's check, at start.
    """
    caches = make_prompt_cache(model)
    layers = list(getattr(model, "layers", None) or [])
    prefix = f"model family {family!r}"
    _check_kinds(caches, lambda i: f"{prefix}: layer {i}")
    try:
        handed = _traced_forward(model, caches, mx.array([[0, 0]], dtype=mx.uint32))
        before = [_state_shapes(c) for c in caches]
        model(mx.array([[1]], dtype=mx.uint32), cache=caches)
    except Exception as exc:
        at = failing_layer(exc, layers)
        where = f"layer {at}" if at is not None else "a forward"
        raise ValueError(f"{prefix}: {where} fails with mlx-lm's own caches: {exc}") from exc
    idle = [j for j, h in enumerate(handed) if h == -1]
    if idle:
        raise ValueError(
            f"{prefix}: layer {idle[0]} did not run with the model's own caches "
            f"({len(caches)} caches for {len(layers)} layers)"
        )
    slot_layer = {h: j for j, h in enumerate(handed) if h is not None and h >= 0}
    entries: list[LayerGeometry | None] = []
    states: list[StateGeometry | None] = []
    slots = []
    for i, cache in enumerate(caches):
        where = f"{prefix}: layer {slot_layer.get(i, i)}"
        if _state_shapes(cache) != before[i]:
            raise ValueError(f"{where}: its recurrent state grows with the tokens (not supported)")
        slot = []
        for c in _members(cache):
            slot.append(len(entries))
            if isinstance(c, ArraysCache):
                entries.append(None)
                states.append(_state_of(c, where))
                continue
            keys, values = c.state[:2]
            _, heads, _, key_dim = keys.shape
            window = c.max_size if isinstance(c, RotatingKVCache) else None
            entries.append(LayerGeometry(int(heads), int(key_dim), int(values.shape[-1]), window))
            states.append(None)
        slots.append(tuple(slot))
    return CacheGeometry(
        tuple(entries),
        tuple(states) if any(s is not None for s in states) else (),
        tuple(slots) if any(len(s) > 1 for s in slots) else (),
        tuple(handed) if layers and len(layers) != len(caches) else (),
    )


def _state_shapes(cache: Any) -> list[tuple[int, ...] | None]:
    return [
        tuple(a.shape) if a is not None else None
        for c in _members(cache)
        if isinstance(c, ArraysCache)
        for a in c.cache
    ]
