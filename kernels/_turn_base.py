"""What both working caches share: the ``TurnCache`` protocol, one cache object per stored
entry (K/V or a recurrent state) and the caches the model takes, built from them
(``kernels.turn_cache`` says what a working cache is)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList

from .geometry import CacheGeometry
from .qcodec import Role
from .recurrent import RecurrentCache
from .rotated import RotatedBasis, RotatedKVCache

if TYPE_CHECKING:
    from .agent_cache import AgentKV
    from .beside import CopyBeside
    from .stored import Parts, StoredRange

#: Tokens of room a float working or ready copy keeps past its last one, so that the next
#: tokens are written in place instead of copying the whole cache to grow it (mlx-lm grows
#: KVCache by 256).
ROOM = 256

__all__ = (
    "ROOM",
    "Entries",
    "TurnCache",
    "geometry_slots",
    "new_values",
    "state_layer",
    "stored_values",
    "with_room",
)


def with_room(pieces: list[mx.array], slack: int) -> mx.array:
    """``pieces`` of K or V ``(1, H, T_i, D)`` joined along the tokens, with ``slack`` zero
    tokens after them (in the dtype of the last piece): one new array."""
    last = pieces[-1]
    room = mx.zeros((*last.shape[:2], slack, last.shape[3]), last.dtype)
    return mx.concatenate([*pieces, room], axis=2)


def stored_values(kv: AgentKV, new: StoredRange, layer: int, role: Role, rotated: bool) -> mx.array:
    """fp32 K or V of the tokens of ``new`` (a range of ``kv``), dequantized; ``rotated``:
    left in the codec's stored basis."""
    parts = new.layers[layer][1 if role == "value" else 0]
    n = new.stop - new.start
    return kv.codec.dequantize(parts, new.start, n, role=role, rotated=rotated)


def new_values(
    layers: Sequence[Any], kv: AgentKV, new: StoredRange
) -> list[tuple[mx.array, mx.array] | None]:
    """``stored_values`` of keys and values of ``new``'s tokens for each of ``layers`` (one
    row each: a K/V entry's cache, or a recurrent one), in the basis that layer works in;
    None for a layer that holds nothing (or a state). When the K/V layers are alike (all
    filled, one basis, parts of the same shapes) each role is dequantized once for all of
    them, stacked along the first axis, then split: a turn's new tokens are few, and sixty
    small calls cost more than the work. The values are the same either way (the codec
    works token by token)."""
    n = new.stop - new.start
    index = [i for i, layer in enumerate(layers) if not isinstance(layer, RecurrentCache)]
    filled = [layers[i].keys is not None and layers[i].values is not None for i in index]
    bases = [isinstance(layers[i], RotatedBasis) for i in index]
    out: list[list[mx.array | None]] = [[], []]
    for j, role in enumerate(cast(tuple[Role, Role], ("key", "value"))):
        parts = [new.layers[i][j] for i in index]
        first = parts[0] if parts else {}
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
                stored_values(kv, new, i, role, b) if f else None
                for i, f, b in zip(index, filled, bases, strict=True)
            ]
    found: list[tuple[mx.array, mx.array] | None] = [None] * len(layers)
    for i, k, v in zip(index, *out, strict=True):
        found[i] = None if k is None or v is None else (k, v)
    return found


def state_layer(kv: AgentKV, i: int) -> RecurrentCache:
    """Entry ``i`` of a one-row cache over ``kv``: a recurrent layer at its last checkpoint
    (empty before any token). Raises ValueError when the last range keeps no checkpoint."""
    g = kv.geometry.state(i)
    assert g is not None
    return RecurrentCache.from_parts(g, kv.last_states().get(i))


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
    def prepare(cls, model: nn.Module, geometry: CacheGeometry | None = None) -> None:
        """Ready ``model`` (whose caches ``geometry`` describes; None: attention layers
        only) to run over caches of this class (once per model). Raises TypeError when
        its attention cannot."""
        ...

    @classmethod
    def ready_nbytes(cls, kv: AgentKV) -> int:
        """Bytes of a ready copy of ``kv`` built ahead of a turn (``ready_steps``)."""
        ...

    @classmethod
    def ready_steps(cls, kv: AgentKV) -> Iterator[tuple[int, TurnCache | None]]:
        """Build ``kv``'s ready copy (what ``start`` makes) in steps of a few layers each,
        evaluated: ``(layers built, None)`` after each step but the last, then ``(layers
        built, the copy)``. Raises NotImplementedError when the class keeps no copy
        between turns."""
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

    def trim(self, keep: int, states: Mapping[int, Parts]) -> None:
        """Forget a ready copy's tokens from ``keep`` on; its recurrent layers take
        ``states`` (the checkpoint at ``keep``: a state cannot be cut back)."""
        ...

    def unfeed(self, n: int) -> None:
        """Forget the last ``n`` tokens fed to every row (a pipelined decode step ran past
        the end of a turn). A recurrent layer takes back only the one token of the last
        step announced by :meth:`before_step`; raises ValueError for more."""
        ...

    def state_arrays(self) -> list[mx.array]:
        """The recurrent layers' arrays it holds (a stored checkpoint's too, at a turn's
        start and in a ready copy: counted once, by ``AgentKV``)."""
        ...

    def landed(self) -> CopyBeside | None:
        """Block until its arrays are all in: a float copy filled beside the first forward
        (``kernels.beside``), returned for its seconds; None when none was filling.
        Raises RuntimeError when it could not be filled."""
        ...

    def before_step(self) -> None:
        """The next forward is a decode step (one token per row) that :meth:`unfeed` may
        take back: recurrent layers keep the state from before it."""
        ...

    def states(self) -> dict[int, Parts]:
        """A one-row cache's recurrent states now, per state entry, as stored parts (the
        checkpoint of a range ending here); ``{}`` without recurrent layers."""
        ...

    def arrays(self) -> list[mx.array]:
        """Every array, for ``mx.eval``."""
        ...

    def can_step(self) -> bool:
        """Whether :meth:`stepwise` can make this cache's positions attend as decode
        steps."""
        ...

    def stepwise(self, on: bool) -> bool:
        """A one-row cache: make its positions attend as decode steps (or again as one
        causal prefill); False when its kind cannot (nothing changed)."""
        ...

    def dispatching(self, on: bool) -> None:
        """A one-row cache: make each K/V layer dispatch the forward's work so far
        (``mx.async_eval``) as the forward hands it new tokens, so the layers before it run
        while the model's graph for the rest is built (a turn's forward; a pipelined
        decode step builds its graph while the step before it runs), or stop."""
        ...


