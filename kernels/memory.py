"""How many freed bytes MLX's allocator keeps for reuse, and a thread's MLX teardown.

On CPU, MLX keeps at most 32 MiB of freed buffers by default; every larger array is then
fresh memory from the OS, and writing it page-faults. A turn's float working copy (~200 MB
for the default model at 4K tokens), the dequantize's intermediates and the batch's
activations are all larger, so each turn paid for its pages again: writing 188 MB of fp32
into fresh pages costs ~2.3x writing it into reused ones here (``bench/dequantize.py``
measures the two limits side by side). Metal's default limit is its memory limit, far
above ours, so the engine only ever raises the limit.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .workers import drop_streams

__all__ = ("FREED_BUFFER_BYTES", "host_views", "keep_freed_buffers", "release_thread")

FREED_BUFFER_BYTES = 1 << 30
"""What the engine asks MLX to keep (capped at an eighth of the machine's memory)."""


def keep_freed_buffers(limit: int = FREED_BUFFER_BYTES) -> int:
    """Let MLX's allocator keep up to ``limit`` bytes of freed buffers (at most an eighth of
    physical memory), never lowering a higher limit already set. Returns the limit now in
    force. Process-wide: every engine of the process shares the allocator."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 * limit
    want = min(limit, physical // 8)
    before = mx.set_cache_limit(want)
    if before > want:
        mx.set_cache_limit(before)
        return before
    return want


def release_thread() -> None:
    """Finish the work this thread queued on MLX and destroy the streams it made. A thread
    that used MLX must call it before it ends (and the main thread before the interpreter
    exits): MLX tears down a stream left behind too late, at exit, and that can abort the
    process ("terminate called without an active exception", mlx 0.32 on Linux)."""
    mx.synchronize()
    drop_streams()
    mx.clear_streams()


def host_views() -> bool:
    """Whether an array's host view (``np.array(a, copy=False)``) is the array's own memory,
    for another thread to write its bytes into (a streamed warm load:
    ``AgentKV.fill_streamed``): on the CPU, and on Metal's unified memory. Not assumed
    elsewhere (CUDA, untested here): a warm cache is then read whole before it is staged."""
    return bool(mx.default_device() == mx.cpu or mx.metal.is_available())
