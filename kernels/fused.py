"""A fused dequantize on the CPU: a layer's stored codes to its fp32 working copy in one
pass, with numba, where MLX's CPU array ops take about nine (unpack, pad, shift, mask,
join, widen, scale, offset, join again).

Measured on a 4K-token cache of the default model's shape (``bench/dequantize.py``, 2
cores): every layer's keys and values in 40 ms against 87 ms for the plain ops spread over
both cores (``kernels.workers``); in fresh memory 66 against 138 ms, at 8K 192 against
330 ms. Bit for bit the same values (``tests/test_fused.py``
compares them for every width and group). Why numba: it is the maintained way to write a
loop that compiles to native code from Python, with wheels for Linux and macOS; MLX has no
custom CPU kernels (``mx.compile`` fuses the element-wise tail only: 1.07x here, and needs
a C++ compiler at run time), and NumPy's whole-array ops make the same passes as MLX's
(1.34x on one core). On a GPU the device's fused ``mx.dequantize`` is the path instead.

The kernel is compiled (or loaded from numba's cache) on a thread of its own the first time
an engine loads a model (:func:`warm`); until it is ready, and wherever numba is missing or
``KVACTOR_FUSED=0`` is set, :func:`dequantize` answers None and the caller takes the plain
path. The engine's thread is still the only caller of MLX: it makes the output array,
evaluates it and lets the kernel write into that array's memory before anything reads it.
numba's default thread pool takes one caller at a time, so calls are serialized by a lock.
A one-thread build of the kernel (:func:`fill_one`, no pool, no lock) fills a turn's copy
beside its forward (``kernels.beside``) into arrays :func:`allocate` made. The same
thread compiles the kernel of the stored-form attention (``kernels.stored_attend``),
under the same switch and lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ._qparts import SINK, SINK_BITS
from .workers import worker_streams

__all__ = (
    "Fill",
    "Job",
    "allocate",
    "calling",
    "compiled",
    "dequantize",
    "dequantize_many",
    "fill_one",
    "host",
    "ready",
    "unavailable",
    "wait",
    "warm",
)

_lock = threading.Lock()  # one caller at a time in numba's thread pool
_ready = threading.Event()
_state: dict[str, Any] = {
    "started": False,
    "kernel": None,
    "one": None,
    "attend": None,
    "error": None,
}


def _enabled() -> bool:
    return os.environ.get("KVACTOR_FUSED", "1") != "0" and mx.default_device() == mx.cpu


def warm() -> None:
    """Compile the kernel on a thread of its own, once per process (no-op after the first
    call, on a GPU, or with ``KVACTOR_FUSED=0``)."""
    if not _enabled():
        return
    with _lock:
        if _state["started"]:
            return
        _state["started"] = True
    # numba's OpenMP threads sleep as soon as a call ends, unless the user chose otherwise
    # (read once, when the OpenMP runtime loads at the first call). Spinning, as they do by
    # default, they held both cores while MLX's threads ran the rest of the step: a decode
    # step over stored codes took 300 ms instead of 110 at 4K (kernels.stored_attend).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Not a daemon: an interpreter that exits mid-compile waits for it (a second or two)
    # rather than tearing LLVM down under it.
    threading.Thread(target=_build, name="kvactor-fused-compile").start()


def _build() -> None:
    try:
        from ._fused_kernel import unpack_scale, unpack_scale_one
        from ._stored_attend_kernel import attend_layer

        codes = np.zeros((1, 1, 8), np.uint8)  # compile for the one signature used
        side = np.ones((1, 1, 1), np.float32)
        for kernel in (unpack_scale, unpack_scale_one):
            kernel(codes, side, side, 8, 8, np.empty((1, 1, 8), np.float32), 0)
        _state["kernel"], _state["one"] = unpack_scale, unpack_scale_one
        # The stored-form attention (``kernels.stored_attend``), its one signature too.
        words = np.zeros((1, 1, 1, 1), np.uint32)
        side4 = np.ones((1, 1, 1, 1), np.float32)
        query = np.zeros((1, 1, 1, 8), np.float32)
        mask = np.zeros((0, 0, 0, 0), np.uint8)
        region = (True, (words, side4, side4, 4, 8), (words, side4, side4, 4, 8))
        turn, sinks = np.eye(8, dtype=np.float32), np.zeros((0,), np.float32)
        attend_layer(query, turn, *region, *region, query, query, mask, sinks, 1, 1, query.copy())
        _state["attend"] = attend_layer
    except Exception as exc:  # numba missing or unable to compile here: the plain path
        _state["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _ready.set()


def wait(timeout: float | None = None) -> bool:
    """Start the compile if need be and wait for it; True when the kernel is ready."""
    warm()
    _ready.wait(timeout)
    return ready()


def ready() -> bool:
    """Whether :func:`dequantize` will take the fused path now."""
    return _enabled() and _ready.is_set() and _state["kernel"] is not None


def compiled(name: str) -> Callable[..., None] | None:
    """A kernel compiled on this module's thread (``"attend"``: the stored-form attention
    of ``kernels.stored_attend``), or None where :func:`ready` is False."""
    kernel: Callable[..., None] | None = _state[name]
    return kernel if ready() else None


def calling() -> threading.Lock:
    """The lock every call into numba's thread pool holds (it takes one caller at a time)."""
    return _lock


