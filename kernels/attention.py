"""Binding a model's attention to cache classes, per model, without patching mlx-lm.

mlx-lm's attention layers call a module-level ``scaled_dot_product_attention(queries, keys,
values, cache=..., scale=..., mask=...)``. To let a cache class run attention itself (the
quantized batch attends over stored parts that are not plain K/V arrays; a float cache in
the Hadamard basis rotates queries in and the output back), each attention layer of *one
model* gets a subclass whose ``__call__`` is the same code with that one name bound to a
router: a cache of a bound class goes to ``cache.attend``, any other cache to mlx-lm's
function. One model may be bound to several classes (both attention modes). A layer that
attends over another layer's K/V with no cache of its own (``kernels._shared_kv``) goes
to that layer's cache. Modules, other models and other caches are untouched. This relies
on the calling convention above, checked for the mlx-lm versions pyproject pins
(``kernels.mlx_lm_compat``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn

from ._shared_kv import fetched_by
from .mlx_lm_compat import SDPA_NAME, SDPA_PARAMETERS

__all__ = ("Attends", "bind_attention", "query_repeats")

_NAME = SDPA_NAME
_BOUND = "_kvactor_attends"  # on a bound subclass: the list of cache classes it routes
_PARAMETERS = SDPA_PARAMETERS


class Attends(Protocol):
    """A cache that runs attention itself."""

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
        """What the layer's ``scaled_dot_product_attention`` call returns: ``keys`` and
        ``values`` are what this cache's ``update_and_fetch`` gave the layer, ``mask`` what
        the model passed (an array, ``"causal"`` or None), ``sdpa`` mlx-lm's function that
        the layer would have called."""
        ...


def bind_attention(model: nn.Module, cache_class: type[Attends]) -> int:
    """Route the attention of every layer of ``model`` whose ``__call__`` uses mlx-lm's
    ``scaled_dot_product_attention`` to ``cache.attend(...)`` whenever its cache is a
    ``cache_class`` (besides the classes bound before). Idempotent; returns how many layers
    were bound to ``cache_class`` now.

    Raises TypeError when no layer of the model calls that function (an architecture whose
    attention cannot run over such a cache).
    """
    subclasses: dict[type, type] = {}
    extended: set[type] = set()
    found = bound = 0
    for _, module in model.named_modules():
        cls = type(module)
        routes: list[type] | None = getattr(cls, _BOUND, None)
        if routes is not None:  # bound before, by a subclass made for this model alone
            found += 1
            if cache_class not in routes:
                routes.append(cache_class)
                extended.add(cls)
            bound += cls in extended
            continue
        call = cls.__call__
        if (
            not isinstance(call, types.FunctionType)
            or _NAME not in call.__code__.co_names
            or _NAME not in call.__globals__  # an attribute of that name (mx.fast's): not ours
        ):
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
    routes: list[type] = [cache_class]
    names = dict(call.__globals__)  # a copy: the module's own namespace stays as it is
    names[_NAME] = _router(original, routes)
    rebound = types.FunctionType(
        call.__code__, names, call.__name__, call.__defaults__, call.__closure__
    )
    rebound.__kwdefaults__ = call.__kwdefaults__
    rebound.__qualname__ = call.__qualname__
    return type(cls.__name__, (cls,), {"__call__": rebound, _BOUND: routes})


def _router(original: Callable[..., mx.array], routes: list[type]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array, keys: mx.array, values: mx.array, *args: Any, **kwargs: Any
    ) -> mx.array:
        given = {**dict(zip(_PARAMETERS, args, strict=False)), **kwargs}
        cache = given.get("cache")
        if cache is None:  # a layer attending over another layer's K/V: through its cache
            cache = fetched_by(keys)
        if not isinstance(cache, tuple(routes)):
            return original(queries, keys, values, *args, **kwargs)
        return cast(Attends, cache).attend(
            queries,
            keys,
            values,
            scale=given["scale"],
            mask=given.get("mask"),
            sinks=given.get("sinks"),
            sdpa=original,
        )

    return scaled_dot_product_attention


def query_repeats(model: nn.Module) -> int | None:
    """Query heads a KV head in ``model``'s attention layers (``n_heads`` over
    ``n_kv_heads``, as mlx-lm's attention modules name them), None when its layers do not
    say or differ."""
    found = set()
    for _, module in model.named_modules():
        heads, kv_heads = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0:
            found.add(heads // kv_heads)
    return found.pop() if len(found) == 1 else None
