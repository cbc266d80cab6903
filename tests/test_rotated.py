"""Float working caches in the codec's Hadamard basis (``kernels.rotated``): the bytes stored
and the attention are those of a working copy in the model's basis (tiny random-weight
models and the default model, real MLX)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvactor
from kvactor.actors.models import LoadedModel, load_model, make_tiny_model
from kvactor.kernels._turn_base import TurnCache
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatPrefix, FloatTurnCache
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec
from kvactor.kernels.rotated import RotatedBasis, RotatedBatchKVCache, RotatedKVCache, works_rotated

pytestmark = pytest.mark.one_backend  # the rotated basis's bits, not the event loop

TURNS = (40, 9, 300)  # the last outgrows the first ready copy's spare room


class ModelBasis(FloatTurnCache):
    """The float working copy as it was before the rotated basis: dequantized with the
    inverse rotation into plain mlx-lm caches, read by the model's own attention; the
    turn's tokens are rotated when they are quantized."""

    @classmethod
    def start(
        cls, kv: AgentKV, prefix: FloatPrefix | None = None, *, beside: bool = False
    ) -> ModelBasis:
        assert prefix is None  # used on an AgentKV directly: no hot tier, no prefix
        layers = []
        for i in range(kv.geometry.n_layers):
            cache = KVCache()
            if kv.ranges:
                keys, values = kv.dequantize(i, "key"), kv.dequantize(i, "value")
                cache.state = (keys, values, kv.stored_tokens)
            layers.append(cache)
        return cls(layers)


def tiny(**overrides: Any) -> LoadedModel:
    lm = make_tiny_model(0, head_dim=64, **overrides)
    FloatTurnCache.prepare(lm.model)
    return lm


def ids(start: int, n: int) -> list[int]:
    return [7 + (start + 13 * i) % 90 for i in range(n)]


def converse(
    lm: LoadedModel, codec: KVCodec, turn_cache: type[TurnCache], chunk: int = 64
) -> tuple[AgentKV, list[mx.array]]:
    """Turns of ``TURNS`` tokens (prefilled ``chunk`` at a time, then three single-token
    steps), each kept as a ready copy; the logits of every step."""
    kv = AgentKV(codec, lm.geometry, turn_cache=turn_cache)
    logits = []
    for n in TURNS:
        work = kv.activate()
        new = ids(len(kv.tokens), n)
        head = new[:-3]
        steps = [head[a : a + chunk] for a in range(0, len(head), chunk)] + [[t] for t in new[-3:]]
        for step in steps:
            logits.append(lm.model(mx.array([step]), cache=work.layers))
            mx.eval(logits[-1])
        kv.tokens.extend(new)
        kv.deactivate(keep_ready=True)
    return kv, logits


def stored_bytes(kv: AgentKV) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [r.to_numpy() for r in kv.ranges]  # what the warm tier writes, byte for byte


