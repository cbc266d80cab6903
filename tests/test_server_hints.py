"""Hints over HTTP (tiny model, real server on 127.0.0.1): ``X-KVActor-Next`` keeps the
named agent hot where LRU order would demote it, ``X-KVActor-Done`` sends one first, the
per-agent hint route answers 202 and refuses what is malformed with 400s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hinting import FIRST, NEWCOMER, SECOND, room_for_one_idle_cache
from hinting import OPTIONS as HINT_OPTIONS
from serving import tiny as serving_tiny
from test_budget import one_turn_need
from test_server import oai, running

import kvactor
from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.models import make_tiny_model


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


OPTIONS: dict[str, Any] = {"attention": "dequantized", "ready_copies": False}


async def ask(base: str, agent: str, headers: dict[str, str] | None = None) -> None:
    client = oai(base, agent)
    await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"hello from {agent}"}],
        max_tokens=3,
        extra_headers=headers or {},
    )


async def tiers(http: httpx.AsyncClient, base: str) -> dict[str, str]:
    listed = (await http.get(f"{base}/v1/agents")).json()["data"]
    return {a["id"]: a["tier"] for a in listed}


async def sizes(tmp_path: Path) -> dict[str, int]:
    """Each agent's hot bytes after its one turn, unbounded."""
    async with running(cache_dir=tmp_path / "sizes", **OPTIONS) as (kv, base):
        for name in ("alpha", "beta", "gamma"):
            await ask(base, name)
        return {n: (await kv.cache_info(n)).nbytes for n in ("alpha", "beta", "gamma")}


async def test_the_next_header_keeps_an_agent_hot_that_lru_would_demote(tmp_path: Path) -> None:
    size = await sizes(tmp_path)
    lm = make_tiny_model(0, head_dim=64)
    reserve = turn_reserve_bytes(lm.geometry, 256)
    # While gamma's turn starts (its cache empty): room for one of alpha and beta.
    budget = reserve + max(size["alpha"], size["beta"]) + 1000
    assert budget < reserve + size["alpha"] + size["beta"] < one_turn_need(False) + budget
    kept = {}
    for n, policy in enumerate((kvactor.LRUPolicy(), kvactor.WorkflowPolicy())):
        options = {**OPTIONS, "budget_bytes": budget, "policy": policy}
        async with (
            running(cache_dir=tmp_path / f"r{n}", **options) as (kv, base),
            httpx.AsyncClient() as http,
        ):
            await ask(base, "alpha")
            await ask(base, "beta")
            await ask(base, "gamma", {"X-KVActor-Next": "alpha"})  # alpha runs after gamma
            kept[type(policy).__name__] = await tiers(http, base)
            assert (await kv.stats()).peak_bytes <= budget
    assert kept["LRUPolicy"]["alpha"] == "warm" and kept["LRUPolicy"]["beta"] == "hot"
    assert kept["WorkflowPolicy"]["alpha"] == "hot" and kept["WorkflowPolicy"]["beta"] == "warm"


@pytest.mark.parametrize(
    ("hint", "kept"),
    [
        (None, SECOND),
        ({"header": FIRST}, FIRST),  # the newcomer's request: X-KVActor-Done: beta
        ({"agent": SECOND, "body": {"done": True}}, FIRST),
        ({"agent": FIRST, "body": {"priority": 5}}, FIRST),
        ({"agent": FIRST, "body": {"expect_in_s": 1.0}}, FIRST),
    ],
    ids=["none", "done-header", "done-route", "priority-route", "expect-route"],
)
async def test_the_hint_route_and_the_done_header_change_which_agent_stays_hot(
    tmp_path: Path, hint: dict[str, Any] | None, kept: str
) -> None:
    """Room for a newcomer's turn and one idle cache (tests/hinting.py): without a hint
    the least recently used agent (alpha) goes warm; ``POST /v1/agents/{id}/hint`` (done
    for beta, a priority or an expected time for alpha) or the newcomer's
    ``X-KVActor-Done: beta`` keep alpha hot and send beta warm instead."""
    budget = await room_for_one_idle_cache(serving_tiny)
    options = {"cache_dir": tmp_path, "budget_bytes": budget, **HINT_OPTIONS}
    async with running(**options) as (kv, base), httpx.AsyncClient() as http:
        for name in (FIRST, SECOND):
            await ask(base, name)
        headers = {}
        if hint is not None and "header" in hint:
            headers = {"X-KVActor-Done": SECOND}
        elif hint is not None:
            url = f"{base}/v1/agents/{hint['agent']}/hint"
            r = await http.post(url, json=hint["body"])
            assert r.status_code == 202
        await ask(base, NEWCOMER, headers)
        got = await tiers(http, base)
        other = SECOND if kept == FIRST else FIRST
        assert (got[kept], got[other]) == ("hot", "warm"), got
        assert (await kv.stats()).peak_bytes <= budget


async def test_the_hint_route_and_headers_refuse_what_is_malformed(tmp_path: Path) -> None:
    async with running(cache_dir=tmp_path) as (_, base), httpx.AsyncClient() as http:
        await ask(base, "alpha", {"X-KVActor-Next": "beta, ghost", "X-KVActor-Done": "zed"})
        url = f"{base}/v1/agents/alpha/hint"
        for body in ({"expect_in_s": 2.5}, {"priority": 3}, {"done": True}, {}):
            r = await http.post(url, json=body)
            assert r.status_code == 202 and r.json() == {"id": "alpha", "hinted": True}
        assert (await http.post(f"{base}/v1/agents/ghost/hint", json={})).status_code == 202
        for bad in (
            {"expect_in_s": "soon"},
            {"expect_in_s": -1},
            {"priority": 1.5},
            {"priority": 10**6},
            {"done": "yes"},
            {"next": ["x"]},
        ):
            r = await http.post(url, json=bad)
            assert r.status_code == 400, bad
        assert (await http.post(f"{base}/v1/agents/bad..id/hint", json={})).status_code == 400
        r = await http.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Agent-Id": "alpha", "X-KVActor-Next": "../etc"},
        )
        assert r.status_code == 400
        await ask(base, "alpha")  # the server serves on