_E = TypeVar("_E", bound="Entries")


class Entries:
    """What both working caches share: one cache object per stored entry (``_layers``: K/V
    of the class's kind, or a :class:`RecurrentCache`), the caches the model takes, made
    of them (``slots``: ``CacheGeometry.slots``), and the mode of their batches."""

    rowwise: ClassVar[bool] = False
    """Batches attend row by row, each row over its own keys (``kernels.rowwise``): a row's
    logits are then the bits it gets alone. Set per engine (``invariant``)."""

    def __init__(self, layers: list[Any], slots: tuple[tuple[int, ...], ...] = ()) -> None:
        # Rows too: a prefill step of one token turns and attends as a decode row does.
        self._layers = self._mark(layers) if self.rowwise else layers
        self._slots = slots

    @classmethod
    def invariant(cls: type[_E]) -> type[_E]:
        """This class with batch-invariant attention (``rowwise``)."""
        if cls.rowwise:
            return cls
        return type(f"{cls.__name__}[invariant]", (cls,), {"rowwise": True})

    def _mark(self, layers: list[Any]) -> list[Any]:
        """``layers`` with this class's batch mode set on each K/V batch (RowwiseBatch)."""
        for layer in layers:
            if not isinstance(layer, RecurrentCache):
                setattr(layer, "rowwise", self.rowwise)  # noqa: B010
        return layers

    def can_step(self) -> bool:
        """Every entry is a float cache in the Hadamard basis (:meth:`stepwise` can)."""
        return all(isinstance(layer, RotatedKVCache) for layer in self._layers)

    def stepwise(self, on: bool) -> bool:
        """Make a row's positions attend as decode steps, each over the keys up to itself
        (``kernels.rowwise.attend_steps``), or again as one causal prefill; False (nothing
        changed) unless every entry is a one-row float cache in the Hadamard basis."""
        if not self.can_step():
            return False
        for layer in self._layers:
            layer.stepwise = on
        return True

    def dispatching(self, on: bool) -> None:
        """Make each K/V entry dispatch the forward's work so far as it takes new tokens
        (``kernels.beside.land``, ``QuantizedBatchCache.update_and_fetch``), or stop: a
        one-token forward at 1K built its graph for ~6 ms before any of it ran (mlx-lm's
        own loop hides that by building each step while the one before runs)."""
        for layer in self._layers:
            if not isinstance(layer, RecurrentCache):
                layer.dispatch = on

    @property
    def layers(self) -> Sequence[Any]:
        """What the model takes as ``cache=``: an entry's cache, or a ``CacheList`` of the
        entries of one slot (a layer keeping a state and K/V)."""
        if not self._slots:
            return self._layers
        return [
            self._layers[s[0]] if len(s) == 1 else CacheList(*(self._layers[j] for j in s))
            for s in self._slots
        ]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)

    def landed(self) -> CopyBeside | None:
        return None

    def before_step(self) -> None:
        for layer in self._layers:
            if isinstance(layer, RecurrentCache):
                layer.mark_step()

    def state_arrays(self) -> list[mx.array]:
        """The recurrent layers' arrays it holds (some may be a stored checkpoint's)."""
        return [
            a for layer in self._layers if isinstance(layer, RecurrentCache) for a in layer.arrays()
        ]

    def check_attended(self) -> list[int]:
        """The entries whose step's K/V no bound attention read (the model's attention
        does not run over this class there)."""
        out = []
        for i, layer in enumerate(self._layers):
            check = getattr(layer, "check_attended", None)
            try:
                if check is not None:
                    check()
            except RuntimeError:
                out.append(i)
        return out

    def states(self) -> dict[int, Parts]:
        return {
            i: layer.parts()
            for i, layer in enumerate(self._layers)
            if isinstance(layer, RecurrentCache)
        }


def geometry_slots(geometry: CacheGeometry) -> tuple[tuple[int, ...], ...]:
    """The slots a working cache of ``geometry`` passes on: ``()`` when each entry is one."""
    return geometry.slots if any(len(s) > 1 for s in geometry.slots) else ()