@pytest.mark.parametrize(
    "codec",
    [
        DEFAULT_CODEC,
        KVCodec(rotate=True),
        KVCodec(bits=4, key_bits=8, rotate=True, sink_tokens=4),
        KVCodec(bits=16, key_bits=4, rotate=True),  # fp16 values: not rotated, plain copy
        KVCodec(bits=4),
    ],
    ids=lambda c: c.name,
)
def test_the_turns_tokens_are_stored_as_the_model_basis_stored_them(codec: KVCodec) -> None:
    # One layer: its K/V do not depend on attention, so both ways see the very same K/V
    # and must store the very same bytes (deeper layers' K/V move with the attention's
    # fp32 rounding, which another basis changes).
    lm = tiny(num_hidden_layers=1)
    mine, _ = converse(lm, codec, FloatTurnCache)
    theirs, _ = converse(lm, codec, ModelBasis)
    assert mine.ready is not None
    rotated = works_rotated(codec)
    assert all(isinstance(layer, RotatedKVCache) == rotated for layer in mine.ready.layers)
    assert len(stored_bytes(mine)) == len(TURNS)
    for a, b in zip(stored_bytes(mine), stored_bytes(theirs), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_attention_in_the_rotated_basis_matches_the_model_basis() -> None:
    lm = tiny(num_hidden_layers=3)
    _, mine = converse(lm, DEFAULT_CODEC, FloatTurnCache, chunk=32)
    _, theirs = converse(lm, DEFAULT_CODEC, ModelBasis, chunk=32)
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_default_model_attends_alike_in_both_bases() -> None:
    lm = load_model()
    FloatTurnCache.prepare(lm.model)
    prompt = lm.tokenizer.encode("What is the capital of France? Answer in one word.")
    logits: dict[type[TurnCache], list[mx.array]] = {}
    for turn_cache in (ModelBasis, FloatTurnCache):
        kv = AgentKV(DEFAULT_CODEC, lm.geometry, turn_cache=turn_cache)
        got = []
        for turn in (prompt, prompt[-6:]):  # the second resumes from the stored cache
            work = kv.activate()
            steps = [turn, *([t] for t in ids(len(kv.tokens), 3))]
            for step in steps:
                got.append(lm.model(mx.array([step]), cache=work.layers)[0, -1])
                kv.tokens.extend(step)
            mx.eval(got)
            kv.deactivate()
        logits[turn_cache] = got
    for a, b in zip(logits[FloatTurnCache], logits[ModelBasis], strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-3)
        assert mx.argmax(a).item() == mx.argmax(b).item()


def test_batch_edits_keep_the_basis() -> None:
    lm = tiny()
    rows = []
    for n in (5, 30):  # rows of other lengths: merged with left padding
        kv = AgentKV(DEFAULT_CODEC, lm.geometry)
        lm.model(mx.array([ids(0, n)]), cache=kv.activate().layers)
        kv.tokens.extend(ids(0, n))
        kv.deactivate()
        rows.append(FloatTurnCache.start(kv))
    batch = rows[0].batch()
    batch.extend(rows[1])
    assert all(isinstance(layer, RotatedBatchKVCache) for layer in batch.layers)
    lm.model(mx.array([[3], [4]]), cache=batch.layers)  # a decode step through the basis
    back = batch.extract(1)
    assert all(isinstance(layer, RotatedKVCache) for layer in back.layers)
    layer, before = back.layers[0], rows[1].layers[0]
    assert layer.offset == 31
    np.testing.assert_array_equal(np.array(layer.keys[:, :, :30]), np.array(before.keys[:, :, :30]))
    batch.filter([1])
    assert isinstance(batch.layers[0], RotatedBatchKVCache)
    # Empty rows merge into an empty batch of the same basis (mlx-lm's would be plain).
    empty = RotatedKVCache.merge([RotatedKVCache(), RotatedKVCache()])
    assert isinstance(empty, RotatedBatchKVCache) and empty.offset.tolist() == [0, 0]
    # Rows of the two bases never mix.
    with pytest.raises(TypeError, match="basis"):
        batch.extend(ModelBasis([KVCache() for _ in range(lm.n_layers)]))
    with pytest.raises(TypeError, match="basis"):
        RotatedBatchKVCache.merge([KVCache()])
    with pytest.raises(TypeError, match="basis"):
        empty.extend(BatchKVCache([0]))


def test_a_model_without_the_basis_change_refuses_a_rotated_cache() -> None:
    lm = make_tiny_model(0, head_dim=64)  # not prepared: its attention is mlx-lm's own
    caches = [RotatedKVCache() for _ in range(lm.n_layers)]
    lm.model(mx.array([ids(0, 5)]), cache=caches)
    with pytest.raises(RuntimeError, match="prepare the model"):
        lm.model(mx.array([[3]]), cache=caches)
    assert isinstance(caches[0], RotatedBasis)


async def test_greedy_answers_agree_ready_stored_reloaded_and_batched(tmp_path: Path) -> None:
    model = functools.partial(make_tiny_model, 0, head_dim=64)
    prompts = ["hello there", "the quick brown fox jumps", "z"]
    follow = "and then?"

    async def sequential(**options: Any) -> tuple[list[list[int]], kvactor.EngineStats]:
        async with kvactor.open(model, attention="dequantized", **options) as kv:
            agents = [await kv.spawn_agent(f"a{i}") for i in range(len(prompts))]
            texts = [*prompts, *[follow] * len(prompts)]
            out = [
                (await agents[i % len(agents)].generate(t, max_tokens=8)).token_ids
                for i, t in enumerate(texts)
            ]
            return out, await kv.stats()

    ready, stats = await sequential()
    assert stats.ready_turns == len(prompts)
    stored, stats = await sequential(ready_copies=False)
    assert stats.ready_turns == 0 and stored == ready

    reloaded = []  # every turn in a new session, from the warm tier
    for turn in range(2):
        for i, prompt in enumerate(prompts):
            async with kvactor.open(model, attention="dequantized", cache_dir=tmp_path) as kv:
                agent = await kv.spawn_agent(f"a{i}")
                text = prompt if turn == 0 else follow
                reloaded.append((await agent.generate(text, max_tokens=8)).token_ids)
    assert reloaded == ready

    batched: list[list[int]] = [[] for _ in range(2 * len(prompts))]
    async with kvactor.open(model, attention="dequantized") as kv:
        agents = [await kv.spawn_agent(f"a{i}") for i in range(len(prompts))]

        async def run(i: int) -> None:
            batched[i] = (await agents[i].generate(prompts[i], max_tokens=8)).token_ids
            batched[len(prompts) + i] = (await agents[i].generate(follow, max_tokens=8)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
        assert (await kv.stats()).max_batch_seen >= 2
    assert batched == ready
