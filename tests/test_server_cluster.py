"""``kvactor serve --cluster``: the server over engine hosts on a local Ray cluster (two
hosts, the tiny model), driven by the ``openai`` SDK. A new conversation goes to the host
that holds its prompt's prefix, a conversation keeps its host, tenants see their own
agents, the figures are the hosts' together, and a host lost for good costs a client one
retryable error, after which its conversation goes on (cold) on the other host with the
same greedy answer. Marked ``ray``; asyncio only (each test starts its own cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from clustering import local_cluster, tiny
from serving import metric, serve_process

import kvactor
from kvactor.actors.cluster import ServedCluster, sum_structs
from kvactor.server._app import create_app

openai = pytest.importorskip("openai")

from _serving import served  # noqa: E402  (on the path once serving is imported)

GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
TEAMS = {  # two teams' system prompts, several 64-token blocks each, different from the start
    "red": "You are the red team's analyst. " + "Check every figure twice. " * 30,
    "blue": "You are the blue team's writer. " + "Keep sentences short. " * 30,
}
KEYS = ["red:red-team-key", "blue:blue-team-key"]
ADMIN = "admin-team-key"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the cluster's hosts run on asyncio, as Ray's async actors do


def _chat(team: str, *turns: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": TEAMS[team]}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
    return messages


async def _solo_answers(
    conversations: list[list[dict[str, str]]], *, one_agent: bool = False
) -> list[str]:
    """Each conversation's greedy answer from one process (the reference): each a new
    agent's first turn, or with ``one_agent`` the turns of one agent."""
    async with kvactor.open(tiny) as kv:
        answers = []
        for i, messages in enumerate(conversations):
            name = f"solo{0 if one_agent else i}"
            agent = kv.agents.get(name) or await kv.spawn_agent(name)
            done = await agent.chat(messages, max_tokens=GREEDY["max_tokens"], temperature=0.0)
            answers.append(done.text)
        return answers


async def _rows(base: str, key: str = ADMIN) -> dict[str, dict[str, Any]]:
    import httpx

    async with httpx.AsyncClient() as http:
        got = await http.get(f"{base}/v1/agents", headers={"Authorization": f"Bearer {key}"})
    got.raise_for_status()
    return {row["id"]: row for row in got.json()["data"]}


async def _ask(client: Any, messages: list[dict[str, str]], **extra: Any) -> Any:
    return await client.chat.completions.create(model="tiny", messages=messages, **GREEDY, **extra)


