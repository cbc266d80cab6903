"""Remake docs/dashboard.png: the dashboard in the middle of a run under memory pressure.

It writes a scenario (twelve agents of the default model, four phases, each prompt
quoting the others' last answers, a 52 MB hot budget: two running turns and a
few idle caches, two turns at once, prefetch on), runs it with ``kvactor run --dashboard 0`` and
opens the page in headless Chromium (a 1400 x 1150 window: the page's cards and the
table's first rows). Once the run has gone on for
``--after`` seconds and the page shows demotions and reloads on its timeline and both hot
and warm agents in its table, it takes the screenshot, then stops the run (SIGINT).

    python tools/dashboard_screenshot.py [--out docs/dashboard.png] [--after 25]

Needs ``chromium``, ``chromedriver`` and ``selenium`` (the test extra); the default model
is fetched if it is not yet. The shot comes 1-2 minutes in on two cores. Known: the
budget is too small for the last phases' turns (a prompt quoting eleven answers needs ~71
MB of working cache), so a run left alone fails there, after the shot; the script stops
it first.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _chromium import chromium  # noqa: E402 (the launch the dashboard's tests use)

AGENTS = 12
ROLES = ("planner", "coder", "reviewer", "tester", "writer", "critic", "designer")
PHASES = (
    ("propose", "Our task: {task}. As the {agent}, give your first idea in two sentences."),
    ("respond", "The team said:\n\n{outputs}\n\nAs the {agent}, respond in two sentences."),
    ("refine", "The team said:\n\n{outputs}\n\nAs the {agent}, refine your part."),
    ("decide", "The team said:\n\n{outputs}\n\nAs the {agent}, say what to do first."),
)
# What the page shows, read from its DOM: the timeline's marks and the table's tiers.
SHOWN = """
const tiers = [...document.querySelectorAll('#agents td.tier')].map(t => t.dataset.tier);
return {
  state: document.getElementById('state').dataset.state,
  demoted: document.querySelectorAll('#timeline line.demoted').length,
  reloaded: document.querySelectorAll('#timeline line.reloaded').length,
  hot: tiers.filter(t => t === 'hot').length,
  warm: tiers.filter(t => t === 'warm').length,
};
"""


def scenario(folder: Path) -> Path:
    """The scenario's TOML in ``folder`` (its warm tier under ``folder/cache``)."""
    lines = [
        'name = "dashboard_screenshot"',
        'task = "a command-line todo app in Python that keeps its tasks in a JSON file"',
        'model = "default"',
        'cache_dir = "cache"',
        "budget_mb = 52",  # two running turns (24 MB each) and a few idle caches (~1 MB)
        'policy = "workflow"',
        "concurrency = 2",
        "prefetch = true",
        "cold_reference = false",
        "",
        "[sampling]",
        "max_tokens = 16",
        "temperature = 0.0",
    ]
    for i in range(AGENTS):
        role = ROLES[i % len(ROLES)]
        lines += ["", "[[agents]]", f'name = "{role}{i // len(ROLES) + 1}"']
        lines.append(f'system = "You are the {role} of a software team. You answer briefly."')
    for name, prompt in PHASES:
        lines += ["", "[[phases]]", f'name = "{name}"', f'prompt = """{prompt}"""']
    path = folder / "screenshot.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def take(out: Path, after_s: float, width: int, height: int) -> dict[str, object]:
    """Run the scenario and take the screenshot (see the module doc); what the page showed."""
    with tempfile.TemporaryDirectory(prefix="kvactor-shot-") as tmp:
        path = scenario(Path(tmp))
        cmd = [sys.executable, "-m", "kvactor", "run", str(path), "--fresh", "--dashboard", "0"]
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, text=True, env=os.environ)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if not first.startswith("dashboard: "):
                raise RuntimeError(f"kvactor run printed {first!r}")
            with chromium("--hide-scrollbars", window=(width, height)) as driver:
                driver.get(first.split()[1])
                started = time.monotonic()
                while True:
                    shown = driver.execute_script(SHOWN)
                    if shown["state"] == "final":
                        raise RuntimeError(f"the run ended before the page showed enough: {shown}")
                    if (
                        time.monotonic() - started >= after_s
                        and shown["demoted"] >= 5
                        and shown["reloaded"] >= 3
                        and shown["hot"] >= 1
                        and shown["warm"] >= 3
                    ):
                        break
                    time.sleep(0.5)  # the page polls every second
                out.write_bytes(driver.get_screenshot_as_png())
                return dict(shown, seconds=round(time.monotonic() - started, 1))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--after", type=float, default=25.0, help="seconds into the run")
    parser.add_argument("--size", default="1400x1150", help="the window (the page: ~140 px less)")
    args = parser.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    shown = take(args.out, args.after, w, h)
    print(f"{args.out}: {args.out.stat().st_size / 1e3:.0f} KB; the page showed {shown}")
