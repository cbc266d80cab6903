"""The shipped examples run as a user runs them (the default model: slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_tool_agents_calls_real_tools_and_extends_each_cache() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tool_agents.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    lines = done.stdout.splitlines()
    calls = [line for line in lines if " calls " in line and " -> " in line]
    assert len(calls) >= 3, done.stdout  # every agent's first step must call a tool
    assert any("calls calculator(" in line for line in calls)
    assert any("calls lookup(" in line for line in calls)
    reused = [line for line in lines if "result turn reused" in line]
    assert reused and all("(extend)" in line for line in reused), done.stdout
    assert not any("<tool_call>" in line for line in lines if "answer:" in line)
