"""The working K/V cache of running turns, one interface for both attention modes.

Between turns an agent's cache is stored quantized (``AgentKV`` ranges). During a turn the
model reads it through a :class:`TurnCache`: every layer's cache of one agent (a row) or of a
batch of agents decoding together. Choosing an attention mode chooses the class:

- :class:`FloatTurnCache` (``"dequantized"``): a float copy of each row's stored tokens, made
  once at the turn's start; one row is a list of mlx-lm ``KVCache``, a batch a list of
  mlx-lm ``BatchKVCache``. When the codec rotates keys and values the copy stays in its
  Hadamard basis (``kernels.rotated``: no inverse rotation to make it), and the model's
  attention is bound to that per model.
- :class:`QuantizedTurnCache` (``"quantized"``): the stored parts read as they are, plus a
  float tail of the turn's tokens (``QuantizedBatchCache`` per layer); the model's attention
  is bound to it per model (:func:`kernels.attention.bind_attention`).

Both keep the turn's new tokens in float (:meth:`TurnCache.added`), which ``AgentKV``
quantizes into a new stored range when the turn ends, or at a cut inside its prompt
(``AgentKV.store_so_far``: then the cache takes those tokens' stored values,
:meth:`TurnCache.adopt`, as if a turn had ended there and the next begun). Caches are
described per layer (:class:`CacheGeometry`): key and value widths may differ, and a layer
may have a sliding window or no cache at all; what a class cannot run raises
``NotImplementedError`` when a turn starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from .attention import bind_attention
from .mlx_lm_compat import batch_of_one, row_of
from .qbatch import Kernel, QuantizedBatchCache
from .qcodec import Role, concat_parts
from .rotated import RotatedBasis, RotatedKVCache, works_rotated
from .rowwise import PlainBatchKVCache, PlainKVCache

if TYPE_CHECKING:
    from .agent_cache import AgentKV, StoredRange

#: Tokens of room a float working or ready copy keeps past its last one, so that the next
#: tokens are written in place instead of copying the whole cache to grow it (mlx-lm grows
#: KVCache by 256).
_ROOM = 256

__all__ = (
    "FloatTurnCache",
    "QuantizedTurnCache",
    "TurnCache",
    "turn_cache_class",
)


def _with_room(pieces: list[mx.array], slack: int) -> mx.array:
    """``pieces`` of K or V ``(1, H, T_i, D)`` joined along the tokens, with ``slack`` zero
    tokens after them (in the dtype of the last piece): one new array."""
    last = pieces[-1]
    room = mx.zeros((*last.shape[:2], slack, last.shape[3]), last.dtype)
    return mx.concatenate([*pieces, room], axis=2)


def _stored_values(
    kv: AgentKV, new: StoredRange, layer: int, role: Role, rotated: bool
) -> mx.array:
    """fp32 K or V of the tokens of ``new`` (a range of ``kv``), dequantized; ``rotated``:
    left in the codec's stored basis."""
    parts = new.layers[layer][1 if role == "value" else 0]
    n = new.stop - new.start
    return kv.codec.dequantize(parts, new.start, n, role=role, rotated=rotated)


def _new_values(
    layers: Sequence[KVCache], kv: AgentKV, new: StoredRange
) -> list[tuple[mx.array, mx.array] | None]:
    """``_stored_values`` of keys and values of ``new``'s tokens for each of ``layers`` (one
    row each), in the basis that layer works in; None for a layer that holds nothing. When
    the layers are alike (all filled, one basis, parts of the same shapes) each role is
    dequantized once for all of them, stacked along the first axis, then split: a turn's
    new tokens are few, and sixty small calls cost more than the work. The values are the
    same either way (the codec works token by token)."""
    n = new.stop - new.start
    filled = [layer.keys is not None and layer.values is not None for layer in layers]
    bases = [isinstance(layer, RotatedBasis) for layer in layers]
    out: list[list[mx.array | None]] = [[], []]
    for j, role in enumerate(cast(tuple[Role, Role], ("key", "value"))):
        parts = [layer[j] for layer in new.layers]
        first = parts[0]
        if (
            len(parts) > 1
            and all(filled)
            and len(set(bases)) == 1
            and all(
                p.keys() == first.keys() and all(p[k].shape == first[k].shape for k in first)
                for p in parts
            )
        ):
            stacked = {k: mx.concatenate([p[k] for p in parts], axis=0) for k in first}
            x = kv.codec.dequantize(stacked, new.start, n, role=role, rotated=bases[0])
            out[j] = [x[i : i + 1] for i in range(len(parts))]
        else:
            out[j] = [
                _stored_values(kv, new, i, role, bases[i]) if filled[i] else None
                for i in range(len(parts))
            ]
    return [None if k is None or v is None else (k, v) for k, v in zip(*out, strict=True)]


