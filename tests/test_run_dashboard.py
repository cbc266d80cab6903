"""``kvactor run --dashboard`` (issue 41): a real ``kvactor run`` process serves the page
and ``/v1/status`` for its scenario while it runs (caches demoted and reloaded under a
small budget), then its final state until SIGINT; the page shows that state in a real
browser (skipped without one)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from browsing import chromium, console_errors, missing, page_state, shown_tiers, wait_until

SCENARIO = Path(__file__).parent / "data" / "dashboard_run.toml"


@pytest.mark.slow  # a kvactor process: the whole suite's
def test_run_serves_its_dashboard_during_and_after_the_run(tmp_path: Path) -> None:
    scenario = tmp_path / SCENARIO.name
    shutil.copy(SCENARIO, scenario)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvactor", "run", str(scenario), "--fresh", "--dashboard", "0"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # printed once it listens, before the run starts
        assert first.startswith("dashboard: http://127.0.0.1:"), first + proc.stderr.read()
        url = first.split()[1]
        base = url.removesuffix("/dashboard")
        deadline = time.monotonic() + 120
        while True:  # the run is over when the status says final
            s = httpx.get(f"{base}/v1/status", timeout=10).json()
            if s["final"]:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        assert s["totals"]["agents"] == 10 and len(s["agents"]) == 10
        assert s["counters"]["demoted_warm"] > 0 and s["counters"]["reloads"] > 0
        kinds = {(e["kind"], e.get("path") or e.get("to")) for e in s["events"]}
        assert ("demoted", "warm") in kinds and ("turn", "warm") in kinds, kinds
        assert sum(e["kind"] == "turn" for e in s["events"]) == 30
        if missing() is None:
            with chromium() as driver:
                driver.get(url)
                wait_until(driver, lambda d: page_state(d) == "final", 10, "the final state")
                assert len(shown_tiers(driver)) == 10 and console_errors(driver) == []
        assert proc.poll() is None  # still serving the final state
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "shows its final state; Ctrl-C stops" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
