"""Carrying an agent between servers over HTTP: ``GET /v1/agents/{id}/cache`` streams its
portable file, ``PUT /v1/agents/{id}/cache`` takes one (docs/serving-others.md). Real
servers on 127.0.0.1 over a tiny random model, httpx streaming both ways and the openai
SDK; tenants, refusals, a name taken and the size limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from serving import metric, running

from kvactor.server._tenants import Keys

ALICE, BOB, ROOT = "alice:key-of-alice-1", "key-of-bob-22", "key-of-the-admin"
KEYS = {"api_keys": [ALICE, BOB], "admin_keys": [ROOT]}
SYSTEM = "You are the careful assistant of a small bakery. Answer in one short line."
FIRST = "We bake rye bread on Mondays and sourdough on Fridays. Remember it."
SECOND = "Which bread do we bake on Fridays?"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


def auth(entry: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {entry.partition(':')[2] or entry}"}


def key(entry: str) -> str:
    return entry.partition(":")[2] or entry


def cache(agent: str) -> str:
    return f"/v1/agents/{agent}/cache"


async def chat(base: str, who: str, agent: str, messages: list[dict[str, str]]) -> Any:
    """A greedy turn of ``agent`` through the openai SDK; returns the completion."""
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key(who), max_retries=0) as c:
        return await c.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Agent-Id": agent},
        )


def first_turn() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]


def next_turn(first: Any) -> list[dict[str, str]]:
    """The conversation after ``first`` (a completion), with the next question."""
    reply = first.choices[0].message.content
    return [
        *first_turn(),
        {"role": "assistant", "content": reply},
        {"role": "user", "content": SECOND},
    ]


async def exported(http: httpx.AsyncClient, base: str, who: str, agent: str) -> bytes:
    r = await http.get(base + cache(agent), headers=auth(who))
    assert r.status_code == 200, r.text
    return r.content


async def listed(http: httpx.AsyncClient, base: str, who: str) -> dict[str, dict[str, Any]]:
    r = await http.get(f"{base}/v1/agents", headers=auth(who))
    assert r.status_code == 200, r.text
    return {a["id"]: a for a in r.json()["data"]}


async def pieces(data: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    """``data`` as a streamed (chunked) request body."""
    for at in range(0, len(data), size):
        yield data[at : at + size]


async def test_an_agent_exported_over_get_resumes_warm_on_another_server(tmp_path: Path) -> None:
    async with (
        running(app_options=KEYS, cache_dir=tmp_path / "a") as (_, one),
        running(app_options=KEYS, cache_dir=tmp_path / "b") as (kv_b, two),
        httpx.AsyncClient(timeout=60) as http,
    ):
        first = await chat(one, ALICE, "notes", first_turn())
        # Streamed out of one server straight into the other: no copy of the whole.
        async with http.stream("GET", one + cache("notes"), headers=auth(ALICE)) as out:
            assert out.status_code == 200
            assert out.headers["content-type"] == "application/octet-stream"
            disposition = out.headers["content-disposition"]
            assert disposition == 'attachment; filename="notes.kvagent"'
            tokens = int(out.headers["x-kvactor-tokens"])
            put = await http.put(
                two + cache("notes"), content=out.aiter_bytes(), headers=auth(ALICE)
            )
        assert put.status_code == 201, put.text
        made = put.json()
        assert made["id"] == "notes" and made["tokens"] == tokens > 0 and made["bytes"] > 0
        assert sorted(kv_b.agents) == ["alice.notes"]  # in Alice's namespace there too
        assert (await listed(http, two, ALICE))["notes"]["tier"] == "warm"
        # The same next turn on both: the same greedy answer, the imported one from disk.
        there = await chat(two, ALICE, "notes", next_turn(first))
        here = await chat(one, ALICE, "notes", next_turn(first))
        assert there.choices[0].message.content == here.choices[0].message.content
        assert there.usage is not None and here.usage is not None
        assert there.usage.completion_tokens == here.usage.completion_tokens
        info = (there.model_extra or {})["kvactor"]
        assert info["path"] == "warm" and info["reused_tokens"] > 0
        assert info["reused_tokens"] == (here.model_extra or {})["kvactor"]["reused_tokens"]
        # Both routes are counted under their own names.
        text = (await http.get(f"{two}/metrics", headers=auth(ROOT))).text
        assert metric(text, "kvactor_http_requests_total", route="import", status="201") == 1
        text = (await http.get(f"{one}/metrics", headers=auth(ROOT))).text
        assert metric(text, "kvactor_http_requests_total", route="export", status="200") == 1


async def test_a_tenant_can_neither_read_nor_overwrite_another_tenants_agent(
    tmp_path: Path,
) -> None:
    bob = Keys([BOB]).tenant({"x-api-key": BOB})
    assert bob is not None
    async with (
        running(app_options=KEYS, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        await chat(base, ALICE, "notes", first_turn())
        data = await exported(http, "", ALICE, "notes")
        alices = (await listed(http, "", ALICE))["notes"]["tokens"]
        # Bob reaches no agent of Alice's, by her id or its session id.
        for target in ("notes", "alice.notes"):
            r = await http.get(cache(target), headers=auth(BOB))
            assert r.status_code == 404 and r.json()["error"]["code"] == "agent_not_found"
        assert (await http.get(cache("notes"))).status_code == 401
        assert (await http.put(cache("notes"), content=data)).status_code == 401
        # His PUT of her file, even under her session id, lands in his own namespace.
        for target in ("notes", "alice.notes"):
            r = await http.put(cache(target) + "?replace=true", content=data, headers=auth(BOB))
            assert r.status_code == 201, r.text
        assert sorted(kv.agents) == sorted(
            ["alice.notes", f"{bob.label}.notes", f"{bob.label}.alice.notes"]
        )
        assert sorted(await listed(http, "", BOB)) == ["alice.notes", "notes"]
        assert list(await listed(http, "", ALICE)) == ["notes"]
        assert (await listed(http, "", ALICE))["notes"]["tokens"] == alices
        # An admin reaches every agent by its session id.
        assert (await http.get(cache("alice.notes"), headers=auth(ROOT))).status_code == 200


async def test_a_truncated_or_altered_file_is_refused_with_its_reason_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    async with (
        running(cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        await chat(base, ALICE, "src", first_turn())
        data = await exported(http, "", ALICE, "src")
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 1
        bodies: dict[str, Any] = {
            "cut": pieces(data[: len(data) // 2]),  # streamed, ends early
            "cut-at-end": data[:-1],
            "flipped": bytes(flipped),
            "junk": b"not an agent file at all",
        }
        for agent, body in bodies.items():
            r = await http.put(cache(agent), content=body)
            assert r.status_code == 422, (agent, r.text)
            error = r.json()["error"]
            assert error["code"] == "cache_rejected", agent
            assert error["message"].startswith("agent file refused: "), agent
            if agent.startswith("cut"):
                assert "truncated" in error["message"], error
        # Nothing of them stayed: no agent, no folder, no staged bytes.
        assert list(await listed(http, "", ALICE)) == ["src"]
        assert list(kv.agents) == ["src"]
        assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == ["src"]
        for agent in bodies:
            assert (await http.get(cache(agent))).status_code == 404


async def test_a_put_over_an_existing_agent_is_409_unless_replace(tmp_path: Path) -> None:
    async with (
        running(cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        first = await chat(base, ALICE, "a", first_turn())
        await chat(base, ALICE, "b", [{"role": "user", "content": "something else"}])
        data = await exported(http, "", ALICE, "a")
        before = await listed(http, "", ALICE)
        r = await http.put(cache("b"), content=data)
        assert r.status_code == 409 and r.json()["error"]["code"] == "agent_exists"
        assert "replace=true" in r.json()["error"]["message"]
        assert await listed(http, "", ALICE) == before  # b untouched
        r = await http.put(cache("b") + "?replace=maybe", content=data)
        assert r.status_code == 400 and r.json()["error"]["param"] == "replace"
        r = await http.put(cache("b") + "?replace=true", content=pieces(data))
        assert r.status_code == 201, r.text
        assert r.json()["tokens"] == before["a"]["tokens"] != before["b"]["tokens"]
        # b is now a's conversation, resumed from the imported file.
        again = await chat(base, ALICE, "b", next_turn(first))
        info = (again.model_extra or {})["kvactor"]
        assert info["path"] == "warm" and info["reused_tokens"] > 0
        assert sorted(kv.agents) == ["a", "b"]


async def test_a_body_over_the_limit_is_413_and_leaves_nothing(tmp_path: Path) -> None:
    async with (
        running(app_options={"max_import_bytes": 2000}, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        await chat(base, ALICE, "src", first_turn())
        data = await exported(http, "", ALICE, "src")
        assert len(data) > 2000
        # Declared (Content-Length) and streamed (chunked: its header says too much).
        for body in (data, pieces(data), pieces(b"x" * 5000)):
            r = await http.put(cache("big"), content=body)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"
        assert list(kv.agents) == ["src"]
        assert list(await listed(http, "", ALICE)) == ["src"]


async def test_a_turn_that_comes_during_an_import_waits_for_it(tmp_path: Path) -> None:
    async with (
        running(app_options=KEYS, cache_dir=tmp_path / "a") as (_, one),
        running(app_options=KEYS, cache_dir=tmp_path / "b") as (_, two),
        httpx.AsyncClient(timeout=60) as http,
    ):
        first = await chat(one, ALICE, "notes", first_turn())
        data = await exported(http, one, ALICE, "notes")
        gate = anyio.Event()

        async def slowly() -> AsyncIterator[bytes]:
            yield data[:4096]
            await gate.wait()
            yield data[4096:]

        async def in_flight(n: int) -> None:
            with anyio.fail_after(20):
                while (await http.get(f"{two}/health", headers=auth(ROOT))).json()["in_flight"] < n:
                    await anyio.sleep(0.01)

        done: dict[str, Any] = {}

        async def put() -> None:
            done["put"] = await http.put(
                two + cache("notes"), content=slowly(), headers=auth(ALICE)
            )

        async def turn() -> None:
            done["turn"] = await chat(two, ALICE, "notes", next_turn(first))

        async with anyio.create_task_group() as tg:
            tg.start_soon(put)
            await in_flight(1)  # the import holds its admission slot and the agent
            tg.start_soon(turn)
            await in_flight(2)  # the turn too, waiting for the import to end
            gate.set()
        assert done["put"].status_code == 201, done["put"].text
        info = (done["turn"].model_extra or {})["kvactor"]
        assert info["path"] == "warm" and info["reused_tokens"] > 0  # on the imported cache
