"""The HTTP part of ``bench/agentic.py``: a round-robin trace replayed over HTTP against
``kvactor serve`` and ``mlx_lm.server`` (its default prompt cache of 10, and again with
``--prompt-cache-size`` set to the number of agents), each server restarted two thirds of
the way through the trace.

Both servers run as their own processes on 127.0.0.1 (free ports) and are stopped with
SIGTERM at the end of their block. mlx-lm's serves an mlx-lm folder exported from the
default model (the same float32 weights); both run MLX over the same optimized BLAS
(mlx-lm's through ``import kvactor``). Each step sends the agent's whole conversation with
the ``openai`` client (streaming, greedy); kvactor's requests name their agent
(``X-Agent-Id``) and the agents that run after it (``X-KVActor-Next``). Summed time to
first token before the restart gives ``vs_mlx_lm_server`` / ``vs_mlx_lm_server_sized``,
after it ``after_restart_vs_mlx_lm_server``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _agentic_trace import Trace, lookahead
from _process import free_port, server_process
from openai import OpenAI


@contextlib.contextmanager
def server(kind: str, model_dir: Path, cache_dir: Path, cache_size: int | None) -> Iterator[str]:
    """A server process on a free port of 127.0.0.1; yields its base URL, then stops it
    with SIGTERM (killed if it has not stopped within a minute)."""
    port = free_port()
    if kind == "kvactor":
        command = [sys.executable, "-m", "kvactor", "serve", "--port", str(port)]
        command += ["--cache-dir", str(cache_dir), "--model-id", "m"]
        ready = "/health"
    else:
        command = [sys.executable, "-c", "import kvactor; from mlx_lm.server import main; main()"]
        command += ["--model", str(model_dir), "--port", str(port), "--log-level", "WARNING"]
        if cache_size is not None:
            command += ["--prompt-cache-size", str(cache_size)]
        ready = "/v1/models"
    with server_process(kind, command, port, ready) as base:
        yield base


def _steps(
    base: str,
    kind: str,
    model: str,
    trace: Trace,
    span: range,
    histories: dict[str, list[dict[str, str]]],
    max_tokens: int,
) -> list[dict[str, Any]]:
    records = []
    client: Any  # typed loosely: plain dict messages
    with OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900) as client:
        for at in span:
            step = trace.steps[at]
            history = histories[step.agent]
            history.append({"role": "user", "content": step.text})
            headers = None
            if kind == "kvactor":
                following = lookahead(trace.order, at, len(trace.agents))
                headers = {"X-Agent-Id": step.agent, "X-KVActor-Next": ",".join(following)}
            t0 = time.perf_counter()
            first, text = None, ""
            stream = client.chat.completions.create(
                model=model,
                messages=history,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_headers=headers,
            )
            parts = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].delta.content
                info = (chunk.model_extra or {}).get("kvactor")
                if info:  # kvactor's finishing chunk: where the turn's time went
                    parts = {**info["timings"], "path": info["path"]}
            history.append({"role": "assistant", "content": text})
            records.append({"agent": step.agent, "ttft_s": (first or time.perf_counter()) - t0})
            records[-1]["text"] = text
            if parts is not None:
                records[-1]["parts"] = parts
    return records


def replay_http(
    kind: str,
    trace: Trace,
    model_dir: Path,
    cache_dir: Path,
    *,
    cache_size: int | None,
    max_tokens: int,
) -> dict[str, Any]:
    """The trace against one server, restarted two thirds of the way through."""
    cut = len(trace.steps) * 2 // 3
    model = "m" if kind == "kvactor" else str(model_dir)
    histories = {a: [{"role": "system", "content": trace.system}] for a in trace.agents}
    began = time.perf_counter()
    with server(kind, model_dir, cache_dir, cache_size) as base:
        before = _steps(base, kind, model, trace, range(cut), histories, max_tokens)
    with server(kind, model_dir, cache_dir, cache_size) as base:
        after = _steps(
            base, kind, model, trace, range(cut, len(trace.steps)), histories, max_tokens
        )
    return {
        "turns": before + after,
        "before_restart_parts": _parts(before),
        "summed_ttft_s": sum(r["ttft_s"] for r in before + after),
        "before_restart_ttft_s": sum(r["ttft_s"] for r in before),
        "after_restart_ttft_s": sum(r["ttft_s"] for r in after),
        "wall_s": time.perf_counter() - began,
    }


PARTS = ("parse_s", "prompt_s", "queue_s", "load_s", "prefill_s", "dequantize_s")


def _parts(turns: list[dict[str, Any]]) -> dict[str, float] | None:
    """kvactor's turns summed by part up to their first token (each turn's reply says
    them: ``kvactor.timings``), the client's time to first token beside them, ``other_s``
    what the parts leave of it (HTTP, routing, actor hops, the first piece's way back),
    and ``bound_s``: each turn's new tokens' forward and its first step (its prefill less
    the working copy), which no server can avoid. None for another server."""
    if not turns or any("parts" not in t for t in turns):
        return None
    out = {k: sum(t["parts"][k] for t in turns) for k in PARTS}
    out["client_ttft_s"] = sum(t["ttft_s"] for t in turns)
    apart = ("parse_s", "prompt_s", "queue_s", "prefill_s")
    out["other_s"] = out["client_ttft_s"] - sum(out[k] for k in apart)
    out["bound_s"] = out["prefill_s"] - out["dequantize_s"]
    return out


def http_results(trace: Trace, tmp: Path, max_tokens: int) -> dict[str, Any]:
    """kvactor against mlx-lm's server, default and sized, and the ratios."""
    from kvactor.actors.models import default_model_path, export_mlx_dir

    model_dir = tmp / "mlx-model"
    export_mlx_dir(default_model_path(), model_dir)
    runs = {
        "kvactor": ("kvactor", None),
        "mlx_lm_server": ("mlx_lm", None),
        "mlx_lm_server_sized": ("mlx_lm", len(trace.agents)),
    }
    out: dict[str, Any] = {
        name: replay_http(
            kind, trace, model_dir, tmp / f"http-{name}", cache_size=size, max_tokens=max_tokens
        )
        for name, (kind, size) in runs.items()
    }
    ours, theirs, sized = out["kvactor"], out["mlx_lm_server"], out["mlx_lm_server_sized"]
    out["vs_mlx_lm_server"] = ours["before_restart_ttft_s"] / theirs["before_restart_ttft_s"]
    out["vs_mlx_lm_server_sized"] = ours["before_restart_ttft_s"] / sized["before_restart_ttft_s"]
    out["after_restart_vs_mlx_lm_server"] = (
        ours["after_restart_ttft_s"] / theirs["after_restart_ttft_s"]
    )
    # Where kvactor's time to first token went before the restart, and the bound.
    out["kvactor_parts"] = ours["before_restart_parts"]
    out["bound_vs_mlx_lm_server_sized"] = (
        out["kvactor_parts"]["bound_s"] / sized["before_restart_ttft_s"]
    )
    pairs = zip(ours["turns"], theirs["turns"], strict=True)
    out["answers_equal"] = sum(a["text"] == b["text"] for a, b in pairs)
    out["agents"], out["steps"] = len(trace.agents), len(trace.steps)
    return out
