"""A strict safetensors writer and reader for warm-cache segments (numpy only, no MLX).

The reader trusts nothing in a file: the header length is bounded, the header must be JSON
of the exact safetensors shape, dtypes come from an allowlist, every tensor must be one the
caller expects (name, shape, dtype), and the data offsets must tile the data area exactly
(no gaps, overlaps or bytes past the end). Tensors come back as views of one buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import numpy as np

from ..errors import CacheRejected

__all__ = (
    "MAX_HEADER_BYTES",
    "Expected",
    "ParsedSegment",
    "Span",
    "build_header",
    "dtype_named",
    "parse_segment",
    "tensor_bytes",
)

dtype_named = functools.cache(np.dtype)
"""The numpy dtype of a name ("uint8"), kept: ``np.dtype(str)`` is slow, and a cache in
many files checks thousands of tensors."""

#: Our headers are a few KiB; anything above this is hostile or not ours.
MAX_HEADER_BYTES = 16 << 20
_MAX_NDIM = 8

_DTYPES: dict[str, np.dtype[Any]] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in (
        ("BOOL", "bool"),
        ("U8", "uint8"),
        ("I8", "int8"),
        ("U16", "uint16"),
        ("I16", "int16"),
        ("F16", "float16"),
        ("U32", "uint32"),
        ("I32", "int32"),
        ("F32", "float32"),
        ("U64", "uint64"),
        ("I64", "int64"),
        ("F64", "float64"),
    )
}
_NAMES = {code: dtype.name for code, dtype in _DTYPES.items()}  # .name is slow to compute
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

#: Exact tensor name -> (shape, numpy dtype name).
Expected = Mapping[str, tuple[tuple[int, ...], str]]


def tensor_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    """The raw bytes of a C-contiguous little-endian array, without copying."""
    return array.data.cast("B") if array.size else memoryview(b"")


def build_header(
    tensors: Iterable[tuple[str, np.ndarray[Any, Any]]], metadata: dict[str, str]
) -> bytes:
    """The 8-byte length and the JSON header for ``tensors`` stored in the given order.

    Raises ValueError for a dtype outside the allowlist. The header is padded with spaces
    to a multiple of 8 bytes so that every tensor of our files stays aligned.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, array in tensors:
        code = _CODES.get(array.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype.name}, not storable")
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = msgspec.json.encode(header)
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


#: Where a tensor lies in its file: ``(begin, end, name, dtype, shape)``, in file offsets.
Span = tuple[int, int, str, np.dtype[Any], tuple[int, ...]]


class ParsedSegment:
    """A checked segment: its metadata, its tensors (views of ``buffer``), its data area,
    and where each tensor lies in the file (``spans``, in file order)."""

    __slots__ = ("data", "metadata", "spans", "tensors")

    def __init__(
        self,
        metadata: dict[str, str],
        tensors: dict[str, np.ndarray[Any, Any]],
        data: memoryview,
        spans: list[Span],
    ) -> None:
        self.metadata = metadata
        self.tensors = tensors
        self.data = data
        self.spans = spans


