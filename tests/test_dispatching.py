"""A turn's forward dispatches its layers as the model builds its graph
(``TurnCache.dispatching``): each K/V layer hands the work so far to MLX as it takes the
forward's new tokens, so the layers before it run while this thread builds the rest. The
same bits as a forward evaluated at its end; never in a decode step, which the batch
pipelines instead (real engine, tiny model, real MLX: a spy records each call and makes
it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pytest
from _stored_ranges import stored_kv

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.quantized_turn import QuantizedTurnCache

pytestmark = pytest.mark.one_backend  # the engine's turns, not the event loop

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the first argument of each ``mx.async_eval`` call from now on where
    it is an array (``()`` where it is a tree); the call is made as it was."""
    shapes: list[tuple[int, ...]] = []
    real = mx.async_eval

    def spy(*arrays: Any) -> None:
        first = arrays[0]
        shapes.append(tuple(first.shape) if isinstance(first, mx.array) else ())
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", spy)
    return shapes


def _kv_calls(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The calls of layers handing on a forward's keys ``(1, heads, tokens, dim)`` (a
    decode batch dispatches its picks, 1-D)."""
    return [s for s in shapes if len(s) == 4]


@pytest.mark.parametrize("kind", ["float", "stored"])
def test_a_dispatched_forward_gives_the_same_bits_a_layer_at_a_time(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    QuantizedTurnCache.prepare(lm.model)
    new = mx.array([[11, 12, 13]])
    shapes = _spy(monkeypatch)
    logits = {}
    for on in (True, False):
        kv = stored_kv(lm)
        work = kv.activate() if kind == "float" else kv.activate_stored()
        del shapes[:]
        work.dispatching(on)
        logits[on] = np.array(lm.model(new, cache=work.layers))
        work.dispatching(False)
        calls = _kv_calls(shapes)
        assert len(calls) == (lm.geometry.n_layers if on else 0)
        assert all(s[2] == 3 for s in calls)  # each layer's keys of the three new tokens
    assert np.array_equal(logits[True], logits[False])


@pytest.mark.parametrize("attention", ["dequantized", "quantized"])
async def test_a_turn_dispatches_its_forward_and_never_its_decode_steps(
    attention: Literal["dequantized", "quantized"],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiny = functools.partial(make_tiny_model, 0, head_dim=64)
    n_layers = make_tiny_model(0, head_dim=64).geometry.n_layers
    shapes = _spy(monkeypatch)
    async with kvactor.open(tiny, cache_dir=tmp_path, attention=attention) as kv:
        agent = await kv.spawn_agent("a")
        first = await agent.complete(PROMPT, max_tokens=6)
        del shapes[:]
        # Hot: from its ready copy (dequantized) or its stored form (quantized).
        hot = await agent.complete(PROMPT + first.text + " And so", max_tokens=6)
        assert hot.path == "hot" and hot.timings.generated_tokens == 6
        calls = _kv_calls(shapes)
        # One forward of the new tokens (one prefill chunk): a call per layer, then
        # five decode steps that dispatch no layer.
        assert len(calls) == n_layers, calls
        assert {s[2] for s in calls} == {hot.timings.prefilled_tokens}
