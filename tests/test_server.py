"""``kvactor serve`` over real HTTP: the real ``openai`` and ``anthropic`` clients against a
uvicorn server on 127.0.0.1 (a free port), on a tiny random model (and the default model,
slow), with real engine, files and actors behind it."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
import uvicorn
from lively import lively
from prometheus_client.parser import text_string_to_metric_families

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm._prefetch import Stage
from kvactor.server._app import create_app

tiny = functools.partial(make_tiny_model, 0, head_dim=64)
SYSTEM = "You are terse."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


@contextlib.asynccontextmanager
async def running(
    model: Any = tiny, app_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[tuple[kvactor.Session, str]]:
    """A session served on 127.0.0.1 on a free port; stops with the block."""
    async with kvactor.open(model, **options) as kv:
        app = create_app(kv, model_id="tiny", **(app_options or {}))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        # Listening now, a client's connection waits in the backlog until the server takes
        # it: nothing needs to wait for the server's start.
        sock.listen()
        port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(server.serve, sockets=[sock]))
            try:
                yield kv, f"http://127.0.0.1:{port}"
            finally:
                while _clients:  # the API clients made for this server
                    await _clients.pop().close()
                server.should_exit = True


_clients: list[Any] = []


def oai(base: str, agent: str | None = None) -> Any:  # typed loosely: plain dict messages
    headers = {"X-Agent-Id": agent} if agent else None
    client = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="unused", default_headers=headers, max_retries=0
    )
    _clients.append(client)
    return client


async def python_answers(turns: list[str], **sampling: Any) -> list[kvactor.Completion]:
    """The Python API's greedy answers to a conversation of user turns, kept hot."""
    async with kvactor.open(tiny) as kv:
        agent = await kv.spawn_agent("ref", system=SYSTEM)
        return [await agent.generate(t, **sampling) for t in turns]


TURNS = ["hello there", "tell me more about caches"]


async def test_chat_completions_equal_the_python_api_streamed_or_not() -> None:
    want = await python_answers(TURNS, max_tokens=8)
    async with running() as (_, base):
        for stream in (False, True):
            client = oai(base, f"chat-{stream}")
            history = [{"role": "system", "content": SYSTEM}]
            for turn, expected in zip(TURNS, want, strict=True):
                history.append({"role": "user", "content": turn})
                if stream:
                    text, usage = "", None
                    chunks = await client.chat.completions.create(
                        model="tiny",
                        messages=history,
                        max_tokens=8,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    async for chunk in chunks:
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        if chunk.usage is not None:
                            usage = chunk.usage
                        if (chunk.model_extra or {}).get("kvactor"):
                            info = chunk.model_extra["kvactor"]  # on the finishing chunk
                else:
                    done = await client.chat.completions.create(
                        model="default", messages=history, max_tokens=8
                    )
                    text, usage = done.choices[0].message.content, done.usage
                    assert done.choices[0].finish_reason in ("stop", "length")
                    info = (done.model_extra or {})["kvactor"]
                _check_parts(info["timings"])
                assert text == expected.text
                assert usage is not None
                assert usage.completion_tokens == len(expected.token_ids)
                # The second turn resends the history: prefix matching reuses the cache.
                # The second conversation's first turn also shares the first one's system
                # prompt (stored as a range of its own): cached, not prefilled.
                cached = usage.prompt_tokens_details.cached_tokens
                if stream and turn == TURNS[0]:
                    assert cached > expected.timings.reused_tokens
                else:
                    assert cached == expected.timings.reused_tokens
                history.append({"role": "assistant", "content": text})
            assert cached > 0


def _check_parts(parts: dict[str, float]) -> None:
    """A turn's time over HTTP in parts (``kvactor.timings``): each part within the ones
    it belongs to, and the parts that run one after another within the whole."""
    assert set(parts) == {
        "parse_s", "prompt_s", "queue_s", "load_s", "prefill_s", "dequantize_s",
        "decode_s", "save_s", "server_s",
    }  # fmt: skip
    assert all(v >= 0 for v in parts.values()), parts
    assert parts["load_s"] <= parts["queue_s"] and parts["dequantize_s"] <= parts["prefill_s"]
    apart = ("parse_s", "prompt_s", "queue_s", "prefill_s", "decode_s", "save_s")
    assert 0 < sum(parts[k] for k in apart) <= parts["server_s"], parts


async def test_completions_and_models_and_health() -> None:
    async with kvactor.open(tiny) as kv:
        want = await (await kv.spawn_agent("ref")).complete("Once upon a time", max_tokens=6)
    async with running() as (_, base):
        client = oai(base, "raw")
        done = await client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6
        )
        assert done.choices[0].text == want.text
        text = ""
        async for chunk in await client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, stream=True
        ):
            text += chunk.choices[0].text
        assert text == want.text
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        async with httpx.AsyncClient() as http:
            health = (await http.get(f"{base}/health")).json()
        assert health["status"] == "ok" and health["model"] == "tiny"


