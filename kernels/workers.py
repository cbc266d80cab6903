"""Array work spread over the CPU's cores: one MLX stream per core, fed layer by layer.

MLX runs each CPU stream's operations on a thread of its own, and most of its CPU array
operations (everything but BLAS matmuls) on one core. A float working copy made from the
stored cache (unpacking codes, scaling them: ``AgentKV.dequantize``) is such work, one
layer at a time: on one stream it keeps one core busy while the others wait. Spread over
one stream per core it runs side by side: measured on a 4K-token cache of the default
model on 2 cores (``bench/dequantize.py``), 115 -> 70 ms, and 236 -> 127 ms into fresh
memory, where the page faults of the new arrays are spread too.

The thread that owns MLX work (the engine's) still builds every array and is the only
caller of MLX: the streams are MLX's own threads, which it schedules. The work must be
*dispatched* a layer at a time (``mx.async_eval`` of each layer's arrays as it is built):
MLX lets a thread run at most ~100 operations ahead of the streams, so one ``eval`` of
every layer at once would start the second stream only near the end.

On a GPU the device runs each operation over all of its cores already: one stream, the
thread's default.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import mlx.core as mx

__all__ = ("MAX_STREAMS", "drop_streams", "spread", "worker_streams")

MAX_STREAMS = 4
"""At most this many streams (the copy's writes share the memory bus beyond that)."""

T = TypeVar("T")

_local = threading.local()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_streams() -> list[mx.Stream]:
    """This thread's streams for array work on the default device: on the CPU, its default
    stream and one more per core up to :data:`MAX_STREAMS` (``KVACTOR_ARRAY_STREAMS``
    sets the number: 1 turns the spreading off); on a GPU, its default stream alone. Made
    once per thread; :func:`drop_streams` forgets them (``kernels.memory.release_thread``,
    which destroys them)."""
    device = mx.default_device()
    kept: dict[str, list[mx.Stream]] = getattr(_local, "streams", None) or {}
    key = str(device)
    streams = kept.get(key)
    if streams is None:
        streams = [mx.default_stream(device)]
        if device == mx.cpu:
            wanted = os.environ.get("KVACTOR_ARRAY_STREAMS")
            count = int(wanted) if wanted and wanted.isdigit() else _cores()
            streams += [mx.new_stream(device) for _ in range(min(count, MAX_STREAMS) - 1)]
        kept[key] = streams
        _local.streams = kept
    return streams


def drop_streams() -> None:
    """Wait for this thread's streams, then forget them (before MLX destroys them)."""
    kept: dict[str, list[mx.Stream]] = getattr(_local, "streams", None) or {}
    for streams in kept.values():
        for stream in streams:
            mx.synchronize(stream)
    _local.streams = None


def spread(
    count: int, make: Callable[[int], T], arrays: Callable[[T], Sequence[mx.array]]
) -> list[T]:
    """``[make(0), ..., make(count - 1)]``, each built on the next of :func:`worker_streams`
    in turn and dispatched at once (``arrays`` of it: what to evaluate), then all waited
    for. The values are those of building them on one stream: the same operations run."""
    streams = worker_streams()
    out = []
    for i in range(count):
        with mx.stream(streams[i % len(streams)]):
            item = make(i)
        if len(streams) > 1:  # on one stream the final eval alone is the old way
            mx.async_eval(list(arrays(item)))
        out.append(item)
    mx.eval([a for item in out for a in arrays(item)])
    return out
