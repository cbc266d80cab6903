"""One agent's KV cache in three forms: stored (quantized ranges), working (during a turn)
and ready (a working cache kept between turns).

A model with sliding-window layers (Gemma 3) attends there only to the last ``window``
tokens: once a range lies wholly behind the window of a turn resuming anywhere in the last
range, its sliding layers' parts are dropped (:meth:`AgentKV.slide`); those tokens read as zeros in
working caches, where the model's window mask hides them anyway. A turn that would resume
below that point (a DIVERGE far back) starts from nothing instead (:meth:`AgentKV.reusable`).

The stored form is what the hot tier keeps and what the warm tier writes, byte for byte:
a list of token ranges, each holding every layer's quantized K and V. While the agent
takes a turn it has a working cache (``kernels.turn_cache``): a float copy of every token
(left in the codec's Hadamard basis when it rotates), or the stored parts read as they are,
depending on the attention mode; either keeps the turn's new tokens in float. When the
turn ends the new tokens are quantized into a new range. The working cache is then
dropped, or, for a float one, kept as the *ready* copy with the new tokens replaced by
their dequantized stored values: it holds exactly what dequantizing the stored ranges
would give, so the next turn starts without dequantizing anything. So an agent kept
ready, one kept quantized and one reloaded from disk resume from the same values.

A model with recurrent layers (state-space, linear attention) keeps their state instead of
K/V: exact, after the last token. A state cannot be cut back, so each range stores the
state at its end (its *checkpoint*, ``StoredRange.states``); the last ``checkpoints``
ranges keep theirs. A turn resumes at the end of a range with a checkpoint: an EXTEND from
the latest, a DIVERGE from the last one at or before the divergence, the K/V layers cut
to the same token (:meth:`AgentKV.reusable`), or from nothing when none is left.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from . import fused
from ._qmath import affine
from ._turn_base import TurnCache
from .beside import CopyBeside
from .float_turn import FloatPrefix, FloatTurnCache
from .geometry import CacheGeometry
from .qcodec import KVCodec, Role
from .quantized_turn import QuantizedTurnCache
from .stored import Parts, StoredRange, cache_nbytes, segment_layout

__all__ = (
    "DEFAULT_CHECKPOINTS",
    "AgentKV",
    "Landing",
    "StoredRange",
    "Unverified",
    "cache_nbytes",
    "segment_layout",
)

#: Ranges whose checkpoint (recurrent state at their end) an agent keeps, by default: a
#: turn stores its prompt and its answer as ranges of their own, so 4 are the last two
#: turns (resume after either, or redo the last answer).
DEFAULT_CHECKPOINTS = 4


class Landing(Protocol):
    """Stored arrays whose bytes are still on their way in (a layer-streamed warm load:
    ``actors.warm``'s StreamedRead writes them from its reader threads)."""

    def wait_layer(self, layer: int, *, counted: bool = True) -> None:
        """Block until entry ``layer``'s bytes are in (trusted only once :meth:`wait`
        says None); ``counted``: the engine's thread waits (not a copy's thread)."""
        ...

    def wait(self) -> str | None:
        """Block until every byte is in: None when they all matched their checksums, else
        why they cannot be trusted."""
        ...


class Unverified(RuntimeError):
    """A cache whose streamed bytes failed their checksum or could not be read: it holds
    nothing to use (:meth:`AgentKV.settle`)."""


class AgentKV:
    """The tokens an agent's cache holds, its stored ranges and, during a turn, its working
    cache (a ``TurnCache`` of the class ``turn_cache``: the attention mode).

    Invariant: when not active, the stored ranges cover every token.
    """

    #: Groups of layers whose float copies a streamed cache makes as they land.
    _GROUPS = 4

    def __init__(
        self,
        codec: KVCodec,
        geometry: CacheGeometry,
        *,
        turn_cache: type[TurnCache] = FloatTurnCache,
        checkpoints: int = DEFAULT_CHECKPOINTS,
    ) -> None:
        if checkpoints < 1:
            raise ValueError("an agent keeps at least 1 checkpoint (its latest state)")
        self.codec = codec
        self.geometry = geometry
        self.turn_cache = turn_cache
        self.checkpoints = checkpoints  # ranges that keep their recurrent states
        self.tokens: list[int] = []
        self.ranges: list[StoredRange] = []
        self._work: TurnCache | None = None
        # The running turn's first forward attends over the stored form (activate_stored).
        self.stored_first = False
        # Between turns: the float copy of every stored token (see the module doc).
        self._ready: TurnCache | None = None
        # Its bytes as last counted, and at which change of the stored ranges: a count of
        # every hot cache each decode step reads it (ready_bytes).
        self._ready_nbytes: tuple[int, int] | None = None
        # Sliding-window layers keep no parts of the ranges before this token (slide()).
        self.window_start = 0
        # Some stored arrays may be another cache's too (a fork, or its source).
        self.shared = False
        # Counts the changes of the stored ranges (a range added, cut, made, or its arrays
        # let go): a counter of stored bytes reads them again only when it moved.
        self._stored_gen = 0
        # Called at each change of its stored ranges, working cache, ready copy or
        # ``shared`` (the setters below and ``share_into`` are its only callers), so that
        # a count over many caches reads again only those that changed (the hot tier's
        # ``Residents`` sets it). A working cache also grows in place during its turn; a
        # ready copy does not (a trim is a change of the stored ranges).
        self.on_change: Callable[[], None] | None = None
        # Its stored arrays' bytes still on their way in (fill_streamed), until settle().
        self.landing: Landing | None = None

    @property
    def stored_gen(self) -> int:
        return self._stored_gen

    @stored_gen.setter
    def stored_gen(self, value: int) -> None:
        self._stored_gen = value
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def fill_staged(
        self, tokens: list[int], ranges: Sequence[tuple[int, int, Mapping[str, Any]]]
    ) -> None:
        """Fill this empty cache with a staged warm cache: ``ranges`` of host arrays
        (numpy, one copy into MLX) covering ``tokens``. Raises ValueError when they do
        not cover the tokens, lack the recurrent checkpoint at the last token, or hold
        sliding-window layers' tensors for other than the last ranges."""
        self.tokens = list(tokens)
        geometry = self.geometry
        sliding = geometry.sliding
        self.ranges = [
            StoredRange.from_numpy(start, stop, geometry, tensors, sliding)
            for start, stop, tensors in ranges
        ]
        self.stored_gen += 1
        if self.stored_tokens != len(tokens):
            raise ValueError("staged ranges do not cover the staged tokens")
        if self.ranges and self.reusable(len(tokens)) != len(tokens):
            raise ValueError("staged recurrent states lack the checkpoint at the last token")
        # The warm tier keeps sliding layers' tensors for the last ranges only.
        lacking = [r for r in self.ranges if any(not r.holds_layer(i) for i in sliding)]
        if lacking:
            if lacking != self.ranges[: len(lacking)]:
                raise ValueError("staged sliding-layer tensors are not the last ranges")
            self.window_start = lacking[-1].stop
        self.slide(len(tokens))  # what it read is on disk
        mx.eval(list(self.stored_arrays()))

    def fill_streamed(
        self,
        tokens: list[int],
        ranges: Sequence[tuple[int, int, Mapping[str, tuple[tuple[int, ...], str]]]],
        landing: Landing,
    ) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Fill this empty cache with arrays of the shapes and dtypes ``ranges`` names
        (``(start, stop, {tensor: (shape, dtype)})``), whose bytes ``landing`` will write:
        their host views (writable, zero-copy on the CPU), per range, for it to write
        into. Until :meth:`settle`, a turn's first forward over the stored form waits for
        each layer as it attends (``QuantizedTurnCache``), and everything else that reads
        the stored arrays waits for all of them and their checksums first. Raises
        ValueError as :meth:`fill_staged` does, or where a host view is not the array's
        memory (nothing then waits on ``landing``)."""
        # Made from numpy's untouched memory: a copy each, materialized at once, where
        # mx.zeros is an op each to evaluate (~4x the time for a cache's 540 arrays).
        made = [
            (start, stop, {n: mx.array(np.empty(shape, dtype)) for n, (shape, dtype) in t.items()})
            for start, stop, t in ranges
        ]
        views = [{n: np.array(a, copy=False) for n, a in t.items()} for *_, t in made]
        places = [v.ctypes.data for t in views for v in t.values() if v.size]
        if len(set(places)) != len(places) or not all(
            v.flags.writeable and v.flags.c_contiguous for t in views for v in t.values()
        ):
            raise ValueError("the arrays' host views are not their own memory")
        self.fill_staged(tokens, made)
        self.landing = landing
        return views

    def settle(self) -> None:
        """Wait until its streamed bytes (:meth:`fill_streamed`) are all in and checked.
        Raises Unverified (the cache holds nothing to use: drop it) when they failed."""
        if self.landing is None:
            return
        why = self.landing.wait()
        if why is not None:
            raise Unverified(why)
        self.landing = None

    # -- sizes ------------------------------------------------------------------------
    @property
    def stored_tokens(self) -> int:
        return self.ranges[-1].stop if self.ranges else 0

    @property
    def stored_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    def stored_arrays(self) -> Iterator[mx.array]:
        """Every array of the stored ranges (a fork's are its source's: see ``fork``)."""
        for r in self.ranges:
            yield from r.arrays()

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the recurrent states its ranges keep (part of ``stored_bytes``)."""
        return sum(r.state_bytes for r in self.ranges)

    @property
    def checkpoint_count(self) -> int:
        """Ranges that keep a checkpoint (0 for a model without recurrent layers)."""
        return sum(bool(r.states) for r in self.ranges)

    def last_states(self) -> dict[int, Parts]:
        """The recurrent states after its last stored token (``{}``: none stored yet).
        Raises ValueError when the last range keeps none (cannot happen between turns:
        ``trim`` resumes only at checkpoints)."""
        if not self.ranges or not self.geometry.recurrent:
            return {}
        states = self.ranges[-1].states
        if not states:
            raise ValueError("the last stored range keeps no checkpoint of its states")
        return states

    @property
    def work(self) -> TurnCache | None:
        """The running turn's working cache (None between turns, or while a batch holds
        it: ``lend_work``)."""
        return self._work

    @work.setter
    def work(self, cache: TurnCache | None) -> None:
        self._work = cache
        self._changed()

    @property
    def ready(self) -> TurnCache | None:
        return self._ready

    @ready.setter
    def ready(self, copy: TurnCache | None) -> None:
        self._ready = copy
        self._ready_nbytes = None
        self._changed()

    @property
    def work_bytes(self) -> int:
        return self._own_bytes(self.work)

    @property
    def ready_bytes(self) -> int:
        """The ready copy's own bytes, counted again only when it was replaced, trimmed, or
        the stored ranges changed (a copy is not changed in place otherwise)."""
        memo = self._ready_nbytes
        if memo is not None and memo[0] == self._stored_gen:
            return memo[1]
        nbytes = self._own_bytes(self._ready)
        self._ready_nbytes = (self._stored_gen, nbytes)
        return nbytes

    def ready_bytes_now(self) -> int:
        """:attr:`ready_bytes` counted now (a count from scratch checks the kept one)."""
        return self._own_bytes(self._ready)

    def _own_bytes(self, cache: TurnCache | None) -> int:
        """A working or ready copy's bytes, less the recurrent states it shares with the
        stored checkpoints (a turn starts from one, a ready copy holds the last)."""
        if cache is None:
            return 0
        if not self.geometry.recurrent:
            return cache.nbytes
        stored = {id(a) for r in self.ranges for p in r.states.values() for a in p.values()}
        shared = {id(a): a.nbytes for a in cache.state_arrays() if id(a) in stored}
        return cache.nbytes - sum(shared.values())

    @property
    def copies_bytes(self) -> int:
        """Its working and ready copies' bytes: ``work_bytes + ready_bytes``, 0 at once for
        a cache with neither (most idle caches: a count over every hot cache reads it)."""
        if self.work is None and self.ready is None:
            return 0
        return self.work_bytes + self.ready_bytes

    @property
    def nbytes(self) -> int:
        return self.stored_bytes + self.copies_bytes

    # -- transitions ------------------------------------------------------------------
    def activate(self, prefix: FloatPrefix | None = None, *, beside: bool = False) -> TurnCache:
        """The working cache of a turn (made once per turn): one row over the stored ranges,
        the ready copy when there is one; ``prefix``: the float copy of its first stored
        ranges, shared with other caches (``FloatPrefix``), so that only the rest is
        dequantized (float attention only). ``beside``: a float copy may fill beside the
        turn's first forward, which must follow at once (``FloatTurnCache.start``)."""
        if self.work is None:
            if self.ready is not None:
                self.work, self.ready = self.ready, None
            elif prefix is not None:
                if not issubclass(self.turn_cache, FloatTurnCache):
                    raise ValueError("a float prefix serves dequantized attention only")
                self.work = self.turn_cache.start(self, prefix)
            elif beside and issubclass(self.turn_cache, FloatTurnCache):
                self.work = self.turn_cache.start(self, beside=True)
            else:
                self.work = self.turn_cache.start(self)
        return self.work

    def activate_stored(self) -> TurnCache:
        """The working cache of a turn whose first forward attends over the stored form (a
        quantized working cache: ``FloatTurnCache.defers``) though this cache's turns are
        float; :meth:`finish_stored` makes the float copy after that forward. Raises
        ValueError for a quantized turn class or during a turn."""
        if not issubclass(self.turn_cache, FloatTurnCache):
            raise ValueError("a first forward over the stored form serves float turns only")
        if self.work is not None or self.ready is not None:
            raise ValueError("a turn is running or a ready copy waits: nothing to defer")
        self.work = QuantizedTurnCache.start(self)
        self.stored_first = True
        return self.work

    def finish_stored(self, prefix: FloatPrefix | None = None) -> TurnCache:
        """After :meth:`activate_stored`'s forward: the turn's float working copy, holding
        that forward's tokens (``FloatTurnCache.after_stored``). Raises ValueError when the
        turn did not start so."""
        if not self.stored_first or self.work is None:
            raise ValueError("this turn's working cache is float already")
        self.work = cast(type[FloatTurnCache], self.turn_cache).after_stored(
            self, self.work, prefix
        )
        self.stored_first = False
        return self.work

    def fork(self, into: AgentKV) -> AgentKV:
        """``into`` (a new, empty cache of the same codec and geometry) holding this one's
        tokens and stored ranges, their arrays shared, not copied: nothing writes stored
        arrays in place (cuts slice them, ``slide`` drops them from the ranges' own
        lists). Between turns only. Returns ``into``."""
        self.settle()
        if self.work is not None:
            raise ValueError("cannot fork a cache during its turn")
        return self.share_into(into, len(self.ranges))

    def boundaries(self) -> list[int]:
        """The token counts at which its stored ranges end (where another cache may share
        a prefix of it: ``share_into``)."""
        return [r.stop for r in self.ranges]

    def share_into(self, into: AgentKV, count: int) -> AgentKV:
        """``into`` (empty, same codec and geometry) holding this cache's first ``count``
        stored ranges and their tokens, the arrays shared, not copied (see ``fork``).
        The ranges are immutable, so this is safe during this cache's turn too."""
        self.settle()
        shared = self.ranges[:count]
        stop = shared[-1].stop if shared else 0
        into.tokens = list(self.tokens[:stop])
        into.ranges = [
            StoredRange(
                r.start,
                r.stop,
                [(dict(k), dict(v)) for k, v in r.layers],
                {i: dict(p) for i, p in r.states.items()},
            )
            for r in shared
        ]
        into.window_start = min(self.window_start, stop)
        into.work = into.ready = None
        into.stored_gen += 1
        if shared:
            into.shared = True
            if not self.shared:
                self.shared = True
                self._changed()  # its arrays are counted once for both from now on
        return into

    def reusable(self, keep: int) -> int:
        """How much of a common prefix of ``keep`` tokens a turn can resume at: all of it;
        with recurrent layers, the end of the last range at or before ``keep`` that keeps
        its checkpoint (0: none); 0 when the sliding-window layers no longer hold the
        window that resuming there needs (tokens ``keep - window + 1 .. keep - 1``)."""
        if self.geometry.recurrent:
            keep = max((r.stop for r in self.ranges if r.stop <= keep and r.states), default=0)
        window = self.geometry.window
        if self.window_start and window is not None and keep < self.window_start + window - 1:
            return 0
        return keep

    def resumable_at(self, count: int) -> bool:
        """Whether a turn can resume at the end of its first ``count`` ranges (a shared
        prefix): the last of them keeps its checkpoint, or the model has no states."""
        return count > 0 and (not self.geometry.recurrent or bool(self.ranges[count - 1].states))

    def _limit_checkpoints(self) -> None:
        """Keep the checkpoints of the last ``checkpoints`` ranges only."""
        if self.geometry.recurrent:
            for r in self.ranges[: -self.checkpoints]:
                if r.states:
                    r.drop_states()
                    self.stored_gen += 1

    def slide(self, persisted: int) -> None:
        """Drop the sliding-window layers' parts of every stored range that lies wholly
        behind the window of a turn resuming anywhere in the last range (so a turn that
        redoes or edits the last one still resumes), and is safe in the warm tier
        (``persisted`` tokens are: a later write never needs them). Between turns only."""
        window = self.geometry.window
        if window is None or self.work is not None or not self.ranges:
            return
        limit = min(self.ranges[-1].start - window + 1, persisted)
        sliding = self.geometry.sliding
        for r in self.ranges:
            if r.stop > limit:
                break
            if r.stop <= self.window_start:
                continue
            for i in sliding:
                r.drop_layer(i)
            self.stored_gen += 1
            self.window_start = r.stop

    def layer_parts(self, layer: int, role: Role) -> list[Parts]:
        """Every stored range's parts of one layer and role, in order; zeros (as the codec
        shapes them) for a range whose sliding-layer parts were dropped."""
        kind = 1 if role == "value" else 0
        g = self.geometry.layer(layer)  # raises for a state entry
        out = []
        for r in self.ranges:
            parts = r.layers[layer][kind]
            if not parts:
                n = r.stop - r.start
                shapes = self.codec.expected_parts(r.start, n, g.n_kv_heads, g.dim(role), role=role)
                parts = {
                    name: mx.zeros(shape, getattr(mx, dtype))
                    for name, (shape, dtype) in shapes.items()
                }
            out.append(parts)
        return out

    def drop_ready(self) -> int:
        """Forget the ready copy (the stored form stays); returns the bytes freed."""
        freed = self.ready_bytes
        self.ready = None
        return freed

    def set_ready(self, copy: TurnCache) -> None:
        """Keep ``copy`` (built from the stored ranges, ``TurnCache.ready_steps``) as the
        ready copy. Raises ValueError during a turn."""
        if self.work is not None:
            raise ValueError("a cache in its turn has its working copy")
        self.ready = copy

    def clear_working(self) -> None:
        """Drop the working and ready copies (their MLX arrays must not outlive the engine
        thread that made them); the stored ranges stay."""
        self.work = self.ready = None
        self.stored_first = False

    def lend_work(self) -> TurnCache:
        """The working cache, handed to a batch that holds it until :meth:`take_work`.
        Raises ValueError between turns."""
        work, self.work = self.work, None
        if work is None:
            raise ValueError("no turn is running")
        return work

    def take_work(self, work: TurnCache) -> None:
        """Take back the working cache (this cache's row, out of a batch)."""
        self.work = work

    def dequantize(
        self,
        layer: int,
        role: Role,
        *,
        rotated: bool = False,
        room: int = 0,
        ranges: slice = slice(None),
    ) -> mx.array:
        """Float K or V ``(1, H, T + room, D)`` in fp32: every stored token of ``layer`` (of
        the stored ranges ``ranges`` selects: a prefix's, or those after it), then ``room``
        zero tokens; ``rotated``: left in the codec's stored basis (``KVCodec.dequantize``).
        Each token's values are the same whichever ranges are asked with it. On CPU, in
        the stored basis, the codes of every range and the room are joined as integers and
        scaled in one pass: no float copy is joined."""
        codec = self.codec
        bits = codec.role_spec(role)[0]
        spans = self._spans(layer, role, ranges)
        if bits != 16 and mx.default_device() == mx.cpu and (rotated or not codec.rotate):
            if fused.ready():  # one pass over the codes (numba); else the plain ops
                done = fused.dequantize(*self._fused_job(spans, role, room))
                if done is not None:
                    return done
            triples = [codec.codes(parts, start, n, role=role) for parts, start, n in spans]
            if room:
                codes, scales, _ = triples[-1]
                zeros = mx.zeros((*codes.shape[:2], room, codes.shape[3]), codes.dtype)
                none = mx.zeros((*scales.shape[:2], room, scales.shape[3]), scales.dtype)
                triples.append((zeros, none, none))
            kinds = {t[0].dtype for t in triples}
            widest = mx.uint32 if mx.uint32 in kinds else mx.uint8
            joined = [
                mx.concatenate([t[j] if j else t[j].astype(widest) for t in triples], axis=2)
                if len(triples) > 1
                else triples[0][j]
                for j in range(3)
            ]
            return affine(joined[0], joined[1].astype(mx.float32), joined[2].astype(mx.float32))
        pieces = [
            codec.dequantize(p, start, n, role=role, rotated=rotated) for p, start, n in spans
        ]
        if room:
            last = pieces[-1]
            pieces.append(mx.zeros((*last.shape[:2], room, last.shape[3]), mx.float32))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

    def dequantize_layers(
        self,
        layers: Sequence[int],
        *,
        rotated: bool = False,
        room: int = 0,
        ranges: slice = slice(None),
    ) -> list[tuple[mx.array, mx.array]] | None:
        """:meth:`dequantize` of the keys and values of each of ``layers`` (attention
        layers), made at once by the fused kernel (``kernels.fused.dequantize_many``: all
        their arrays allocated side by side first, then filled), evaluated; None where the
        fused path cannot take them: the caller asks :meth:`dequantize` layer by layer.
        Raises ValueError like :meth:`dequantize`."""
        if not fused.ready() or not self._fused_covers(rotated):
            return None
        landing = self.landing
        if landing is not None:  # streaming in: a group at a time, as its layers land
            size = -(-len(layers) // self._GROUPS)
            groups = [list(layers[k : k + size]) for k in range(0, len(layers), size)]
        else:
            groups = [list(layers)]
        out: dict[int, tuple[mx.array, mx.array]] = {}
        for group in groups:
            if landing is not None:
                for i in group:
                    landing.wait_layer(i)
            made = fused.dequantize_many(self._layer_jobs(group, room, ranges))
            if made is None:
                return None
            out.update((i, (made[2 * k], made[2 * k + 1])) for k, i in enumerate(group))
        return [out[i] for i in layers]

    def dequantize_beside(
        self, layers: Sequence[int], *, rotated: bool = False, room: int = 0
    ) -> tuple[list[tuple[mx.array, mx.array]], CopyBeside] | None:
        """The arrays of :meth:`dequantize_layers` (every stored range), made but not
        filled: the returned :class:`~kvactor.kernels.beside.CopyBeside` fills them in
        layer order once started, each layer after its streamed bytes land (nothing reads
        them before its ``wait_layer``). None where the fused path cannot take them."""
        if fused.compiled("one") is None or not self._fused_covers(rotated):
            return None
        made = fused.allocate(self._layer_jobs(layers, room, slice(None)))
        if made is None:
            return None
        outs, fills = made
        pairs = [(outs[2 * k], outs[2 * k + 1]) for k in range(len(layers))]
        per_layer = [fills[2 * k : 2 * k + 2] for k in range(len(layers))]
        landing = self.landing
        waits = None if landing is None else functools.partial(landing.wait_layer, counted=False)
        return pairs, CopyBeside(per_layer, layers, waits)

    def _fused_covers(self, rotated: bool) -> bool:
        """Whether the fused kernel makes this codec's copies: no 16-bit role, and a
        rotating codec's copy left in its stored basis (``rotated``)."""
        codec = self.codec
        if any(codec.role_spec(role)[0] == 16 for role in ("key", "value")):
            return False
        return rotated or not codec.rotate

    def _layer_jobs(self, layers: Sequence[int], room: int, ranges: slice) -> list[fused.Job]:
        """The fused kernel's jobs for the keys, then the values, of each of ``layers``
        (shapes checked, their bytes not waited for)."""
        roles: tuple[Role, Role] = ("key", "value")
        return [
            self._fused_job(self._spans(i, role, ranges, landed=True), role, room)
            for i in layers
            for role in roles
        ]

    def _spans(
        self, layer: int, role: Role, ranges: slice, *, landed: bool = False
    ) -> list[tuple[Parts, int, int]]:
        """(parts, start, tokens) of each stored range ``ranges`` selects, for one layer's
        role (their bytes in: :meth:`settle`, unless ``landed``: the caller waited for the
        layer). Raises ValueError when it selects none."""
        if not landed:
            self.settle()
        spans = [
            (parts, r.start, r.stop - r.start)
            for parts, r in zip(
                self.layer_parts(layer, role)[ranges], self.ranges[ranges], strict=True
            )
        ]
        if not spans:
            raise ValueError("no stored range to dequantize")
        return spans

    def _fused_job(self, spans: list[tuple[Parts, int, int]], role: Role, room: int) -> fused.Job:
        """What ``kernels.fused`` takes for one layer's role (its :meth:`_spans`): their
        parts, checked against their token counts (raises ValueError like
        :meth:`dequantize`)."""
        for parts, start, n in spans:
            self.codec.check_parts(parts, start, n, role=role)
        return [parts for parts, _, _ in spans], self.codec.role_spec(role)[0], room

    def deactivate(self, *, keep_ready: bool = False) -> StoredRange | None:
        """Quantize the tokens added since the last range, drop the working copy, or with
        ``keep_ready`` keep it as the ready copy when its class can (``TurnCache.settle``).

        Returns the new range (None when nothing was added).
        """
        new = self._quantize_tail()
        if keep_ready and self.work is not None and not self.stored_first:
            self.ready = self.work.settle(self, new)
        self.work = None
        self.stored_first = False
        return new

    def store_so_far(self) -> StoredRange | None:
        """During a turn: quantize its tokens so far into a range of their own, and let the
        working cache read their stored values from now on, as if the turn had ended here and
        the next one begun (a cut in a prompt: the end of a system prompt, where another
        cache may share its ranges). Returns the new range (None when nothing was added).
        Raises ValueError between turns."""
        if self.work is None:
            raise ValueError("no turn is running")
        new = self._quantize_tail()
        if new is not None:
            self.work.adopt(self, new)
        return new

    def _quantize_tail(self) -> StoredRange | None:
        start, stop = self.stored_tokens, len(self.tokens)
        if self.work is None or stop <= start:
            return None
        layers: list[tuple[Parts, Parts]] = []
        for i in range(self.geometry.n_layers):
            if self.geometry.state(i) is not None:
                layers.append(({}, {}))
                continue
            k, v, rotated = self.work.added(i, start, stop)
            layers.append(
                (
                    self.codec.quantize(k, start, role="key", rotated=rotated),
                    self.codec.quantize(v, start, role="value", rotated=rotated),
                )
            )
        new = StoredRange(start, stop, layers, self.work.states())
        mx.eval(list(new.arrays()))
        self.ranges.append(new)
        self.stored_gen += 1
        self._limit_checkpoints()
        return new

    def trim(self, keep: int) -> None:
        """Forget every token from ``keep`` on (a prompt that diverged there). Raises
        ValueError during a turn (the working cache holds them too): end the turn first.
        Streamed arrays still landing are cut lazily (nothing read)."""
        if len(self.tokens) <= keep:
            return
        if self.work is not None:
            raise ValueError("cannot trim a cache during its turn: end the turn first")
        if keep != self.reusable(keep):
            raise ValueError(f"cannot resume at token {keep}: see reusable()")
        del self.tokens[keep:]
        if keep == 0:
            self.window_start = 0
        kept: list[StoredRange] = []
        for r in self.ranges:
            if r.stop <= keep:
                kept.append(r)
            elif r.start < keep:
                kept.append(self._cut(r, keep))
        self.ranges = kept
        if self.ready is not None:
            self.ready.trim(keep, self.last_states())
        self.stored_gen += 1  # after the ready copy's trim: its bytes are counted again

    def _cut(self, r: StoredRange, keep: int) -> StoredRange:
        """The first ``keep - r.start`` tokens of a range (per-token codecs slice cleanly),
        without a checkpoint (its states are those at the range's end)."""
        n = keep - r.start
        layers: list[tuple[Parts, Parts]] = []
        for i, (k, v) in enumerate(r.layers):
            if self.geometry.state(i) is not None:
                layers.append(({}, {}))
                continue
            g = self.geometry.layer(i)
            cut = []
            for role, parts in (("key", k), ("value", v)):
                shapes = self.codec.expected_parts(
                    r.start, n, g.n_kv_heads, g.dim(cast(Role, role)), role=cast(Role, role)
                )
                cut.append(
                    {
                        name: a[:, :, : shapes[name][0][2]]
                        for name, a in parts.items()
                        if name in shapes
                    }
                )
            layers.append((cut[0], cut[1]))
        return StoredRange(r.start, keep, layers)

    def ranges_from(self, token: int) -> Sequence[StoredRange]:
        """The stored ranges that hold any token at or after ``token``."""
        self.settle()
        return [r for r in self.ranges if r.stop > token]
