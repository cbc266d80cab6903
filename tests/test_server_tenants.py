"""A server that faces more than one client (issue 26): API keys, tenants that cannot see,
route into or forget each other's agents, no cache side channel between them, /metrics
for admins only. Real HTTP on 127.0.0.1 with the openai and anthropic SDKs and httpx, a
tiny random model behind it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serving import running

from kvactor.server._tenants import Keys, key_entries

ALICE, BOB, ROOT = "alice:key-of-alice-1", "key-of-bob-22", "key-of-the-admin"
KEYS = {"api_keys": [ALICE, BOB], "admin_keys": [ROOT]}
SYSTEM = "You are the careful assistant of a small bakery. Answer in one short line."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


def auth(entry: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {entry.partition(':')[2] or entry}"}


def chat(content: str, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return {"model": "tiny", "messages": messages, "max_tokens": 3, **extra}


async def test_requests_need_a_key_and_get_401_in_each_apis_shape() -> None:
    async with running(app_options=KEYS) as (_, base), httpx.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"x-api-key": "nope"}):
            r = await http.post(f"{base}/v1/chat/completions", json=chat("hi"), headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post(f"{base}/v1/messages", json=chat("hi"), headers=headers)
            assert r.status_code == 401
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
            for path in ("/v1/agents", "/v1/models", "/metrics"):
                assert (await http.get(base + path, headers=headers)).status_code == 401
        # The SDKs: a wrong key raises their authentication error, a right one works.
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong-1", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(**chat("hi"))
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=BOB, max_retries=0) as c:
            done = await c.chat.completions.create(**chat("hi"))
            assert done.choices[0].message.content is not None
        async with anthropic.AsyncAnthropic(base_url=base, api_key="wrong-1", max_retries=0) as a:
            with pytest.raises(anthropic.AuthenticationError):
                await a.messages.create(**chat("hi"))
        alice = ALICE.partition(":")[2]
        async with anthropic.AsyncAnthropic(base_url=base, api_key=alice, max_retries=0) as a:
            message = await a.messages.create(**chat("hi"))
            assert message.content[0].type == "text"
        # /health answers anyone (a liveness probe), the load only to an admin.
        public = {"status": "ok", "model": "tiny", "models": ["tiny"]}  # every model named
        assert (await http.get(f"{base}/health")).json() == public
        health = (await http.get(f"{base}/health", headers=auth(ROOT))).json()
        assert health["in_flight"] == 0


async def test_tenants_cannot_see_route_into_or_forget_each_others_agents(tmp_path: Path) -> None:
    async with (
        running(app_options=KEYS, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base) as http,
    ):

        async def post(who: str, body: dict[str, Any], agent: str | None = None) -> Any:
            headers = auth(who) | ({"X-Agent-Id": agent} if agent else {})
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r.json()

        # The same id in two tenants: two agents, each seeing only its own.
        assert (await post(ALICE, chat("hello"), "notes"))["kvactor"]["agent"] == "notes"
        assert (await post(BOB, chat("other"), "notes"))["kvactor"]["agent"] == "notes"
        bob = Keys([BOB]).tenant({"x-api-key": BOB})
        assert bob is not None and bob.label.startswith("k") and "bob" not in bob.label
        assert sorted(kv.agents) == sorted(["alice.notes", f"{bob.label}.notes"])
        for who in (ALICE, BOB):
            listed = (await http.get("/v1/agents", headers=auth(who))).json()["data"]
            assert [a["id"] for a in listed] == ["notes"]
        every = (await http.get("/v1/agents", headers=auth(ROOT))).json()["data"]
        assert sorted(a["id"] for a in every) == sorted(kv.agents)
        # Bob cannot reach Alice's agent by her id, nor by its session id.
        for target in ("alice.notes", "alice"):
            r = await http.delete(f"/v1/agents/{target}", headers=auth(BOB))
            assert r.status_code == 404
            r = await http.post(f"/v1/agents/{target}/prefetch", headers=auth(BOB))
            assert r.status_code == 404
        # Bob's forget forgets his own only.
        assert (await http.delete("/v1/agents/notes", headers=auth(BOB))).status_code == 200
        assert list(kv.agents) == ["alice.notes"]
        listed = (await http.get("/v1/agents", headers=auth(ALICE))).json()["data"]
        assert [a["id"] for a in listed] == ["notes"]
        # Anonymous routing stays in a tenant: Bob continuing Alice's id-less
        # conversation gets an agent of his own and nothing from her cache.
        first = await post(ALICE, chat("a question without an id"))
        history = chat("a question without an id")["messages"] + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and a second one"},
        ]
        body = {"model": "tiny", "messages": history, "max_tokens": 3}
        bobs = await post(BOB, body)
        assert bobs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        alices = await post(ALICE, body)
        assert alices["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        anonymous = [a for a in kv.agents if ".anon." in a]
        assert len(anonymous) == 2 and len({a.partition(".")[0] for a in anonymous}) == 2
        # /metrics: of every tenant together, so for admins only.
        assert (await http.get("/metrics", headers=auth(ALICE))).status_code == 403
        r = await http.get("/metrics", headers=auth(ROOT))
        assert r.status_code == 200 and "kvactor_turns_total" in r.text


async def test_a_right_and_a_wrong_guess_of_another_tenants_prompt_report_the_same() -> None:
    wrong = SYSTEM.replace("bakery", "florist")
    async with running(app_options=KEYS) as (_, base), httpx.AsyncClient(base_url=base) as http:

        async def ask(who: str, agent: str, system: str) -> dict[str, Any]:
            headers = auth(who) | {"X-Agent-Id": agent}
            r = await http.post("/v1/chat/completions", json=chat("hi", system), headers=headers)
            assert r.status_code == 200, r.text
            return dict(r.json())

        await ask(ALICE, "victim", SYSTEM)
        # Within a tenant, an agent with the same system prompt shares its cache: the
        # channel this test watches is real.
        assert (await ask(ALICE, "colleague", SYSTEM))["kvactor"]["reused_tokens"] > 0
        right, guess = await ask(BOB, "right", SYSTEM), await ask(BOB, "wrong", wrong)
        for reply in (right, guess):
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert reply["kvactor"]["reused_tokens"] == 0
            assert reply["kvactor"]["path"] == "cold" and reply["kvactor"]["match"] == "new"


async def test_sharing_can_be_turned_off_entirely() -> None:
    async with running(share_prefixes=False) as (_, base), httpx.AsyncClient() as http:
        replies = []
        for agent in ("one", "two"):
            r = await http.post(
                f"{base}/v1/chat/completions",
                json=chat("hi", SYSTEM),
                headers={"X-Agent-Id": agent},
            )
            replies.append(r.json())
        assert [r["kvactor"]["reused_tokens"] for r in replies] == [0, 0]


def test_key_entries_files_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(
        "# our tenants\nteam-a:aaaaaaaa-1\n\n  bbbbbbbb-2  \nroot:cccccccc-3 admin\n"
    )
    monkeypatch.setenv("KVACTOR_API_KEYS", "dddddddd-4, team-a:eeeeeeee-5")
    entries = key_entries(["ffffffff-6"], [keys_file])
    assert entries == [
        "ffffffff-6",
        "team-a:aaaaaaaa-1",
        "bbbbbbbb-2",
        "root:cccccccc-3 admin",
        "dddddddd-4",
        "team-a:eeeeeeee-5",
    ]
    keys = Keys(entries)
    tenant = keys.tenant
    assert tenant({"authorization": "Bearer aaaaaaaa-1"}) == tenant({"x-api-key": "eeeeeeee-5"})
    team = tenant({"authorization": "Bearer aaaaaaaa-1"})
    assert team is not None and team.label == "team-a" and not team.admin
    admin = tenant({"x-api-key": "cccccccc-3"})
    assert admin is not None and admin.admin and admin.prefix == ""
    plain = tenant({"authorization": "bearer bbbbbbbb-2"})
    assert plain is not None and plain.label.startswith("k") and len(plain.label) == 17
    alone = Keys(["bbbbbbbb-2"]).tenant({"x-api-key": "bbbbbbbb-2"})
    assert alone is not None and alone.label == plain.label  # stable: from the key alone
    assert "bbbbbbbb" not in plain.label
    assert tenant({"authorization": "Bearer aaaaaaaa-"}) is None
    assert tenant({}) is None
    assert keys.tenants == 4 and keys.scope_of("team-a.x") == "team-a"
    assert keys.scope_of("unknown.x") == "" and keys.scope_of("team-a") == ""
    for bad in ("short", "bad name:aaaaaaaa-1", "aaaaaaaa-1 admin extra", "aaaaaaaa-1 root"):
        with pytest.raises(ValueError):
            Keys([bad])
    assert os.environ["KVACTOR_API_KEYS"]


def test_serve_refuses_bad_keys_before_loading_anything(tmp_path: Path) -> None:
    from kvactor.cli import main

    assert main(["serve", "tiny", "--api-key", "short", "--no-cache-dir"]) == 2
    assert main(["serve", "tiny", "--api-key-file", str(tmp_path / "missing")]) == 2


async def test_agent_ids_of_a_tenant_are_checked_and_bounded() -> None:
    async with running(app_options=KEYS) as (_, base), httpx.AsyncClient(base_url=base) as http:
        for agent, status in (("../etc", 400), ("anon.1", 400), ("x" * 125, 400), ("ok", 200)):
            r = await http.post(
                "/v1/chat/completions",
                json=chat("hi"),
                headers=auth(ALICE) | {"X-Agent-Id": agent},
            )
            assert r.status_code == status, (agent, r.text)
            if status == 400:
                assert "alice" not in r.json()["error"]["message"]


def test_the_open_server_is_one_tenant_that_sees_everything() -> None:
    tenant = Keys().tenant({})
    assert tenant is not None and tenant.admin and tenant.full_id("x") == "x"  # clients' own
    assert tenant.owns("anything") and tenant.local_id("anything") == "anything"


async def test_a_tenants_forget_lists_only_its_own_agents_as_users_of_what_it_kept(
    tmp_path: Path,
) -> None:
    """docs/serving-others.md: a forget's ``kept_shared`` lists only the tenant's own
    agents as users. Alice's agent has two forks on disk (made by the application that
    mounts the server): her own, and one outside her tenant. Forgetting it keeps the
    files they use, naming her fork (by her id) and not the other."""
    async with (
        running(app_options=KEYS, cache_dir=tmp_path) as (kv, base),
        httpx.AsyncClient(base_url=base) as http,
    ):
        headers = auth(ALICE) | {"X-Agent-Id": "notes"}
        r = await http.post("/v1/chat/completions", json=chat("hello", SYSTEM), headers=headers)
        assert r.status_code == 200, r.text
        await kv.fork("alice.notes", "alice.copy", scope="alice")
        await kv.fork("alice.notes", "outsider", scope="alice")
        r = await http.delete("/v1/agents/notes", headers=auth(ALICE))
        assert r.status_code == 200, r.text
        kept = r.json()["kept_shared"]
        assert kept and all(k["used_by"] == ["copy"] for k in kept), kept
        # The admin, who owns every agent, sees both users of what the next forget keeps.
        r = await http.delete("/v1/agents/alice.copy", headers=auth(ROOT))
        assert r.status_code == 200, r.text
        assert {u for k in r.json()["kept_shared"] for u in k["used_by"]} == {"outsider"}
