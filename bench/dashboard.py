"""What the live dashboard costs: decode tok/s of agents decoding together while three
headless Chromium pages have ``/dashboard`` open and live, against none, in one run.

A session on the default model (with a warm tier in a scratch folder) is served in this
process on 127.0.0.1 (a free port). Three Chromium pages (the distribution's, driven by
Selenium, the flags of the dashboard's tests) are started once, before anything is timed;
for a ``three`` round they open ``/dashboard`` and wait until it is live, for a ``none``
round they go to ``about:blank``, so that only the pages' reading differs (each reads
``/v1/status`` as a stream: a status as it changes, at most one a second, the session
sampled at most every 0.25 s). Each round, ``--agents`` new agents (4) each decode
``--tokens`` greedy tokens (64) together through the Python API; what counts is the
window in which all of them decode (from the last one's first token to the first one's
last, as ``bench/decode_batch.py`` counts). Rounds alternate (none, three, three, none,
none, three...: each round's pair in both orders) after one untimed round,
``--rounds`` of each (3); figures are medians:

- ``decode_tok_s_no_dashboard``, ``decode_tok_s_three_dashboards``, ``dashboard_cost``
  (the median over rounds of 1 - three / none; target <= 0.02) and
  ``dashboard_cost_of_medians`` (1 - the median three / the median none);
- ``status_ms``: the median ``GET /v1/status`` as a client times it, each asked when the
  last sample is stale (a fresh sample: the session asked), the agents idle; and
  ``status_ms_decoding``, the same while the agents decode (an extra, untimed round);
- ``status_requests_per_s``: the statuses sent to the pages per second (a stream's
  events, or answers to single requests) from their load to the end of each ``three``
  round (proof they read);
- the bound, where the CPU goes during each round's decode window (Linux): ``cpu_share``
  by kind of round, the share of the machine's cores (CPU seconds over the window's wall
  seconds times the cores) used by the Chromium processes (``browsers``) and by this
  process (``kvactor``: the engine, the server, the board), medians over rounds.

The three browsers run on this machine's CPUs beside the engine: their rendering is part of
what is measured. ``--browsers-nice N`` (Linux) runs the bench's own Chromium processes
(the tree under each chromedriver) at niceness ``N`` (19: they get the CPU only where
the engine leaves it), the bound of the server's own
part on a machine with no core to spare for a browser (``browsers_nice`` in the JSON).
``--pollers`` opens no browser: a ``three`` round runs a process of three plain HTTP
clients reading ``/v1/status`` streams and parsing each status, as the pages do
(``clients``: ``pollers``): the server's part alone. The bench stops its server,
browsers and pollers itself.

    python bench/dashboard.py [--rounds 3] [--agents 4] [--tokens 64] [--json PATH] [--quick]
        [--browsers-nice N] [--pollers]

``--quick`` runs on a tiny random model, one round of each (a smoke test, not a
measurement). Needs ``chromium`` and ``chromedriver`` on the PATH and ``selenium``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio
import httpx
from _chromium import chromium, missing
from _results import figure_table, write_json  # bench/ is the script's folder: on sys.path
from _serving import served
from decode_batch import measure as decode_round

from kvactor.server._app import create_app

PAGES = 3
TARGET = 0.02


@contextlib.contextmanager
def browsers(n: int) -> Iterator[list[Any]]:
    """``n`` headless Chromium pages on ``about:blank``, each with a fresh profile; quit
    with the block."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(chromium()) for _ in range(n)]


def show(drivers: list[Any], url: str | None) -> None:
    """Each page to the dashboard at ``url``, live (None: to ``about:blank``)."""
    from selenium.webdriver.support.ui import WebDriverWait

    for driver in drivers:
        driver.get(url or "about:blank")
    if url is None:
        return
    live = "return document.getElementById('state').dataset.state === 'live';"
    for driver in drivers:
        WebDriverWait(driver, 60, poll_frequency=0.05).until(lambda d: d.execute_script(live))