class TurnCache(Protocol):
    """All layers' working cache of one or more rows (agents) in running turns.

    ``layers`` is what the model takes as ``cache=``. A turn starts with a one-row cache
    (:meth:`start`); rows join a batch with :meth:`extend`, leave it with :meth:`extract`
    and :meth:`filter`.
    """

    quantized: ClassVar[bool]  # whether attention reads the stored (quantized) parts
    keeps_ready: ClassVar[bool]  # whether a copy is kept between turns (``settle``)

    @classmethod
    def start(cls, kv: AgentKV) -> TurnCache:
        """A one-row cache over ``kv``'s stored ranges."""
        ...

    @classmethod
    def prepare(cls, model: nn.Module) -> None:
        """Ready ``model`` to run over caches of this class (once per model)."""
        ...

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        """Bytes of a ready copy of ``kv`` built ahead of a turn (``ready_steps``)."""
        ...

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[TurnCache | None]:
        """Build ``kv``'s ready copy (what ``start`` makes) in steps of one layer each,
        evaluated: None after each layer but the last, then the copy. Raises
        NotImplementedError when the class keeps no copy between turns."""
        ...

    @property
    def layers(self) -> Sequence[Any]: ...

    @property
    def nbytes(self) -> int: ...

    def batch(self) -> TurnCache:
        """This cache as the first rows of a batch (which ``extend`` / ``filter`` /
        ``extract`` edit); may share arrays with it."""
        ...

    def extend(self, other: TurnCache) -> None:
        """Append ``other``'s rows to this batch (in place)."""
        ...

    def filter(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order (in place)."""
        ...

    def extract(self, row: int) -> TurnCache:
        """Row ``row`` alone."""
        ...

    def added(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array, bool]:
        """Float K and V ``(1, H, stop - start, D)`` of a one-row cache's tokens
        [start, stop), which the turn added after its stored tokens, and whether they are
        in the codec's stored (rotated) basis already.

        Raises RuntimeError or ValueError when the cache does not hold them as it should.
        """
        ...

    def adopt(self, kv: AgentKV, new: StoredRange) -> None:
        """Let this one-row cache hold the stored values of ``new``'s tokens (just quantized
        from what it holds, mid-turn) instead of their float ones."""
        ...

    def settle(self, kv: AgentKV, new: StoredRange | None) -> TurnCache | None:
        """This one-row cache, at the end of its turn, as ``kv``'s ready copy: exactly what
        a new turn would start from (the tokens of ``new``, just quantized, replaced by
        their stored values); None when this class keeps no copy between turns."""
        ...

    def trim(self, keep: int) -> None:
        """Forget a ready copy's tokens from ``keep`` on."""
        ...

    def unfeed(self, n: int) -> None:
        """Forget the last ``n`` tokens fed to every row (a pipelined decode step ran past
        the end of a turn)."""
        ...

    def arrays(self) -> list[mx.array]:
        """Every array, for ``mx.eval``."""
        ...


_L = TypeVar("_L", bound="_Layers")


class _Layers:
    """What both working caches share: one cache object per layer, and the mode of their
    batches (``rowwise``)."""

    rowwise: ClassVar[bool] = False
    """Batches attend row by row, each row over its own keys (``kernels.rowwise``): a row's
    logits are then the bits it gets alone. Set per engine (``invariant``)."""

    def __init__(self, layers: list[Any]) -> None:
        self._layers = layers

    @classmethod
    def invariant(cls: type[_L]) -> type[_L]:
        """This class with batch-invariant attention (``rowwise``)."""
        if cls.rowwise:
            return cls
        return type(f"{cls.__name__}[invariant]", (cls,), {"rowwise": True})

    @property
    def layers(self) -> Sequence[Any]:
        return self._layers

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)


