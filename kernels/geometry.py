"""How an agent's cache is shaped, layer by layer: heads, key and value widths, windows."""

from __future__ import annotations

from dataclasses import dataclass

from .qcodec import Role

__all__ = ("CacheGeometry", "LayerGeometry")


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's cache: ``n_kv_heads`` heads of keys ``key_dim`` wide and values
    ``value_dim`` wide; ``window`` tokens kept (None: all of them)."""

    n_kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None

    def dim(self, role: Role) -> int:
        return self.key_dim if role == "key" else self.value_dim


@dataclass(frozen=True)
class CacheGeometry:
    """Every layer's cache geometry, in order; ``None`` for a layer that keeps no cache."""

    layers: tuple[LayerGeometry | None, ...]

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, head_dim: int) -> CacheGeometry:
        """``n_layers`` alike full-attention layers with keys and values ``head_dim`` wide."""
        return cls((LayerGeometry(n_kv_heads, head_dim, head_dim),) * n_layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> list[list[int]]:
        """Per layer ``[n_kv_heads, key_dim, value_dim, window]`` (window 0: none; ``[]`` for
        a layer without a cache): what a stored cache records and is checked against."""
        return [
            [] if g is None else [g.n_kv_heads, g.key_dim, g.value_dim, g.window or 0]
            for g in self.layers
        ]

    @classmethod
    def from_description(cls, layers: list[list[int]]) -> CacheGeometry:
        """The geometry :meth:`describe` gave ``layers``. Raises ValueError for anything else."""
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
        return cls(tuple(out))

    def layer(self, i: int) -> LayerGeometry:
        """Layer ``i``'s geometry; raises NotImplementedError for a layer without a cache
        (not supported by the stored form yet). A sliding-window layer keeps only its
        window's ranges (``AgentKV.slide``) and is attended through the model's mask."""
        g = self.layers[i]
        if g is None:
            raise NotImplementedError(f"layer {i} keeps no KV cache: not supported yet")
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
        """Bytes of one token's fp32 K and V over every layer."""
        return sum(4 * g.n_kv_heads * (g.key_dim + g.value_dim) for g in self.layers if g)
