"""A turn's float working copy filled beside its first forward (``kernels.beside``): the
engine makes the arrays, a thread of their own fills them in layer order (after each
layer's streamed bytes land), and the forward waits at each layer for its own copy and
never for the rest. The copy and the answers are the copy made first's, bit for bit; a
copy that cannot be filled fails its turn alone, after the forward, and loses nothing
(real engine, tiny model, real MLX, real numba, real files)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from _stored_ranges import stored_kv

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm._prefetch import PrefetchActor
from kvactor.kernels import fused
from kvactor.kernels.beside import CopyBeside
from kvactor.kernels.float_turn import FloatTurnCache

pytestmark = pytest.mark.one_backend  # the engine's turns, not the event loop

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert fused.wait(300), fused.unavailable()


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


def _layers(work: Any) -> list[np.ndarray[Any, Any]]:
    return [np.array(a) for layer in work.layers for a in layer.state[:2]]


def test_a_copy_filled_beside_the_forward_is_the_copy_made_first() -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    new = mx.array([[11, 12, 13]])
    beside_kv, first_kv = stored_kv(lm), stored_kv(lm)
    work = beside_kv.activate(beside=True)
    assert isinstance(work, FloatTurnCache) and work.copying is not None
    logits = lm.model(new, cache=work.layers)
    copied = work.landed()
    assert copied is not None and copied.filled and copied.fill_s > 0
    assert work.copying is None and work.landed() is None  # once
    made_first = first_kv.activate()
    assert isinstance(made_first, FloatTurnCache) and made_first.copying is None
    want = lm.model(new, cache=made_first.layers)
    assert np.array_equal(np.array(logits), np.array(want))
    for got, plain in zip(_layers(work), _layers(made_first), strict=True):
        assert np.array_equal(got, plain)


class _Landing:
    """A streamed read as the copy's thread sees it: the layers it waited for, in order,
    and whether it counted them as the engine's waits."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.counted: list[bool] = []
        self.threads: set[str] = set()

    def wait_layer(self, layer: int, *, counted: bool = True) -> None:
        self.layers.append(layer)
        self.counted.append(counted)
        self.threads.add(threading.current_thread().name)

    def wait(self) -> str | None:
        return None


def test_each_layer_waits_for_its_own_copy_as_the_forward_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    kv = stored_kv(lm)
    kv.landing = landing = _Landing()
    waited: list[int] = []
    whole: list[bool] = []
    each, every = CopyBeside.wait_layer, CopyBeside.wait

    def wait_layer(self: CopyBeside, k: int) -> None:
        waited.append(k)
        each(self, k)

    def wait(self: CopyBeside) -> None:
        whole.append(True)
        every(self)

    monkeypatch.setattr(CopyBeside, "wait_layer", wait_layer)
    monkeypatch.setattr(CopyBeside, "wait", wait)
    work = kv.activate(beside=True)
    lm.model(mx.array([[11, 12, 13]]), cache=work.layers)
    # The forward waited for each layer once, in order, as it reached it, and never for
    # the whole copy; the copy's thread waited for each layer's bytes first, uncounted.
    assert waited == list(range(lm.n_layers)) and not whole
    work.landed()
    assert whole == [True]
    assert landing.layers == list(range(lm.n_layers)) and not any(landing.counted)
    assert landing.threads and not landing.threads & {threading.current_thread().name}


def test_a_copy_that_cannot_be_filled_is_told_at_the_wait() -> None:
    def fails(layer: int) -> None:
        raise OSError(f"layer {layer}: the disk went away")

    target = np.zeros((1, 2, 8), np.float32)
    copying = CopyBeside([[(target, [])]], [0], fails)
    copying.start()
    copying.wait_layer(0)  # in the forward: it runs on, told after it
    with pytest.raises(RuntimeError, match="the disk went away"):
        copying.wait()
    with pytest.raises(ValueError, match="one layer index"):
        CopyBeside([[(target, [])]], [0, 1])


@pytest.mark.parametrize("stream", [False, True])
async def test_warm_and_hot_turns_answer_alike_with_the_copy_beside_or_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setattr(PrefetchActor, "stream_min_bytes", 0)
    monkeypatch.setattr(PrefetchActor, "stream_min_file_bytes", 0)
    monkeypatch.setenv("KVACTOR_STREAM", "1" if stream else "0")
    answers: dict[str, list[Any]] = {}
    for beside in ("1", "0"):
        root = tmp_path / beside
        async with kvactor.open(tiny(), cache_dir=root) as kv:
            await (await kv.spawn_agent("a")).complete(PROMPT, max_tokens=2)
        monkeypatch.setenv("KVACTOR_BESIDE", beside)
        async with kvactor.open(tiny(), cache_dir=root, ready_copies=False) as kv:
            agent = await kv.spawn_agent("a")
            warm = await agent.complete(PROMPT + " And so", max_tokens=4)
            hot = await agent.complete(PROMPT + " And so, then", max_tokens=4)  # its stored form
        assert (warm.path, hot.path) == ("warm", "hot")
        for done in (warm, hot):
            assert (done.timings.copy_s > 0) == (beside == "1")
            assert done.timings.copy_wait_s <= done.timings.prefill_s
        assert (warm.timings.stream_s > 0) == stream
        answers[beside] = [warm.token_ids, hot.token_ids]
    assert answers["1"] == answers["0"]


async def test_a_turn_whose_copy_cannot_be_filled_fails_alone_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def turns(root: Path, fail: bool) -> list[Any]:
        async with kvactor.open(tiny(), cache_dir=root, ready_copies=False) as kv:
            agent = await kv.spawn_agent("a")
            first = await agent.complete(PROMPT, max_tokens=2)
            if fail:
                fill = fused.fill_one

                def broken(_: fused.Fill) -> None:
                    raise MemoryError("no room to fill the copy")

                monkeypatch.setattr(fused, "fill_one", broken)
                with pytest.raises(RuntimeError, match="no room to fill the copy"):
                    await agent.complete(PROMPT + " And so", max_tokens=4)
                monkeypatch.setattr(fused, "fill_one", fill)
            again = await agent.complete(PROMPT + " And so", max_tokens=4)
            assert again.path == "hot" and again.timings.copy_s > 0
            later = await kv.spawn_agent("b")  # the engine goes on for everyone
            other = await later.complete(PROMPT, max_tokens=2)
        return [first.token_ids, again.token_ids, other.token_ids]

    assert await turns(tmp_path / "failed", True) == await turns(tmp_path / "clean", False)
