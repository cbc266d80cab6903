"""A real ``kvactor serve`` process (issue 26): bounded memory under its default settings
(1,000 anonymous conversations, sampled RSS), keys given three ways, a start that says
when there are none, and a SIGTERM that drains: turns end and are saved, no traceback."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from serving import ENDLESS, metric, serve_process, tiny_model_dir

from kvactor.server._serve import BUDGET_CAP, default_budget_bytes, total_memory

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_default_budget_is_a_quarter_of_memory_at_most_8_gib() -> None:
    total = total_memory()
    assert total is not None
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert abs(total - kib * 1024) < 64 << 20  # sysconf and /proc/meminfo agree
    assert default_budget_bytes() == min(total // 4, BUDGET_CAP)


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
async def test_1000_anonymous_conversations_stay_within_a_memory_bound(tmp_path: Path) -> None:
    with serve_process(tmp_path, "--no-cache-dir", "--model-id", "tiny") as server:
        assert server.start["budget_bytes"] == default_budget_bytes()
        assert server.start["auth"] is False
        assert "no API keys" in server.log()  # said at start
        samples: list[tuple[int, int]] = []
        done = 0
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as http:

            async def client(first: int) -> None:
                nonlocal done
                for i in range(first, 1000, 4):
                    content = f"conversation {i}: tell me about the number {i * 7919 % 1000}"
                    body = {
                        "model": "tiny",
                        "max_tokens": 1,
                        "messages": [{"role": "user", "content": content}],
                    }
                    r = await http.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    done += 1
                    if done % 50 == 0:
                        samples.append((done, server.rss_bytes()))

            with anyio.fail_after(240):
                async with anyio.create_task_group() as tg:
                    for first in range(4):
                        tg.start_soon(client, first)
            agents = (await http.get("/v1/agents")).json()["data"]
            text = (await http.get("/metrics")).text
        warm = dict(samples)[100]  # the 16 anonymous agents and their caches are there
        last = samples[-1][1]
        print("RSS MB by conversations:", [(n, round(b / 2**20, 1)) for n, b in samples])
        print(f"growth after 100: {(last - warm) / 2**20:.2f} MB for 900 conversations")
        assert len(agents) <= 16  # max_anonymous
        assert metric(text, "kvactor_budget_bytes") == default_budget_bytes()
        assert last - warm < 8 << 20, (warm, last)


def _stream(base: str, agent: str, max_tokens: int, got: list[str]) -> None:
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    headers = {"X-Agent-Id": agent, "Authorization": "Bearer key-of-the-one-tenant"}
    try:
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            got.extend(line for line in r.iter_lines() if line)
    except httpx.HTTPError as exc:
        got.append(f"error: {exc!r}")


@pytest.mark.slow  # a server process drained by a signal: the whole suite's
def test_sigterm_drains_turns_end_and_are_saved_without_a_traceback(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one tenant\nteam:key-of-the-one-tenant\n")
    cache = tmp_path / "cache"
    args = ("--cache-dir", str(cache), "--model-id", "tiny", "--drain-seconds", "2")
    env = {"KVACTOR_API_KEYS": "key-from-the-environment"}
    # The tiny model with a context long enough that the long turn runs for minutes.
    model = str(tiny_model_dir(tmp_path / "model"))
    with serve_process(
        tmp_path, *args, "--api-key-file", str(keys), env=env, model=model
    ) as server:
        assert server.start["auth"] is True and server.start["tenants"] == 2
        assert "no API keys" not in server.log()
        assert httpx.get(f"{server.base}/v1/models").status_code == 401
        wrong = {"Authorization": "Bearer key-from-the-environment"}
        assert httpx.get(f"{server.base}/v1/models", headers=wrong).status_code == 200
        short: list[str] = []
        long: list[str] = []
        # A short turn (50 tokens: ends well within the drain's 2 s) and a long one that
        # cannot end by itself in minutes: ended by the drain.
        threads = [
            threading.Thread(target=_stream, args=(server.base, "short", 50, short)),
            threading.Thread(target=_stream, args=(server.base, "long", ENDLESS, long)),
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not (short and long) and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        # It stops after the drain's 2 s, not after the long turn (minutes).
        assert server.proc.wait(timeout=30) == 0
        for thread in threads:
            thread.join(timeout=30)
        log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert short[-1] == "data: [DONE]"
    # The long turn: ended by the server, in OpenAI's shape.
    last: dict[str, Any] = json.loads(long[-1][len("data: ") :])
    assert last["error"]["code"] == "shutting_down", long[-3:]
    manifest = json.loads((cache / "agents" / "team.short" / "manifest.json").read_bytes())
    assert manifest["manifest"]["n_tokens"] > 50  # the short turn's tokens, saved
    # The long turn, ended by the drain at a decode step: what it streamed is saved too.
    chunks = [json.loads(line[len("data: ") :]) for line in long[:-1]]
    pieces = sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks)
    manifest = json.loads((cache / "agents" / "team.long" / "manifest.json").read_bytes())
    assert manifest["manifest"]["n_tokens"] >= pieces > 50, (pieces, manifest["manifest"])


@pytest.mark.slow  # a subprocess: the whole suite's
def test_sigint_drains_and_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    """docs/server.md: Ctrl-C (SIGINT) stops taking connections and lets in-flight turns
    run for the drain time; a second signal stops at once. The drain here is 300 s and the
    turn cannot end by itself in minutes: only the second signal ends the process."""
    model = str(tiny_model_dir(tmp_path / "model"))
    args = ("--no-cache-dir", "--model-id", "tiny", "--drain-seconds", "300")
    with serve_process(tmp_path, *args, model=model) as server:
        lines: list[str] = []
        body = {
            "model": "tiny",
            "max_tokens": ENDLESS,
            "stream": True,
            "messages": [{"role": "user", "content": "Hi"}],
        }

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", f"{server.base}/v1/chat/completions", json=body, timeout=60
                ) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
            except httpx.HTTPError as exc:
                lines.append(f"error: {exc!r}")

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lines, server.log()
        server.proc.send_signal(signal.SIGINT)
        # Draining: no new connection is taken, the turn in flight goes on streaming.
        deadline = time.monotonic() + 30
        refused = False
        while not refused and time.monotonic() < deadline:
            try:
                httpx.get(f"{server.base}/health", timeout=5)
                time.sleep(0.01)
            except httpx.HTTPError:
                refused = True
        assert refused
        seen = len(lines)
        deadline = time.monotonic() + 30
        while len(lines) < seen + 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lines) >= seen + 10 and server.proc.poll() is None
        server.proc.send_signal(signal.SIGINT)  # the second: at once, not after 300 s
        code = server.proc.wait(timeout=30)
        reader.join(timeout=30)
        assert not reader.is_alive()
        print(f"exit status {code}; the stream's last line: {lines[-1][:80]}")
        # (Stopping at once, uvicorn logs the stream cut mid-turn as an ASGI exception:
        # ActorDeadError of the agent. The drain, not this, promises a quiet log.)


@pytest.mark.slow  # a subprocess: the whole suite's
def test_serve_flags_max_pending_admin_key_no_share_prefixes_and_codec(tmp_path: Path) -> None:
    """docs/server.md, docs/serving-others.md: ``--max-pending 1`` answers a second request
    in flight with a 429 (Retry-After: 1); ``--admin-key`` reads /metrics and sees every
    tenant's agents, a tenant's key neither; ``--no-share-prefixes``: a second agent of
    the same system prompt prefills it again; ``--codec q8``: the warm tier stores 8 bits."""
    model = str(tiny_model_dir(tmp_path / "model"))
    cache = tmp_path / "cache"
    args = (
        "--cache-dir", str(cache), "--model-id", "tiny", "--max-pending", "1",
        "--admin-key", "the-admin", "--api-key", "team:the-team", "--no-share-prefixes",
        "--codec", "q8",
    )  # fmt: skip
    team = {"Authorization": "Bearer the-team"}
    admin = {"Authorization": "Bearer the-admin"}
    system = "You are one of many careful agents who share this long system prompt. " * 4

    def chat(agent: str, max_tokens: int = 2, stream: bool = False) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens}
        return {**body, "stream": stream} if stream else body

    with serve_process(tmp_path, *args, model=model) as server, httpx.Client(timeout=60) as http:
        url = f"{server.base}/v1/chat/completions"
        first = http.post(url, json=chat("one"), headers={**team, "X-Agent-Id": "one"})
        second = http.post(url, json=chat("two"), headers={**team, "X-Agent-Id": "two"})
        assert first.status_code == second.status_code == 200
        assert first.json()["kvactor"]["reused_tokens"] == 0
        assert second.json()["kvactor"]["reused_tokens"] == 0  # nothing shared from "one"
        # One request in flight (a turn of minutes, streaming) holds the only slot.
        # (EOS banned: the tiny model may end this conversation so.)
        endless = {**chat("talker", ENDLESS, stream=True), "logit_bias": {"2": -100}}
        with http.stream("POST", url, json=endless, headers={**team, "X-Agent-Id": "t"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a closed iterator closes the response
            while not next(lines).startswith("data:"):
                pass
            busy = http.post(url, json=chat("three"), headers={**team, "X-Agent-Id": "three"})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert next(lines) is not None  # the talker still talks
        # The stream left: its slot is free again (its cancel is at the engine's next step).
        deadline = time.monotonic() + 30
        while (
            http.get(f"{server.base}/health", headers=admin).json()["in_flight"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        again = http.post(url, json=chat("three"), headers={**team, "X-Agent-Id": "three"})
        assert again.status_code == 200
        assert http.get(f"{server.base}/metrics", headers=team).status_code == 403
        metrics = http.get(f"{server.base}/metrics", headers=admin)
        assert metrics.status_code == 200 and "kvactor_" in metrics.text
        mine = {a["id"] for a in http.get(f"{server.base}/v1/agents", headers=team).json()["data"]}
        every = {
            a["id"] for a in http.get(f"{server.base}/v1/agents", headers=admin).json()["data"]
        }
        assert {"one", "two", "t"} <= mine and {"team.one", "team.two", "team.t"} <= every
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    manifest = json.loads((cache / "agents" / "team.one" / "manifest.json").read_bytes())
    assert '"bits":8' in json.dumps(manifest, separators=(",", ":"))  # --codec q8
