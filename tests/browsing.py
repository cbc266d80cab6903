"""Helpers of the dashboard's browser tests: the distribution's Chromium, headless, driven
by Selenium through the distribution's chromedriver (:func:`chromium`; the tests skip,
saying why, where either is missing: ``./dev`` installs them when it runs as root), and
the page's agents table as the browser shows it (:func:`shown_tiers`)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

# Without the background-networking flags Chromium dials out at start, and the closed
# network here refuses it (errors in its log, slow starts).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def missing() -> str | None:
    """Why no browser test can run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra has it)"
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "no chromium / chromedriver: apt-get install chromium chromium-driver"
    return None


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium with a fresh profile, its console log kept; skips the test
    when there is none to drive."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="kvactor-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            yield driver
        finally:
            driver.quit()


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
