"""A float turn's first forward over the stored form: a turn that starts without a float
copy (warm, or hot without a ready copy) and feeds a few tokens attends over the stored
codes (``kernels.stored_attend``), and makes its float copy after its first token, or
never for a turn of one token. Answers are the copy path's; the copy made after holds
exactly the stored values and the forward's tokens (real engine, tiny model, real MLX,
real numba, real files)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from _stored_ranges import stored_kv

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.kernels import fused, stored_attend
from kvactor.kernels._qmath import rotate_rows
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec
from kvactor.kernels.quantized_turn import QuantizedTurnCache
from kvactor.kernels.rotated import RotatedKVCache

pytestmark = pytest.mark.one_backend  # the engine's turns, not the event loop

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    # numba is a dependency on Linux: where the kernel cannot compile, say why.
    assert fused.wait(300), fused.unavailable()


@pytest.fixture(autouse=True)
def short_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model's caches hold a few hundred tokens: below the default threshold.
    monkeypatch.setattr(FloatTurnCache, "stored_first_tokens", 1)


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


def test_the_copy_made_after_holds_the_stored_values_and_the_forwards_tokens() -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    QuantizedTurnCache.prepare(lm.model)
    kv = stored_kv(lm)
    assert FloatTurnCache.defers(kv, 8)
    first = kv.activate_stored()
    assert isinstance(first, QuantizedTurnCache) and kv.stored_first
    new = [11, 12, 13]
    lm.model(mx.array([new]), cache=first.layers)
    kv.tokens.extend(new)
    tails = [first.added(i, kv.stored_tokens, len(kv.tokens))[:2] for i in range(lm.n_layers)]
    work = kv.finish_stored()
    assert isinstance(work, FloatTurnCache) and not kv.stored_first
    fresh = FloatTurnCache.start(kv)  # what the copy path makes of the stored ranges
    stored = kv.stored_tokens
    for layer, plain, (keys, values) in zip(work.layers, fresh.layers, tails, strict=True):
        assert isinstance(layer, RotatedKVCache) and layer.offset == stored + len(new)
        for got, want, tail in zip(layer.state[:2], plain.state[:2], (keys, values), strict=True):
            np.testing.assert_array_equal(
                np.array(got[:, :, :stored]), np.array(want[:, :, :stored])
            )
            np.testing.assert_array_equal(
                np.array(got[:, :, stored : stored + len(new)]), np.array(rotate_rows(tail))
            )
    kv.deactivate(keep_ready=True)  # the turn ends as a float turn: its ready copy kept
    assert kv.ready is not None


def test_what_cannot_defer(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    QuantizedTurnCache.prepare(lm.model)
    kv = stored_kv(lm)
    assert FloatTurnCache.defers(kv, stored_attend.MAX_QUERIES)
    assert not FloatTurnCache.defers(kv, stored_attend.MAX_QUERIES + 1)  # a prefill chunk
    assert not FloatTurnCache.defers(stored_kv(lm, KVCodec(bits=16)), 2)  # fp16: nothing to read
    assert not FloatTurnCache.defers(AgentKV(DEFAULT_CODEC, lm.geometry), 2)  # nothing stored
    monkeypatch.setenv("KVACTOR_FUSED", "0")
    assert not FloatTurnCache.defers(kv, 2)  # the kernel switched off
    monkeypatch.delenv("KVACTOR_FUSED")
    monkeypatch.setenv("KVACTOR_STORED_FIRST", "0")
    assert not FloatTurnCache.defers(kv, 2)  # this path switched off alone
    monkeypatch.delenv("KVACTOR_STORED_FIRST")
    monkeypatch.setattr(FloatTurnCache, "stored_first_tokens", kv.stored_tokens + 1)
    assert not FloatTurnCache.defers(kv, 2)  # too short: the copy first is faster
    with pytest.raises(ValueError, match="float already"):
        kv.finish_stored()
    kv.activate()
    with pytest.raises(ValueError, match="a turn is running"):
        kv.activate_stored()


async def _warm_turns(root: Path, fused_on: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A warm turn of a few new tokens decoding 6, then a hot one; then a warm turn of one
    token in a new session: their tokens and the sessions' stats."""
    monkeypatch.setenv("KVACTOR_FUSED", "1" if fused_on else "0")
    try:
        async with kvactor.open(tiny(), attention="dequantized", cache_dir=root) as kv:
            agent = await kv.spawn_agent("a")
            warm = await agent.complete(PROMPT + "And", max_tokens=6)
            hot = await agent.complete(PROMPT + "And" + "xyz", max_tokens=4)
            first = await kv.stats()
        async with kvactor.open(tiny(), attention="dequantized", cache_dir=root) as kv:
            agent = await kv.spawn_agent("a")
            one = await agent.complete(PROMPT + "And" + "xyz" + "!", max_tokens=1)
            second = await kv.stats()
    finally:
        monkeypatch.delenv("KVACTOR_FUSED")
    return (warm, hot, one), (first, second)


async def test_warm_turns_answer_as_the_copy_path_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("on", "off"):
        async with kvactor.open(tiny(), attention="dequantized", cache_dir=tmp_path / name) as kv:
            await (await kv.spawn_agent("a")).complete(PROMPT, max_tokens=1)
    over_stored, stats = await _warm_turns(tmp_path / "on", True, monkeypatch)
    copied, copy_stats = await _warm_turns(tmp_path / "off", False, monkeypatch)
    assert [c.path for c in over_stored] == ["warm", "hot", "warm"]
    assert [c.token_ids for c in over_stored] == [c.token_ids for c in copied]
    # The warm turns' first forwards attended over the stored form; the hot turn started
    # from the ready copy the converted turn left. The copy path never did.
    assert stats[0].stored_first_turns == 1 and stats[0].ready_turns == 1
    assert stats[1].stored_first_turns == 1
    assert copy_stats[0].stored_first_turns == copy_stats[1].stored_first_turns == 0
    # A turn of one token never made a float copy of its stored tokens (the copy path
    # did); a ready copy may be built for it afterwards, between steps.
    assert over_stored[2].timings.dequantize_s < copied[2].timings.dequantize_s
