"""Two models in one session under one memory limit, against two separate sessions.

Workload: ``--agents`` agents per model (2), ``--turns`` rounds (4); each round every agent
takes one greedy turn of ``--max-tokens`` (8), the models' agents taking turns one after
another (router's, coder's, router's, ...), so that with a limit that holds one model the
session swaps models at every turn of the other model.

- one session: ``kvactor.open(models={"router": A, "coder": B}, memory_limit=L,
  cache_dir=tmp)``. ``L`` (``--limit``, bytes; default: sized by
  ``kvactor.actors.memory_limit`` to the larger model's weights, activations, the larger
  of one turn and what loading it holds at its peak beyond the weights (measured), and a
  sixteenth for MLX's kept buffers, plus 1/8 of a turn for the caches: room for one model
  at a time).
- separate: two sessions (one per model, ``memory_limit=None``, their own ``cache_dir``),
  open at the same time, the same turns in the same order.

Output (``--json PATH``): ``limit_bytes``; ``peak_bytes``: the larger of the session's own
count's peak (``stats().memory_peak_bytes``: weights, activations, hot tiers, MLX's kept
buffers) and MLX's measured peak (``mlx_peak_bytes``: ``mx.get_peak_memory()`` plus the
kept buffers, sampled each engine step); ``model_loads`` (loads that turns caused);
``swap_s`` (median seconds of an unload and the load that followed); ``ttft_s`` per model
(median over its turns); ``separate_peak_bytes``: MLX's peak active bytes over the
separate run plus what it kept at the end; ``separate_ttft_s`` per model; ``identical``:
every greedy answer equal in both runs. Targets: ``peak_bytes <= limit_bytes``, and
``peak_bytes <= 0.8 * separate_peak_bytes``.

Models: the default model twice (``--quick``: two tiny random models of different
configurations, a few seconds; the full run loads SmolLM2-135M-Instruct four times).

    python bench/multimodel.py [--quick] [--agents 2] [--turns 4] [--max-tokens 8]
        [--limit BYTES] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio
import mlx.core as mx
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.actors.engine import EngineConfig
from kvactor.actors.engine._memory import (
    activation_bytes,
    kept_buffer_bytes,
    one_turn_bytes,
    weights_bytes,
)
from kvactor.actors.models import load_model, make_tiny_model

PROMPTS = [
    "Say hello to the team.",
    "Which file should we read first?",
    "Summarize what we know so far.",
    "What is the next step?",
]


def _models(quick: bool) -> dict[str, Any]:
    if quick:
        tiny = functools.partial(make_tiny_model, head_dim=64)
        return {
            "router": functools.partial(tiny, 0, hidden_size=192, intermediate_size=768),
            "coder": functools.partial(tiny, 1, hidden_size=256, intermediate_size=1024),
        }
    return {"router": None, "coder": None}  # the default model, twice


def _default_limit(models: dict[str, Any]) -> int:
    """Room for the larger model, one turn and some caches, never both models."""
    config = EngineConfig()
    room = 0
    for spec in models.values():
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        lm = spec() if callable(spec) else load_model(spec)
        # Loading holds a file's tensors beside their dequantized copies for a while.
        transient = mx.get_peak_memory() - before - weights_bytes(lm)
        turn = one_turn_bytes(lm, config)
        extra = max(turn, transient) + turn // 8
        room = max(room, weights_bytes(lm) + activation_bytes(lm, config) + extra)
        del lm
        mx.clear_cache()
    limit = room * 16 // 15 + 16
    assert room <= limit - kept_buffer_bytes(limit)
    return limit


async def _turns(
    agents: dict[str, kvactor.Agent], roles: dict[str, str], args: argparse.Namespace
) -> tuple[dict[str, list[str]], dict[str, list[float]]]:
    """Every agent's answers, and each model's TTFTs, turn by turn in model order."""
    answers: dict[str, list[str]] = {name: [] for name in agents}
    ttft: dict[str, list[float]] = {}
    for round_ in range(args.turns):
        prompt = PROMPTS[round_ % len(PROMPTS)]
        for name, agent in agents.items():
            done = await agent.generate(prompt, max_tokens=args.max_tokens)
            answers[name].append(done.text)
            ttft.setdefault(roles[name], []).append(done.timings.ttft_s)
    return answers, ttft


def _roles(models: dict[str, Any], per_model: int) -> dict[str, str]:
    """Agent name -> model, alternating models: r0, c0, r1, c1, ..."""
    names = list(models)
    return {f"{m[0]}{i}": m for i in range(per_model) for m in names}


async def one_session(
    models: dict[str, Any], limit: int, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    roles = _roles(models, args.agents)
    async with kvactor.open(models=models, memory_limit=limit, cache_dir=root) as kv:
        agents = {
            n: await kv.spawn_agent(n, system=f"You are {n}.", model=m) for n, m in roles.items()
        }
        started = time.perf_counter()
        answers, ttft = await _turns(agents, roles, args)
        wall = time.perf_counter() - started
        stats = await kv.stats()
    return {
        "answers": answers,
        "limit_bytes": limit,
        "peak_bytes": max(stats.memory_peak_bytes, stats.mlx_peak_bytes),
        "counted_peak_bytes": stats.memory_peak_bytes,
        "mlx_peak_bytes": stats.mlx_peak_bytes,
        "model_loads": stats.model_loads,
        "model_unloads": stats.model_unloads,
        "swap_s": stats.swap_s,
        "ttft_s": {m: statistics.median(v) for m, v in ttft.items()},
        "wall_s": wall,
    }


async def separate(models: dict[str, Any], args: argparse.Namespace, root: Path) -> dict[str, Any]:
    roles = _roles(models, args.agents)
    mx.reset_peak_memory()
    async with (
        kvactor.open(models["router"], cache_dir=root / "router", memory_limit=None) as a,
        kvactor.open(models["coder"], cache_dir=root / "coder", memory_limit=None) as b,
    ):
        sessions = {"router": a, "coder": b}
        agents = {
            n: await sessions[m].spawn_agent(n, system=f"You are {n}.") for n, m in roles.items()
        }
        answers, ttft = await _turns(agents, roles, args)
        peak = int(mx.get_peak_memory()) + int(mx.get_cache_memory())
    return {
        "answers": answers,
        "separate_peak_bytes": peak,
        "separate_ttft_s": {m: statistics.median(v) for m, v in ttft.items()},
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    models = _models(args.quick)
    limit = args.limit or _default_limit(models)
    with tempfile.TemporaryDirectory(prefix="kvactor-mm-") as tmp:
        one = await one_session(models, limit, args, Path(tmp) / "one")
        two = await separate(models, args, Path(tmp) / "two")
    identical = one.pop("answers") == two.pop("answers")
    out = {**one, **two, "identical": identical, "quick": args.quick}
    out["peak_ratio"] = out["peak_bytes"] / max(out["separate_peak_bytes"], 1)
    return out


def _print(out: dict[str, Any]) -> None:
    mb = 1e6
    print(
        f"one session: peak {out['peak_bytes'] / mb:.1f} MB of a {out['limit_bytes'] / mb:.1f} MB "
        f"limit, {out['model_loads']} model loads, median swap {out['swap_s'] * 1000:.0f} ms"
    )
    print(f"separate sessions: peak {out['separate_peak_bytes'] / mb:.1f} MB")
    print(
        f"peak ratio {out['peak_ratio']:.2f} (target <= 0.8); identical answers: {out['identical']}"
    )
    for model, ttft in out["ttft_s"].items():
        alone = out["separate_ttft_s"][model]
        print(f"  {model}: median TTFT {ttft * 1000:.0f} ms (separate: {alone * 1000:.0f} ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two tiny models, seconds")
    parser.add_argument("--agents", type=int, default=2, help="agents per model")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--limit", type=int, help="the memory limit in bytes")
    parser.add_argument("--json", help="write the results here")
    arguments = parser.parse_args()
    results = anyio.run(main, arguments)
    _print(results)
    if arguments.json:
        write_json(arguments.json, results)
