"""``Session.end_turns`` (what a stopping server calls when its drain time is up): a
decoding turn ends at its next step with finish_reason "ended", its tokens saved to the
warm tier as any turn's and equal to the same turn run whole up to there; a turn asked
for afterwards fails with TurnEnded; with several models too. Real engine, real files,
tiny random models."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import pytest
from multimodels import MODELS

import kvactor
from kvactor.actors.models import make_tiny_model

SYSTEM = "You are a careful writer."
ASK = "Write a very long story about a lighthouse."


def tiny(**overrides: Any) -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64, **overrides)


#: A turn of ENDLESS tokens on a context this long runs for minutes: ended, not finished.
ENDLESS = 100_000
LONG_CONTEXT = 1 << 17


async def _ended_mid_turn(
    session: kvactor.Session, name: str, pieces: int
) -> tuple[kvactor.Completion, int]:
    """Agent ``name``'s endless turn, ended by ``end_turns`` once ``pieces`` pieces are
    out; and the session's generated tokens just after the engine took the end (a stats
    query answered after it: the mailbox keeps their order)."""
    agent = await session.spawn_agent(name, system=SYSTEM)
    got, upto = 0, 0
    # Ended, it returns at once; not ended, it would run for minutes.
    with anyio.fail_after(60):
        async with agent.stream(ASK, max_tokens=ENDLESS) as stream:
            async for _ in stream:
                got += 1
                if got == pieces:
                    assert await session.end_turns() >= 1
                    upto = (await session.stats()).generated_tokens
    done = stream.completion
    assert done is not None
    return done, upto


async def test_a_decoding_turn_ends_at_its_next_step_and_is_saved(tmp_path: Path) -> None:
    model = tiny(max_position_embeddings=LONG_CONTEXT)
    async with kvactor.open(model, cache_dir=tmp_path, deterministic=True) as session:
        done, upto = await _ended_mid_turn(session, "writer", pieces=5)
        assert done.finish_reason == kvactor.FinishReason.ENDED
        # At its next step (two, pipelined) after the engine took the end: however far the
        # engine ran ahead of the pieces read here.
        assert 5 <= len(done.token_ids) <= upto + 2
        assert done.saved and done.save_error is None
        with pytest.raises(kvactor.TurnEnded):  # and nothing starts after it
            await session.agent("writer").generate("Go on.", max_tokens=4)
        held = (await session.cache_info("writer")).tokens
    # What was saved is what the turn made: the same tokens as the turn run whole.
    whole_dir = tmp_path / "whole"
    async with kvactor.open(model, cache_dir=whole_dir, deterministic=True) as other:
        agent = await other.spawn_agent("writer", system=SYSTEM)
        whole = await agent.generate(ASK, max_tokens=len(done.token_ids) + 4)
    assert whole.token_ids[: len(done.token_ids)] == done.token_ids
    async with kvactor.open(model, cache_dir=tmp_path) as again:
        (info,) = [w for w in await again.warm_agents() if w.agent == "writer"]
        assert info.tokens == held  # every token of the ended turn is on disk
        agent = await again.spawn_agent("writer", system=SYSTEM)
        more = await agent.generate(ASK + done.text + " And then?", max_tokens=2)
        assert more.path == kvactor.Tier.WARM
        assert more.timings.reused_tokens >= held - 1


async def test_several_models_end_every_models_turns(tmp_path: Path) -> None:
    async with kvactor.open(models=MODELS, cache_dir=tmp_path) as session:
        done, upto = await _ended_mid_turn(session, "router-agent", pieces=3)
        assert done.finish_reason == kvactor.FinishReason.ENDED and done.saved
        assert 3 <= len(done.token_ids) <= upto + 2
        coder = await session.spawn_agent("coder-agent", model="coder")
        with pytest.raises(kvactor.TurnEnded):
            await coder.generate("Hello", max_tokens=2)


async def test_turns_queued_or_prefilling_fail_with_turn_ended_and_are_not_saved(
    tmp_path: Path,
) -> None:
    """docs/embedding.md: at ``end_turns`` a decoding turn ends (saved), a turn still
    queued (here: the same agent's next turn, behind its decoding one) or prefilling (a
    long prompt in chunks of 8 tokens) raises TurnEnded, and neither is saved."""
    model = tiny(max_position_embeddings=LONG_CONTEXT)
    results: dict[str, kvactor.Completion | BaseException] = {}
    with anyio.fail_after(120):
        async with kvactor.open(model, cache_dir=tmp_path, prefill_chunk=8) as session:
            talker = await session.spawn_agent("talker", system=SYSTEM)
            reader = await session.spawn_agent("reader", system=SYSTEM)

            async def run(key: str, agent: Any, text: str, max_tokens: int) -> None:
                try:
                    results[key] = await agent.generate(text, max_tokens=max_tokens)
                except kvactor.TurnEnded as exc:
                    results[key] = exc

            async def stats_say(**counts: int) -> None:
                while True:  # a poll: nothing signals these counts
                    stats = await session.stats()
                    if all(getattr(stats, k) == v for k, v in counts.items()):
                        return
                    await anyio.sleep(0.01)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "decoding", talker, ASK, ENDLESS)
                await stats_say(decoding=1)
                tg.start_soon(run, "queued", talker, "And then?", 4)
                # ~15,000 tokens in chunks of 8: its prefill lasts far longer than the test.
                tg.start_soon(run, "prefilling", reader, "word " * 3000, 2)
                await stats_say(decoding=1, prefilling=1)
                assert await session.end_turns() == 2  # the decoding and prefilling turns
            ended = results["decoding"]
            assert isinstance(ended, kvactor.Completion)
            assert ended.finish_reason == kvactor.FinishReason.ENDED and ended.saved
            assert isinstance(results["queued"], kvactor.TurnEnded)
            assert isinstance(results["prefilling"], kvactor.TurnEnded)
            held = (await session.cache_info("talker")).tokens
    async with kvactor.open(model, cache_dir=tmp_path) as again:
        warm = {w.agent: w.tokens for w in await again.warm_agents()}
    assert warm == {"talker": held}  # the ended turn's tokens, nothing of the others
