"""An agent's stored cache, range by range: what the hot tier keeps and the warm tier writes.

A :class:`StoredRange` holds tokens [start, stop) of every K/V entry, quantized by the
codec, and, for a model with recurrent layers, their *checkpoint*: each recurrent layer's
state after token ``stop - 1`` (``states``, exact, not quantized; ``{}`` once dropped:
``AgentKV.checkpoints`` says how many ranges keep theirs). Tensor names, as files hold
them: ``{entry}.k.{part}`` / ``{entry}.v.{part}`` for K/V, ``{entry}.s.{j}`` for states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .geometry import CacheGeometry, storage_dtype
from .qcodec import KVCodec, Role

__all__ = ("Parts", "StoredRange", "cache_nbytes", "segment_layout")

Parts = dict[str, mx.array]


@dataclass
class StoredRange:
    """Tokens [start, stop) of every entry: ``layers[i] = (k_parts, v_parts)`` of a K/V
    entry (``({}, {})`` for a state entry); ``states[i]``: state entry ``i`` after the
    range's last token (empty when this range keeps no checkpoint).

    Invariant: its arrays change only by :meth:`drop_states` and :meth:`drop_layer` (a
    range is otherwise made whole and left so), which keeps :attr:`nbytes` (counted once:
    the hot tier's count reads it every decode step) true."""

    start: int
    stop: int
    layers: list[tuple[Parts, Parts]]
    states: dict[int, Parts] = field(default_factory=dict)
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)

    def arrays(self) -> Iterator[mx.array]:
        """Every part array of every layer, and the checkpoint's arrays."""
        for k, v in self.layers:
            yield from k.values()
            yield from v.values()
        for parts in self.states.values():
            yield from parts.values()

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = sum(a.nbytes for a in self.arrays())
        return self._nbytes

    def drop_states(self) -> None:
        """Keep no checkpoint (its state arrays let go)."""
        self.states = {}
        self._nbytes = None

    def drop_layer(self, layer: int) -> None:
        """Let go of one entry's parts (a sliding layer's, behind the window)."""
        self.layers[layer] = ({}, {})
        self._nbytes = None

    @property
    def state_bytes(self) -> int:
        """Bytes of its checkpoint (0: none kept)."""
        return sum(a.nbytes for parts in self.states.values() for a in parts.values())

    def to_numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """Host views of the arrays (zero-copy on CPU; a bfloat16 state as float32),
        named ``{layer}.{k|v}.{part}`` and ``{layer}.s.{j}``."""
        mx.eval(list(self.arrays()))
        out: dict[str, np.ndarray[Any, Any]] = {}
        for i, (k, v) in enumerate(self.layers):
            for kind, parts in (("k", k), ("v", v)):
                for name, array in parts.items():
                    out[f"{i}.{kind}.{name}"] = np.array(array, copy=False)
        for i, parts in self.states.items():
            for name, array in parts.items():
                if array.dtype == mx.bfloat16:
                    array = array.astype(mx.float32)
                out[f"{i}.s.{name}"] = np.array(array, copy=False)
        return out

    @classmethod
    def from_numpy(
        cls,
        start: int,
        stop: int,
        geometry: CacheGeometry,
        tensors: Mapping[str, np.ndarray[Any, Any] | mx.array],
        may_lack: frozenset[int] = frozenset(),
    ) -> StoredRange:
        """The inverse of ``to_numpy`` (one copy into MLX, states in their own dtype; MLX
        arrays are taken as they are: ``AgentKV.fill_streamed``); the
        K/V entries in ``may_lack`` (sliding-window layers, see ``AgentKV.slide``) may have
        no parts at all, and the states may all be missing (no checkpoint). Raises KeyError
        on another missing layer, half of one, or part of a checkpoint."""
        layers: list[tuple[Parts, Parts]] = [({}, {}) for _ in range(geometry.n_layers)]
        states: dict[int, Parts] = {}
        for key, array in tensors.items():
            layer, kind, name = key.split(".", 2)
            if kind == "s":
                g = geometry.state(int(layer))
                if g is None:
                    raise KeyError(f"entry {layer} keeps no state")
                dtype = getattr(mx, g.dtypes[int(name)])
                states.setdefault(int(layer), {})[name] = mx.array(array).astype(dtype)
            else:
                taken = array if isinstance(array, mx.array) else mx.array(array)
                layers[int(layer)][0 if kind == "k" else 1][name] = taken
        state_layers = geometry.state_layers
        for i, (k, v) in enumerate(layers):
            if i in state_layers:
                continue
            if (not k or not v) and (k or v or i not in may_lack):
                raise KeyError("a stored range lacks the K or V parts of some layer")
        if states and (
            set(states) != state_layers
            or any(len(states[i]) != len(g.shapes) for i, g in _states(geometry))
        ):
            raise KeyError("a stored range holds part of a checkpoint")
        return cls(start, stop, layers, states)

    def holds_layer(self, layer: int) -> bool:
        """Whether the range has the layer's parts (a sliding layer's may be dropped)."""
        return bool(self.layers[layer][0])


def _states(geometry: CacheGeometry) -> Iterator[tuple[int, Any]]:
    for i in sorted(geometry.state_layers):
        yield i, geometry.state(i)


def segment_layout(
    codec: KVCodec, geometry: CacheGeometry
) -> Callable[[int, int], dict[str, tuple[tuple[int, ...], str]]]:
    """``expect(start, stop)``: the exact name, shape and dtype of every array a stored range
    of tokens [start, stop) holds, as ``StoredRange.to_numpy`` names them, its checkpoint
    included (``{layer}.s.{j}``). The warm tier checks untrusted files against it.
    Raises ValueError like ``KVCodec.expected_parts`` (at the first call)."""
    roles: tuple[tuple[str, Role], ...] = (("k", "key"), ("v", "value"))

    # Every warm load and import asks for the same few ranges (a segment's tokens): the
    # answer is a pure function of them, kept for the 32 ranges asked most recently
    # (~33 KiB each on the default model: ~1 MiB at most).
    @functools.lru_cache(maxsize=32)
    def layout(start: int, stop: int) -> dict[str, tuple[tuple[int, ...], str]]:
        n = stop - start
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for kind, role in roles:
            for layer in geometry.kv_layers:
                g = geometry.layer(layer)
                try:
                    parts = codec.expected_parts(start, n, g.n_kv_heads, g.dim(role), role=role)
                except ValueError as exc:
                    raise ValueError(f"layer {geometry.model_layer(layer)}: {exc}") from None
                for name, spec in parts.items():
                    out[f"{layer}.{kind}.{name}"] = spec
        for layer, s in _states(geometry):
            for j, (shape, dtype) in enumerate(zip(s.shapes, s.dtypes, strict=True)):
                out[f"{layer}.s.{j}"] = (tuple(shape), storage_dtype(dtype))
        return out

    def expect(start: int, stop: int) -> dict[str, tuple[tuple[int, ...], str]]:
        return dict(layout(start, stop))  # the caller's own copy

    return expect


def cache_nbytes(codec: KVCodec, geometry: CacheGeometry, n_tokens: int, start: int = 0) -> int:
    """Stored K/V bytes of tokens ``start .. start + n_tokens - 1`` over every K/V entry of
    ``geometry`` (each layer's heads, key and value widths; a checkpoint adds
    ``geometry.state_bytes``). Raises ValueError like ``KVCodec.expected_parts``."""
    return sum(
        codec.nbytes(n_tokens, g.n_kv_heads, g.key_dim, start, value_dim=g.value_dim)
        for g in (geometry.layer(i) for i in geometry.kv_layers)
    )
