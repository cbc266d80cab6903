"""The demo's workload over HTTP: ``kvactor serve`` against mlx-lm's own server
(``mlx_lm.server``) on the same weights, same machine, one run.

Both servers run as their own processes on 127.0.0.1 (free ports). mlx-lm's serves an
mlx-lm model folder exported from the default model (``kvactor fetch-model --mlx-dir``:
the same float32 weights, bit-identical logits); kvactor serves the default model with the
demo's hot budget (83 MB: about two idle agents beside the running turn) and a fresh warm
tier. The workload is ``kvactor/scenarios/demo.toml``: six agents, three phases, each
prompt quoting the others' last answers, every agent's conversation resent in full each
turn by the ``openai`` client (streaming, greedy, 32 tokens), kvactor's requests naming
their agent with ``X-Agent-Id``. The first phases run on freshly started servers; then
both servers are restarted and the last phase runs (``after_restart``). Both processes run
MLX over the same optimized BLAS (mlx-lm's is started through ``import kvactor``).

Two more runs put the ratios in their place. ``kvactor_fp16``: kvactor storing its caches as
fp16 (``--codec fp16``), which separates what the 5/3-bit codec changes in the answers from
what the engine computes. ``mlx_lm_no_restart``: mlx-lm's server is not restarted before the
last phase, so each of its turns prefills only the tokens new to the conversation at
mlx-lm's own speed: against the restarted run, the ratio a server would reach that resumed
every conversation at no cost (``ttft_ratio_bound``, ``ttft_ratio_after_restart_bound``).

Printed: summed time to first token per run (all turns, before and after the restart),
kvactor's per path, the ratios, the bounds, and whether the greedy answers agree turn by
turn.

    python bench/serve.py [--json PATH] [--budget-mb 83]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
from _process import free_port, server_process  # bench/ is the script's folder: on sys.path
from _results import write_json
from openai import OpenAI

from kvactor.actors.models import default_model_path, export_mlx_dir
from kvactor.scenario import Scenario
from kvactor.scenario._format import load_scenario, turn_plan, turn_prompt

DEMO = Path(kvactor.__file__).parent / "scenarios" / "demo.toml"
MAX_TOKENS = 32


@contextlib.contextmanager
def server(
    kind: str, model_dir: Path, cache_dir: Path, budget_mb: float, codec: str = "default"
) -> Iterator[str]:
    """A server process on a free port; yields its base URL, stops it with SIGTERM."""
    port = free_port()
    if kind == "kvactor":
        command = [
            sys.executable,
            "-m",
            "kvactor",
            "serve",
            "--port",
            str(port),
            "--cache-dir",
            str(cache_dir),
            "--budget",
            str(int(budget_mb * 1e6)),
            "--model-id",
            "m",
            "--codec",
            codec,
        ]
        ready = "/health"
    else:
        # Through kvactor's import, which puts the same optimized BLAS under MLX (else
        # mlx-lm would run on the wheel's reference BLAS, ~40x slower here: not a fair peer).
        command = [
            sys.executable,
            "-c",
            "import kvactor; from mlx_lm.server import main; main()",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ]
        ready = "/v1/models"
    with server_process(kind, command, port, ready) as base:
        yield base


def run_phases(
    base: str,
    kind: str,
    model: str,
    s: Scenario,
    phases: list[int],
    histories: dict[str, list[dict[str, str]]],
    outputs: dict[str, str],
) -> list[dict[str, Any]]:
    """The turns of the given phases, in the demo's order; histories and outputs grow."""
    records = []
    client: Any  # typed loosely: plain dict messages
    with OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        for index, phase, names in turn_plan(s):
            if index not in phases:
                continue
            snapshot = dict(outputs)
            for name in names:
                history = histories[name]
                history.append({"role": "user", "content": turn_prompt(s, phase, name, snapshot)})
                headers = {"X-Agent-Id": name} if kind == "kvactor" else None
                t0 = time.perf_counter()
                first = None
                text, path = "", None
                stream = client.chat.completions.create(
                    model=model,
                    messages=history,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    stream=True,
                    extra_headers=headers,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text += chunk.choices[0].delta.content
                    info = (chunk.model_extra or {}).get("kvactor")
                    if info:
                        path = info["path"]
                wall = time.perf_counter() - t0
                history.append({"role": "assistant", "content": text})
                outputs[name] = text
                records.append(
                    {
                        "phase": index,
                        "agent": name,
                        "ttft_s": (first or time.perf_counter()) - t0,
                        "wall_s": wall,
                        "path": path,
                        "text": text,
                    }
                )
    return records


def workload(
    kind: str, model_dir: Path, cache_dir: Path, budget_mb: float, *, codec: str, restart: bool
) -> dict[str, Any]:
    """The demo's phases against one server kind; with ``restart`` the server is restarted
    before the last phase, else the last phase runs on the same server."""
    s = load_scenario(DEMO)
    last = len(turn_plan(s)) - 1
    model = "m" if kind == "kvactor" else str(model_dir)
    histories: dict[str, list[dict[str, str]]] = {
        a.name: [{"role": "system", "content": a.system}] if a.system else [] for a in s.agents
    }
    outputs: dict[str, str] = {}
    t0 = time.perf_counter()
    with server(kind, model_dir, cache_dir, budget_mb, codec) as base:
        before = run_phases(base, kind, model, s, list(range(last)), histories, outputs)
        if not restart:
            after = run_phases(base, kind, model, s, [last], histories, outputs)
    if restart:
        with server(kind, model_dir, cache_dir, budget_mb, codec) as base:
            after = run_phases(base, kind, model, s, [last], histories, outputs)
    return {
        "turns": before + after,
        "ttft_s": sum(r["ttft_s"] for r in before + after),
        "ttft_before_restart_s": sum(r["ttft_s"] for r in before),
        "ttft_after_restart_s": sum(r["ttft_s"] for r in after),
        "wall_s": time.perf_counter() - t0,
    }


def equal_answers(ours: dict[str, Any], theirs: dict[str, Any]) -> int:
    pairs = zip(ours["turns"], theirs["turns"], strict=True)
    return sum(a["text"] == b["text"] for a, b in pairs)


def main(budget_mb: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
        root = Path(tmp)
        model_dir = root / "mlx-model"
        export_mlx_dir(default_model_path(), model_dir)
        runs = {
            "kvactor": ("kvactor", "default", True),
            "kvactor_fp16": ("kvactor", "fp16", True),
            "mlx_lm": ("mlx_lm", "default", True),
            "mlx_lm_no_restart": ("mlx_lm", "default", False),
        }
        results = {
            name: workload(
                kind, model_dir, root / f"warm-{name}", budget_mb, codec=codec, restart=restart
            )
            for name, (kind, codec, restart) in runs.items()
        }
    ours, fp16, theirs = results["kvactor"], results["kvactor_fp16"], results["mlx_lm"]
    kept = results["mlx_lm_no_restart"]
    by_path: dict[str, list[float]] = {}
    for r in ours["turns"]:
        by_path.setdefault(r["path"] or "?", []).append(r["ttft_s"])
    return {
        "budget_mb": budget_mb,
        "max_tokens": MAX_TOKENS,
        **results,
        "kvactor_ttft_by_path": {
            p: {"turns": len(v), "sum_s": sum(v), "median_s": statistics.median(v)}
            for p, v in by_path.items()
        },
        "ttft_ratio": ours["ttft_s"] / theirs["ttft_s"],
        "ttft_ratio_after_restart": ours["ttft_after_restart_s"] / theirs["ttft_after_restart_s"],
        "answers_equal": equal_answers(ours, theirs),
        "turns": len(ours["turns"]),
        # kvactor storing its caches as fp16: how much of the difference is the 5/3-bit codec.
        "ttft_ratio_fp16": fp16["ttft_s"] / theirs["ttft_s"],
        "ttft_ratio_after_restart_fp16": (
            fp16["ttft_after_restart_s"] / theirs["ttft_after_restart_s"]
        ),
        "answers_equal_fp16": equal_answers(fp16, theirs),
        # A server that resumed every conversation at no cost and prefilled its new tokens at
        # mlx-lm's own speed: mlx-lm's server never restarted, against the restarted one.
        "ttft_ratio_bound": (theirs["ttft_before_restart_s"] + kept["ttft_after_restart_s"])
        / theirs["ttft_s"],
        "ttft_ratio_after_restart_bound": kept["ttft_after_restart_s"]
        / theirs["ttft_after_restart_s"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=83.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    out = main(args.budget_mb)
    print("| server | summed TTFT | before restart | after restart | wall |")
    print("|---|---:|---:|---:|---:|")
    for name in ("kvactor", "kvactor_fp16", "mlx_lm", "mlx_lm_no_restart"):
        r = out[name]
        print(
            f"| {name} | {r['ttft_s']:.2f} s | {r['ttft_before_restart_s']:.2f} s "
            f"| {r['ttft_after_restart_s']:.2f} s | {r['wall_s']:.1f} s |"
        )
    print(
        f"kvactor / mlx-lm summed TTFT: {out['ttft_ratio']:.2f}x "
        f"(after the restart: {out['ttft_ratio_after_restart']:.2f}x); "
        f"greedy answers equal in {out['answers_equal']} of {out['turns']} turns"
    )
    print(
        f"kvactor storing fp16: {out['ttft_ratio_fp16']:.2f}x "
        f"(after the restart: {out['ttft_ratio_after_restart_fp16']:.2f}x); "
        f"greedy answers equal in {out['answers_equal_fp16']} of {out['turns']} turns"
    )
    print(
        f"bound (every conversation resumed free, new tokens at mlx-lm's speed): "
        f"{out['ttft_ratio_bound']:.2f}x (after the restart: "
        f"{out['ttft_ratio_after_restart_bound']:.2f}x)"
    )
    for path, row in out["kvactor_ttft_by_path"].items():
        print(
            f"  kvactor {path}: {row['turns']} turns, {row['sum_s']:.2f} s "
            f"(median {row['median_s']:.2f} s)"
        )
    if args.json:
        write_json(args.json, out)
