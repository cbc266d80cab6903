"""Array primitives of the KV codec: the Hadamard rotation and a plain-ops dequantization.
The codec (``qcodec``) is their public home."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

__all__ = ("affine", "dequantize_reference", "rotate", "rotate_rows", "rotation_block", "unpack")


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(n: int) -> mx.array:
    """The orthonormal Sylvester-Hadamard matrix of size n (a power of two), in fp32."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / np.sqrt(n, dtype=np.float32))


def rotation_block(width: int) -> int:
    """The size of the Hadamard blocks that rotate vectors ``width`` wide: the whole width
    when it is a power of two, else the largest power of two dividing it (a 96-wide MLA key
    turns in three blocks of 32). Block-diagonal, the rotation is still orthonormal and
    symmetric, and each block spans whole quantization groups or lies inside one."""
    return width & -width


def rotate(x: mx.array) -> mx.array:
    """x·H over the last axis (H orthonormal Hadamard, block-diagonal in blocks of
    :func:`rotation_block`; the same as ``mx.hadamard_transform`` of each block).

    On CPU a BLAS matmul with H beats MLX's fast Walsh-Hadamard transform (~1.8x here for
    a 4K-token cache); elsewhere the transform is used.
    """
    width = x.shape[-1]
    block = rotation_block(width)
    if block != width:
        return rotate(x.reshape(*x.shape[:-1], width // block, block)).reshape(x.shape)
    if mx.default_device() == mx.cpu:
        return x @ _hadamard_matrix(width)
    return mx.hadamard_transform(x)


def rotate_rows(x: mx.array) -> mx.array:
    """x·H over the last axis in fp32 (blocks as :func:`rotate`), each row on its own: a
    row's result does not depend on the rows that come with it (a BLAS matmul, as in
    :func:`rotate`, may round differently with their number). What the codec quantizes, so
    that K/V rotated as they enter a working cache quantize to the bytes of K/V rotated at
    once when the turn ends."""
    width = x.shape[-1]
    block = rotation_block(width)
    blocks = x.astype(mx.float32).reshape(*x.shape[:-1], width // block, block)
    return mx.hadamard_transform(blocks).reshape(x.shape)


def dequantize_reference(
    q: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``mx.dequantize`` (affine) in plain array ops, bit for bit the same given fp32 scales and
    biases; on CPU it is faster (3x for 3, 5 and 6 bits, whose values straddle words)."""
    return affine(unpack(q, bits), scales, biases, group_size)


def unpack(q: mx.array, bits: int) -> mx.array:
    """The codes packed in ``q`` (uint32 ``(..., words)``) as integers ``(..., words * 32 /
    bits)``: uint32 for 2, 4 and 8 bits, uint8 for 3, 5 and 6.

    MLX packs values little-endian: ``32 / bits`` per uint32 for 2, 4 and 8 bits, else 8 values
    per ``bits`` bytes. Those 8 are read as one word (the ``bits`` bytes padded with zeros to
    a uint32 for 3 bits, a uint64 for 5 and 6) and shifted apart in one broadcast: 1.5x (5
    bits) to 2.8x (3 bits) faster on CPU than assembling the word byte by byte.
    """
    lead, words = q.shape[:-1], q.shape[-1]
    dim = words * 32 // bits
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        return ((q[..., None] >> mx.arange(0, 32, bits, dtype=mx.uint32)) & mask).reshape(
            *lead, dim
        )
    width, kind = (4, mx.uint32) if bits * 8 <= 32 else (8, mx.uint64)
    packs = mx.view(q, mx.uint8).reshape(*lead, dim // 8, bits)
    padded = mx.pad(packs, [(0, 0)] * len(lead) + [(0, 0), (0, width - bits)])
    word = mx.view(padded, kind)  # (..., dim // 8, 1)
    values = (word >> mx.arange(0, 8 * bits, bits, dtype=kind)).astype(mx.uint8) & mask
    return values.reshape(*lead, dim)


def affine(
    codes: mx.array, scales: mx.array, biases: mx.array, group_size: int | None = None
) -> mx.array:
    """``codes * scale + bias`` per group of ``group_size`` along the last axis (None: the
    width over the scales per vector), in the dtype of ``scales`` (fp32 here)."""
    lead, dim = codes.shape[:-1], codes.shape[-1]
    group_size = group_size or dim // scales.shape[-1]
    grouped = codes.reshape(*lead, dim // group_size, group_size).astype(scales.dtype)
    return (grouped * scales[..., None] + biases[..., None]).reshape(*lead, dim)
