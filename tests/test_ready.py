"""Ready copies: a hot agent keeps its float working copy between turns (dequantized
attention), holding exactly what dequantizing its stored cache gives, so answers never
change; the budget drops ready copies before it demotes anything (real engine, tiny model,
real MLX arrays)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, cast

import anyio
import mlx.core as mx
import numpy as np
import pytest
from multimodels import hot_pool

import kvactor
from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.enums import Tier
from kvactor.actors.hot._policy import Rates
from kvactor.actors.hot._ready import ReadyCopies
from kvactor.actors.hot._shared_ready import SharedPrefixes
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm._prefetch import Stage
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatPrefix, FloatTurnCache
from kvactor.kernels.qcodec import DEFAULT_CODEC, KVCodec
from kvactor.kernels.rotated import RotatedKVCache

pytestmark = pytest.mark.one_backend  # ready copies, not the event loop

TURNS = ["hello there", "tell me more", "tell me more", "and something else entirely"]


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


def test_a_ready_copy_holds_exactly_the_dequantized_stored_cache() -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    for n in (40, 9, 300):  # the last turn outgrows the first copy's spare room
        work = kv.activate()
        ids = [7 + (len(kv.tokens) + i) % 50 for i in range(n)]
        lm.model(mx.array([ids]), cache=work.layers)
        kv.tokens.extend(ids)
        kv.deactivate(keep_ready=True)
        assert kv.ready is not None and kv.work is None
        fresh = FloatTurnCache.start(kv)  # what a reloaded agent would start from
        # Both in the codec's Hadamard basis (kernels.rotated), as the turns ran.
        assert all(isinstance(layer, RotatedKVCache) for layer in (*kv.ready.layers, *fresh.layers))
        for mine, theirs in zip(kv.ready.layers, fresh.layers, strict=True):
            assert mine.offset == theirs.offset == len(kv.tokens)
            for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):
                np.testing.assert_array_equal(
                    np.array(a[:, :, : mine.offset]), np.array(b[:, :, : theirs.offset])
                )
    kv.trim(20)  # a prompt that diverged: the ready copy is cut with the stored ranges
    assert kv.ready is not None and kv.ready.layers[0].offset == 20
    assert kv.drop_ready() > 0 and kv.ready is None and kv.stored_tokens == 20


def test_a_turn_finishes_a_half_built_ready_copy_instead_of_starting_again() -> None:
    lm = make_tiny_model(0, head_dim=64, num_hidden_layers=4)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    work = kv.activate()
    ids = [7 + i % 50 for i in range(60)]
    lm.model(mx.array([ids]), cache=work.layers)
    kv.tokens.extend(ids)
    kv.deactivate()  # stored only, as a cache staged from disk is
    copies = ReadyCopies(FloatTurnCache, enabled=True)
    assert (nbytes := copies.want("a", kv, None)) > 0
    # Asked again while it is being built (each hint asks for the soonest agents' copies):
    # one build, its bytes reserved once (twice, a prefetch found no room that was free).
    assert copies.want("a", kv, None) == 0 and copies.reserved == nbytes
    assert copies.step(lambda agent, cache: True)  # a layer per worker stream, of four
    assert kv.ready is None and copies.building
    assert copies.finish(kv)  # the turn came: the layers left, not all four again
    assert kv.ready is not None and not copies.building
    assert copies.dequantized == len(kv.tokens)  # one copy's worth, each layer once
    fresh = FloatTurnCache.start(kv)
    for mine, theirs in zip(kv.ready.layers, fresh.layers, strict=True):
        for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):
            np.testing.assert_array_equal(
                np.array(a[:, :, : mine.offset]), np.array(b[:, :, : theirs.offset])
            )
    # A cache cut since its build began (a prompt that diverged) is not finished from
    # what was built of the longer one: its build is given up.
    kv.drop_ready()
    assert copies.want("a", kv, None) > 0 and copies.step(lambda agent, cache: True)
    kv.trim(20)
    assert not copies.finish(kv) and kv.ready is None and not copies.building
    assert copies.want("a", kv, None) > 0
    kv.trim(10)
    assert not copies.step(lambda agent, cache: True) and not copies.building


def _address(a: mx.array) -> int:
    """Where an array's buffer lies (an in-place write keeps it, a copy does not)."""
    return int(np.asarray(memoryview(cast(Any, a))).__array_interface__["data"][0])


