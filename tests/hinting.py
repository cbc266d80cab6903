"""A hot budget where a hint decides the outcome, for the tests of hints (Python API,
hosts, HTTP): room for a newcomer's turn and one idle cache, not two. Two agents run a
turn each, then a third: one of the two idle caches must go, and without a hint it is
the least recently used (the first). A hint that keeps the first hot, or sends the
second first, changes which one; the tests run the same turns with and without it."""

from __future__ import annotations

import functools
from typing import Any

import kvactor
from kvactor.actors.engine import turn_reserve_bytes

#: Options of every session here: one stored form per cache (no ready float copies, which
#: would be dropped for room before any cache is demoted).
OPTIONS: dict[str, Any] = {"attention": "dequantized", "ready_copies": False}
MAX_TOKENS = 3
FIRST, SECOND, NEWCOMER = "alpha", "beta", "gamma"


def ask(agent: str) -> str:
    return f"hello from {agent}"


_measured: dict[Any, int] = {}


def _key(model: Any) -> Any:
    if isinstance(model, functools.partial):
        return model.func, model.args, tuple(sorted(model.keywords.items()))
    return model


async def room_for_one_idle_cache(model: Any) -> int:
    """The budget: the newcomer's turn and the larger idle cache fit, not both idle ones
    (measured once per model without a budget: each cache's bytes after its turn, the
    newcomer's prompt)."""
    key = _key(model)
    if key not in _measured:
        _measured[key] = await _measure(model)
    return _measured[key]


async def _measure(model: Any) -> int:
    async with kvactor.open(model, **OPTIONS) as kv:
        sizes = []
        for name in (FIRST, SECOND):
            await (await kv.spawn_agent(name)).generate(ask(name), max_tokens=MAX_TOKENS)
            sizes.append((await kv.cache_info(name)).nbytes)
        newcomer = await kv.spawn_agent(NEWCOMER)
        done = await newcomer.generate(ask(NEWCOMER), max_tokens=MAX_TOKENS)
    geometry = model().geometry
    reserve = turn_reserve_bytes(geometry, done.timings.prompt_tokens + MAX_TOKENS)
    budget = reserve + max(sizes) + 1000
    assert budget < reserve + sum(sizes)
    return budget
