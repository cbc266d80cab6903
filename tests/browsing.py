"""Helpers of the dashboard's browser tests: the distribution's Chromium, headless, driven
by Selenium through the distribution's chromedriver (:func:`chromium`; the tests skip,
saying why, where either is missing: ``./dev`` installs them when it runs as root), and
the page's agents table as the browser shows it (:func:`shown_tiers`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _chromium import chromium as launched  # one launch for tests, bench and tools
from _chromium import missing as missing


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium with a fresh profile, its console log kept; skips the test
    when there is none to drive."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    with launched(console=True) as driver:
        yield driver


def console_errors(driver: Any) -> list[str]:
    """The page's console messages at level SEVERE since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def shown_tiers(driver: Any) -> dict[str, str]:
    """Each agent row of the page's table: its id and the tier it shows."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#agents tbody tr')]"
        ".map(r => [r.dataset.agent, r.querySelector('td.tier').dataset.tier]);"
    )
    return {agent: tier for agent, tier in rows}


def page_state(driver: Any) -> str:
    """What the page says of its connection: starting, live, reconnecting or final."""
    return str(driver.execute_script("return document.getElementById('state').dataset.state;"))


def wait_until(driver: Any, check: Callable[[Any], Any], timeout: float, what: str) -> Any:
    """``check(driver)``'s first truthy answer within ``timeout`` seconds (Selenium's
    wait, polling every 50 ms). Raises AssertionError saying ``what`` did not happen."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(check)
    except TimeoutException:
        raise AssertionError(f"within {timeout} s: {what}") from None