class FloatTurnCache(_Layers):
    """Dequantized attention: a float copy of the stored tokens, made once per turn. A row
    is a list of mlx-lm KVCache, a batch a list of BatchKVCache (their subclasses in the
    Hadamard basis when the codec rotates: ``kernels.rotated``).

    A turn's K/V stay in one buffer from its start to its ready copy when the turn runs
    alone (a batch of one row, see ``batch_of_one`` / ``row_of``, and ``settle`` in
    place): no whole-cache copy at the batch's door or the turn's end."""

    quantized: ClassVar[bool] = False
    keeps_ready: ClassVar[bool] = True
    keeps_buffers: ClassVar[bool] = True
    """False: copy as mlx-lm's ``merge`` / ``extract`` do and settle into a new copy (what
    ``bench/turn_buffers.py`` measures against); the arrays' values are the same."""

    @classmethod
    def start(cls, kv: AgentKV) -> FloatTurnCache:
        # With room for the turn's first tokens: the first step writes in place instead of
        # growing (copying) every layer, as KVCache would by the same 256 tokens.
        out = cls([cls.row_layer(kv, i, _ROOM) for i in range(kv.geometry.n_layers)])
        if kv.ranges:
            mx.eval(out.arrays())
        return out

    @staticmethod
    def row_layer(kv: AgentKV, i: int, slack: int = 0) -> KVCache:
        """Layer ``i`` of a one-row float cache over ``kv``'s stored ranges, with room for
        ``slack`` more tokens (lazy: evaluate it)."""
        kv.geometry.layer(i)
        rotated = works_rotated(kv.codec)
        cache = RotatedKVCache() if rotated else PlainKVCache()
        if kv.ranges:
            keys = kv.dequantize(i, "key", rotated=rotated, room=slack)
            values = kv.dequantize(i, "value", rotated=rotated, room=slack)
            cache.state = (keys, values, kv.stored_tokens)
        return cache

    @classmethod
    def prepare(cls, model: nn.Module) -> None:
        # Rotated caches attend through the basis; batches of either attend row by row.
        bind_attention(model, RotatedBasis)
        bind_attention(model, PlainBatchKVCache)

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        return (kv.stored_tokens + _ROOM) * kv.geometry.fp32_bytes_per_token()

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[FloatTurnCache | None]:
        layers: list[KVCache] = []
        for i in range(kv.geometry.n_layers):
            layers.append(cls.row_layer(kv, i, _ROOM))
            mx.eval([a for a in layers[-1].state if isinstance(a, mx.array)])
            if len(layers) < kv.geometry.n_layers:
                yield None
        yield cls(layers)

    def _batched(self) -> list[BatchKVCache]:
        join = batch_of_one if self.keeps_buffers else (lambda row: type(row).merge([row]))
        out = [layer if isinstance(layer, BatchKVCache) else join(layer) for layer in self._layers]
        for layer in out:
            setattr(layer, "rowwise", self.rowwise)  # noqa: B010 (the batch's attention mode)
        return out

    def batch(self) -> FloatTurnCache:
        return type(self)(self._batched())

    def extend(self, other: TurnCache) -> None:
        if not isinstance(other, FloatTurnCache):
            raise TypeError("a float batch takes float rows only")
        mine = self._batched()
        for layer, new in zip(mine, other._batched(), strict=True):
            if isinstance(layer, RotatedBasis) != isinstance(new, RotatedBasis):
                raise TypeError("a float batch takes rows in its own basis only")
            layer.extend(new)
        self._layers = mine

    def filter(self, rows: list[int]) -> None:
        self._layers = self._batched()
        for layer in self._layers:
            layer.filter(mx.array(rows))

    def extract(self, row: int) -> FloatTurnCache:
        if not self.keeps_buffers:
            return type(self)([layer.extract(row) for layer in self._batched()])
        return type(self)([row_of(layer, row) for layer in self._batched()])

    def added(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array, bool]:
        cache = self._layers[layer]
        rotated = isinstance(cache, RotatedBasis)
        if rotated:
            cache.check_attended()
        keys, values = cache.state[:2]
        return keys[:, :, start:stop, :], values[:, :, start:stop, :], rotated

    def adopt(self, kv: AgentKV, new: StoredRange) -> None:
        for layer, stored in zip(self._layers, _new_values(self._layers, kv, new), strict=True):
            if stored is None:
                continue
            keys, values = stored
            layer.keys[:, :, new.start : new.stop, :] = keys.astype(layer.keys.dtype)
            layer.values[:, :, new.start : new.stop, :] = values.astype(layer.values.dtype)

    def settle(self, kv: AgentKV, new: StoredRange | None) -> FloatTurnCache | None:
        total = kv.stored_tokens
        cut = new.start if new is not None else total
        if not all(isinstance(layer, KVCache) and layer.offset == total for layer in self._layers):
            return None  # not one row over every stored token: start afresh next time
        values = [None] * len(self._layers) if new is None else _new_values(self._layers, kv, new)
        layers = []
        for layer, pair in zip(self._layers, values, strict=True):
            if layer.keys is None or layer.values is None:
                layers.append(type(layer)())
                continue
            fresh = []
            for j, array in enumerate((layer.keys, layer.values)):
                stored = None if pair is None else pair[j]
                if array.shape[2] > total and self.keeps_buffers:
                    # Room after its tokens: buffers of this row alone (a row leaves a
                    # larger batch as a full copy: row_of); the stored values go in place.
                    if stored is not None:
                        array[:, :, cut:total, :] = stored.astype(array.dtype)
                    fresh.append(array)
                else:  # full: a copy with room for the next turn's first tokens
                    parts = [array[:, :, :cut, :]] + ([] if stored is None else [stored])
                    fresh.append(_with_room(parts, _ROOM))
            cache = type(layer)()
            cache.state = (fresh[0], fresh[1], total)
            layers.append(cache)
        out = type(self)(layers)
        mx.eval(out.arrays())
        return out

    def trim(self, keep: int) -> None:
        for layer in self._layers:
            layer.trim(max(layer.offset - keep, 0))

    def unfeed(self, n: int) -> None:
        for layer in self._layers:
            layer.trim(n)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self._layers for a in layer.state if isinstance(a, mx.array)]


