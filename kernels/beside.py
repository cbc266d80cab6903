"""A turn's float working copy filled beside the forward that reads it.

A turn over a warm or hot stored cache makes its float copy first (``FloatTurnCache``):
on the CPU the fused kernel unpacks every layer's codes over both cores, and only then
does the first forward run. That forward keeps about one core busy (MLX runs a stream's
operations on one thread, and the engine's thread builds them), so the copy can run on
the other one instead, a layer ahead: the engine makes every layer's arrays (the only MLX
work, on its thread), a thread of this module fills them in layer order with the
one-thread kernel (``kernels.fused.fill_one``: NumPy views of that memory, no MLX call),
and the forward waits at each layer for its own (:meth:`CopyBeside.wait_layer`, before
the layer's cache takes the new tokens) and never for the rest. A layer-streamed read
(``AgentKV.landing``) composes: the thread waits for a layer's bytes before filling it.

Why a thread of its own and one core: the engine's forward needs the other (a fill over
both cores would take its core from it), and the thread never calls MLX, so MLX keeps its
one owner. Measured by ``bench/ttft.py`` (``warm_dequantize_s``, ``warm_forward_s``).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from . import fused

__all__ = ("CopyBeside", "land")

_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    with _pool_lock:
        if not _pool:
            _pool.append(
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvactor-copy")
            )
        return _pool[0]


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class CopyBeside:
    """Copies to fill, a list per layer (its keys' and values' ``kernels.fused.Fill``),
    filled in that order on this module's thread from :meth:`start`. ``landing(layer)``,
    where given, blocks until ``layers[k]``'s stored bytes are in (a streamed read's
    ``wait_layer``) before entry ``k`` is filled."""

    def __init__(
        self,
        fills: Sequence[Sequence[fused.Fill]],
        layers: Sequence[int],
        landing: Callable[[int], None] | None = None,
    ) -> None:
        if len(fills) != len(layers):
            raise ValueError("one layer index per entry to fill")
        self._fills = [list(layer) for layer in fills]
        self._layers, self._landing = layers, landing
        self._done = [threading.Event() for _ in fills]
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self.fill_s = 0.0  # the thread's seconds, from the start to the last layer
        self.waited_s = 0.0  # the engine's seconds blocked in wait_layer / wait

    def start(self) -> None:
        """Begin filling on this module's thread."""
        _executor().submit(self._run)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for k, layer in enumerate(self._layers):
                if self._landing is not None:
                    self._landing(layer)
                self._fill(k)
                self._done[k].set()
        except BaseException as exc:  # told at the next wait, on the engine's thread
            self._error = exc
        finally:
            self.fill_s = time.perf_counter() - t0
            self._fills = []  # their views keep the arrays' memory: let go
            for event in self._done:
                event.set()
            self._ended.set()

    def _fill(self, k: int) -> None:
        # Its views are let go before the forward may write the layer in place (a view
        # still held would keep MLX from reusing the buffer: it would copy it).
        fills, self._fills[k] = self._fills[k], []
        for fill in fills:
            fused.fill_one(fill)

    def wait_layer(self, k: int) -> None:
        """Block until entry ``k`` is filled, or filling failed (inside the forward: it
        runs on, and :meth:`wait` raises after it)."""
        self._wait(self._done[k])

    def wait(self) -> None:
        """Block until every entry is filled (the thread let go of their memory). Raises
        RuntimeError when filling failed: nothing of the copy is to be used."""
        self._wait(self._ended)
        if self._error is not None:
            raise RuntimeError(f"the float copy failed as it was filled: {self._error}")

    @property
    def filled(self) -> bool:
        return self._ended.is_set()

    def _wait(self, event: threading.Event) -> None:
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.waited_s += time.perf_counter() - t0


def land(cache: Any, keys: mx.array, values: mx.array) -> None:
    """In a layer cache's ``update_and_fetch``, before it takes the forward's new ``keys``
    and ``values``: where the forward dispatches as it goes (``cache.dispatch``:
    ``TurnCache.dispatching``) or its copy is still filling (``cache.landing``, set by
    ``FloatTurnCache.start`` with ``beside``), dispatch the layers before it
    (``mx.async_eval``: they run while this thread builds the rest or waits); then wait
    for its own copy, once."""
    landing: Callable[[], None] | None = cache.landing
    if cache.dispatch or landing is not None:
        mx.async_eval(keys, values)
    if landing is not None:
        landing()
        cache.landing = None