class Counted:
    """An ASGI app that counts the statuses ``/v1/status`` sends (answers and a stream's
    events)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.status = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/status":
            return await self.app(scope, receive, send)

        async def counted(message: Any) -> None:  # a status sent: an answer or an event
            if message["type"] == "http.response.body" and message.get("body"):
                self.status += 1
            await send(message)

        await self.app(scope, receive, counted)


def browser_pids() -> Iterator[int]:
    """The Chromium processes alive now (none without ``/proc``)."""
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith(("chrom", "headless")):
                    yield int(pid)
        except OSError:  # gone meanwhile
            continue


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command's name (the state first), or None
    when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return None


def browsers_cpu_s() -> float:
    """The CPU seconds every Chromium process alive now has used (0 without ``/proc``)."""
    total = 0
    for pid in browser_pids():
        if (fields := stat_fields(pid)) is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime: clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it alive now (``[root]`` without ``/proc``)."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit() and (fields := stat_fields(pid)) is not None:
            children.setdefault(int(fields[1]), []).append(int(pid))  # by its parent
    out: list[int] = []
    todo = [root]
    while todo:
        at = todo.pop()
        out.append(at)
        todo += children.get(at, [])
    return out


def renice_browsers(drivers: list[Any], nice: int) -> None:
    """The processes of ``drivers`` (each chromedriver and the Chromium below it) to
    niceness ``nice``: those Chromium starts later inherit it from its browser process and
    zygote, and a visit's new renderers are reniced after it (``main``)."""
    for driver in drivers:
        for pid in descendants(driver.service.process.pid):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.setpriority(os.PRIO_PROCESS, pid, nice)


# A page's reading without a browser: ``n`` threads each reading ``/v1/status`` as a
# stream and parsing each status, as the page does (stdlib only: nothing to import for long).
POLLER = """
import json, sys, threading, time, urllib.request
base, n = sys.argv[1], int(sys.argv[2])
def ask():
    with urllib.request.urlopen(base + "/v1/status", timeout=60) as r:
        json.loads(r.read())
def poll():
    while True:  # a stream ends after its life: the next one at once, as the page does
        with urllib.request.urlopen(base + "/v1/status?stream=true", timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    json.loads(line[6:])
ask()
print("ready", flush=True)
for _ in range(n):
    threading.Thread(target=poll, daemon=True).start()
sys.stdin.read()  # until the bench closes it
"""