class QuantizedTurnCache(_Layers):
    """Quantized attention: the stored parts as they are plus a float tail of the turn
    (a QuantizedBatchCache per layer)."""

    quantized: ClassVar[bool] = True
    keeps_ready: ClassVar[bool] = False
    kernel: ClassVar[Kernel] = "auto"
    _layers: list[QuantizedBatchCache]

    @classmethod
    def start(cls, kv: AgentKV) -> QuantizedTurnCache:
        out = cls([cls._layer(kv, i) for i in range(kv.geometry.n_layers)])
        for layer in out._layers:
            layer.rowwise = cls.rowwise  # the batch's attention mode
        return out

    @classmethod
    def _layer(cls, kv: AgentKV, i: int) -> QuantizedBatchCache:
        g = kv.geometry.layer(i)
        return QuantizedBatchCache.from_parts(
            kv.codec,
            g.n_kv_heads,
            (g.key_dim, g.value_dim),
            concat_parts(kv.layer_parts(i, "key")),
            concat_parts(kv.layer_parts(i, "value")),
            kv.stored_tokens,
            cls.kernel,
        )

    @classmethod
    def prepare(cls, model: nn.Module) -> None:
        bind_attention(model, QuantizedBatchCache)

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        return 0

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[QuantizedTurnCache | None]:
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
            layer.extend(new)

    def filter(self, rows: list[int]) -> None:
        for layer in self._layers:
            layer.filter(rows)

    def extract(self, row: int) -> QuantizedTurnCache:
        return type(self)([layer.extract(row) for layer in self._layers])

    def added(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array, bool]:
        cache = self._layers[layer]
        stored = cache.stored_lengths()
        if len(stored) != 1 or start < stored[0] or cache.tail_lengths() != [stop - stored[0]]:
            raise ValueError("the working cache does not hold this agent's new tokens")
        keys, values = cache.tail(0)
        skip = start - stored[0]  # tokens of the tail stored already (AgentKV.store_so_far)
        return keys[:, :, skip:], values[:, :, skip:], False  # the tail is in the model's basis

    def adopt(self, kv: AgentKV, new: StoredRange) -> None:
        for i, layer in enumerate(self._layers):
            at = new.start - layer.stored_lengths()[0]
            keys, values = (_stored_values(kv, new, i, role, False) for role in ("key", "value"))
            layer.set_tail(0, at, keys, values)

    def settle(self, kv: AgentKV, new: StoredRange | None) -> None:
        return None  # the stored parts are what it reads: nothing to keep

    def trim(self, keep: int) -> None:
        raise NotImplementedError("a quantized working cache is never kept between turns")

    def unfeed(self, n: int) -> None:
        for layer in self._layers:
            layer.unfeed(n)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self._layers for a in layer.state]


def turn_cache_class(quantized: bool) -> type[FloatTurnCache] | type[QuantizedTurnCache]:
    """The TurnCache class of an attention mode."""
    return QuantizedTurnCache if quantized else FloatTurnCache
