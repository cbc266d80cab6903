"""Dequantized attention's working cache (``kernels.turn_cache``): a float copy of each
row's stored tokens, made once per turn, and each recurrent layer's state."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from . import stored_attend
from ._qmath import rotate_rows
from ._turn_base import ROOM, Entries, TurnCache, geometry_slots, new_values, state_layer, with_room
from .attention import bind_attention
from .beside import CopyBeside
from .geometry import CacheGeometry
from .mlx_lm_compat import batch_of_one, row_of
from .recurrent import RecurrentCache
from .rotated import RotatedBasis, RotatedKVCache, works_rotated
from .rowwise import PlainBatchKVCache, PlainKVCache
from .workers import spread, worker_streams

if TYPE_CHECKING:
    from .agent_cache import AgentKV
    from .qcodec import Role
    from .stored import Parts, StoredRange

__all__ = ("FloatPrefix", "FloatTurnCache")


class FloatPrefix:
    """The float K/V of the first ``count`` stored ranges that several caches share (the
    same arrays: a shared context, a fork, a shared prefix), made once, so that a turn of
    any of them dequantizes only its own ranges after it and copies this. Each token's
    values are what dequantizing the whole cache gives (``AgentKV.dequantize``), so the
    working copy is the same, bit for bit. Attention layers only: the geometries it
    serves have no recurrent or sliding-window layer (``serves``)."""

    def __init__(self, kv: AgentKV, count: int) -> None:
        if not 0 < count <= len(kv.ranges) or not self.serves(kv.geometry):
            raise ValueError("a float prefix covers 1 or more stored ranges of attention layers")
        rotated = works_rotated(kv.codec)
        self.count = count
        self.tokens = kv.ranges[count - 1].stop
        self.rotated = rotated
        part = slice(0, count)
        every = range(kv.geometry.n_layers)
        self.layers = kv.dequantize_layers(every, rotated=rotated, ranges=part) or spread(
            len(every),
            lambda i: (
                kv.dequantize(i, "key", rotated=rotated, ranges=part),
                kv.dequantize(i, "value", rotated=rotated, ranges=part),
            ),
            lambda pair: pair,
        )
        self.nbytes = sum(a.nbytes for pair in self.layers for a in pair)

    @staticmethod
    def serves(geometry: CacheGeometry) -> bool:
        return not geometry.recurrent and not geometry.sliding

    @staticmethod
    def nbytes_for(geometry: CacheGeometry, tokens: int) -> int:
        """What a prefix of ``tokens`` takes (fp32)."""
        return tokens * geometry.fp32_bytes_per_token()

    def joined(self, kv: AgentKV, i: int, slack: int) -> tuple[mx.array, mx.array]:
        """Layer ``i``'s float K and V for ``kv`` (whose first ranges this covers): this
        prefix, then its other ranges dequantized, then ``slack`` zero tokens (lazy)."""
        rest = slice(self.count, None)
        out = []
        roles: tuple[Role, Role] = ("key", "value")
        for j, role in enumerate(roles):
            mine = self.layers[i][j]
            if len(kv.ranges) > self.count:
                tail = kv.dequantize(i, role, rotated=self.rotated, room=slack, ranges=rest)
            else:
                tail = mx.zeros((*mine.shape[:2], slack, mine.shape[3]), mine.dtype)
            out.append(mx.concatenate([mine, tail], axis=2))
        return out[0], out[1]


class FloatTurnCache(Entries):
    """Dequantized attention: a float copy of the stored tokens, made once per turn. A row
    is a list of mlx-lm KVCache, a batch a list of BatchKVCache (their subclasses in the
    Hadamard basis when the codec rotates: ``kernels.rotated``); a recurrent layer is a
    :class:`RecurrentCache` either way.

    A turn's K/V stay in one buffer from its start to its ready copy when the turn runs
    alone (a batch of one row, see ``batch_of_one`` / ``row_of``, and ``settle`` in
    place): no whole-cache copy at the batch's door or the turn's end."""

    quantized: ClassVar[bool] = False
    keeps_ready: ClassVar[bool] = True
    keeps_buffers: ClassVar[bool] = True
    """False: copy as mlx-lm's ``merge`` / ``extract`` do and settle into a new copy (what
    ``bench/turn_buffers.py`` measures against); the arrays' values are the same."""

    copying: CopyBeside | None = None
    """The copy still filling beside the first forward (:meth:`start` with ``beside``)."""

    @classmethod
    def start(
        cls, kv: AgentKV, prefix: FloatPrefix | None = None, *, beside: bool = False
    ) -> FloatTurnCache:
        # With room for the turn's first tokens: the first step writes in place instead of
        # growing (copying) every layer, as KVCache would by the same 256 tokens.
        # At once by the fused kernel, else layer by layer spread over the CPU's cores;
        # with ``beside``, filled beside the forward that follows (``kernels.beside``).
        if prefix is None and beside:
            made = cls._beside(kv)
            if made is not None:
                return made
        if prefix is None:
            layers = cls.rows(kv, 0, kv.geometry.n_layers, ROOM)
        else:
            every = kv.geometry.n_layers
            layers = spread(every, lambda i: cls.row_layer(kv, i, ROOM, prefix), _arrays)
        return cls(layers, geometry_slots(kv.geometry))

    @classmethod
    def _beside(cls, kv: AgentKV) -> FloatTurnCache | None:
        """:meth:`start`'s copy, its arrays made and filled on ``kernels.beside``'s thread
        in layer order; each layer's cache waits for its own as the forward first hands it
        new tokens (``landing``), :meth:`landed` for all. None where the fused path
        cannot take it (plain attention layers only)."""
        geometry = kv.geometry
        if not kv.ranges or not FloatPrefix.serves(geometry) or not geometry.kv_layers:
            return None
        if os.environ.get("KVACTOR_BESIDE", "1") == "0":
            return None
        rotated = works_rotated(kv.codec)
        attending = list(range(geometry.n_layers))
        made = kv.dequantize_beside(attending, rotated=rotated, room=ROOM)
        if made is None:
            return None
        pairs, copying = made
        layers = []
        for k, pair in enumerate(pairs):
            layer = _kv_row(rotated, *pair, kv.stored_tokens)
            layer.landing = functools.partial(copying.wait_layer, k)
            layers.append(layer)
        out = cls(layers, geometry_slots(geometry))
        out.copying = copying
        copying.start()
        return out

    def landed(self) -> CopyBeside | None:
        copying = self.copying
        if copying is None:
            return None
        for layer in self._layers:
            layer.landing = None
        self.copying = None
        copying.wait()
        return copying

    stored_first_tokens: ClassVar[int] = 1536
    """Stored tokens from which a first forward over the stored form beats making the copy
    first: bench/ttft.py had the copy first 97 against 113 ms at 1K, and 0.45-0.73x the
    time over the stored form at 2K-8K (a copy's cost grows with the tokens). Since the
    kernel runs in one call a layer (553fab8) the two are about even at 1K (a 19 ms copy
    against a forward 16.7 ms slower, 81.5 against 64.8), so the bound stayed. With the
    copy filled beside the forward (:meth:`start` with ``beside``) a 1K turn took 93
    against 107 ms, and at 4K the stored form stays ahead (147 against 164 ms)."""

    @classmethod
    def defers(cls, kv: AgentKV, queries: int) -> bool:
        """Whether a turn's first forward, ``queries`` queries a row, may attend over the
        stored form (``kernels.stored_attend``: no float copy before its first token) and
        make this copy after it (:meth:`after_stored`): attention layers only, at least
        :attr:`stored_first_tokens` stored, the kernel ready and covering the codec's
        widths; ``KVACTOR_STORED_FIRST=0`` turns it off (read at each turn)."""
        if os.environ.get("KVACTOR_STORED_FIRST", "1") == "0":
            return False
        if kv.stored_tokens < max(cls.stored_first_tokens, 1) or not kv.geometry.kv_layers:
            return False
        if not FloatPrefix.serves(kv.geometry):
            return False
        layers = [kv.geometry.layer(i) for i in kv.geometry.kv_layers]
        widths = [w for layer in layers for w in (layer.key_dim, layer.value_dim)]
        bits = [kv.codec.role_spec(role)[0] for role in ("key", "value")]
        return stored_attend.takes(bits, widths, queries)

    @classmethod
    def after_stored(
        cls, kv: AgentKV, first: TurnCache, prefix: FloatPrefix | None = None
    ) -> FloatTurnCache:
        """This turn's float working copy after a first forward over the stored form
        (``first``, a quantized working cache over ``kv``): the stored ranges made float as
        :meth:`start` makes them, then the tokens that forward added, as its layers hold
        them (in the stored basis where the codec rotates, as a float layer takes them)."""
        out = cls.start(kv, prefix)
        start, stop = kv.stored_tokens, len(kv.tokens)
        for i, layer in enumerate(out._layers):
            keys, values, _ = first.added(i, start, stop)
            if isinstance(layer, RotatedBasis):
                keys, values = rotate_rows(keys), rotate_rows(values)
            at = layer.offset
            room = layer.keys.shape[2] - at if layer.keys is not None else 0
            if room >= stop - start:
                layer.keys[:, :, at : at + stop - start, :] = keys.astype(layer.keys.dtype)
                layer.values[:, :, at : at + stop - start, :] = values.astype(layer.values.dtype)
                layer.offset = at + stop - start
            else:
                layer.state = (
                    with_room([layer.keys[:, :, :at], keys], ROOM),
                    with_room([layer.values[:, :, :at], values], ROOM),
                    at + stop - start,
                )
        mx.eval(out.arrays())
        return out

    @classmethod
    def rows(cls, kv: AgentKV, first: int, count: int, slack: int) -> list[Any]:
        """Entries ``first .. first + count - 1`` of a one-row float cache over ``kv``'s
        stored ranges, as :meth:`row_layer` makes them, evaluated: the attention layers'
        copies made at once by the fused kernel where it can (``AgentKV.dequantize_layers``),
        else a layer per worker stream (``kernels.workers``)."""
        wanted = range(first, first + count)
        geometry, rotated = kv.geometry, works_rotated(kv.codec)
        attending = [i for i in wanted if geometry.state(i) is None]
        copies = None
        if kv.ranges and attending:
            copies = kv.dequantize_layers(attending, rotated=rotated, room=slack)
        if copies is None:
            return spread(count, lambda j: cls.row_layer(kv, first + j, slack), _arrays)
        made = dict(zip(attending, copies, strict=True))
        out = [
            _kv_row(rotated, *made[i], kv.stored_tokens) if i in made else state_layer(kv, i)
            for i in wanted
        ]
        mx.eval([a for layer in out for a in _arrays(layer)])
        return out

    @staticmethod
    def row_layer(kv: AgentKV, i: int, slack: int = 0, prefix: FloatPrefix | None = None) -> Any:
        """Entry ``i`` of a one-row float cache over ``kv``'s stored ranges, with room for
        ``slack`` more tokens (lazy: evaluate it); a recurrent layer at its checkpoint.
        ``prefix``: the float copy of its first ranges (copied, not dequantized again)."""
        if kv.geometry.state(i) is not None:
            return state_layer(kv, i)
        kv.geometry.layer(i)
        rotated = works_rotated(kv.codec)
        if not kv.ranges:
            return RotatedKVCache() if rotated else PlainKVCache()
        if prefix is None:
            keys = kv.dequantize(i, "key", rotated=rotated, room=slack)
            values = kv.dequantize(i, "value", rotated=rotated, room=slack)
        else:
            keys, values = prefix.joined(kv, i, slack)
        return _kv_row(rotated, keys, values, kv.stored_tokens)

    @classmethod
    def prepare(cls, model: nn.Module, geometry: CacheGeometry | None = None) -> None:
        # Rotated caches attend through the basis; batches of either attend row by row.
        if geometry is None or geometry.kv_layers:
            bind_attention(model, RotatedBasis)
            bind_attention(model, PlainBatchKVCache)

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        # Its recurrent states are the last checkpoint's arrays: nothing more.
        return (kv.stored_tokens + ROOM) * kv.geometry.fp32_bytes_per_token()

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[tuple[int, FloatTurnCache | None]]:
        # A layer a step per worker stream, side by side (``kernels.workers``).
        layers: list[Any] = []
        total = kv.geometry.n_layers
        per_step = len(worker_streams())
        for at in range(0, total, per_step):
            built = cls.rows(kv, at, min(per_step, total - at), ROOM)
            layers += built
            done = len(layers) == total
            yield len(built), cls(layers, geometry_slots(kv.geometry)) if done else None

    def _batched(self) -> list[Any]:
        self.landed()
        join = batch_of_one if self.keeps_buffers else (lambda row: type(row).merge([row]))
        return self._mark(
            [
                layer if isinstance(layer, BatchKVCache | RecurrentCache) else join(layer)
                for layer in self._layers
            ]
        )

    def batch(self) -> FloatTurnCache:
        return type(self)(self._batched(), self._slots)

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
        batched = self._batched()
        if not self.keeps_buffers:
            return type(self)([layer.extract(row) for layer in batched], self._slots)
        return type(self)(
            [
                layer.extract(row) if isinstance(layer, RecurrentCache) else row_of(layer, row)
                for layer in batched
            ],
            self._slots,
        )

    def added(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array, bool]:
        self.landed()
        cache = self._layers[layer]
        rotated = isinstance(cache, RotatedBasis)
        if rotated:
            cache.check_attended()
        keys, values = cache.state[:2]
        return keys[:, :, start:stop, :], values[:, :, start:stop, :], rotated

    def adopt(self, kv: AgentKV, new: StoredRange) -> None:
        self.landed()
        for layer, stored in zip(self._layers, new_values(self._layers, kv, new), strict=True):
            if stored is None:
                continue
            keys, values = stored
            layer.keys[:, :, new.start : new.stop, :] = keys.astype(layer.keys.dtype)
            layer.values[:, :, new.start : new.stop, :] = values.astype(layer.values.dtype)

    def settle(self, kv: AgentKV, new: StoredRange | None) -> FloatTurnCache | None:
        self.landed()
        total = kv.stored_tokens
        cut = new.start if new is not None else total
        if not all(
            (isinstance(layer, RecurrentCache) and layer.batch_size == 1)
            or (isinstance(layer, KVCache) and layer.offset == total)
            for layer in self._layers
        ):
            return None  # not one row over every stored token: start afresh next time
        values = [None] * len(self._layers) if new is None else new_values(self._layers, kv, new)
        layers: list[Any] = []
        for i, (layer, pair) in enumerate(zip(self._layers, values, strict=True)):
            if isinstance(layer, RecurrentCache):
                layers.append(state_layer(kv, i))  # the checkpoint just stored
            elif layer.keys is None or layer.values is None:
                layers.append(type(layer)())
            else:
                layers.append(self._settled(layer, pair, cut, total))
        out = type(self)(layers, self._slots)
        mx.eval(out.arrays())
        return out

    def _settled(
        self, layer: KVCache, pair: tuple[mx.array, mx.array] | None, cut: int, total: int
    ) -> KVCache:
        fresh: list[mx.array] = []
        for j, array in enumerate((layer.keys, layer.values)):
            assert array is not None
            stored = None if pair is None else pair[j]
            if array.shape[2] > total and self.keeps_buffers:
                # Room after its tokens: buffers of this row alone (a row leaves a larger
                # batch as a full copy: row_of); the stored values go in place.
                if stored is not None:
                    array[:, :, cut:total, :] = stored.astype(array.dtype)
                fresh.append(array)
            else:  # full: a copy with room for the next turn's first tokens
                parts = [array[:, :, :cut, :]] + ([] if stored is None else [stored])
                fresh.append(with_room(parts, ROOM))
        cache = type(layer)()
        cache.state = (fresh[0], fresh[1], total)
        return cache

    def trim(self, keep: int, states: Mapping[int, Parts]) -> None:
        for i, layer in enumerate(self._layers):
            if isinstance(layer, RecurrentCache):
                g_parts = states.get(i)
                fresh = RecurrentCache(len(layer.cache))
                if g_parts:
                    fresh.cache = [g_parts[str(j)] for j in range(len(layer.cache))]
                self._layers[i] = fresh
            else:
                layer.trim(max(layer.offset - keep, 0))

    def unfeed(self, n: int) -> None:
        for layer in self._layers:
            if isinstance(layer, RecurrentCache):
                layer.unfeed(n)
            else:
                layer.trim(n)

    def arrays(self) -> list[mx.array]:
        self.landed()
        return [a for layer in self._layers for a in _arrays(layer)]


def _kv_row(rotated: bool, keys: mx.array, values: mx.array, offset: int) -> Any:
    """An attention layer's one-row float cache holding ``keys`` and ``values`` (their
    first ``offset`` tokens stored, room after them), in the stored basis when ``rotated``."""
    cache = RotatedKVCache() if rotated else PlainKVCache()
    cache.state = (keys, values, offset)
    return cache


def _arrays(layer: Any) -> list[mx.array]:
    if isinstance(layer, RecurrentCache):
        return layer.arrays()
    return [a for a in layer.state if isinstance(a, mx.array)]