class Clients:
    """What a ``three`` round opens against ``none``: ``PAGES`` Chromium pages on
    ``/dashboard`` (at niceness ``nice`` when not 0), or with ``pollers`` a process of
    ``PAGES`` plain HTTP clients polling ``/v1/status`` as the pages do (the server's own
    part, no browser)."""

    def __init__(self, pages: list[Any], base: str, *, nice: int, pollers: bool) -> None:
        self.pages, self.base, self.nice, self.pollers = pages, base, nice, pollers
        self._poller: subprocess.Popen[str] | None = None

    def open(self, kind: str) -> None:
        """Open what ``kind`` ("three" or "none") has, live, before a round."""
        if self.pollers:
            self.close()
            if kind == "three":
                self._poller = subprocess.Popen(
                    [sys.executable, "-c", POLLER, self.base, str(PAGES)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert self._poller.stdout is not None
                if self._poller.stdout.readline().strip() != "ready":
                    raise RuntimeError("the pollers did not start")
            return
        show(self.pages, f"{self.base}/dashboard" if kind == "three" else None)
        if self.nice:  # the pages' renderers too, started by the visit
            renice_browsers(self.pages, self.nice)

    def close(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            assert poller.stdin is not None and poller.stdout is not None
            poller.stdin.close()
            poller.wait(timeout=30)
            poller.stdout.close()


class CpuShare:
    """The share of the machine's cores the browsers and this process use over a span."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.browsers, self.own = browsers_cpu_s(), time.process_time()

    def shares(self) -> dict[str, float]:
        wall = (time.perf_counter() - self.t) * (os.cpu_count() or 1)
        return {
            "browsers": (browsers_cpu_s() - self.browsers) / wall,
            "kvactor": (time.process_time() - self.own) / wall,
        }


async def status_ms(http: httpx.AsyncClient, base: str, n: int) -> list[float]:
    """``n`` timed ``GET /v1/status``, each after the last sample went stale (0.25 s)."""
    out = []
    for _ in range(n):
        await anyio.sleep(0.3)  # the board shares a sample younger than 0.25 s
        t0 = time.perf_counter()
        r = await http.get(f"{base}/v1/status")
        out.append((time.perf_counter() - t0) * 1e3)
        r.raise_for_status()
    return out


async def main(
    rounds: int, agents: int, tokens: int, quick: bool, nice: int = 0, pollers: bool = False
) -> dict[str, Any]:
    """The figures of the module doc. Raises RuntimeError where no browser can run."""
    why = None if pollers else missing()
    if why is not None:
        raise RuntimeError(why)
    spec: Any = None
    if quick:
        from kvactor.actors.models import make_tiny_model

        spec = functools.partial(make_tiny_model, 0, head_dim=64)
    rates: dict[str, list[float]] = {"none": [], "three": []}
    shares: dict[str, list[dict[str, float]]] = {"none": [], "three": []}
    polled = polled_s = 0.0
    with tempfile.TemporaryDirectory(prefix="kvactor-bench-dash-") as tmp:
        async with kvactor.open(spec, cache_dir=Path(tmp)) as kv:
            app = Counted(create_app(kv))
            async with served(app) as base, httpx.AsyncClient(timeout=60) as http:
                opened: contextlib.AbstractContextManager[list[Any]] = (
                    contextlib.nullcontext([]) if pollers else browsers(PAGES)
                )
                with (
                    opened as pages,
                    contextlib.closing(Clients(pages, base, nice=nice, pollers=pollers)) as clients,
                ):
                    if nice:
                        renice_browsers(pages, nice)
                    await decode_round(kv, agents, tokens, "warmup")  # untimed
                    for r in range(rounds):
                        # ABBA: each pair in both orders, so a drift within a pair cancels.
                        order = ("none", "three") if r % 2 == 0 else ("three", "none")
                        for kind in order:
                            before, t0 = app.status, time.perf_counter()  # from the page's load
                            await anyio.to_thread.run_sync(clients.open, kind)
                            span = CpuShare()
                            rate = await decode_round(kv, agents, tokens, f"{kind}{r}")
                            shares[kind].append(span.shares())
                            rates[kind].append(rate)
                            if kind == "three":
                                polled += app.status - before
                                polled_s += time.perf_counter() - t0
                    await anyio.to_thread.run_sync(clients.open, "none")
                idle = await status_ms(http, base, 5 if quick else 15)
                busy: list[float] = []
                async with anyio.create_task_group() as tg:

                    async def probe() -> None:
                        busy.extend(await status_ms(http, base, 3 if quick else 8))

                    tg.start_soon(probe)
                    while not busy:  # decode until the probe is done
                        await decode_round(kv, agents, tokens, f"probe{len(busy)}")
    none, three = statistics.median(rates["none"]), statistics.median(rates["three"])
    # The cost of each round's pair, then their median: steadier than a ratio of medians on
    # a machine whose rate drifts between rounds (both are reported).
    pairs = [1 - t / n for n, t in zip(rates["none"], rates["three"], strict=True)]
    return {
        "model": "tiny (random)" if quick else "default",
        "quick": quick,
        "blas": kvactor.BLAS.name,
        "agents": agents,
        "tokens": tokens,
        "rounds": rounds,
        "pages": PAGES,
        "browsers_nice": nice,
        "clients": "pollers" if pollers else "chromium",
        "decode_tok_s_no_dashboard": none,
        "decode_tok_s_three_dashboards": three,
        "dashboard_cost": statistics.median(pairs),
        "dashboard_cost_of_medians": 1 - three / none,
        "rounds_cost": pairs,
        "rounds_tok_s": rates,
        "status_ms": statistics.median(idle),
        "status_ms_decoding": statistics.median(busy),
        "status_requests_per_s": polled / polled_s if polled_s else 0.0,
        "cpu_share": {
            kind: {who: statistics.median(s[who] for s in spans) for who in ("browsers", "kvactor")}
            for kind, spans in shares.items()
        },
    }


def _table(out: dict[str, Any]) -> str:
    cost = out["dashboard_cost"]
    return figure_table(
        [
            ("decode tok/s, no dashboard", f"{out['decode_tok_s_no_dashboard']:.1f}", "", ""),
            (
                f"decode tok/s, {out['pages']} dashboards",
                f"{out['decode_tok_s_three_dashboards']:.1f}",
                "",
                "",
            ),
            (
                "dashboard cost (median of rounds' 1 - three / none)",
                f"{cost:+.3f}",
                f"<= {TARGET}",
                cost <= TARGET,
            ),
            (
                "dashboard cost (1 - median three / median none)",
                f"{out['dashboard_cost_of_medians']:+.3f}",
                "",
                "",
            ),
            ("GET /v1/status, idle (median)", f"{out['status_ms']:.1f} ms", "", ""),
            ("GET /v1/status, decoding (median)", f"{out['status_ms_decoding']:.1f} ms", "", ""),
            ("status requests/s (three pages)", f"{out['status_requests_per_s']:.2f}", "", ""),
            *(
                (
                    f"CPU share, {kind} round: browsers / kvactor",
                    f"{cpu['browsers']:.3f} / {cpu['kvactor']:.3f}",
                    "",
                    "",
                )
                for kind, cpu in out["cpu_share"].items()
            ),
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a tiny random model, one round")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--browsers-nice",
        type=int,
        default=0,
        metavar="N",
        help="run the Chromium processes at this niceness (19: the server's own part)",
    )
    parser.add_argument(
        "--pollers",
        action="store_true",
        help="plain HTTP clients polling /v1/status as the pages do, instead of Chromium",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    results = anyio.run(
        main, args.rounds, args.agents, args.tokens, args.quick, args.browsers_nice, args.pollers
    )
    print(_table(results))
    if args.json:
        write_json(args.json, results)
