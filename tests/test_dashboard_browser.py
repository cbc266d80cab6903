"""The dashboard in a real browser (issue 41): the distribution's headless Chromium driven
by Selenium (tests/browsing.py; skipped, saying why, where there is none). The page loads
without console errors, its table follows each agent's tier within 2 s while the engine
demotes and reloads, a tenant's key shows its own agents and an admin's all, and the page
reconnects to a restarted server."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from browsing import chromium, console_errors, page_state, shown_tiers, wait_until
from serving import running, serve_process, tiny_model_dir
from test_dashboard import AGENTS, ALICE, BUDGET, KEYS, ROOT, auth, sampled_after, turn

SHOWN_WITHIN_S = 2.0  # what the issue asks of the page: a tier change shown within 2 s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


async def in_browser(driver: Any, call: Any, *args: Any) -> Any:
    """A blocking Selenium call on a worker thread: the server keeps running meanwhile."""
    return await anyio.to_thread.run_sync(call, driver, *args)


async def test_the_page_follows_every_tier_change(tmp_path: Path) -> None:
    with chromium() as driver:
        async with (
            running(budget_bytes=BUDGET, cache_dir=tmp_path) as (_, base),
            httpx.AsyncClient(timeout=60) as http,
        ):
            await in_browser(driver, lambda d: d.get(f"{base}/dashboard"))
            await in_browser(
                driver, wait_until, lambda d: page_state(d) == "live", 10, "the page is live"
            )
            assert console_errors(driver) == []
            changes = 0
            before: dict[str, str] = {}
            for step in range(2):
                for agent in AGENTS:
                    await turn(http, base, agent, step)
                    # A sample taken after the turn (one is shared for a quarter second:
                    # a fast machine runs several turns within one)
                    fresh = await sampled_after(http, base, time.time())
                    truth = {r["id"]: r["tier"] for r in fresh["agents"]}
                    changes += sum(before.get(a) not in (None, t) for a, t in truth.items())
                    before = truth
                    await in_browser(
                        driver,
                        wait_until,
                        lambda d, want=truth: shown_tiers(d) == want,
                        SHOWN_WITHIN_S,
                        f"the table shows {truth}",
                    )
            assert changes >= 4  # demotions and reloads happened, and the page showed each
            texts = await in_browser(driver, lambda d: d.find_element("tag name", "body").text)
            assert "memory limit" in texts and "hot budget" in texts and "tok/s" in texts
            disk = await in_browser(
                driver, lambda d: d.find_element("css selector", "#disk .bar-label").text
            )
            assert fresh["disk"] is not None and " free of " in disk, disk  # as the memory bars
            assert "zebra" not in texts  # no prompt text on the page
            assert console_errors(driver) == []


async def test_a_tenant_key_shows_its_agents_and_the_admin_key_all() -> None:
    with chromium() as driver:
        async with running(app_options=KEYS) as (_, base), httpx.AsyncClient(timeout=60) as http:
            for agent in ("a1", "a2"):
                await turn(http, base, agent, 0, auth(ALICE))
            await turn(http, base, "b1", 0, auth("bob:key-of-bob-22"))
            key = ALICE.partition(":")[2]
            await in_browser(driver, lambda d: d.get(f"{base}/dashboard#key={key}"))
            await in_browser(
                driver,
                wait_until,
                lambda d: set(shown_tiers(d)) == {"a1", "a2"},
                10,
                "alice's agents alone",
            )
            await in_browser(driver, lambda d: d.get(f"{base}/dashboard#key={ROOT}"))
            want = {"alice.a1", "alice.a2", "bob.b1"}
            await in_browser(
                driver, wait_until, lambda d: set(shown_tiers(d)) == want, 10, "every agent"
            )
            assert console_errors(driver) == []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow  # two server processes, one after the other
def test_the_page_reconnects_when_the_server_restarts(tmp_path: Path) -> None:
    model = str(tiny_model_dir(tmp_path / "model", context=4096))
    port, cache = str(_free_port()), str(tmp_path / "cache")
    args = ("--port", port, "--cache-dir", cache)
    with chromium() as driver:

        def chat(base: str, agent: str) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Agent-Id": agent})
            assert r.status_code == 200, r.text

        with serve_process(tmp_path, *args, model=model) as first:
            chat(first.base, "before")
            driver.get(f"{first.base}/dashboard")
            wait_until(driver, lambda d: "before" in shown_tiers(d), 10, "the first agent")
            first.proc.kill()
            first.proc.wait()
            wait_until(driver, lambda d: page_state(d) == "reconnecting", 10, "reconnecting")
        with serve_process(tmp_path, *args, model=model) as second:
            chat(second.base, "after")
            wait_until(
                driver,
                lambda d: page_state(d) == "live" and {"before", "after"} <= set(shown_tiers(d)),
                10,
                "live again, with the agent of the restarted server",
            )
            assert shown_tiers(driver)["before"] == "warm"  # found on disk by the new server
