"""The 2026 model lineup's cache geometries, from their published configs (no download):
what each layer keeps as kvactor stores it (K/V of attention layers, the state of a
recurrent layer as mlx-lm 0.32 holds it), and the bytes of the weights as MLX runs them
(4-bit affine, group 64: 4.5 bits a parameter; gpt-oss in its own MXFP4, about the same).

Recurrent states as mlx-lm keeps them: a gated delta layer (Qwen3.5) a convolution state
``(kernel - 1, 2·Hk·Dk + Hv·Dv)`` in the model's dtype (bf16) and a delta state
``(Hv, Dv, Dk)`` in fp32; a Mamba-2 layer (Nemotron-H, Granite 4) a convolution state
``(kernel - 1, heads·head_dim + 2·groups·d_state)`` (bf16) and an SSM state
``(heads, head_dim, d_state)`` (fp32); an LFM2 short convolution ``(L_cache - 1, hidden)``
(bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvactor.kernels.geometry import CacheGeometry, LayerGeometry, StateGeometry

__all__ = ("LINEUP", "Lineup")

_BITS_PER_WEIGHT = 4.5


@dataclass(frozen=True)
class Lineup:
    """One model: its cache geometry and the bytes of its weights."""

    geometry: CacheGeometry
    weights_bytes: int
    source: str


def _weights(params: float) -> int:
    return int(params * _BITS_PER_WEIGHT / 8)


def _make(entries: list[LayerGeometry | StateGeometry]) -> CacheGeometry:
    kv = tuple(e if isinstance(e, LayerGeometry) else None for e in entries)
    states = tuple(e if isinstance(e, StateGeometry) else None for e in entries)
    return CacheGeometry(kv, states if any(states) else ())


def _delta(hk: int, hv: int, dk: int, dv: int, kernel: int) -> StateGeometry:
    conv = (1, kernel - 1, 2 * hk * dk + hv * dv)
    return StateGeometry((conv, (1, hv, dv, dk)), ("bfloat16", "float32"))


def _mamba2(heads: int, head_dim: int, d_state: int, groups: int, kernel: int) -> StateGeometry:
    conv = (1, kernel - 1, heads * head_dim + 2 * groups * d_state)
    return StateGeometry((conv, (1, heads, head_dim, d_state)), ("bfloat16", "float32"))


def _qwen35(layers: int, kv_heads: int, hk: int, hv: int, params: float, name: str) -> Lineup:
    # Every 4th layer gated attention (head_dim 256), the others gated delta (dims 128).
    attention = LayerGeometry(kv_heads, 256, 256)
    delta = _delta(hk, hv, 128, 128, 4)
    entries = [attention if (i + 1) % 4 == 0 else delta for i in range(layers)]
    return Lineup(_make(entries), _weights(params), name)


def _pattern(pattern: str, attention: LayerGeometry, mamba: StateGeometry) -> CacheGeometry:
    """Nemotron-H's layer string: M Mamba-2, * attention, E / - (MoE, MLP) no cache."""
    entries: list[LayerGeometry | StateGeometry] = []
    owners: list[int | None] = []
    for c in pattern:
        if c in "M*":
            owners.append(len(entries))
            entries.append(mamba if c == "M" else attention)
        else:
            owners.append(None)
    g = _make(entries)
    return CacheGeometry(g.layers, g.states, model_layers=tuple(owners))


def _gemma4_e2b() -> CacheGeometry:
    # 35 layers, every 5th global; the last 20 reuse the first 15's K/V: 15 stored, of
    # which 3 global (1 KV head of 512) and 12 sliding (1 KV head of 256, window 512).
    stored = [
        LayerGeometry(1, 512, 512) if (i + 1) % 5 == 0 else LayerGeometry(1, 256, 256, 512)
        for i in range(15)
    ]
    return CacheGeometry(tuple(stored), model_layers=tuple([*range(15), *[None] * 20]))


_NEMOTRON_NANO = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

#: The lineup: name -> geometry and weights (config values hard-coded from the published
#: model configs).
LINEUP: dict[str, Lineup] = {
    # 40 layers, attention 16 heads / 2 KV x 256; delta 16 QK / 32 V heads x 128.
    "Qwen3.5-35B-A3B": _qwen35(40, 2, 16, 32, 35e9, "Qwen/Qwen3.5-35B-A3B"),
    # 60 layers, attention 32 heads / 2 KV x 256; delta 16 QK / 64 V heads x 128.
    "Qwen3.5-397B-A17B": _qwen35(60, 2, 16, 64, 397e9, "Qwen/Qwen3.5-397B-A17B"),
    # 16 layers: 6 attention (8 KV heads x 64) at 2, 5, 8, 10, 12, 14; 10 short convs.
    "LFM2-1.2B": Lineup(
        _make(
            [
                LayerGeometry(8, 64, 64)
                if i in (2, 5, 8, 10, 12, 14)
                else StateGeometry(((1, 2, 2048),), ("bfloat16",))
                for i in range(16)
            ]
        ),
        _weights(1.17e9),
        "LiquidAI/LFM2-1.2B",
    ),
    # 52 layers: 23 Mamba-2 (64 heads x 64, d_state 128, 8 groups), 6 attention (2 KV x
    # 128), 23 MoE layers without a cache.
    "Nemotron-3-Nano-30B-A3B": Lineup(
        _pattern(_NEMOTRON_NANO, LayerGeometry(2, 128, 128), _mamba2(64, 64, 128, 8, 4)),
        _weights(31.6e9),
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B",
    ),
    # 40 layers: 4 attention (8 KV x 128), 36 Mamba-2 (128 heads x 64, d_state 128).
    "Granite-4.0-H-Small": Lineup(
        _make(
            [
                LayerGeometry(8, 128, 128) if i in (5, 15, 25, 35) else _mamba2(128, 64, 128, 1, 4)
                for i in range(40)
            ]
        ),
        _weights(32.2e9),
        "ibm-granite/granite-4.0-h-small",
    ),
    # 24 layers alternating sliding (window 128) and full, 8 KV heads x 64.
    "gpt-oss-20b": Lineup(
        CacheGeometry(
            tuple(LayerGeometry(8, 64, 64, 128 if i % 2 == 0 else None) for i in range(24))
        ),
        _weights(20.9e9),
        "openai/gpt-oss-20b",
    ),
    "Gemma-4-E2B": Lineup(_gemma4_e2b(), _weights(5.1e9), "google/gemma-4-E2B"),
}