async def test_anthropic_messages_equal_the_python_api_streamed_or_not() -> None:
    want = await python_answers(TURNS[:1], max_tokens=8)
    async with running() as (_, base):
        client: Any = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        _clients.append(client)
        messages = [{"role": "user", "content": TURNS[0]}]
        done = await client.messages.create(
            model="tiny",
            max_tokens=8,
            system=SYSTEM,
            messages=messages,
            metadata={"user_id": "claude-one"},
        )
        assert done.content[0].text == want[0].text
        assert done.stop_reason in ("end_turn", "max_tokens")
        assert done.usage.output_tokens == len(want[0].token_ids)
        text = ""
        async with client.messages.stream(
            model="tiny",
            max_tokens=8,
            system=SYSTEM,
            messages=messages,
            metadata={"user_id": "claude-two"},
        ) as events:
            async for piece in events.text_stream:
                text += piece
            final = await events.get_final_message()
        assert text == want[0].text == final.content[0].text
        # Asked again, the same agent reuses its cache: reported as a cache read.
        again = await client.messages.create(
            model="tiny",
            max_tokens=8,
            system=SYSTEM,
            messages=messages,
            metadata={"user_id": "claude-one"},
        )
        assert again.content[0].text == want[0].text
        assert again.usage.cache_read_input_tokens > 0


async def test_eight_clients_stream_at_once() -> None:
    prompts = [f"client {i} asks about {'abcdefgh'[i] * (2 + i)}" for i in range(8)]
    # Batched answers equal solo ones in the mode that promises it, on a model whose tokens
    # depend on their cache (tests/lively.py).
    model = lively()
    async with kvactor.open(model, deterministic=True) as kv:
        want = [
            await (await kv.spawn_agent(f"s{i}")).generate(p, max_tokens=10)
            for i, p in enumerate(prompts)
        ]
    async with running(model, max_batch=8, deterministic=True) as (kv, base):
        got: list[str] = [""] * 8

        async def one(i: int) -> None:
            client = oai(base, f"c{i}")
            chunks = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=10,
                stream=True,
            )
            async for chunk in chunks:
                got[i] += chunk.choices[0].delta.content or ""

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert got == [w.text for w in want]
        assert (await kv.stats()).max_batch_seen > 1


async def test_a_client_that_disconnects_mid_stream_frees_its_slot() -> None:
    async with running(max_batch=2) as (kv, base):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go on and on"}],
            "max_tokens": 1500,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream(
                "POST", f"{base}/v1/chat/completions", json=body, headers={"X-Agent-Id": "leaver"}
            ) as response:
                assert response.status_code == 200
                lines = 0
                async for line in response.aiter_lines():
                    lines += line.startswith("data:")
                    if lines >= 3:
                        break  # leave: the connection closes
            with anyio.fail_after(20):  # a poll: nothing signals the engine's noticing the exit
                while (stats := await kv.stats()).decoding or stats.prefilling:
                    await anyio.sleep(0.05)
            assert stats.generated_tokens < 1500
            # The slot is free: another client is served.
            done = await oai(base, "next").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert done.choices[0].message.content is not None
            assert (await http.get(f"{base}/health")).json()["in_flight"] == 0


