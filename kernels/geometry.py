"""How an agent's cache is shaped, entry by entry: attention layers' heads, key and value
widths and windows; recurrent layers' fixed-size states; how the entries make the caches
the model takes, and which of its layers keep none of their own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .qcodec import Role

__all__ = ("CacheGeometry", "LayerGeometry", "StateGeometry", "storage_dtype")


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer's cache: ``n_kv_heads`` heads of keys ``key_dim`` wide and
    values ``value_dim`` wide; ``window`` tokens kept (None: all of them)."""

    n_kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None

    def dim(self, role: Role) -> int:
        return self.key_dim if role == "key" else self.value_dim


@dataclass(frozen=True)
class StateGeometry:
    """One recurrent (state-space or linear-attention) layer's cache: a fixed-size state
    after the last token, as mlx-lm's ``ArraysCache`` holds it (a convolution state, an
    SSM or delta-rule state): each array's shape for one row (leading axis 1) and its
    dtype (an MLX name: ``"float32"``, ``"bfloat16"`` ...). Stored as it is, never quantized
    (on disk a bfloat16 array as float32, exactly: :func:`storage_dtype`)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one row's state (one checkpoint of this layer)."""
        return sum(
            math.prod(s) * getattr(mx, d).size
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    def describe(self) -> dict[str, Any]:
        return {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)}


def storage_dtype(dtype: str) -> str:
    """The numpy dtype a state array of MLX dtype ``dtype`` is stored in on disk: its own,
    or float32 for bfloat16 (numpy has none; the cast is exact both ways)."""
    return "float32" if dtype == "bfloat16" else dtype