def parse_segment(
    buffer: np.ndarray[Any, Any], expected: Expected, *, arrays: bool = True
) -> ParsedSegment:
    """Check the whole file in ``buffer`` (uint8) against ``expected`` and map its tensors.

    Raises CacheRejected (without a path: the caller adds it) naming the first problem:
    a short file, a header length over the bound or past the end, a header that is not a
    JSON object of safetensors entries, metadata that is not str -> str, an unknown dtype,
    a bad or huge shape, a tensor name not expected or missing, a shape or dtype other than
    expected, or data offsets that do not tile the data area exactly. ``arrays``: map
    the tensors (else a check only: ``tensors`` is empty).
    """
    size = buffer.nbytes
    if size < 8:
        raise CacheRejected(f"file of {size} bytes is shorter than a safetensors header")
    header_len = int.from_bytes(buffer[:8].tobytes(), "little")
    if header_len > MAX_HEADER_BYTES:
        raise CacheRejected(f"header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
    if header_len > size - 8:
        raise CacheRejected(f"header length {header_len} runs past the end of a {size}-byte file")
    try:
        header = msgspec.json.decode(buffer[8 : 8 + header_len].tobytes())
    except (msgspec.DecodeError, RecursionError) as exc:
        raise CacheRejected(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CacheRejected("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CacheRejected("header __metadata__ is missing or not a str -> str object")
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise CacheRejected(f"unexpected tensor(s) {', '.join(map(repr, unexpected[:5]))}")
    missing = sorted(set(expected) - set(header))
    if missing:
        raise CacheRejected(f"missing tensor(s) {', '.join(map(repr, missing[:5]))}")

    data_start = 8 + header_len
    data_len = size - data_start
    spans: list[tuple[int, int, str, np.dtype[Any], tuple[int, ...]]] = []
    for name, entry in header.items():
        begin, stop, dtype, shape = _check_entry(name, entry, expected[name], data_len)
        spans.append((begin, stop, name, dtype, shape))
    spans.sort()
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            what = "overlaps the previous one" if begin < end else "leaves a gap before it"
            raise CacheRejected(f"tensor {name!r} at offset {begin} {what} (expected {end})")
        end = stop
    if end != data_len:
        raise CacheRejected(f"tensors cover {end} of the {data_len} data bytes")

    tensors = {
        name: np.frombuffer(buffer, dtype, math.prod(shape), data_start + begin).reshape(shape)
        for begin, _, name, dtype, shape in (spans if arrays else ())
    }
    data = buffer.data[data_start:]
    at: list[Span] = [
        (data_start + begin, data_start + stop, name, dtype, shape)
        for begin, stop, name, dtype, shape in spans
    ]
    return ParsedSegment(metadata, tensors, data, at)


def _check_entry(
    name: str, entry: object, want: tuple[tuple[int, ...], str], data_len: int
) -> tuple[int, int, np.dtype[Any], tuple[int, ...]]:
    """Validate one header entry; return its data offsets, dtype and shape."""
    fast = _entry_as_expected(entry, want, data_len)
    if fast is not None:
        return fast
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CacheRejected(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise CacheRejected(f"tensor {name!r}: dtype {code!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
    ):
        raise CacheRejected(f"tensor {name!r}: bad shape {str(shape)[:80]}")
    want_shape, want_dtype = want
    if tuple(shape) != tuple(want_shape) or _NAMES[code] != want_dtype:
        raise CacheRejected(
            f"tensor {name!r} is {_NAMES[code]}{list(shape)}, "
            f"expected {want_dtype}{list(want_shape)}"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise CacheRejected(
            f"tensor {name!r}: data offsets {str(offsets)[:80]} outside the {data_len} data bytes"
        )
    begin, end = offsets
    nbytes = math.prod(shape) * _DTYPES[code].itemsize
    if end - begin != nbytes:
        raise CacheRejected(
            f"tensor {name!r}: offsets span {end - begin} bytes, shape needs {nbytes}"
        )
    return begin, end, _DTYPES[code], tuple(shape)


def _entry_as_expected(
    entry: object, want: tuple[tuple[int, ...], str], data_len: int
) -> tuple[int, int, np.dtype[Any], tuple[int, ...]] | None:
    """``_check_entry``'s answer for an entry exactly as expected (every warm load's and
    import's case: a few hundred entries a segment), with fewer steps; None for anything
    else, which the full checks then name."""
    if type(entry) is not dict or len(entry) != 3:
        return None
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    want_shape, want_dtype = want
    if (
        type(code) is not str
        or _NAMES.get(code) != want_dtype
        or type(shape) is not list
        or type(offsets) is not list
        or len(offsets) != 2
        or tuple(shape) != want_shape
        or _INT_TYPES.issuperset(map(type, shape + offsets)) is False
    ):
        return None
    begin, end = offsets
    dtype = _DTYPES[code]
    if not 0 <= begin <= end <= data_len or end - begin != math.prod(shape) * dtype.itemsize:
        return None
    return begin, end, dtype, want_shape


_INT_TYPES = frozenset((int,))  # JSON numbers decoded as int, not bool or float
