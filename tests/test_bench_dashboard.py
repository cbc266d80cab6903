"""``bench/dashboard.py`` in its quick mode (the tiny model, one round of each kind, three
real headless Chromium pages): every figure is there, and the pages polled while they were
open. Skips without Chromium, chromedriver or selenium."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import dashboard  # bench/ is not a package: its folder on sys.path

KEYS = (
    "decode_tok_s_no_dashboard",
    "decode_tok_s_three_dashboards",
    "dashboard_cost",
    "dashboard_cost_of_medians",
    "status_ms",
    "status_ms_decoding",
    "status_requests_per_s",
    "cpu_share",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


@pytest.mark.slow  # a bench's run with three browsers, seconds: the whole suite's
async def test_the_quick_bench_reports_the_dashboards_cost() -> None:
    why = dashboard.missing()
    if why is not None:
        pytest.skip(why)
    out = await dashboard.main(1, 2, 32, True)
    assert set(KEYS) <= set(out)
    assert out["decode_tok_s_no_dashboard"] > 0 and out["decode_tok_s_three_dashboards"] > 0
    assert out["status_requests_per_s"] > 0  # the pages polled during their rounds
    assert out["status_ms"] > 0 and out["status_ms_decoding"] > 0
    assert "| dashboard cost (median of rounds' 1 - three / none) |" in dashboard._table(out)
    assert len(out["rounds_cost"]) == out["rounds"]
    cpu = out["cpu_share"]
    assert set(cpu) == {"none", "three"} and cpu["three"]["kvactor"] > 0
    # The pages' own work while they poll is the CPU time of the Chromium processes alive
    # at the span's ends, in 10 ms ticks: over a quick round of a fraction of a second a
    # renderer that starts or ends inside it makes the share anything (0, and outside
    # [0, 1], seen in whole-suite runs).
    # That the pages polled is checked above; here, that the figure is there.
    assert all(math.isfinite(c["browsers"]) for c in cpu.values())


@pytest.mark.slow  # a real Chromium
def test_the_bench_renices_its_own_browsers_alone() -> None:
    why = dashboard.missing()
    if why is not None:
        pytest.skip(why)
    with dashboard.browsers(1) as pages:
        pages[0].get("data:text/html,<p>a page</p>")  # a renderer of the visit
        dashboard.renice_browsers(pages, 19)
        tree = dashboard.descendants(pages[0].service.process.pid)
        nices = [os.getpriority(os.PRIO_PROCESS, pid) for pid in tree]
        mine = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert len(tree) > 2 and set(nices) == {19}  # chromedriver, Chromium and its helpers
    assert mine != 19  # this process is not one of them


@pytest.mark.slow  # a bench's run, seconds
async def test_the_pollers_ask_for_the_status_as_the_pages_do() -> None:
    # No browser: the server's part alone, its clients a process of plain HTTP pollers.
    out = await dashboard.main(1, 2, 32, True, pollers=True)
    assert out["clients"] == "pollers" and out["status_requests_per_s"] > 0
    assert len(out["rounds_cost"]) == out["rounds"]