@dataclass(frozen=True)
class CacheGeometry:
    """Every stored entry of an agent's cache, in order: ``layers[i]`` an attention layer's
    K/V, or None where ``states[i]`` is a recurrent layer's state (``states`` is empty for
    a model without any). ``slots``: which entries make each cache the model takes
    (``()``: one entry each; two for a ``CacheList`` of a state and K/V, Falcon-H1's).
    ``model_layers``: per model layer, the slot it keeps, None for a layer that keeps no
    cache of its own (an MLP layer, a layer reusing another's K/V); ``()``: one slot each."""

    layers: tuple[LayerGeometry | None, ...]
    states: tuple[StateGeometry | None, ...] = ()
    slots: tuple[tuple[int, ...], ...] = ()
    model_layers: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.states and len(self.states) != len(self.layers):
            raise ValueError("states must have one entry per stored entry")
        for i, g in enumerate(self.layers):
            if (g is None) == (self.state(i) is None):
                raise ValueError(f"entry {i} must be either K/V or a state")
        if self.slots and sorted(j for s in self.slots for j in s) != list(range(len(self.layers))):
            raise ValueError("slots must name every entry once")

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, head_dim: int) -> CacheGeometry:
        """``n_layers`` alike full-attention layers with keys and values ``head_dim`` wide."""
        return cls((LayerGeometry(n_kv_heads, head_dim, head_dim),) * n_layers)

    @property
    def n_layers(self) -> int:
        """Stored entries (the model's layers, for a model with one cache per layer)."""
        return len(self.layers)

    def state(self, i: int) -> StateGeometry | None:
        """Entry ``i``'s state geometry (None: a K/V entry)."""
        return self.states[i] if self.states else None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The entries that hold K/V."""
        return tuple(i for i, g in enumerate(self.layers) if g is not None)

    @property
    def state_layers(self) -> frozenset[int]:
        """The entries that hold a recurrent state."""
        return frozenset(i for i in range(self.n_layers) if self.state(i) is not None)

    @property
    def recurrent(self) -> bool:
        """Whether any entry is a recurrent state (its turns keep checkpoints)."""
        return bool(self.state_layers)

    @property
    def state_bytes(self) -> int:
        """Bytes of one row's state of every recurrent layer (one checkpoint)."""
        return sum(s.nbytes for s in self.states if s is not None)

    @property
    def slot_entries(self) -> tuple[tuple[int, ...], ...]:
        """Per cache the model takes, its entries."""
        return self.slots or tuple((i,) for i in range(self.n_layers))

    def model_layer(self, entry: int) -> int:
        """The model layer that keeps entry ``entry`` (its slot, where every layer has one)."""
        slot = next(k for k, s in enumerate(self.slot_entries) if entry in s)
        return self.model_layers.index(slot) if slot in self.model_layers else slot

    def describe(self) -> list[list[int]]:
        """Per entry ``[n_kv_heads, key_dim, value_dim, window]`` (window 0: none; ``[]`` for
        a state entry): what a stored cache records and is checked against."""
        return [
            [] if g is None else [g.n_kv_heads, g.key_dim, g.value_dim, g.window or 0]
            for g in self.layers
        ]

    def describe_states(self) -> list[dict[str, Any]]:
        """Per state entry ``{"layer": i, "shapes": [...], "dtypes": [...]}`` (``[]`` without
        any): what a stored cache records of its recurrent layers."""
        return [{"layer": i, **s.describe()} for i, s in enumerate(self.states) if s is not None]

    @classmethod
    def from_description(
        cls, layers: list[list[int]], states: list[dict[str, Any]] | None = None
    ) -> CacheGeometry:
        """The geometry :meth:`describe` and :meth:`describe_states` gave (one cache per
        entry). Raises ValueError for anything else."""
        out: list[LayerGeometry | None] = []
        for entry in layers:
            if not entry:
                out.append(None)
                continue
            if len(entry) != 4 or not all(isinstance(x, int) and x >= 0 for x in entry):
                raise ValueError(f"bad layer geometry {entry!r}")
            heads, key_dim, value_dim, window = entry
            if min(heads, key_dim, value_dim) <= 0:
                raise ValueError(f"bad layer geometry {entry!r}")
            out.append(LayerGeometry(heads, key_dim, value_dim, window or None))
        if not out:
            raise ValueError("a geometry has at least one layer")
        found: list[StateGeometry | None] = [None] * len(out)
        for spec in states or []:
            found[_state_index(spec, len(out))] = _state_of(spec)
        return cls(tuple(out), tuple(found) if states else ())

    def layer(self, i: int) -> LayerGeometry:
        """Entry ``i``'s K/V geometry; raises NotImplementedError for a state entry (it has
        no K/V: see :meth:`state`). A sliding-window layer keeps only its window's ranges
        (``AgentKV.slide``) and is attended through the model's mask."""
        g = self.layers[i]
        if g is None:
            raise NotImplementedError(f"entry {i} keeps a recurrent state, not K/V")
        return g

    @property
    def window(self) -> int | None:
        """The widest sliding window of any layer (None: every layer attends to all)."""
        windows = [g.window for g in self.layers if g is not None and g.window is not None]
        return max(windows) if windows else None

    @property
    def sliding(self) -> frozenset[int]:
        """The layers that attend through a sliding window."""
        return frozenset(
            i for i, g in enumerate(self.layers) if g is not None and g.window is not None
        )

    def fp32_bytes_per_token(self) -> int:
        """Bytes of one token's fp32 K and V over every K/V entry."""
        return sum(4 * g.n_kv_heads * (g.key_dim + g.value_dim) for g in self.layers if g)

    def summary(self) -> str:
        """What the entries hold, in words (``3 K/V (1 sliding), 2 states; 1 of 6 layers
        without a cache``)."""
        kv, states = len(self.kv_layers), len(self.state_layers)
        parts = [f"{kv} K/V" + (f" ({len(self.sliding)} sliding)" if self.sliding else "")]
        if states:
            parts.append(f"{states} states")
        if self.slots and any(len(s) > 1 for s in self.slots):
            parts.append(f"{sum(len(s) > 1 for s in self.slots)} layers keep both")
        text = ", ".join(parts)
        none = sum(s is None for s in self.model_layers)
        if none:
            text += f"; {none} of {len(self.model_layers)} layers without a cache of their own"
        return text


def _state_index(spec: Any, n: int) -> int:
    layer = spec.get("layer") if isinstance(spec, dict) else None
    if not isinstance(layer, int) or not 0 <= layer < n:
        raise ValueError(f"bad state geometry {spec!r}")
    return layer


def _state_of(spec: dict[str, Any]) -> StateGeometry:
    shapes, dtypes = spec.get("shapes"), spec.get("dtypes")
    if (
        not isinstance(shapes, list)
        or not isinstance(dtypes, list)
        or not shapes
        or len(shapes) != len(dtypes)
        or not all(
            isinstance(s, list) and all(isinstance(x, int) and x > 0 for x in s) for s in shapes
        )
        or not all(isinstance(d, str) for d in dtypes)
    ):
        raise ValueError(f"bad state geometry {spec!r}")
    if not all(isinstance(getattr(mx, d, None), mx.Dtype) for d in dtypes):
        raise ValueError(f"bad state dtype in {spec!r}")
    return StateGeometry(tuple(tuple(s) for s in shapes), tuple(dtypes))
