"""The stored form of K/V caches: per-token affine quantization (2 to 8 bits) or fp16.

One layer's K (after RoPE) or V is a float array ``(1, n_kv_heads, T, head_dim)``. The codec
turns a token range of it into named *parts* (plain arrays: what the hot tier keeps and the warm
tier writes to safetensors, byte for byte) and back. Groups of ``group_size`` values run along
``head_dim`` (for widths it does not divide, the largest smaller group that does: 32-wide
MLA values, 96-wide MLA keys; :meth:`KVCodec.group_for`), so every token is coded on its
own: quantizing a range in pieces gives exactly the bytes of quantizing it at once, and the
warm tier can append new token ranges as new segments.

Parts of one range (``{prefix}`` is ``""`` for the body and ``"sink_"`` for sink tokens):

- quantized roles: ``{prefix}q`` uint32 ``(1, H, n, head_dim * bits / 32)`` (packed values),
  ``{prefix}s`` and ``{prefix}b`` float16 ``(1, H, n, head_dim / group_size)`` (scale, bias);
- a 16-bit role: ``x`` float16 ``(1, H, n, head_dim)``.

Options, all measured by ``bench/fidelity.py`` on the default model:

- ``rotate``: multiply each head vector by the orthonormal Sylvester Hadamard matrix H before
  quantizing and by Hᵀ (= H) after dequantizing. Orthonormal, so the values that come back can
  feed any attention unchanged; it only spreads outlier channels over the group before rounding.
  A width that is not a power of two turns in blocks (``rotation_block``: 96 in three of 32).
  A role stored in fp16 is never rotated (:meth:`KVCodec.rotates`). ``rotated=True`` on
  :meth:`KVCodec.quantize` / :meth:`KVCodec.dequantize` takes / gives values still in the
  stored basis (x·H), for attention that works there (``kernels.rotated``).
- ``sink_tokens``: the first N tokens of the sequence (attention sinks) are stored at 8 bits.
- ``key_bits`` / ``key_group_size``: keys coded differently from values (K8/V4 and the like).
  Such a codec needs ``role="key"`` or ``role="value"`` on every call (:data:`DEFAULT_CODEC` is
  one); a symmetric codec accepts the role and ignores it.

Dequantizing runs in fp32 (the fp16 scales are widened first). On CPU it uses plain array ops
(:func:`dequantize_reference`), bit for bit what ``mx.dequantize`` gives and faster there.

Per-channel key quantization (KIVI) is not offered: its groups run along tokens, so a new token
range would re-quantize old ones and the warm tier could no longer only append.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import mlx.core as mx
import numpy as np

from ._qmath import dequantize_reference as dequantize_reference
from ._qmath import rotate as rotate
from ._qmath import rotate_rows as rotate_rows
from ._qparts import (
    SCALE_DTYPE,
    SINK,
    SINK_BITS,
    dequantize_parts,
    joined_codes,
    part_shapes,
    quantize_parts,
)
from ._qparts import concat_parts as concat_parts
from ._qparts import parts_tokens as parts_tokens

__all__ = (
    "DEFAULT_CODEC",
    "FP16_CODEC",
    "FORMAT",
    "KVCodec",
    "Role",
    "concat_parts",
    "dequantize_reference",
    "parts_tokens",
    "rotate_rows",
)

Role = Literal["key", "value"]

FORMAT = "kvactor-kv"
"""The ``format`` entry of :meth:`KVCodec.describe` (with a version, bumped on any change of
the stored bytes)."""
_VERSION = 1
_QUANT_BITS = (2, 3, 4, 5, 6, 8)
_BITS = (*_QUANT_BITS, 16)
_GROUP_SIZES = (32, 64, 128)
_DESCRIPTION_KEYS = frozenset(
    {
        "format",
        "version",
        "bits",
        "group_size",
        "key_bits",
        "key_group_size",
        "rotate",
        "sink_tokens",
        "sink_bits",
        "scale_dtype",
    }
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class KVCodec:
    """How a K/V cache is stored. ``bits`` 2, 3, 4, 5, 6 or 8 quantize (affine, scales and biases
    in fp16), 16 stores plain fp16. ``key_bits`` / ``key_group_size`` override ``bits`` /
    ``group_size`` for keys (``None``: same as values).

    Raises ValueError for bits or group sizes outside those sets, a negative ``sink_tokens``,
    or fields of the wrong type.
    """

    bits: int = 4
    group_size: int = 64
    rotate: bool = False
    sink_tokens: int = 0
    key_bits: int | None = None
    key_group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("bits", "key_bits"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value not in _BITS):
                raise ValueError(f"{name} must be one of {_BITS}, not {value!r}")
        for name in ("group_size", "key_group_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value not in _GROUP_SIZES):
                raise ValueError(f"{name} must be one of {_GROUP_SIZES}, not {value!r}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be a bool, not {self.rotate!r}")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, not {self.sink_tokens!r}")
        # One spelling per codec, so that equal behaviour means equal objects and descriptions.
        if self.key_bits == self.bits:
            object.__setattr__(self, "key_bits", None)
        if self.key_group_size == self.group_size:
            object.__setattr__(self, "key_group_size", None)

    # ------------------------------------------------------------------ settings per role

    @property
    def symmetric(self) -> bool:
        """Whether keys and values are coded alike (then ``role`` may be left out)."""
        return self.key_bits is None and self.key_group_size is None

    @property
    def name(self) -> str:
        """A short label: ``q4g64``, ``q4g64+h+s4``, ``k5v3g64+h+s4``, ``k5g32v3g64``, ``fp16``."""
        kb, kg = self._spec("key")
        vb, vg = self._spec("value")
        if self.symmetric:
            label = "fp16" if vb == 16 else f"q{vb}g{vg}"
        elif kg == vg:
            label = f"k{kb}v{vb}g{vg}"
        else:
            label = f"k{kb}g{kg}v{vb}g{vg}"
        if self.rotate:
            label += "+h"
        if self.sink_tokens:
            label += f"+s{self.sink_tokens}"
        return label

    def role_spec(self, role: Role) -> tuple[int, int]:
        """(bits, group_size) of keys or values. Raises ValueError for another role."""
        return self._spec(role)

    def _spec(self, role: Role | None) -> tuple[int, int]:
        """(bits, group_size) of one role. Raises ValueError for a missing role of an asymmetric
        codec or an unknown role."""
        if role is None:
            if not self.symmetric:
                raise ValueError(f"codec {self.name} codes keys and values differently: pass role")
            return self.bits, self.group_size
        if role == "key":
            return (
                self.bits if self.key_bits is None else self.key_bits,
                self.group_size if self.key_group_size is None else self.key_group_size,
            )
        if role == "value":
            return self.bits, self.group_size
        raise ValueError(f"role must be 'key' or 'value', not {role!r}")

    def rotates(self, role: Role | None = None) -> bool:
        """Whether a role is stored in the Hadamard basis (``rotate``, and not fp16). Raises
        ValueError like :meth:`role_spec`, and for a missing role of an asymmetric codec."""
        return self.rotate and self._spec(role)[0] != 16

    def _n_sink(self, bits: int, start: int, n: int) -> int:
        """How many of tokens ``start .. start + n - 1`` are sinks kept apart at 8 bits."""
        if bits >= SINK_BITS:
            return 0  # the body is already at >= 8 bits: no separate sink parts
        return max(0, min(self.sink_tokens - start, n))

    def group_for(self, role: Role | None, width: int) -> int:
        """The quantization group of a role's vectors ``width`` wide: the role's group size
        when it divides the width, else the largest smaller one of 64 and 32 that does (MLA
        values 32 wide, keys 96 wide). Raises ValueError when none does, and like
        :meth:`role_spec`."""
        bits, group = self._spec(role)
        if bits == 16:
            return group
        for size in sorted(_GROUP_SIZES, reverse=True):
            if size <= group and width % size == 0:
                return size
        raise ValueError(
            f"no quantization group of {group} or less divides width {width} "
            f"({self.name} stores {role or 'K/V'} of widths that are multiples of 32)"
        )

    def _check_head_dim(self, head_dim: int, role: Role | None) -> tuple[int, int]:
        """(bits, group) of a role for vectors ``head_dim`` wide: see :meth:`group_for`."""
        bits, _ = self._spec(role)
        return bits, self.group_for(role, head_dim)

    # ------------------------------------------------------------------ coding

    def quantize(
        self, x: mx.array, start: int, *, role: Role | None = None, rotated: bool = False
    ) -> dict[str, mx.array]:
        """The stored parts of ``x`` (``(1, H, n, head_dim)`` float, K after RoPE or V) whose first
        token sits at absolute position ``start`` of the sequence. Lazy: nothing is evaluated.
        ``rotated``: ``x`` is in the stored basis already (x·H by :func:`rotate_rows`, as this
        method would rotate it, so the bytes are the same); nothing changes for a role the
        codec does not :meth:`rotates`.

        Values are rounded to fp16 first (so MLX returns scales and biases in fp16, the stored
        dtype; the rounding costs nothing measurable at <= 8 bits) and must lie in fp16 range.

        Raises ValueError if ``x`` is not 4-D with batch 1, ``start`` is negative, ``role`` is
        missing for an asymmetric codec, or ``head_dim`` does not suit the codec.
        """
        if x.ndim != 4 or x.shape[0] != 1:
            raise ValueError(f"expected (1, n_kv_heads, tokens, head_dim), got {x.shape}")
        if start < 0:
            raise ValueError(f"start must be >= 0, not {start}")
        bits, group = self._check_head_dim(x.shape[-1], role)
        n = x.shape[2]
        if n == 0:
            return {}
        if bits == 16:
            return {"x": x.astype(mx.float16)}
        if self.rotate and not rotated:
            # Not rotate(): a BLAS matmul rounds differently with the number of rows, so pieces
            # would not quantize to the bytes of the whole; the transform works row by row.
            x = rotate_rows(x)
        x = x.astype(mx.float16)
        n_sink = self._n_sink(bits, start, n)
        parts: dict[str, mx.array] = {}
        if n_sink:
            parts.update(quantize_parts(x[:, :, :n_sink], SINK_BITS, group, SINK))
        if n_sink < n:
            parts.update(quantize_parts(x[:, :, n_sink:], bits, group, ""))
        return parts

    def dequantize(
        self,
        parts: Mapping[str, mx.array],
        start: int,
        n: int,
        dtype: mx.Dtype = mx.float32,
        *,
        role: Role | None = None,
        rotated: bool = False,
    ) -> mx.array:
        """``(1, H, n, head_dim)`` in ``dtype`` from the parts of tokens ``start .. start + n - 1``;
        ``rotated``: left in the stored basis (x·H when the codec :meth:`rotates` the role:
        skips the inverse rotation, most of the cost on CPU).

        Raises ValueError if the part names or token counts do not fit that range (the shapes
        of untrusted parts are checked against :meth:`expected_parts` by their reader).
        """
        bits, group = self.check_parts(parts, start, n, role=role)
        if bits == 16:
            return parts["x"].astype(dtype)
        x = dequantize_parts(parts, bits, group)
        if self.rotate and not rotated:
            x = rotate(x)  # H is symmetric and orthonormal: H·H = I
        return x.astype(dtype)

    def codes(
        self, parts: Mapping[str, mx.array], start: int, n: int, *, role: Role | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The integer codes ``(1, H, n, head_dim)`` of a quantized role's tokens ``start ..
        start + n - 1`` (sinks and body joined), with their fp16 scales and biases ``(1, H,
        n, head_dim / group_size)``: ``affine`` of them (scales widened to fp32) is
        :meth:`dequantize` with ``rotated=True``, bit for bit. Joining codes of several
        ranges before one ``affine`` copies a quarter of the bytes of joining floats (on CPU,
        where the codes are unpacked by plain ops anyway). Raises ValueError like
        :meth:`dequantize`, and for a 16-bit role."""
        bits, _ = self.check_parts(parts, start, n, role=role)
        if bits == 16:
            raise ValueError("a 16-bit role has no codes")
        return joined_codes(parts, bits)

    def check_parts(
        self, parts: Mapping[str, mx.array], start: int, n: int, *, role: Role | None = None
    ) -> tuple[int, int]:
        """(bits, group) of parts that fit tokens ``start .. start + n - 1``; the group from
        their shapes (width over scales per token)."""
        bits, group = self._spec(role)
        names = set(self._part_names(bits, start, n))
        if set(parts) != names:
            raise ValueError(f"parts {sorted(parts)} do not match {sorted(names)} for {self.name}")
        if n == 0:
            raise ValueError("cannot dequantize an empty range: its shape is unknown")
        if parts_tokens(parts) != n:
            raise ValueError(f"parts hold {parts_tokens(parts)} tokens, not {n}")
        if bits != 16:
            prefix = "" if "q" in parts else SINK
            width = parts[prefix + "q"].shape[-1] * 32 // (bits if prefix == "" else SINK_BITS)
            group = self.group_for(role, width)
        return bits, group

    def _part_names(self, bits: int, start: int, n: int) -> list[str]:
        if n == 0:
            return []
        if bits == 16:
            return ["x"]
        n_sink = self._n_sink(bits, start, n)
        names = [SINK + k for k in "qsb"] if n_sink else []
        return names + (list("qsb") if n_sink < n else [])

    def expected_parts(
        self, start: int, n: int, n_kv_heads: int, head_dim: int, *, role: Role | None = None
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, numpy dtype name) of every part that :meth:`quantize` returns for
        tokens ``start .. start + n - 1``; ``{}`` for an empty range.

        Raises ValueError for negative arguments, a missing role of an asymmetric codec, or a
        ``head_dim`` that does not suit the codec.
        """
        if min(start, n, n_kv_heads, head_dim) < 0:
            raise ValueError("start, n, n_kv_heads and head_dim must be >= 0")
        bits, group = self._check_head_dim(head_dim, role)
        if n == 0:
            return {}
        if bits == 16:
            return {"x": ((1, n_kv_heads, n, head_dim), "float16")}
        n_sink = self._n_sink(bits, start, n)
        return part_shapes(n_sink, n, n_kv_heads, head_dim, bits, group)

    # ------------------------------------------------------------------ sizes

    def nbytes(
        self,
        n_tokens: int,
        n_kv_heads: int,
        head_dim: int,
        start: int = 0,
        *,
        value_dim: int | None = None,
    ) -> int:
        """Bytes of K *and* V of one layer for tokens ``start .. start + n_tokens - 1`` (keys
        ``head_dim`` wide, values ``value_dim``, default the same; ``kernels.agent_cache.
        cache_nbytes`` sums a whole cache). Raises ValueError like :meth:`expected_parts`."""
        total = 0
        widths: tuple[tuple[Role, int], ...] = (("key", head_dim), ("value", value_dim or head_dim))
        for role, dim in widths:
            for shape, dtype in self.expected_parts(
                start, n_tokens, n_kv_heads, dim, role=role
            ).values():
                total += int(np.prod(shape)) * np.dtype(dtype).itemsize
        return total

    def bytes_ratio_vs_fp16(self, head_dim: int) -> float:
        """Bytes of the body (tokens past the sinks) over the bytes of the same K/V in fp16;
        exact: Q4 g64 is 0.28125. Raises ValueError if ``head_dim`` does not suit the codec."""
        ratio = Fraction(0)
        for role in ("key", "value"):
            bits, group = self._check_head_dim(head_dim, role)
            per_value = Fraction(16) if bits == 16 else bits + Fraction(2 * 16, group)
            ratio += per_value / 16 / 2
        return float(ratio)

    # ------------------------------------------------------------------ description

    def describe(self) -> dict[str, int | bool | str]:
        """Everything that decides the stored bytes, for file metadata and compatibility checks:
        a cache written under another description must be refused."""
        key_bits, key_group = self._spec("key")
        return {
            "format": FORMAT,
            "version": _VERSION,
            "bits": self.bits,
            "group_size": self.group_size,
            "key_bits": key_bits,
            "key_group_size": key_group,
            "rotate": self.rotate,
            "sink_tokens": self.sink_tokens,
            "sink_bits": SINK_BITS,
            "scale_dtype": SCALE_DTYPE,
        }

    @classmethod
    def from_description(cls, d: Mapping[str, object]) -> KVCodec:
        """The codec that :meth:`describe` returned ``d`` for.

        Raises ValueError for a missing or unknown key, another format or version, or a value
        of the wrong type or outside the allowed set.
        """
        keys = set(d)
        if keys != _DESCRIPTION_KEYS:
            missing = sorted(_DESCRIPTION_KEYS - keys)
            unknown = sorted(keys - _DESCRIPTION_KEYS)
            raise ValueError(f"bad codec description: missing {missing}, unknown {unknown}")
        fixed = {
            "format": FORMAT,
            "version": _VERSION,
            "sink_bits": SINK_BITS,
            "scale_dtype": SCALE_DTYPE,
        }
        for key, want in fixed.items():
            got = d[key]
            if type(got) is not type(want) or got != want:
                raise ValueError(f"codec description has {key}={got!r}; this build reads {want!r}")
        rotate = d["rotate"]
        if not isinstance(rotate, bool):
            raise ValueError(f"codec description: rotate must be a bool, not {rotate!r}")
        return cls(
            bits=_int_entry(d, "bits"),
            group_size=_int_entry(d, "group_size"),
            rotate=rotate,
            sink_tokens=_int_entry(d, "sink_tokens"),
            key_bits=_int_entry(d, "key_bits"),
            key_group_size=_int_entry(d, "key_group_size"),
        )


def _int_entry(d: Mapping[str, object], key: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"codec description: {key} must be an int, not {value!r}")
    return value


FP16_CODEC = KVCodec(bits=16)
"""Plain fp16 storage: the baseline for capacity and fidelity comparisons."""

DEFAULT_CODEC = KVCodec(bits=3, group_size=64, key_bits=5, rotate=True, sink_tokens=4)
"""The stored form unless told otherwise: keys 5-bit, values 3-bit (group 64 both), Hadamard
rotation, the first 4 tokens at 8 bits; 0.281 of fp16 bytes, as many as plain Q4 g64. Chosen by
``bench/fidelity.py`` (SmolLM2-135M, 4096 tokens in chunks of 256, past stored, current chunk
exact; two windows of the text): +0.39% / +0.43% perplexity over fp, where plain Q4 g64 is
+1.25% / +1.39% and Q4 g64 with rotation and sinks +1.06% / +0.60%. Keys carry most of the
error (K8/V4 with rotation is +0.02%). Keys at group 32 (0.297 of fp16) scored the same within
noise (+0.42% / +0.29%) for 6% more bytes, so the smaller form won."""
