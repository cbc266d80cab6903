"""The parts of a coded token range (their layout is described in ``qcodec``): the array
code that makes them from values, reads values back from them, joins their codes, and
joins the parts of adjacent ranges. ``KVCodec`` decides the bits and groups and checks
what it is given; the functions here trust their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx

from ._qmath import affine, unpack

__all__ = (
    "SCALE_DTYPE",
    "SINK",
    "SINK_BITS",
    "concat_parts",
    "dequantize_parts",
    "joined_codes",
    "part_shapes",
    "parts_tokens",
    "quantize_parts",
)

SINK = "sink_"
"""The name prefix of the sink tokens' parts (the body's have none)."""
SINK_BITS = 8
"""The bits of sink tokens (when the body has fewer)."""
SCALE_DTYPE = "float16"
"""The stored dtype of scales and biases."""


def quantize_parts(x: mx.array, bits: int, group: int, prefix: str) -> dict[str, mx.array]:
    """The ``q``, ``s`` and ``b`` parts (names after ``prefix``) of fp16 values ``x``."""
    # MLX rounds against fp32 scale/bias and returns them in x's dtype (fp16: the stored form).
    q, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    return {prefix + "q": q, prefix + "s": scales, prefix + "b": biases}


def joined_codes(parts: Mapping[str, mx.array], bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """The integer codes of quantized parts, sinks (at SINK_BITS) and body (at ``bits``)
    joined along the tokens, with their fp16 scales and biases."""
    codes, scales, biases = [], [], []
    for prefix, width in ((SINK, SINK_BITS), ("", bits)):
        if prefix + "q" in parts:
            codes.append(unpack(parts[prefix + "q"], width))
            scales.append(parts[prefix + "s"])
            biases.append(parts[prefix + "b"])
    if len(codes) == 1:
        return codes[0], scales[0], biases[0]
    kind = codes[-1].dtype  # sink codes (8 bits) fit the body's (uint8 or uint32)
    return (
        mx.concatenate([c.astype(kind) for c in codes], axis=2),
        mx.concatenate(scales, axis=2),
        mx.concatenate(biases, axis=2),
    )


def dequantize_parts(parts: Mapping[str, mx.array], bits: int, group: int) -> mx.array:
    """The fp32 values of quantized parts (sinks and body joined), in the stored basis.

    On CPU plain array ops on the joined codes (bit for bit ``mx.dequantize``, and faster
    there); elsewhere ``mx.dequantize`` of each piece. Either way in fp32: given fp16
    scales, ``mx.dequantize`` would compute in fp16 (less exact, 4x slower on CPU).
    """
    if mx.default_device() == mx.cpu:
        codes, scales, biases = joined_codes(parts, bits)
        return affine(codes, scales.astype(mx.float32), biases.astype(mx.float32), group)
    pieces = []
    for prefix in (SINK, ""):
        if prefix + "q" in parts:
            q, scales, biases = (parts[prefix + k] for k in "qsb")
            width = SINK_BITS if prefix else bits
            pieces.append(
                mx.dequantize(
                    q,
                    scales.astype(mx.float32),
                    biases.astype(mx.float32),
                    group_size=group,
                    bits=width,
                )
            )
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def part_shapes(
    n_sink: int, n: int, n_kv_heads: int, head_dim: int, bits: int, group: int
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, numpy dtype name) of the quantized parts of ``n`` tokens, the first
    ``n_sink`` of them sinks."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for prefix, b, count in ((SINK, SINK_BITS, n_sink), ("", bits, n - n_sink)):
        if count:
            out[prefix + "q"] = ((1, n_kv_heads, count, head_dim * b // 32), "uint32")
            scale_shape = (1, n_kv_heads, count, head_dim // group)
            out[prefix + "s"] = (scale_shape, SCALE_DTYPE)
            out[prefix + "b"] = (scale_shape, SCALE_DTYPE)
    return out


def parts_tokens(parts: Mapping[str, mx.array]) -> int:
    """How many tokens a dict of parts holds (0 for ``{}``)."""
    return sum(parts[k].shape[2] for k in ("x", "q", SINK + "q") if k in parts)


def concat_parts(pieces: Sequence[Mapping[str, mx.array]]) -> dict[str, mx.array]:
    """The parts of adjacent token ranges, given in sequence order, as the parts of their union
    (each part concatenated along the token axis). Sink parts may only appear before body parts,
    as they do in a sequence; the result equals quantizing the union at once, bit for bit.

    Raises ValueError if a piece holds sink parts after an earlier piece held body parts, or if
    the pieces mix fp16 and quantized parts.
    """
    seen_body = False
    names: list[str] = []
    for piece in pieces:
        if seen_body and any(k.startswith(SINK) for k in piece):
            raise ValueError("sink parts after body parts: pieces out of order or not adjacent")
        seen_body = seen_body or "q" in piece or "x" in piece
        names += [k for k in piece if k not in names]
    if "x" in names and len(names) > 1:
        raise ValueError(f"pieces mix fp16 and quantized parts: {sorted(names)}")
    out: dict[str, mx.array] = {}
    for name in names:
        arrays = [piece[name] for piece in pieces if name in piece]
        out[name] = arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=2)
    return out