def test_a_lone_turn_keeps_its_buffers_from_its_start_to_its_ready_copy() -> None:
    # A turn from a ready copy, its prompt prefilled alone, then decoded in a batch of one
    # and leaving it, as the engine runs it: the K/V buffers are the same from the start
    # to the next ready copy (no merge, grow, extract or settle copy), and hold exactly
    # what dequantizing the stored cache gives.
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    for n in (40, 5):
        work = kv.activate()
        start = [
            (_address(layer.keys), _address(layer.values))
            for layer in work.layers
            if layer.keys is not None  # the first turn starts with no buffers
        ]
        ids = [7 + (len(kv.tokens) + i) % 50 for i in range(n)]
        logits = lm.model(mx.array([ids]), cache=work.layers)
        kv.tokens.extend(ids)
        batch, kv.work = work.batch(), None  # the engine's hand-over to the decode batch
        del work
        for _ in range(4):
            token = cast(int, mx.argmax(logits[0, -1]).item())
            logits = lm.model(mx.array([[token]]), cache=batch.layers)
            kv.tokens.append(token)
            mx.eval(logits)
        kv.work = batch.extract(0)
        del batch
        kv.deactivate(keep_ready=True)
        assert kv.ready is not None
        kept = [(_address(layer.keys), _address(layer.values)) for layer in kv.ready.layers]
        if start:
            assert kept == start
        fresh = FloatTurnCache.start(kv)
        for mine, theirs in zip(kv.ready.layers, fresh.layers, strict=True):
            assert mine.offset == theirs.offset == len(kv.tokens)
            for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):
                np.testing.assert_array_equal(
                    np.array(a[:, :, : mine.offset]), np.array(b[:, :, : theirs.offset])
                )


async def conversation(**options: Any) -> tuple[list[list[int]], kvactor.EngineStats]:
    async with kvactor.open(tiny(), attention="dequantized", **options) as kv:
        agent = await kv.spawn_agent("a", system="You are terse.")
        out = []
        for i, text in enumerate(TURNS):
            if i == 3:  # a raw prompt that diverges from the cached text
                out.append((await agent.complete("something else", max_tokens=6)).token_ids)
            out.append((await agent.generate(text, max_tokens=6)).token_ids)
        return out, await kv.stats()


async def test_ready_copies_change_no_answer_and_skip_the_dequantize(tmp_path: Path) -> None:
    ready, with_ready = await conversation()
    plain, without = await conversation(ready_copies=False)
    assert ready == plain
    assert with_ready.ready_turns == len(ready) - 1 and with_ready.ready_agents == 1
    assert with_ready.ready_bytes > 0
    assert without.ready_turns == 0 and without.ready_agents == 0
    # Every turn but the first made its stored tokens float again; with copies, none did.
    assert without.dequantized_tokens > 0 and with_ready.dequantized_tokens == 0
    # A reload from disk between every turn gives the same answers too.
    reloaded = []
    for i, text in enumerate(TURNS):
        async with kvactor.open(tiny(), attention="dequantized", cache_dir=tmp_path) as kv:
            agent = await kv.spawn_agent("a", system="You are terse.")
            if i == 3:
                reloaded.append((await agent.complete("something else", max_tokens=6)).token_ids)
            reloaded.append((await agent.generate(text, max_tokens=6)).token_ids)
    assert reloaded == ready


