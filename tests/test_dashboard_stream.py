"""The status stream the dashboard's page reads (issue 41): ``GET /v1/status?stream=true``
sends the status as server-sent events while it changes, as the request's key may see
it; it is bounded (open streams, each stream's life) and ends within a second when the
server stops, so that Ctrl-C does not wait for open pages. Real HTTP on 127.0.0.1, a tiny
random model. The page itself, in a real browser: test_dashboard_browser.py."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from serving import serve_process, served, tiny, tiny_model_dir
from test_dashboard import ALICE, BOB, KEYS, auth, turn

import kvactor
from kvactor.server import _dashboard
from kvactor.server._app import create_app
from kvactor.server._dashboard import Dashboard


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


@contextlib.asynccontextmanager
async def dashboard_served(
    **app_options: Any,
) -> AsyncIterator[tuple[Dashboard, str, httpx.AsyncClient]]:
    """A tiny model's app served on 127.0.0.1: its dashboard, its base URL, a client."""
    async with kvactor.open(tiny) as kv:
        app = create_app(kv, model_id="tiny", **app_options)
        dash = app.state.dashboard
        assert isinstance(dash, Dashboard)
        async with served(app) as base, httpx.AsyncClient(timeout=60) as http:
            yield dash, base, http


async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The statuses of an open stream, as they come; ends with the stream."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


async def test_a_stream_follows_turns_as_its_key_sees_them() -> None:
    async with dashboard_served(**KEYS) as (_, base, http):
        url = f"{base}/v1/status"
        async with http.stream("GET", url, params={"stream": "true"}, headers=auth(ALICE)) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            seen: list[dict[str, Any]] = []
            with anyio.fail_after(30):
                async for s in events(r):
                    seen.append(s)
                    if len(seen) == 1:  # the first status: before any turn
                        assert s["agents"] == [] and s["scope"]["tenant"] == "alice"
                        await turn(http, base, "b1", 0, auth(BOB))
                        await turn(http, base, "a1", 0, auth(ALICE))
                    if any(e["kind"] == "turn" for e in s["events"]):
                        break
        # Alice's stream showed her turn, once, and nothing of Bob's.
        shown = {a["id"] for s in seen for a in s["agents"]}
        assert shown == {"a1"}
        turns = [e for s in seen for e in s["events"] if e["kind"] == "turn"]
        assert [e["agent"] for e in turns] == ["a1"]
        # A bad flag is a 400; without a key, a 401.
        r2 = await http.get(url, params={"stream": "maybe"}, headers=auth(ALICE))
        assert r2.status_code == 400 and r2.json()["error"]["param"] == "stream"
        r2 = await http.get(url, params={"stream": "true"})
        assert r2.status_code == 401


async def test_streams_are_bounded_and_end_when_the_server_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_dashboard, "MAX_STREAMS", 1)
    async with dashboard_served() as (dash, base, http):
        url = f"{base}/v1/status"
        async with http.stream("GET", url, params={"stream": "true"}) as r:
            statuses = events(r)
            first = await anext(statuses)
            assert first["ready"] and dash.streams == 1
            # One stream is open: the next is refused, saying what to do instead.
            second = await http.get(url, params={"stream": "true"})
            assert second.status_code == 429 and second.headers["retry-after"] == "5"
            assert "poll /v1/status" in second.json()["error"]["message"]
            assert (await http.get(url)).status_code == 200  # polling still answers
            dash.close()  # as kvactor serve does on Ctrl-C: the open stream ends
            with anyio.fail_after(10):
                async for _ in statuses:
                    pass
        assert dash.streams == 0
        r2 = await http.get(url, params={"stream": "true"})
        assert r2.status_code == 429  # closing: no new stream
        assert "the server is stopping" in r2.json()["error"]["message"]


async def test_streams_asked_for_together_are_bounded_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A stream is counted from its request, not from its first event: two asked for at
    # the same moment under a bound of one get one stream and one 429.
    monkeypatch.setattr(_dashboard, "MAX_STREAMS", 1)
    async with dashboard_served() as (dash, base, http):
        codes: list[int] = []
        both = anyio.Event()

        async def ask() -> None:
            async with http.stream("GET", f"{base}/v1/status?stream=true") as r:
                codes.append(r.status_code)
                if len(codes) == 2:
                    both.set()
                with anyio.fail_after(30):
                    await both.wait()  # held open until both answered

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            tg.start_soon(ask)
        assert sorted(codes) == [200, 429]
        with anyio.fail_after(10):
            while dash.streams:  # released as the responses end
                await anyio.sleep(0.01)


async def test_a_stream_ends_after_its_life(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dashboard, "STREAM_LIFE_S", 0.5)
    async with dashboard_served() as (dash, base, http):
        with anyio.fail_after(20):
            async with http.stream("GET", f"{base}/v1/status?stream=1") as r:
                got = [s async for s in events(r)]
        assert got and got[0]["object"] == "status"
        assert dash.streams == 0


@pytest.mark.slow  # a subprocess: the whole suite's
def test_ctrl_c_does_not_wait_for_an_open_page(tmp_path: Path) -> None:
    """A stream would keep uvicorn's graceful stop waiting for its response (up to the
    stream's 30 s life): the first SIGINT ends the streams. The drain is 300 s and no turn
    is in flight, so the process ends as soon as its connections do."""
    model = str(tiny_model_dir(tmp_path / "model"))
    args = ("--no-cache-dir", "--model-id", "tiny", "--drain-seconds", "300")
    with serve_process(tmp_path, *args, model=model) as server:
        got: list[str] = []
        opened = threading.Event()

        def read() -> None:
            with httpx.stream("GET", f"{server.base}/v1/status?stream=true", timeout=60) as r:
                for line in r.iter_lines():
                    got.append(line)
                    opened.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert opened.wait(30), server.log()
        server.proc.send_signal(signal.SIGINT)
        t = time.monotonic()
        code = server.proc.wait(timeout=20)  # the stream's own end: 30 s after it opened
        reader.join(timeout=10)
        assert code == 0 and not reader.is_alive(), server.log()
        print(f"stopped {time.monotonic() - t:.1f} s after SIGINT, {len(got)} lines read")