async def test_bad_requests_get_errors_in_the_api_shape_and_the_server_serves_on() -> None:
    # strict_model: another model's name is a 404 (by default any name is the one served).
    app_options = {"max_body_bytes": 64 << 10, "max_pending": 2, "strict_model": True}
    async with running(app_options=app_options) as (_, base), httpx.AsyncClient() as http:
        chat = f"{base}/v1/chat/completions"
        user = [{"role": "user", "content": "hi"}]

        async def post(url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
            r = await http.post(url, **kw)
            return r.status_code, r.json()

        status, body = await post(chat, content=b"{not json")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        status, body = await post(chat, json={"model": "tiny", "messages": user, "bogus": 1})
        assert status == 400 and "bogus" in body["error"]["message"]
        status, body = await post(chat, json={"model": "tiny", "messages": user, "temperature": 7})
        assert status == 400 and body["error"]["param"] == "temperature"
        status, body = await post(chat, json={"model": "nope", "messages": user})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await post(
            chat, json={"model": "tiny", "messages": user}, headers={"X-Agent-Id": "../etc"}
        )
        assert status == 400 and "agent id" in body["error"]["message"]
        status, body = await post(chat, json={"model": "tiny", "messages": []})
        assert status == 400
        long = [{"role": "user", "content": "x" * 4000}]  # over the tiny model's 2048
        status, body = await post(chat, json={"model": "tiny", "messages": long})
        # A 400 that says the limit (issue 26: it was a 413, which means a body too large).
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "2048" in body["error"]["message"]
        status, body = await post(chat, content=b" " * (65 << 10))
        assert status == 413
        # Anthropic's shape on its route.
        status, body = await post(f"{base}/v1/messages", json={"model": "tiny", "messages": user})
        assert status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        # Two requests in flight (max_pending=2): the third is told to retry.
        slow = {"model": "tiny", "messages": user, "max_tokens": 400, "stream": True}
        async with (
            http.stream("POST", chat, json=slow, headers={"X-Agent-Id": "s1"}) as one,
            http.stream("POST", chat, json=slow, headers={"X-Agent-Id": "s2"}) as two,
        ):
            assert one.status_code == two.status_code == 200
            r = await http.post(chat, json={"model": "tiny", "messages": user})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
        # And everyone else is still served.
        status, body = await post(chat, json={"model": "tiny", "messages": user, "max_tokens": 2})
        assert status == 200 and body["choices"][0]["message"]["content"] is not None


async def test_a_restarted_server_resumes_agents_from_their_warm_caches(tmp_path: Path) -> None:
    want = await python_answers(TURNS, max_tokens=8)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    async with running(cache_dir=tmp_path) as (_, base):
        first = await oai(base, "keeper").chat.completions.create(
            model="tiny", messages=history, max_tokens=8
        )
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": TURNS[1]},
    ]
    async with running(cache_dir=tmp_path) as (_, base), httpx.AsyncClient() as http:
        listed = (await http.get(f"{base}/v1/agents")).json()["data"]
        assert [(a["id"], a["tier"]) for a in listed] == [("keeper", "warm")]
        r = await http.post(
            f"{base}/v1/chat/completions",
            headers={"X-Agent-Id": "keeper"},
            json={"model": "tiny", "messages": history, "max_tokens": 8},
        )
        body = r.json()
        assert body["kvactor"]["path"] == "warm"
        assert body["choices"][0]["message"]["content"] == want[1].text
        assert (
            body["usage"]["prompt_tokens_details"]["cached_tokens"] == want[1].timings.reused_tokens
        )


async def test_agent_routes_list_forget_and_prefetch(tmp_path: Path) -> None:
    async with running(cache_dir=tmp_path) as (_, base), httpx.AsyncClient() as http:
        await oai(base, "alpha").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        listed = {a["id"]: a for a in (await http.get(f"{base}/v1/agents")).json()["data"]}
        assert listed["alpha"]["tier"] == "hot" and listed["alpha"]["tokens"] > 0
        assert listed["alpha"]["warm_bytes"] > 0
        assert (await http.post(f"{base}/v1/agents/alpha/prefetch")).status_code == 202
        assert (await http.post(f"{base}/v1/agents/ghost/prefetch")).status_code == 404
        assert (await http.delete(f"{base}/v1/agents/bad..id")).status_code == 400
        assert (await http.delete(f"{base}/v1/agents/ghost")).status_code == 404
        r = await http.delete(f"{base}/v1/agents/alpha")
        assert r.status_code == 200 and r.json()["freed_bytes"] > 0
        assert (await http.get(f"{base}/v1/agents")).json()["data"] == []
        assert not (tmp_path / "agents" / "alpha").exists()


