"""Binding a model's attention to a cache class, per model, without patching mlx-lm.

mlx-lm's attention layers call a module-level ``scaled_dot_product_attention(queries, keys,
values, cache=..., scale=..., mask=...)``. To let a cache class run attention itself (the
quantized batch attends over stored parts that are not plain K/V arrays), each attention
layer of *one model* gets a subclass whose ``__call__`` is the same code with that one name
bound to a router: a cache of the class goes to ``cache.attend``, any other cache to
mlx-lm's function. Modules, other models and other caches are untouched. This relies on the
calling convention above, checked for the mlx-lm versions pyproject pins.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

__all__ = ("Attends", "bind_attention")

_NAME = "scaled_dot_product_attention"
_BOUND = "_kvactor_attends"  # on a bound subclass: the cache class it routes
_PARAMETERS = ("cache", "scale", "mask", "sinks")  # after queries, keys, values


class Attends(Protocol):
    """A cache that runs attention itself."""

    def attend(self, queries: mx.array, scale: float, mask: mx.array | None) -> mx.array: ...


def bind_attention(model: nn.Module, cache_class: type[Attends]) -> int:
    """Route the attention of every layer of ``model`` whose ``__call__`` uses mlx-lm's
    ``scaled_dot_product_attention`` to ``cache.attend(queries, scale, mask)`` whenever its
    cache is a ``cache_class``. Idempotent; returns how many layers were bound now.

    Raises TypeError when no layer of the model calls that function (an architecture whose
    attention cannot run over such a cache), or when layers are bound to another class.
    """
    subclasses: dict[type, type] = {}
    found = bound = 0
    for _, module in model.named_modules():
        cls = type(module)
        routed = getattr(cls, _BOUND, None)
        if routed is not None:
            if routed is not cache_class:
                raise TypeError(f"{cls.__name__} is bound to {routed.__name__} already")
            found += 1
            continue
        call = cls.__call__
        if not isinstance(call, types.FunctionType) or _NAME not in call.__code__.co_names:
            continue
        if cls not in subclasses:
            subclasses[cls] = _bound_subclass(cls, call, cache_class)
        module.__class__ = subclasses[cls]
        found += 1
        bound += 1
    if not found:
        raise TypeError(f"{type(model).__name__}: no attention layer calls {_NAME}")
    return bound


def _bound_subclass(cls: type, call: types.FunctionType, cache_class: type[Attends]) -> type:
    original = call.__globals__[_NAME]
    names = dict(call.__globals__)  # a copy: the module's own namespace stays as it is
    names[_NAME] = _router(original, cache_class)
    rebound = types.FunctionType(
        call.__code__, names, call.__name__, call.__defaults__, call.__closure__
    )
    rebound.__kwdefaults__ = call.__kwdefaults__
    rebound.__qualname__ = call.__qualname__
    return type(cls.__name__, (cls,), {"__call__": rebound, _BOUND: cache_class})


def _router(
    original: Callable[..., mx.array], cache_class: type[Attends]
) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array, keys: mx.array, values: mx.array, *args: Any, **kwargs: Any
    ) -> mx.array:
        given = {**dict(zip(_PARAMETERS, args, strict=False)), **kwargs}
        cache = given.get("cache")
        if not isinstance(cache, cache_class):
            return original(queries, keys, values, *args, **kwargs)
        if given.get("sinks") is not None:
            raise NotImplementedError("learned attention sinks over a quantized batch")
        mask = given.get("mask")
        return cache.attend(queries, given["scale"], mask if isinstance(mask, mx.array) else None)

    return scaled_dot_product_attention
