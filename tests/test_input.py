"""Bad input gets a clear error, before any state changes, and breaks nothing for the next
call (issue 10: faults 6, 10, 11). Real engine and agent actors on a tiny model."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest

import kvactor
from kvactor.actors.model import make_tiny_model
from kvactor.actors.store import format_table


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


@pytest.mark.parametrize("seed", [-1, 1 << 64, 1 << 70])
async def test_an_out_of_range_seed_is_refused_and_the_agent_stays_usable(seed: int) -> None:
    async with kvactor.open(tiny()) as kv:
        agent = await kv.spawn_agent("a")
        with pytest.raises(ValueError, match="seed"):
            await agent.generate("hello", max_tokens=3, temperature=0.7, seed=seed)
        done = await agent.generate("hello", max_tokens=3, temperature=0.7, seed=(1 << 64) - 1)
        assert len(done.token_ids) == 3


async def test_loose_input_gets_short_type_and_value_errors() -> None:
    async with kvactor.open(tiny()) as kv:
        agent = await kv.spawn_agent("a")
        with pytest.raises(TypeError, match="prompt must be a str"):
            await agent.generate(123)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="prompt must be a str"):
            await agent.complete(b"raw")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="stop must be a str or a list of str"):
            await agent.generate("hi", stop=None)
        with pytest.raises(TypeError, match="stop must be"):
            await agent.generate("hi", stop=["ok", 3])
        with pytest.raises(TypeError, match="system must be a str"):
            await kv.spawn_agent("b", system=123)  # type: ignore[arg-type]
        assert "b" not in kv.agents
        with pytest.raises(kvactor.InvalidAgentId) as caught:
            await kv.spawn_agent("x" * 10_000)
        assert len(str(caught.value)) < 200 and "10000 characters" in str(caught.value)
        done = await agent.generate("still fine", max_tokens=2)
        assert len(done.token_ids) == 2
    await kv.aclose()  # a second close does nothing
    await kv.aclose()


def test_inspect_escapes_names_from_disk() -> None:
    row = {
        "agent": "evil\x1b[2J\nforged  warm  999",
        "tier": kvactor.Tier.WARM,
        "tokens": 1,
        "bytes": 10,
        "model": "m\x07",
        "codec": "c",
        "updated": time.time(),
        "status": "rejected",
        "reason": "bad\rname",
    }
    table = format_table([row])
    assert "\x1b" not in table and "\x07" not in table and "\r" not in table
    assert len(table.splitlines()) == 2  # the header and one row: nothing forged
    assert "evil\\x1b[2J\\nforged" in table
