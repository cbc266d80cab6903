"""Array work spread over the CPU's cores (``kernels.workers``): a float working copy made
on one MLX stream per core holds the same bits as one made on a single stream (and as one
made by the fused kernel, ``kernels.fused``), layer by
layer on alternating streams; a thread's streams go with ``release_thread`` (real MLX,
tiny model)."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvactor.actors.models import make_tiny_model
from kvactor.kernels import fused
from kvactor.kernels._turn_base import ROOM
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatPrefix, FloatTurnCache
from kvactor.kernels.memory import release_thread
from kvactor.kernels.qcodec import DEFAULT_CODEC
from kvactor.kernels.workers import MAX_STREAMS, _cores, spread, worker_streams


def _stored(turns: tuple[int, ...] = (40, 9, 300)) -> AgentKV:
    """A tiny model's cache of a few stored ranges (several turns)."""
    lm = make_tiny_model(0, head_dim=64, num_hidden_layers=5)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    for n in turns:
        work = kv.activate()
        ids = [7 + (len(kv.tokens) + i) % 50 for i in range(n)]
        lm.model(mx.array([ids]), cache=work.layers)
        kv.tokens.extend(ids)
        kv.deactivate()
    return kv


def _in_thread(fn: Any, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fn()`` on a new thread (whose streams are its own), MLX released after."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test below
            failed.append(exc)
        finally:
            release_thread()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def _values(cache: FloatTurnCache) -> list[np.ndarray]:
    return [np.array(a) for layer in cache.layers for a in layer.state[:2]]


def test_a_working_copy_spread_over_streams_holds_the_bits_of_one_made_on_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = _stored()

    def made() -> tuple[int, list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        prefix = FloatPrefix(kv, 2)
        steps = list(FloatTurnCache.ready_steps(kv))
        assert sum(built for built, _ in steps) == kv.geometry.n_layers
        ready = steps[-1][1]
        assert ready is not None and all(copy is None for _, copy in steps[:-1])
        return (
            len(worker_streams()),
            _values(FloatTurnCache.start(kv)),
            _values(FloatTurnCache.start(kv, prefix)),
            _values(ready),
        )

    assert fused.wait(300), fused.unavailable()  # the fused kernel (numba) makes them
    spread_n, *spread_values = _in_thread(made, {"KVACTOR_ARRAY_STREAMS": "3"}, monkeypatch)
    one_n, *one_values = _in_thread(made, {"KVACTOR_ARRAY_STREAMS": "1"}, monkeypatch)
    # and MLX's plain ops, over streams and on one
    plain = {"KVACTOR_FUSED": "0", "KVACTOR_ARRAY_STREAMS": "3"}
    plain_n, *plain_values = _in_thread(made, plain, monkeypatch)
    _, *plain_one_values = _in_thread(made, {"KVACTOR_ARRAY_STREAMS": "1"}, monkeypatch)
    assert (spread_n, one_n, plain_n) == (3, 1, 3)
    # Each way, from the stored ranges, with a shared prefix's copy, as a ready copy.
    for ways in zip(spread_values, one_values, plain_values, plain_one_values, strict=True):
        assert len(ways[0]) == 2 * kv.geometry.n_layers
        for a, *others in zip(*ways, strict=True):
            assert a.shape == (1, a.shape[1], len(kv.tokens) + ROOM, a.shape[3])
            for b in others:
                np.testing.assert_array_equal(a, b)


def test_layers_go_to_the_streams_in_turn_and_each_thread_has_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def used() -> tuple[list[mx.Stream], list[mx.Stream]]:
        streams = worker_streams()
        seen = spread(
            5, lambda i: (mx.default_stream(mx.cpu), mx.zeros((4,)) + i), lambda p: [p[1]]
        )
        assert [int(p[1][0]) for p in seen] == list(range(5))
        return streams, [p[0] for p in seen]

    monkeypatch.delenv("KVACTOR_ARRAY_STREAMS", raising=False)
    streams, seen = _in_thread(used, {}, monkeypatch)
    assert len(streams) == max(1, min(_cores(), MAX_STREAMS))
    assert seen == [streams[i % len(streams)] for i in range(5)]
    again, _ = _in_thread(used, {}, monkeypatch)
    assert again[1:] != streams[1:] or len(streams) == 1  # made afresh: the old ones are gone
