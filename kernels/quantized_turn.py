"""Quantized attention's working cache (``kernels.turn_cache``): the stored parts as they
are plus a float tail of the turn, and each recurrent layer's state."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ._qparts import concat_parts
from ._turn_base import Entries, TurnCache, geometry_slots, state_layer, stored_values
from .attention import bind_attention
from .geometry import CacheGeometry
from .qattend import Kernel
from .qbatch import QuantizedBatchCache
from .recurrent import RecurrentCache

if TYPE_CHECKING:
    from .agent_cache import AgentKV
    from .stored import Parts, StoredRange

__all__ = ("QuantizedTurnCache",)

Layer = QuantizedBatchCache | RecurrentCache


class QuantizedTurnCache(Entries):
    """Quantized attention: the stored parts as they are plus a float tail of the turn (a
    QuantizedBatchCache per K/V entry; a :class:`RecurrentCache` per recurrent one)."""

    quantized: ClassVar[bool] = True
    keeps_ready: ClassVar[bool] = False
    kernel: ClassVar[Kernel] = "auto"
    _layers: list[Layer]

    @classmethod
    def start(cls, kv: AgentKV) -> QuantizedTurnCache:
        layers = [cls._layer(kv, i) for i in range(kv.geometry.n_layers)]
        out = cls(layers, geometry_slots(kv.geometry))
        out._mark(layers)
        return out

    @classmethod
    def _layer(cls, kv: AgentKV, i: int) -> Layer:
        if kv.geometry.state(i) is not None:
            return state_layer(kv, i)
        g = kv.geometry.layer(i)
        out = QuantizedBatchCache.from_parts(
            kv.codec,
            g.n_kv_heads,
            (g.key_dim, g.value_dim),
            concat_parts(kv.layer_parts(i, "key")),  # lazy: read when it attends
            concat_parts(kv.layer_parts(i, "value")),
            kv.stored_tokens,
            cls.kernel,
        )
        if kv.landing is not None:  # streamed in: this layer's bytes first (fill_streamed)
            out.landing = functools.partial(kv.landing.wait_layer, i)
        return out

    @classmethod
    def prepare(cls, model: nn.Module, geometry: CacheGeometry | None = None) -> None:
        if geometry is None or geometry.kv_layers:
            bind_attention(model, QuantizedBatchCache)

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        return 0

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[tuple[int, QuantizedTurnCache | None]]:
        raise NotImplementedError("a quantized working cache is never kept between turns")

    @classmethod
    def with_kernel(cls, kernel: Kernel) -> type[QuantizedTurnCache]:
        """This class with attention forced to one kernel (``"reference"`` ...), for tests
        and benchmarks."""
        return type(f"QuantizedTurnCache[{kernel}]", (cls,), {"kernel": kernel})

    def batch(self) -> QuantizedTurnCache:
        return self

    def extend(self, other: TurnCache) -> None:
        if not isinstance(other, QuantizedTurnCache):
            raise TypeError("a quantized batch takes quantized rows only")
        for layer, new in zip(self._layers, other._layers, strict=True):
            if type(layer) is not type(new):
                raise TypeError("rows of another model's entries")
            layer.extend(new)  # type: ignore[arg-type]

    def filter(self, rows: list[int]) -> None:
        for layer in self._layers:
            layer.filter(rows)

    def extract(self, row: int) -> QuantizedTurnCache:
        return type(self)([layer.extract(row) for layer in self._layers], self._slots)

    def _kv(self, layer: int) -> QuantizedBatchCache:
        cache = self._layers[layer]
        if not isinstance(cache, QuantizedBatchCache):
            raise ValueError(f"entry {layer} keeps a recurrent state, not K/V")
        return cache

    def added(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array, bool]:
        cache = self._kv(layer)
        stored = cache.stored_lengths()
        if len(stored) != 1 or start < stored[0] or cache.tail_lengths() != [stop - stored[0]]:
            raise ValueError("the working cache does not hold this agent's new tokens")
        keys, values = cache.tail(0)
        skip = start - stored[0]  # tokens of the tail stored already (AgentKV.store_so_far)
        return keys[:, :, skip:], values[:, :, skip:], False  # the tail is in the model's basis

    def adopt(self, kv: AgentKV, new: StoredRange) -> None:
        for i, layer in enumerate(self._layers):
            if isinstance(layer, RecurrentCache):
                continue  # a state is stored exactly: nothing to adopt
            at = new.start - layer.stored_lengths()[0]
            keys, values = (stored_values(kv, new, i, role, False) for role in ("key", "value"))
            layer.set_tail(0, at, keys, values)

    def settle(self, kv: AgentKV, new: StoredRange | None) -> None:
        return None  # the stored parts are what it reads: nothing to keep

    def trim(self, keep: int, states: Mapping[int, Parts]) -> None:
        raise NotImplementedError("a quantized working cache is never kept between turns")

    def unfeed(self, n: int) -> None:
        for layer in self._layers:
            layer.unfeed(n)

    def arrays(self) -> list[mx.array]:
        return [
            a
            for layer in self._layers
            for a in (layer.arrays() if isinstance(layer, RecurrentCache) else layer.state)
        ]