async def _stream_text(client: Any, messages: list[dict[str, str]]) -> str:
    pieces = []
    stream: AsyncIterator[Any] = await client.chat.completions.create(
        model="tiny", messages=messages, stream=True, **GREEDY
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces)


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_conversations_go_where_their_prefix_is_and_survive_a_lost_host(
    tmp_path: Path,
) -> None:
    import httpx

    questions = ["first question", "second question", "third question"]
    # Two of a team in a row, then the other team's, then one each: a balancer that
    # alternates hosts (or fills the emptier one) splits each team.
    order = [("red", questions[0]), ("red", questions[1]), ("blue", questions[0])]
    order += [("blue", questions[1]), ("red", questions[2]), ("blue", questions[2])]
    conversations = [_chat(team, q) for team, q in order]
    named = _chat("red", "who are you?")
    solo = await _solo_answers([*conversations, named])
    async with local_cluster(tmp_path) as kv:
        app = create_app(
            await ServedCluster.over(kv), model_id="tiny", api_keys=KEYS, admin_keys=[ADMIN]
        )
        async with served(app, start_s=10) as base, contextlib.AsyncExitStack() as stack:
            clients = {
                team: await stack.enter_async_context(
                    openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=f"{team}-team-key")
                )
                for team in TEAMS
            }
            replies = []
            for (team, _), messages in zip(order, conversations, strict=True):
                replies.append(await _ask(clients[team], messages))
            # Greedy answers are the one process's, whichever host ran them.
            assert [r.choices[0].message.content for r in replies] == solo[:-1]
            rows = await _rows(base)
            hosts = {t: {r["host"] for k, r in rows.items() if k.startswith(t)} for t in TEAMS}
            # Each team on one host, the two teams apart: every later conversation of a
            # team found its system prompt cached where it went.
            assert all(len(h) == 1 for h in hosts.values()), hosts
            assert hosts["red"] != hosts["blue"], hosts
            for i, reply in enumerate(replies):
                info = reply.model_extra["kvactor"]
                later = order[i][1] != questions[0]
                assert info["reused_tokens"] >= 64 * 3 if later else info["reused_tokens"] == 0
            # A tenant sees its own agents only; the admin sees both, with their hosts.
            async with httpx.AsyncClient() as http:
                blue_key = {"Authorization": "Bearer blue-team-key"}
                listed = (await http.get(f"{base}/v1/agents", headers=blue_key)).json()
            blue = {k.removeprefix("blue.") for k in rows if k.startswith("blue.")}
            assert {row["id"] for row in listed["data"]} == blue and len(blue) == len(questions)
            assert len(rows) == len(order)
            # A named agent: its conversation keeps its host, streamed or whole.
            red = clients["red"]
            first = await _ask(red, named, user="alice")
            assert first.choices[0].message.content == solo[-1]
            home = (await _rows(base))["red.alice"]["host"]
            assert home == next(iter(hosts["red"]))
            follow = [*named, {"role": "assistant", "content": solo[-1]}]
            follow.append({"role": "user", "content": "and then?"})
            alice = red.with_options(default_headers={"X-Agent-Id": "alice"})
            streamed = await _stream_text(alice, follow)
            assert (await _rows(base))["red.alice"]["host"] == home
            # The figures are the hosts' together; /health names the hosts.
            async with httpx.AsyncClient() as http:
                admin = {"Authorization": f"Bearer {ADMIN}"}
                text = (await http.get(f"{base}/metrics", headers=admin)).text
                health = (await http.get(f"{base}/health", headers=admin)).json()
                status = await http.get(f"{base}/v1/status", headers=admin)
            assert metric(text, "kvactor_agents_cached") >= len(order)
            assert sorted(h["name"] for h in health["hosts"]) == ["h0", "h1"]
            assert status.status_code == 200
            # The red host is lost for good: the next red turn fails once, retryably...
            import ray  # (imported once the cluster is up: it listens on 127.0.0.1 only)

            ray.kill(kv.engine_hosts.any(home).handle, no_restart=True)
            again = [*follow, {"role": "assistant", "content": streamed}]
            again.append({"role": "user", "content": "one more"})
            no_retry = red.with_options(max_retries=0)
            with pytest.raises(openai.APIStatusError) as lost:
                await _ask(no_retry, again, user="alice")
            assert lost.value.status_code == 503, lost.value
            assert lost.value.response.headers["retry-after"] == "1"
            # ... and the retry goes on, cold, on the host that is left, answering as one
            # process answers the whole conversation.
            after = await _ask(no_retry, again, user="alice")
            assert after.model_extra["kvactor"]["path"] == "cold"
            [expected] = await _solo_answers([again])
            assert after.choices[0].message.content == expected
            assert (await _rows(base))["red.alice"]["host"] != home


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_with_replicas_a_lost_hosts_conversation_goes_on_warm(tmp_path: Path) -> None:
    opening = _chat("blue", "hello")
    [said] = await _solo_answers([opening])
    follow = [
        *opening,
        {"role": "assistant", "content": said},
        {"role": "user", "content": "go on"},
    ]
    _, expected = await _solo_answers([opening, follow], one_agent=True)  # hot, as warm
    async with local_cluster(tmp_path, replicas=2) as kv:
        app = create_app(await ServedCluster.over(kv), model_id="tiny")
        async with (
            served(app, start_s=10) as base,
            openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as client,
        ):
            first = await _ask(client, opening, user="carol")
            assert first.choices[0].message.content == said
            home = (await _rows(base, "none"))["carol"]["host"]
            import ray  # (imported once the cluster is up: it listens on 127.0.0.1 only)

            ray.kill(kv.engine_hosts.any(home).handle, no_restart=True)
            with pytest.raises(openai.APIStatusError) as lost:
                await _ask(client, follow, user="carol")
            assert lost.value.status_code == 503 and "carol ->" in str(lost.value), lost.value
            after = await _ask(client, follow, user="carol")
            # Resumed from the replica on the other host: warm, as one process answers.
            info = after.model_extra["kvactor"]
            assert info["path"] == "warm" and info["reused_tokens"] > 0, info
            assert after.choices[0].message.content == expected
            assert (await _rows(base, "none"))["carol"]["host"] != home


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kvactor_serve_cluster_starts_serves_stops_and_finds_its_agents_again(
    tmp_path: Path,
) -> None:
    args = ("--cluster", "local", "--hosts", "2", "--cache-dir", str(tmp_path / "cache"))
    with serve_process(tmp_path, *args, env={"RAY_ADDRESS": ""}, start_s=120) as server:
        assert server.start["hosts"] == ["h0", "h1"]
        with openai.OpenAI(base_url=f"{server.base}/v1", api_key="none") as client:
            reply = client.chat.completions.create(
                model="tiny", messages=_chat("red", "hello"), user="bob", **GREEDY
            )
        reply_text = reply.choices[0].message.content or ""
        with urllib.request.urlopen(f"{server.base}/health") as got:
            health = json.load(got)
        assert len(health["hosts"]) == 2
        with urllib.request.urlopen(f"{server.base}/v1/agents") as got:
            home = {row["id"]: row["host"] for row in json.load(got)["data"]}["bob"]
        os.kill(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0, server.log()
    # A new server finds the agent on its host's disk and resumes it there, warm.
    with serve_process(tmp_path, *args, env={"RAY_ADDRESS": ""}, start_s=120) as server:
        with urllib.request.urlopen(f"{server.base}/v1/agents") as got:
            rows = {row["id"]: row for row in json.load(got)["data"]}
        assert rows["bob"]["host"] == home and rows["bob"]["tier"] == "warm"
        follow = [*_chat("red", "hello"), {"role": "assistant", "content": reply_text}]
        follow.append({"role": "user", "content": "go on"})
        with openai.OpenAI(base_url=f"{server.base}/v1", api_key="none") as client:
            again = client.chat.completions.create(
                model="tiny", messages=follow, user="bob", **GREEDY
            )
        assert again.model_extra["kvactor"]["path"] == "warm"
        assert again.model_extra["kvactor"]["reused_tokens"] > 0
        os.kill(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0, server.log()


def test_hosts_need_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    from kvactor.cli import main

    assert main(["serve", "tiny", "--hosts", "2"]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main(["serve", "tiny", "--cluster", "local", "--hosts", "0"]) == 2
    assert main(["serve", "tiny", "--replicas", "2"]) == 2
    assert main(["serve", "tiny", "--cluster", "local", "--no-cache-dir"]) == 2
    assert "--no-cache-dir" in capsys.readouterr().err


def test_a_clusters_figures_are_its_hosts_summed() -> None:
    from kvactor.actors.warm import StoreStats

    a = StoreStats(reads=2, bytes_read=100, read_s=0.5, disk_bytes=10)
    b = StoreStats(reads=3, bytes_read=50, read_s=0.25, disk_bytes=5)
    both = sum_structs([a, b])
    assert (both.reads, both.bytes_read, both.read_s, both.disk_bytes) == (5, 150, 0.75, 15)
    assert both.disk_limit_bytes is None  # hosts without a limit: none together
    limited = msgspec.structs.replace(a, disk_limit_bytes=1000)
    assert sum_structs([limited, b]).disk_limit_bytes is None  # one host unbounded: unbounded
    assert sum_structs([limited, limited]).disk_limit_bytes == 2000
    with pytest.raises(ValueError):
        sum_structs([])