@pytest.mark.parametrize("ready_copies", [True, False])
async def test_the_dequantize_rate_learns_only_from_a_dequantize(ready_copies: bool) -> None:
    """The policies' reload estimates: a turn from a ready copy dequantized nothing, so it
    tells the rate nothing (it once fed the whole cache's bytes over its few microseconds,
    making every warm reload look free); a turn that dequantized moves it."""
    seeded = Rates().dequantize_bytes_s
    async with kvactor.open(tiny(), attention="dequantized", ready_copies=ready_copies) as kv:
        agent = await kv.spawn_agent("a", system="You are terse.")
        for text in TURNS:
            await agent.generate(text, max_tokens=6)
        rates = hot_pool(kv).rates
        stats = await kv.stats()
    if ready_copies:
        assert stats.ready_turns == len(TURNS) - 1 and stats.dequantized_tokens == 0
        assert rates.dequantize_bytes_s == seeded
    else:
        assert stats.dequantized_tokens > 0 and rates.dequantize_bytes_s != seeded
    assert 0 < rates.prefill_tokens_s < math.inf


@pytest.mark.parametrize("agents", [6])
async def test_the_budget_drops_ready_copies_before_demoting_anyone(
    tmp_path: Path, agents: int
) -> None:
    async def run(budget: int | None) -> tuple[list[list[int]], kvactor.EngineStats]:
        async with kvactor.open(
            tiny(), attention="dequantized", budget_bytes=budget, cache_dir=tmp_path / str(budget)
        ) as kv:
            out = []
            names = [await kv.spawn_agent(f"a{i}") for i in range(agents)]
            for phase in ("first words", "second words"):
                for agent in names:  # one at a time: no turn waits on another
                    out.append((await agent.generate(phase, max_tokens=5)).token_ids)
                names.reverse()  # the agents that ran last come back first
            return out, await kv.stats()

    unbounded, stats = await run(None)
    assert stats.ready_agents == agents and stats.dropped_ready == 0
    stored = stats.cache_bytes - stats.ready_bytes
    # Room for every stored cache, one turn's working copy and one ready copy, not more.
    reserve = turn_reserve_bytes(make_tiny_model(0, head_dim=64).geometry, 128)
    budget = stored + reserve + stats.ready_bytes // agents
    bounded, tight = await run(budget)
    assert bounded == unbounded
    assert tight.peak_bytes <= budget
    assert tight.dropped_ready > 0 and tight.demoted_warm == tight.demoted_cold == 0
    assert tight.ready_turns > 0  # the most recent agents kept theirs, and used them


async def test_a_prefetch_hint_builds_the_ready_copy_before_the_turn(tmp_path: Path) -> None:
    async with kvactor.open(tiny(), attention="dequantized", cache_dir=tmp_path) as kv:
        await (await kv.spawn_agent("p")).generate("remember this", max_tokens=6)
    answers, made_float = [], []
    for prefetch in (True, False):
        async with kvactor.open(tiny(), attention="dequantized", cache_dir=tmp_path) as kv:
            agent = await kv.spawn_agent("p")
            if prefetch:
                await kv.prefetch("p")
                with anyio.fail_after(10):  # a poll: nothing signals a ready copy built ahead
                    while (await kv.stats()).ready_agents == 0:
                        await anyio.sleep(0.005)
            done = await agent.generate("what was it?", max_tokens=6)
            stats = await kv.stats()
            assert done.path == (Tier.HOT if prefetch else Tier.WARM)
            assert stats.ready_turns == (1 if prefetch else 0)
            made_float.append(stats.dequantized_tokens)
            answers.append(done.token_ids)
        # Restore the warm cache as it was for the next session: forget this turn.
        await save_first_turn(tmp_path)
    assert answers[0] == answers[1]
    # The same stored tokens made float once: ahead of the turn, or at its start.
    assert made_float[0] == made_float[1] > 0


async def save_first_turn(root: Path) -> None:
    async with kvactor.open(tiny(), attention="dequantized", cache_dir=root) as kv:
        await kv.forget("p")
        await (await kv.spawn_agent("p")).generate("remember this", max_tokens=6)


