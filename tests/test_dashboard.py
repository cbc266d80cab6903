"""The dashboard's JSON (issue 41): ``GET /v1/status`` follows agents through the tiers
as the engine moves them, scopes what it shows by key, stays bounded, and never holds a
prompt's or an answer's text; ``/dashboard`` and its files come from the package; the
start line and ``/health`` name every model. Real HTTP on 127.0.0.1, a tiny random model
under a hot budget small enough that caches are demoted and reloaded. The page itself,
in a real browser: test_dashboard_browser.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from multimodels import MODELS
from serving import running

import kvactor
from kvactor.actors.records import TierMove, TierMoves
from kvactor.server._activity import Activity
from kvactor.server._serve import start_line

AGENTS = [f"agent-{i}" for i in range(8)]
BUDGET = 1_300_000  # the tiny model: one turn's working cache and a couple of caches
MARK = "zebra-quartz"  # in every prompt: never in the status JSON
ALICE, BOB, ROOT = "alice:key-of-alice-1", "bob:key-of-bob-22", "key-of-the-admin"
KEYS = {"api_keys": [ALICE, BOB], "admin_keys": [ROOT]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


def auth(entry: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {entry.partition(':')[2] or entry}"}


async def turn(
    http: httpx.AsyncClient, base: str, agent: str, step: int, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """One turn of ``agent`` (a conversation that grows with ``step``): its reply."""
    messages = []
    for i in range(step + 1):
        messages.append({"role": "user", "content": f"{MARK} {agent} says {i}. " * 2})
        if i < step:
            messages.append({"role": "assistant", "content": f"noted {i}"})
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    r = await http.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={"X-Agent-Id": agent, **(headers or {})},
    )
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


async def status(http: httpx.AsyncClient, base: str, **params: Any) -> dict[str, Any]:
    r = await http.get(f"{base}/v1/status", params=params, headers=params.pop("headers", {}))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def sampled_after(http: httpx.AsyncClient, base: str, t: float) -> dict[str, Any]:
    """The first status whose sample was taken after ``t`` (a sample is shared for a
    quarter second: it polls for the next)."""
    with anyio.fail_after(30):
        while (s := await status(http, base))["sampled_at"] < t:
            await anyio.sleep(0.05)
    return s


async def moves_match(
    kv: kvactor.Session, http: httpx.AsyncClient, base: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """Every demotion and reload event ``headers``' key sees once they number what the
    engine counted (a sample is taken at most every quarter second: it polls for that)."""
    events: list[dict[str, Any]] = []
    since = 0
    with anyio.fail_after(30):
        while True:
            s = await status(http, base, since=since, headers=headers)
            events += [e for e in s["events"] if e["kind"] in ("demoted", "reloaded")]
            since = s["events_next"]
            c = await kv.stats()
            demoted = [e for e in events if e["kind"] == "demoted"]
            if (
                len(demoted) >= c.demoted_warm + c.demoted_cold
                and len(events) - len(demoted) >= c.installs
            ):
                return events
            await anyio.sleep(0.05)  # the next sample: a quarter second after the last


async def test_status_follows_agents_through_the_tiers(tmp_path: Path) -> None:
    async with (
        running(budget_bytes=BUDGET, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(timeout=60) as http,
    ):
        seen: dict[str, set[str]] = {a: set() for a in AGENTS}
        replies = []
        for step in range(2):  # within 256 tokens: a turn reserves 1 MiB of working cache
            for agent in AGENTS:
                replies.append((await turn(http, base, agent, step))["choices"][0])
                for row in (await sampled_after(http, base, time.time()))["agents"]:
                    seen[row["id"]].add(row["tier"])
        s = await status(http, base)
        # The table followed the agents in and out of the hot tier.
        assert not any("cold" in tiers for tiers in seen.values()), seen  # all saved
        assert sum({"hot", "warm"} <= tiers for tiers in seen.values()) >= 2, seen
        listed = (await http.get(f"{base}/v1/agents")).json()["data"]
        assert {r["id"] for r in s["agents"]} == {r["id"] for r in listed}
        kinds = {(e["kind"], e.get("path") or e.get("to")) for e in s["events"]}
        assert ("demoted", "warm") in kinds and ("turn", "warm") in kinds, kinds
        c = s["counters"]
        assert c["turns"] == 2 * len(AGENTS) and c["demoted_warm"] > 0 and c["reloads"] > 0
        row = next(r for r in s["agents"] if r["id"] == AGENTS[-1])
        assert row["last_path"] in ("hot", "warm") and row["last_ttft_s"] > 0
        assert row["model"] == s["models"][0]["name"] and row["tokens"] > 0
        # A bar per limit: the parts and the free bytes make the limit.
        assert [m["kind"] for m in s["memory"]] == ["memory limit", "hot budget"]
        for m in s["memory"]:
            assert sum(p["bytes"] for p in m["parts"]) + m["free_bytes"] == m["limit_bytes"]
        assert s["memory"][1]["limit_bytes"] == BUDGET
        assert s["totals"]["agents"] == len(AGENTS)
        disk = s["disk"]  # the default disk limit of a cache directory
        assert disk["used_bytes"] + disk["free_bytes"] == disk["limit_bytes"]
        assert disk["used_bytes"] >= s["totals"]["warm_bytes"] > 0
        assert disk["written_today_bytes"] >= disk["used_bytes"]
        # One question to the engine answers what four do, at one moment.
        board = await kv.board()
        (name,) = kv.models
        assert board.hot == {name: await kv.hot_caches()} and board.hot[name]
        logged = await kv.tier_moves()
        assert board.moves == logged and logged[name].moves
        states = await kv.model_states()
        assert [(m.name, m.loaded) for m in board.states] == [(m.name, m.loaded) for m in states]
        stats = await kv.stats()
        for key in ("agents_cached", "cache_bytes", "demoted_warm", "warm_bytes"):
            assert getattr(board.stats, key) == getattr(stats, key), key
        later = await kv.board({name: logged[name].last})
        assert later.moves[name].moves == [] and later.moves[name].last == logged[name].last
        # No prompt's text, no answer's.
        text = json.dumps(s)
        assert MARK not in text
        for choice in replies:
            answer = choice["message"]["content"]
            assert len(answer) < 6 or answer not in text
        # Bounded and filtered by the query; only what came after ``since``.
        few = await status(http, base, limit=2)
        assert len(few["agents"]) == 2 and few["agents_total"] == len(AGENTS)
        assert [r["id"] for r in (await status(http, base, q="agent-3"))["agents"]] == ["agent-3"]
        assert (await status(http, base, since=s["events_next"]))["events"] == []
        for bad in ({"limit": "-1"}, {"limit": "9999"}, {"since": "x"}):
            r = await http.get(f"{base}/v1/status", params=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] in bad
        # Every move the hot tier made is an event, exactly: none lost between samples.
        moves = await moves_match(kv, http, base, {})
        c = await kv.stats()
        demoted = [e for e in moves if e["kind"] == "demoted"]
        assert len(demoted) == c.demoted_warm + c.demoted_cold > len(AGENTS)
        assert sum(e["to"] == "warm" for e in demoted) == c.demoted_warm
        reloads = [e for e in moves if e["kind"] == "reloaded"]
        assert len(reloads) == c.installs > 0 and {e["source"] for e in reloads} <= {
            "turn",
            "prefetch",
        }
        assert all(e["bytes"] > 0 and e["agent"] in AGENTS for e in moves)
        assert [e["seq"] for e in moves] == sorted({e["seq"] for e in moves})


async def test_agents_the_warm_tier_makes_cold_are_events_too(tmp_path: Path) -> None:
    async with (
        running(cache_dir=tmp_path / "probe", disk_limit=1 << 30) as (kv, base),
        httpx.AsyncClient(timeout=60) as http,
    ):
        await turn(http, base, "probe", 0)
        one = (await kv.stats()).warm_bytes
    limit = int(one * 2.9)  # two agents and the headroom (as in test_warm_limits)
    async with (
        running(cache_dir=tmp_path / "cache", disk_limit=limit) as (kv, base),
        httpx.AsyncClient(timeout=60) as http,
    ):
        for agent in AGENTS[:5]:
            await turn(http, base, agent, 0)
        cold: list[dict[str, Any]] = []
        since = 0
        with anyio.fail_after(30):
            while True:
                s = await status(http, base, since=since)
                since = s["events_next"]
                cold += [e for e in s["events"] if e["kind"] == "demoted" and e["from"] == "warm"]
                made = (await kv.stats()).demoted_warm_to_cold
                if made >= 3 and len(cold) >= made:
                    break
                await anyio.sleep(0.05)  # the next sample: a quarter second after the last
        assert len(cold) == made and {e["to"] for e in cold} == {"cold"}
        assert cold[0]["agent"] == AGENTS[0] and all(e["bytes"] > 0 for e in cold)


async def test_a_tenant_sees_its_own_agents_and_an_admin_all() -> None:
    async with running(app_options=KEYS) as (_, base), httpx.AsyncClient(timeout=60) as http:
        for entry, agents in ((ALICE, ["a1", "a2"]), (BOB, ["b1"])):
            for agent in agents:
                await turn(http, base, agent, 0, auth(entry))
        await http.post(f"{base}/v1/agents/a1/hint", json={"priority": 2}, headers=auth(ALICE))
        r = await http.get(f"{base}/v1/status")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # The page and its files hold no data: no key needed.
        for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
            assert (await http.get(base + path)).status_code == 200
        assert (await http.get(f"{base}/dashboard/secrets.txt")).status_code == 404
        alice = await status(http, base, headers=auth(ALICE))
        assert sorted(r["id"] for r in alice["agents"]) == ["a1", "a2"]
        assert {e["agent"] for e in alice["events"]} <= {"a1", "a2"}
        assert next(r for r in alice["agents"] if r["id"] == "a1")["hint"] == "priority 2"
        assert "counters" not in alice and alice["scope"] == {"tenant": "alice", "admin": False}
        for bar in alice["memory"]:
            assert [p["name"] for p in bar["parts"]] == ["your hot caches"]
            assert bar["free_bytes"] is None
        assert alice["totals"]["agents"] == 2
        assert "loads" not in alice["models"][0]
        bob = await status(http, base, headers=auth(BOB))
        assert [r["id"] for r in bob["agents"]] == ["b1"]
        admin = await status(http, base, headers=auth(ROOT))
        ids = {r["id"]: r["tenant"] for r in admin["agents"]}
        assert ids == {"alice.a1": "alice", "alice.a2": "alice", "bob.b1": "bob"}
        assert admin["counters"]["turns"] == 3


async def test_a_tenant_sees_only_its_own_agents_moves(tmp_path: Path) -> None:
    async with (
        running(app_options=KEYS, budget_bytes=BUDGET, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(timeout=60) as http,
    ):
        mine = {ALICE: ["a1", "a2", "a3"], BOB: ["b1", "b2", "b3"]}
        for step in range(2):
            for i in range(3):  # alternately: each tenant's caches push the other's out
                for entry, agents in mine.items():
                    await turn(http, base, agents[i], step, auth(entry))
        every = await moves_match(kv, http, base, auth(ROOT))
        seen = {}
        for entry, agents in mine.items():
            own = (await status(http, base, headers=auth(entry)))["events"]
            seen[entry] = [e for e in own if e["kind"] in ("demoted", "reloaded")]
            assert seen[entry] and {e["agent"] for e in seen[entry]} <= set(agents)
        # The admin's are both tenants' (by their scoped ids), no more.
        assert len(every) == len(seen[ALICE]) + len(seen[BOB])
        assert {e["agent"].split(".")[0] for e in every} == {"alice", "bob"}


async def test_health_and_the_start_line_name_every_model() -> None:
    async with running(None, models=MODELS) as (_, base), httpx.AsyncClient() as http:
        health = (await http.get(f"{base}/health")).json()
        assert health["models"] == ["router", "coder"]
        s = await status(http, base)
        assert [m["name"] for m in s["models"]] == ["router", "coder"]
    line = start_line("127.0.0.1", 8, "router", None, models=["router", "coder"])
    assert "models router, coder" in line and "http://127.0.0.1:8/dashboard" in line
    fields = json.loads(start_line("h", 8, "router", None, as_json=True, models=["a", "b"]))
    assert fields["models"] == ["a", "b"] and fields["dashboard"] == "http://h:8/dashboard"


def test_the_move_log_is_bounded_and_numbered() -> None:
    from kvactor.actors.enums import Tier
    from kvactor.actors.hot import MoveLog

    log = MoveLog(limit=4)
    for i in range(10):
        log.demoted(f"a{i}", Tier.WARM, 10 + i)
    log.installed("a0", 5, prefetch=False)
    (last,) = log.after(10).moves
    assert last == TierMove(11, last.t, "installed", "a0", 5, source="turn")
    assert [m.seq for m in log.after(9).moves] == [10, 11]
    old = log.after(0)  # the first seven left the log: counted, not returned
    assert [m.seq for m in old.moves] == [8, 9, 10, 11] and old.lost == 7 and old.last == 11
    assert log.after(11).moves == [] and log.after(50).last == 11  # ahead: all kept
    assert old.moves[0].tier == "warm" and old.moves[0].nbytes == 17


def test_the_activity_log_is_bounded() -> None:
    from kvactor.server._activity import TurnSeen

    log = Activity(max_events=10, max_agents=3)
    for i in range(50):
        log.turn(TurnSeen(f"a{i}", "cold", 0.1, 5.0, 10, 0, 2))
    assert len(log.events(lambda _: True)) == 10 and log.seq == 50
    assert log.last_turn("a49") is not None and log.last_turn("a0") is None
    moved = [
        TierMove(1, 5.0, "demoted", "a48", 100, tier="warm"),
        TierMove(2, 6.0, "installed", "a48", 90, source="prefetch"),
    ]
    log.moved({"tiny": TierMoves(moved, last=9, lost=7)})
    assert [e | {"seq": 0} for e in log.events(lambda _: True)[-2:]] == [
        {
            "seq": 0,
            "t": 5.0,
            "kind": "demoted",
            "agent": "a48",
            "bytes": 100,
            "model": "tiny",
            "to": "warm",
            "from": "hot",
        },
        {
            "seq": 0,
            "t": 6.0,
            "kind": "reloaded",
            "agent": "a48",
            "bytes": 90,
            "model": "tiny",
            "source": "prefetch",
        },
    ]
    assert log.seq == 52 and log.moves_lost == 7
    again = TurnSeen("a49", "cold", 0.1, 5.0, 10, 0, 2)
    log.turn(again)  # a cold turn of an agent seen before: its cache was lost
    assert log.events(lambda _: True)[-1]["reprefill"] is True
