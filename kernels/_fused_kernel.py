"""The numba kernels of ``kernels.fused`` (imported by it, on a thread of its own:
importing numba takes ~0.25 s and compiling these ~2 s, or ~0.1 s from numba's cache)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

__all__ = ("unpack_scale", "unpack_scale_one")


@njit(inline="always", nogil=True, cache=True)
def _row(
    codes: Any, scales: Any, biases: Any, bits: int, group: int, out: Any, start: int, row: int
) -> None:  # pragma: no cover - compiled by numba, which coverage does not see
    """Row ``row`` (head-major) of :func:`unpack_scale`."""
    tokens = codes.shape[1]
    width = out.shape[2]
    mask = np.uint64((1 << bits) - 1)
    h = row // tokens
    t = row - h * tokens
    packed = codes[h, t]
    values = out[h, start + t]
    for p in range(width // 8):
        word = np.uint64(0)
        for k in range(bits):
            word |= np.uint64(packed[p * bits + k]) << np.uint64(8 * k)
        g = (p * 8) // group
        scale = scales[h, t, g]
        bias = biases[h, t, g]
        for k in range(8):
            code = (word >> np.uint64(k * bits)) & mask
            values[p * 8 + k] = np.float32(code) * scale + bias


@njit(parallel=True, nogil=True, cache=True)
def unpack_scale(
    codes: Any, scales: Any, biases: Any, bits: int, group: int, out: Any, start: int
) -> None:  # pragma: no cover - compiled by numba, which coverage does not see
    """``out[h, start + t, j] = code(h, t, j) * scale + bias`` for every head ``h``, token
    ``t`` and value ``j``, over every core: ``codes`` uint8 ``(H, T, D * bits / 8)``, each
    row the values' bits end to end, little-endian (how MLX packs 2 to 8 bits, so that 8
    values take ``bits`` bytes); ``scales`` and ``biases`` fp32 ``(H, T, D / group)``;
    ``out`` fp32 ``(H, >= start + T, D)``. One multiply then one add, each rounded to
    fp32, as the plain ops do (no fused multiply-add: numba asks LLVM for none without
    ``fastmath``)."""
    heads, tokens, _ = codes.shape
    for row in prange(heads * tokens):
        _row(codes, scales, biases, bits, group, out, start, row)


@njit(nogil=True, cache=True)
def unpack_scale_one(
    codes: Any, scales: Any, biases: Any, bits: int, group: int, out: Any, start: int
) -> None:  # pragma: no cover - compiled by numba, which coverage does not see
    """:func:`unpack_scale` on the calling thread alone (no thread pool: a copy filled
    beside the engine's forward, ``kernels.fused.fill_one``), the same values."""
    heads, tokens, _ = codes.shape
    for row in range(heads * tokens):
        _row(codes, scales, biases, bits, group, out, start, row)