def unavailable() -> str | None:
    """Why the fused path cannot run in this process (None: it can, or is compiling)."""
    if not _enabled():
        return "KVACTOR_FUSED=0 or not on the CPU"
    error: str | None = _state["error"]
    return error


def host(array: mx.array, dtype: Any = None) -> np.ndarray[Any, Any]:
    """A C-contiguous NumPy array of an MLX one (evaluated), or of a NumPy one (no MLX call
    then: any thread), no copy when it can be: what the numba kernels read."""
    out = np.asarray(array)
    return np.ascontiguousarray(out if dtype is None else out.astype(dtype, copy=False))


Job = tuple[Sequence[Mapping[str, mx.array]], int, int]
"""One copy to make: a layer-role's consecutive stored ranges (their parts), the body's
bits, and the zero tokens of room after them."""


def _pieces(ranges: Sequence[Mapping[str, mx.array]], bits: int) -> list[tuple[Any, ...]]:
    """(codes, scales, biases, bits) of each quantized piece (sinks, body) in token order."""
    out = []
    for parts in ranges:
        for prefix, width in ((SINK, SINK_BITS), ("", bits)):
            if prefix + "q" in parts:
                out.append((parts[prefix + "q"], parts[prefix + "s"], parts[prefix + "b"], width))
    return out


def _shape(pieces: list[tuple[Any, ...]], room: int) -> tuple[int, ...] | None:
    """The copy's shape (None where the kernel does not cover it)."""
    if not pieces:
        return None
    _, heads, _, words = pieces[0][0].shape
    dim = words * 32 // pieces[0][3]
    if dim % 8:
        return None
    return (1, heads, sum(q.shape[2] for q, *_ in pieces) + room, dim)


def dequantize(
    ranges: Sequence[Mapping[str, mx.array]], bits: int, room: int = 0
) -> mx.array | None:
    """Float32 ``(1, H, T + room, D)``: the quantized parts of consecutive stored ranges
    (sinks at :data:`SINK_BITS`, the body at ``bits``; in their stored basis) joined along
    the tokens, then ``room`` zero tokens; the values of ``affine`` of their joined codes,
    bit for bit. None when the fused path cannot take it (not ready, or a width it does
    not cover): the caller then runs the plain ops."""
    made = dequantize_many([(ranges, bits, room)])
    return None if made is None else made[0]


def dequantize_many(jobs: Sequence[Job]) -> list[mx.array] | None:
    """:func:`dequantize` of each job (None if any is not covered): their arrays made
    (:func:`allocate`), then filled one after another, each over every core."""
    kernel: Callable[..., None] | None = _state["kernel"]
    made = allocate(jobs)
    if made is None or kernel is None:
        return None
    outs, fills = made
    with _lock:
        for fill in fills:
            _run(kernel, fill)
    return outs


Fill = tuple[np.ndarray[Any, Any], list[tuple[Any, ...]]]
"""What fills one copy: its memory (``(H, T, D)`` fp32) and each quantized piece's codes
(uint8), scales and biases (as stored: converted to fp32 as the piece is filled, when its
bytes are in) and width, in token order."""


def allocate(jobs: Sequence[Job]) -> tuple[list[mx.array], list[Fill]] | None:
    """The copies of ``jobs`` made, not filled yet: each job's fp32 array (evaluated, all of
    them side by side over the worker streams, ``kernels.workers``: in fresh memory most
    of a copy's time is the first touch of its pages, which one zero-fill per array on one
    stream would leave to one core), and what :func:`fill_one` (or the kernel over every
    core) fills it with. Reads no stored bytes. None where the kernel does not cover a
    job or is not ready."""
    if _state["kernel"] is None or not ready():
        return None
    plans = [(_pieces(ranges, bits), room) for ranges, bits, room in jobs]
    shapes = [_shape(pieces, room) for pieces, room in plans]
    if any(shape is None for shape in shapes):
        return None
    streams = worker_streams()
    outs = []
    for k, shape in enumerate(shapes):
        with mx.stream(streams[k % len(streams)]):
            outs.append(mx.zeros(shape, mx.float32))  # type: ignore[arg-type]
        if len(streams) > 1:
            mx.async_eval(outs[-1])
    mx.eval(outs)
    targets = [np.asarray(out) for out in outs]
    if not all(t.flags.c_contiguous and t.flags.writeable and t.base is not None for t in targets):
        return None
    fills = [
        (target[0], [(np.asarray(q), np.asarray(s), np.asarray(b), w) for q, s, b, w in pieces])
        for target, (pieces, _) in zip(targets, plans, strict=True)
    ]
    return outs, fills


def fill_one(fill: Fill) -> None:
    """Fill one copy of :func:`allocate` on the calling thread alone, any thread (no MLX,
    no thread pool: beside the engine's forward, ``kernels.beside``)."""
    kernel: Callable[..., None] = _state["one"]
    _run(kernel, fill)


def _run(kernel: Callable[..., None], fill: Fill) -> None:
    target, pieces = fill
    heads, start = target.shape[0], 0
    for q, scales, biases, width in pieces:
        codes = host(q).view(np.uint8).reshape(heads, q.shape[2], -1)
        s32, b32 = host(scales, np.float32)[0], host(biases, np.float32)[0]
        kernel(codes, s32, b32, width, target.shape[2] // s32.shape[-1], target, start)
        start += q.shape[2]