async def test_requests_without_an_id_go_to_the_conversation_they_continue() -> None:
    async with running() as (_, base), httpx.AsyncClient() as http:
        chat = f"{base}/v1/chat/completions"
        history = [{"role": "user", "content": "first question"}]
        one = (
            await http.post(chat, json={"model": "tiny", "messages": history, "max_tokens": 5})
        ).json()
        history += [
            {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
            {"role": "user", "content": "second question"},
        ]
        two = (
            await http.post(chat, json={"model": "tiny", "messages": history, "max_tokens": 5})
        ).json()
        other = (
            await http.post(
                chat,
                json={
                    "model": "tiny",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "new"}],
                },
            )
        ).json()
        assert one["kvactor"]["agent"] == two["kvactor"]["agent"] != other["kvactor"]["agent"]
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_metrics_parse_with_prometheus_client(tmp_path: Path) -> None:
    async with running(cache_dir=tmp_path) as (_, base), httpx.AsyncClient() as http:
        for _ in range(2):
            await oai(base, "m").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        text = (await http.get(f"{base}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["kvactor_ttft_seconds"]
    counts = {s.labels["path"]: s.value for s in ttft.samples if s.name.endswith("_count")}
    assert counts.get("cold") == 1 and counts.get("hot") == 1
    assert families["kvactor_cache_bytes"].samples[0].value > 0
    assert families["kvactor_warm_tier_writes"].samples[0].value == 2
    assert families["kvactor_warm_tier_bytes_written"].samples[0].value > 0
    rates = {
        s.labels["direction"]: s.value
        for s in families["kvactor_warm_tier_bytes_per_second"].samples
    }
    assert rates["write"] > 0
    assert any(s.labels.get("status") == "200" for s in families["kvactor_http_requests"].samples)


@pytest.mark.slow
async def test_the_default_model_answers_over_http_as_in_python() -> None:
    async with kvactor.open() as kv:
        want = await (await kv.spawn_agent("ref")).generate("What is 2+2?", max_tokens=12)
    async with running(model=None) as (_, base):
        done = await oai(base, "d").chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=12,
        )
    assert done.choices[0].message.content == want.text


@pytest.mark.slow
def test_kvactor_serve_answers_and_stops_on_sigterm_with_caches_committed(
    tmp_path: Path,
) -> None:
    import os
    import re
    import signal
    import subprocess
    import sys

    serve = ["serve", "--port", "0", "--cache-dir", str(tmp_path), "--codec", "fp16"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvactor", *serve],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        port = None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(found.group(1)) if found else None
        assert port is not None
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=60,
            headers={"X-Agent-Id": "cli"},
            json={
                "model": "default",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    manifest = json.loads((tmp_path / "agents" / "cli" / "manifest.json").read_bytes())
    assert manifest["manifest"]["n_tokens"] > 0
    assert '"bits":16' in json.dumps(manifest, separators=(",", ":"))  # --codec fp16


def test_serve_takes_a_budget_in_bytes_or_with_a_unit() -> None:
    import argparse

    from kvactor.cli._main import _size, build_parser

    assert [_size(t) for t in ("1000", "512M", "2G", "1.5GB", "64KiB")] == [
        1000,
        512 << 20,
        2 << 30,
        3 << 29,
        64 << 10,
    ]
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            _size(bad)
    args = build_parser().parse_args(["serve", "--budget", "256M", "--port", "0"])
    assert args.budget == 256 << 20 and args.port == 0 and args.host == "127.0.0.1"


async def test_metrics_split_a_warm_turn_and_label_a_prefetched_one(tmp_path: Path) -> None:
    user = [{"role": "user", "content": "hi"}]
    async with running(cache_dir=tmp_path) as (_, base):
        for name in ("w", "p"):
            await oai(base, name).chat.completions.create(model="tiny", messages=user, max_tokens=3)
    async with running(cache_dir=tmp_path) as (kv, base), httpx.AsyncClient() as http:
        # "w" comes back without a hint: reloaded for its turn; "p" is prefetched first.
        await oai(base, "w").chat.completions.create(model="tiny", messages=user, max_tokens=3)
        assert (await http.post(f"{base}/v1/agents/p/prefetch")).status_code == 202
        # The route tells the prefetch actor before it answers, and the actor handles one
        # message at a time, in order: once this is answered, "p" is staged.
        assert kv.prefetcher is not None
        await kv.prefetcher.ask(Stage("nobody"), timeout=None)
        listed = (await http.get(f"{base}/v1/agents")).json()["data"]
        assert any(a["id"] == "p" and a["tier"] == "hot" for a in listed)
        await oai(base, "p").chat.completions.create(model="tiny", messages=user, max_tokens=3)
        text = (await http.get(f"{base}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        s.labels["path"]: s.value
        for s in families["kvactor_ttft_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"warm": 1, "prefetched": 1}
    parts = {
        s.labels["part"]: s.value
        for s in families["kvactor_ttft_part_seconds"].samples
        if s.name.endswith("_sum")
    }
    assert set(parts) == {"prompt", "queue", "load", "dequantize", "prefill"}
    assert parts["load"] > 0 and parts["dequantize"] > 0 and parts["prefill"] > 0
    assert parts["prompt"] > 0
    assert families["kvactor_warm_tier_reads"].samples[0].value == 2


async def test_one_agent_takes_concurrent_requests_in_turn_and_anonymous_ones_are_bounded() -> None:
    async with running(app_options={"max_anonymous": 2}) as (kv, base), httpx.AsyncClient() as http:
        chat = f"{base}/v1/chat/completions"
        same = {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "one at a time"}],
        }
        answers: list[str] = []

        async def ask() -> None:
            r = await http.post(chat, json=same, headers={"X-Agent-Id": "solo"}, timeout=60)
            assert r.status_code == 200
            answers.append(r.json()["choices"][0]["message"]["content"])

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(ask)
        assert len(set(answers)) == 1 and len(answers) == 3  # greedy, same prompt
        # Three unrelated id-less conversations with room for two: the oldest is forgotten.
        names = []
        for i in range(3):
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": f"topic {i}"}],
            }
            names.append((await http.post(chat, json=body)).json()["kvactor"]["agent"])
        assert len(set(names)) == 3
        assert names[0] not in kv.agents and names[2] in kv.agents


def test_the_server_package_exports_its_names_once() -> None:
    import kvactor.server as server

    assert isinstance(server.__all__, tuple) and len(set(server.__all__)) == len(server.__all__)
    for name in server.__all__:
        assert callable(getattr(server, name)), name


def test_the_start_line_is_text_or_one_json_object(tmp_path: Path) -> None:
    import os
    import re

    from kvactor.server._serve import start_line

    text = start_line("127.0.0.1", 8123, "m", tmp_path)
    assert text == f"kvactor serving on http://127.0.0.1:8123/v1 (cache {tmp_path}); Ctrl-C stops"
    assert re.search(r"http://127\.0\.0\.1:(\d+)/v1", text)  # what scripts look for
    assert "no warm tier" in start_line("::1", 1, "m", None)
    line = start_line("127.0.0.1", 8123, "m", tmp_path, as_json=True)
    assert "\n" not in line
    assert json.loads(line) == {
        "event": "serving",
        "url": "http://127.0.0.1:8123/v1",
        "host": "127.0.0.1",
        "port": 8123,
        "model": "m",
        "cache_dir": str(tmp_path),
        "pid": os.getpid(),
    }
    assert json.loads(start_line("127.0.0.1", 1, "m", None, as_json=True))["cache_dir"] is None


async def test_serve_prints_a_json_start_line_answers_and_stops_on_sigterm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import os
    import signal

    from kvactor.server._serve import serve

    listening = anyio.Event()
    ports: list[int] = []

    def ready(port: int) -> None:
        ports.append(port)
        listening.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(serve, tiny, port=0, ready=ready, model_id="t", json_start=True)
            )
            await listening.wait()
            async with httpx.AsyncClient() as http:
                health = (await http.get(f"http://127.0.0.1:{ports[0]}/health")).json()
            assert health == {"status": "ok", "model": "t", "models": ["t"], "in_flight": 0}
            os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler: a graceful stop
    lines = capsys.readouterr().err.splitlines()
    start = json.loads(lines[0])
    assert start["event"] == "serving" and start["port"] == ports[0] and start["model"] == "t"
    assert start["url"] == f"http://127.0.0.1:{ports[0]}/v1" and start["cache_dir"] is None
    assert start["models"] == ["t"] and start["dashboard"].endswith(f":{ports[0]}/dashboard")


async def test_the_agent_is_the_header_else_user_else_metadata_user_id() -> None:
    """docs/server.md: a request names its agent with the X-Agent-Id header, else OpenAI's
    ``user`` field, else Anthropic's ``metadata.user_id`` (the header wins over both)."""
    async with running() as (_, base), httpx.AsyncClient(timeout=60) as http:
        messages = [{"role": "user", "content": "hi"}]
        chat = {"model": "tiny", "messages": messages, "max_tokens": 2}
        cases = [
            ("/v1/chat/completions", {**chat, "user": "by-user"}, {}, "by-user"),
            ("/v1/chat/completions", {**chat, "user": "ignored"}, {"X-Agent-Id": "h1"}, "h1"),
            ("/v1/messages", {**chat, "metadata": {"user_id": "by-meta"}}, {}, "by-meta"),
            ("/v1/messages", {**chat, "metadata": {"user_id": "no"}}, {"X-Agent-Id": "h2"}, "h2"),
        ]
        for route, body, headers, agent in cases:
            before = {a["id"] for a in (await http.get(f"{base}/v1/agents")).json()["data"]}
            r = await http.post(f"{base}{route}", json=body, headers=headers)
            assert r.status_code == 200, r.text
            after = {a["id"] for a in (await http.get(f"{base}/v1/agents")).json()["data"]}
            assert after - before == {agent}, (route, body, headers)
        assert not {"ignored", "no"} & after