async def test_a_ready_copy_is_built_ahead_only_with_free_room(tmp_path: Path) -> None:
    async with kvactor.open(tiny(), attention="dequantized", cache_dir=tmp_path) as kv:
        await (await kv.spawn_agent("p")).generate("remember this", max_tokens=6)
        stored = (await kv.stats()).cache_bytes - (await kv.stats()).ready_bytes
    # Room for the stored cache (and its file header), not for a ready copy: the hint
    # stages it but builds no copy and demotes nobody.
    async with kvactor.open(
        tiny(), attention="dequantized", cache_dir=tmp_path, budget_bytes=stored + 65536
    ) as kv:
        await kv.prefetch("p")
        assert kv.prefetcher is not None
        # Handled after the hint (one message at a time, in order): the stage is installed.
        await kv.prefetcher.ask(Stage("nobody"), timeout=None)
        stats = await kv.stats()
        assert stats.installs == 1
        # Room for a copy is reserved when the stage is installed, or never: nothing but
        # the stored cache is in use now, and no copy can be on its way.
        assert stats.cache_bytes == stored
        assert stats.ready_agents == 0 and stats.demoted_warm == 0
        assert stats.peak_bytes <= stored + 65536


@pytest.mark.parametrize(
    "codec",
    [DEFAULT_CODEC, KVCodec(bits=4), KVCodec(bits=16, key_bits=4, rotate=True)],
    ids=lambda c: c.name,
)
def test_a_shared_prefix_copy_gives_the_very_working_copy_of_a_whole_dequantize(
    codec: KVCodec,
) -> None:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(codec, lm.geometry)
    for n in (70, 30, 12):  # three stored ranges: a prefix of one, then of two
        work = kv.activate()
        ids = [7 + (len(kv.tokens) + i) % 50 for i in range(n)]
        lm.model(mx.array([ids]), cache=work.layers)
        kv.tokens.extend(ids)
        kv.deactivate()
    whole = FloatTurnCache.start(kv)
    for count in (1, 2, 3):
        prefix = FloatPrefix(kv, count)
        assert prefix.tokens == kv.ranges[count - 1].stop
        assert prefix.nbytes == FloatPrefix.nbytes_for(lm.geometry, prefix.tokens)
        joined = FloatTurnCache.start(kv, prefix)
        for mine, theirs in zip(joined.layers, whole.layers, strict=True):
            assert mine.offset == theirs.offset == len(kv.tokens)
            for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):
                assert a.shape == b.shape  # the same room for the turn's tokens
                np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError):
        FloatPrefix(kv, 4)


BRIEF = "You are one of a team. " + "Shared rules: keep answers short and exact. " * 12


async def team_turns(shared: bool) -> tuple[list[list[int]], kvactor.EngineStats, int]:
    """Three agents of one shared context taking turns in a budget that keeps no agent's
    ready copy to its next turn: each turn makes its working copy from the stored form."""
    SharedPrefixes.active = shared
    try:
        async with kvactor.open(tiny(), attention="dequantized", budget_bytes=5_500_000) as kv:
            await kv.context("brief", BRIEF)
            team = [await kv.spawn_agent(f"a{i}", context="brief") for i in range(3)]
            out = []
            for r in range(3):
                for agent in team:
                    done = await agent.generate(f"round {r}: go on", max_tokens=4)
                    out.append(done.token_ids)
            stats = await kv.stats()
            for name in ("a0", "a1", "a2", "brief"):  # the last users leave
                await kv.forget(name)
            return out, stats, (await kv.stats()).ready_bytes
    finally:
        SharedPrefixes.active = True


async def test_agents_sharing_a_context_share_its_float_copy() -> None:
    shared, with_copy, left = await team_turns(True)
    plain, without, _ = await team_turns(False)
    assert shared == plain
    # The context's tokens are made float once, not at every turn of every agent.
    assert with_copy.dequantized_tokens <= 0.5 * without.dequantized_tokens
    assert with_copy.peak_bytes <= 5_500_000
    assert left == 0  # the copy went with the last agent sharing it
