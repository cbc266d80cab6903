"""``Session.end_turns`` (what a stopping server calls when its drain time is up): a
decoding turn ends at its next step with finish_reason "ended", its tokens saved to the
warm tier as any turn's and equal to the same turn run whole up to there; a turn asked
for afterwards fails with TurnEnded; with several models too. Real engine, real files,
tiny random models."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from multimodels import MODELS

import kvactor
from kvactor.actors.models import make_tiny_model

SYSTEM = "You are a careful writer."
ASK = "Write a very long story about a lighthouse."


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


async def _ended_mid_turn(session: kvactor.Session, name: str, pieces: int) -> kvactor.Completion:
    """Agent ``name``'s long turn, ended by ``end_turns`` once ``pieces`` pieces are out."""
    agent = await session.spawn_agent(name, system=SYSTEM)
    got = 0
    async with agent.stream(ASK, max_tokens=1500) as stream:
        async for _ in stream:
            got += 1
            if got == pieces:
                assert await session.end_turns() >= 1
    done = stream.completion
    assert done is not None
    return done


async def test_a_decoding_turn_ends_at_its_next_step_and_is_saved(tmp_path: Path) -> None:
    async with kvactor.open(tiny(), cache_dir=tmp_path, deterministic=True) as session:
        done = await _ended_mid_turn(session, "writer", pieces=5)
        assert done.finish_reason == kvactor.FinishReason.ENDED
        assert 5 <= len(done.token_ids) <= 8  # within a step or two (pipelined) of the call
        assert done.saved and done.save_error is None
        with pytest.raises(kvactor.TurnEnded):  # and nothing starts after it
            await session.agent("writer").generate("Go on.", max_tokens=4)
        held = (await session.cache_info("writer")).tokens
    # What was saved is what the turn made: the same tokens as the turn run whole.
    async with kvactor.open(tiny(), cache_dir=tmp_path / "whole", deterministic=True) as other:
        agent = await other.spawn_agent("writer", system=SYSTEM)
        whole = await agent.generate(ASK, max_tokens=len(done.token_ids) + 4)
    assert whole.token_ids[: len(done.token_ids)] == done.token_ids
    async with kvactor.open(tiny(), cache_dir=tmp_path) as again:
        (info,) = [w for w in await again.warm_agents() if w.agent == "writer"]
        assert info.tokens == held  # every token of the ended turn is on disk
        agent = await again.spawn_agent("writer", system=SYSTEM)
        more = await agent.generate(ASK + done.text + " And then?", max_tokens=2)
        assert more.path == kvactor.Tier.WARM
        assert more.timings.reused_tokens >= held - 1


async def test_several_models_end_every_models_turns(tmp_path: Path) -> None:
    async with kvactor.open(models=MODELS, cache_dir=tmp_path) as session:
        done = await _ended_mid_turn(session, "router-agent", pieces=3)
        assert done.finish_reason == kvactor.FinishReason.ENDED and done.saved
        coder = await session.spawn_agent("coder-agent", model="coder")
        with pytest.raises(kvactor.TurnEnded):
            await coder.generate("Hello", max_tokens=2)
