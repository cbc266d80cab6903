"""The distribution's Chromium, headless, driven by Selenium through the distribution's
chromedriver: one launch for the dashboard's browser tests (``tests/browsing.py``), its
cost bench (``bench/dashboard.py``) and its screenshot (``tools/dashboard_screenshot.py``)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

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
)


def missing() -> str | None:
    """Why no browser can be driven here (None: one can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra has it)"
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "no chromium / chromedriver: apt-get install chromium chromium-driver"
    return None


@contextlib.contextmanager
def chromium(
    *flags: str, window: tuple[int, int] = (1400, 1000), console: bool = False
) -> Iterator[Any]:
    """A headless Chromium (a Selenium driver) with a fresh profile, its window ``window``
    and ``flags`` besides the usual ones (``console``: its console log kept, for
    ``driver.get_log("browser")``); quit, its profile deleted, with the block."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="kvactor-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, *flags, f"--window-size={window[0]},{window[1]}"):
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        if console:
            options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            yield driver
        finally:
            driver.quit()
