"""The memory policies' decisions at 100, 1,000 and 10,000 agents, replayed without model
compute (issue 40, item 3), checked against a real run first.

``bench/_replay.py`` drives the real hot tier (``CachePool``: residents, ledger, ready
copies, demotion, the policies and hints) on real MLX caches, with zeros for the
forward and the warm store as a count of segments, on its own clock; each turn's time
comes from per-path rates fitted to a real run of ``bench/agentic.py`` (its pressure
shape: ``--real PATH``, the JSON that bench wrote).

1. **Against the real run**, the same trace (its steps, each turn's reused and new tokens
   as the unbounded run had them, the imports, the budget and disk limit, the default
   model's cache geometry; a run made with ``--settle``, whose stagings do not race its
   turns, is replayed with them first), each policy and the unbounded reference,
   replayed twice. On the real turns' own times where the replay takes their path (what
   the engine's rates and the hints' clock learned there): ``decisions_equal`` (every
   turn's path and every step's moves, hot-tier demotions and installs and warm agents
   made cold, the same as the real run's), ``paths_equal`` and ``moves_equal`` (shares
   of steps). On the fitted costs alone, as at scale: ``cost_error``, the largest
   |replayed / real - 1| of summed TTFT over the runs (``policies_cost_error``: over the
   policies' runs alone), and ``fitted_paths_equal`` / ``fitted_moves_equal``. A
   manifest's bytes a token (``manifest_bytes``) are fitted to the real run's own
   manifests where it lists them (``manifests``: a tokenizer's ids and text take more
   or fewer bytes a token), else the default model's figures.
2. **At scale**: seeded pressure traces of ``--sizes`` agents (5 team agents to 4
   subagents, documents and steps of the real shape's token counts, 2 rounds), the hot
   budget one turn's room plus 25% of the agents' stored caches and the disk limit 50%
   (issue 40's sizes), caches of one layer and one KV head (the decisions are the same
   as at any geometry with the budgets in proportion; the arrays fit): per size and
   policy ``summed_ttft_s`` and ``summed_excess_s`` (replayed), ``cold_turns``,
   ``warm_reloads``, ``made_cold``, ``book_s`` (wall seconds in the tier's code and the
   replay's bookkeeping, the zeros' arrays left out) and ``book_ms_per_step``; per size
   ``oracle_vs_lru``, ``captured``, ``wrong_vs_lru``. Each hinted step names every
   agent still to come, as the real run's do; ``--lookahead K`` names the next K alone
   (what an application that sees a few steps ahead can say), and ``--hint-every E``
   before every E-th step alone (a whole order sent once in a while); the real check is
   hinted as the real run was.

    python bench/replay.py --real agentic.json [--sizes 100 1000 10000] [--json PATH]
        [--lookahead K] [--hint-every E]
        [--policies lru workflow ...]   # a share, one process per core; then:
    python bench/replay.py --merge A.json B.json [--json PATH]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
from _agentic_trace import OraclePolicy, pressure_schedule, wrong
from _agentic_trace import lookahead as _lookahead
from _replay import Clock, Costs, ManifestBytes, Observed, Replay, Step
from _results import write_json  # bench/ is the script's folder: on sys.path
from agentic import captured

from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.hot import make_hint
from kvactor.actors.models import load_model, make_tiny_model
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC

POLICIES = ("lru", "workflow", "workflow_wrong", "oracle")
WRONG_P = 0.3
HOT_SHARE, DISK_SHARE = 0.25, 0.5


class IndexedOracle(OraclePolicy):
    """:class:`OraclePolicy`'s rule, each agent's next use found by bisection in an index
    of its steps (the plain one scans the trace: too slow at 10,000 agents)."""

    def __init__(self, order: Sequence[str]) -> None:
        super().__init__(order)
        self._at: dict[str, list[int]] = {}
        for i, agent in enumerate(order):
            self._at.setdefault(agent, []).append(i)

    def _ahead(self, agent: str) -> float:
        steps = self._at.get(agent, [])
        i = bisect.bisect_left(steps, self.position)
        return steps[i] - self.position + 1 if i < len(steps) else math.inf


def _policy(name: str, order: Sequence[str], clock: Clock) -> Any:
    if name == "lru":
        return kvactor.LRUPolicy()
    if name == "oracle":
        return IndexedOracle(order)
    return kvactor.WorkflowPolicy(clock=clock.monotonic)  # the hints' times: the replay's


def replay(
    steps: Sequence[Step],
    agents: Sequence[str],
    *,
    policy: str,
    geometry: CacheGeometry,
    budget: int | None,
    disk_limit: int | None,
    costs: Costs,
    brief: int,
    brief_hot: bool,
    seed: int = 0,
    settled: bool = False,
    lookahead: int | None = None,
    hint_every: int = 1,
    manifests: ManifestBytes | None = None,
) -> Replay:
    """One replay of ``steps`` under ``policy``, hinted as ``bench/agentic.py`` hints (the
    soonest distinct agents before each step, ``done`` after an agent's last step): all of
    them, or the first ``lookahead``; before every ``hint_every``-th step alone."""
    order = [s.agent for s in steps]
    clock = Clock()
    chosen = _policy(policy, order, clock)
    rng = random.Random(seed)
    run = Replay(
        geometry=geometry,
        codec=DEFAULT_CODEC,
        policy=chosen,
        budget=budget,
        disk_limit=disk_limit,
        costs=costs,
        clock=clock,
        settled=settled,
        manifests=manifests,
    )
    run.seed("brief", list(range(brief)), hot=brief_hot)
    last = {agent: i for i, agent in enumerate(order)}
    for at, step in enumerate(steps):
        if isinstance(chosen, OraclePolicy):
            chosen.position = at
        hint = done = None
        if policy != "lru":
            if at % hint_every == 0:
                upcoming = _lookahead(order, at, lookahead or len(agents))
                if policy == "workflow_wrong":
                    upcoming = wrong(upcoming, agents, rng, WRONG_P)
                hint = make_hint(next=upcoming)
            if last[step.agent] == at:
                done = make_hint(done=[step.agent])
        run.run(step, hint, done)
    return run


def figures(run: Replay, bounds: Sequence[float]) -> dict[str, Any]:
    turns = run.turns
    return {
        "summed_ttft_s": sum(t["ttft_s"] for t in turns),
        "summed_excess_s": sum(t["ttft_s"] - b for t, b in zip(turns, bounds, strict=True)),
        "cold_turns": sum(t["path"] == "cold" for t in turns),
        "warm_reloads": sum(m[0] == "installed" for t in turns for m in t["moves"]),
        "made_cold": sum(m[3] == "warm" for t in turns for m in t["moves"]),
        "re_prefilled_tokens": sum(t["prefilled_tokens"] for t in turns),
        "dequantized_tokens": sum(t["dequantized_tokens"] for t in turns),
        "peak_bytes": run.pool.peak,
        "disk_peak_bytes": run.disk_peak,
        "book_s": run.book_s,
        "book_ms_per_step": 1e3 * run.book_s / max(len(turns), 1),
    }


def policy_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    def floored(r: dict[str, Any]) -> float:
        return max(r["summed_excess_s"], 1e-3)

    lru, wf, oracle = runs["lru"], runs["workflow"], runs["oracle"]
    return {
        "oracle_vs_lru": floored(oracle) / floored(lru),
        "workflow_vs_lru": floored(wf) / floored(lru),
        "wrong_vs_lru": floored(runs["workflow_wrong"]) / floored(lru),
        "captured": captured(lru, wf, oracle),
    }


# -- against the real run ---------------------------------------------------------------
def real_steps(pressure: dict[str, Any], run: dict[str, Any] | None = None) -> list[Step]:
    """The real run's trace as replay steps: the unbounded run's reused and new tokens;
    with ``run`` (one of the real runs), each step observes that run's turn."""
    ref = pressure["reference"]["turns"]
    imported = pressure["imported_tokens"]
    seen: set[str] = set()
    steps = []
    for at, ((agent, wait), turn) in enumerate(zip(pressure["trace"], ref, strict=True)):
        first = agent not in seen
        seen.add(agent)
        observed = None
        if run is not None:
            real = run["turns"][at]
            observed = Observed(
                real["path"],
                real["ttft_s"],
                real.get("turn_s", real["ttft_s"]),
                real["dequantize_s"],
                real["prefill_s"],
            )
        steps.append(
            Step(
                agent,
                reused=turn["reused_tokens"],
                new=turn["prompt_tokens"] - turn["reused_tokens"],
                tool_wait_s=wait,
                imported=imported[agent] if first and agent in imported else 0,
                observed=observed,
            )
        )
    return steps


def _moves(moves: list[list[str]]) -> Counter[tuple[str, ...]]:
    return Counter(tuple(m) for m in moves)


def _compare(replayed: Sequence[dict[str, Any]], real: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Step by step: the same path, the same moves (each a share of the steps, and a
    count), and the steps that differ."""
    pairs = list(zip(replayed, real, strict=True))
    paths = [a["path"] == b["path"] for a, b in pairs]
    moves = [_moves(a["moves"]) == _moves(b["moves"]) for a, b in pairs]
    return {
        "paths_equal": sum(paths) / len(paths),
        "moves_equal": sum(moves) / len(moves),
        "paths_same": sum(paths),
        "moves_same": sum(moves),
        "differ": [
            {
                "step": i,
                "agent": a["agent"],
                "replayed": [a["path"], a["moves"]],
                "real": [b["path"], b["moves"]],
            }
            for i, (a, b) in enumerate(pairs)
            if not (paths[i] and moves[i])
        ],
    }


def against_real(pressure: dict[str, Any], geometry: CacheGeometry) -> dict[str, Any]:
    """Each run of the real one replayed twice: on the real turns' own times where the
    replay takes their path (the decisions: ``paths_equal``, ``moves_equal``), and on the
    fitted :class:`Costs` alone, as at scale (``cost_error``, ``fitted_*``)."""
    agents = sorted(a for a in pressure["imported_tokens"] if a.startswith("te")) + sorted(
        a for a in pressure["imported_tokens"] if a.startswith("su")
    )
    real_turns = [t for r in pressure["policies"].values() for t in r["turns"]]
    costs = Costs.fit(real_turns)
    # A manifest's bytes a token, from the real run's own (runs before they were listed:
    # the default model's figures).
    samples = [m for r in pressure["policies"].values() for m in r.get("manifests", [])]
    manifests = ManifestBytes.fit(samples)
    bounds = [
        costs.prefill(t["prefilled_tokens"], t["reused_tokens"])
        for t in pressure["reference"]["turns"]
    ]
    runs: dict[str, Any] = {}
    for name in ("reference", *POLICIES):
        real = pressure["reference"] if name == "reference" else pressure["policies"][name]
        limited = name != "reference"
        common: dict[str, Any] = {
            "policy": name if limited else "lru",
            "geometry": geometry,
            "budget": pressure["budget_bytes"] if limited else None,
            "disk_limit": pressure["disk_limit_bytes"] if limited else None,
            "costs": costs,
            "brief": pressure["brief_tokens"],
            "brief_hot": "brief" in pressure["start_hot"],
            "settled": pressure.get("settled", False),
            "manifests": manifests,
            "seed": pressure.get("seed", 0),  # the wrong hints' picks, as the real run's
        }
        fitted = replay(real_steps(pressure), agents, **common)
        seen = replay(real_steps(pressure, real), agents, **common)
        decided = _compare(seen.turns, real["turns"])
        costed = _compare(fitted.turns, real["turns"])
        got = figures(fitted, bounds)
        real_ttft = real["summed_ttft_s"]
        runs[name] = {
            **got,
            "real_summed_ttft_s": real_ttft,
            "real_summed_excess_s": real["summed_excess_s"],
            "cost_error": got["summed_ttft_s"] / real_ttft - 1,
            **decided,
            "fitted_paths_equal": costed["paths_equal"],
            "fitted_moves_equal": costed["moves_equal"],
            "fitted_differ": costed["differ"],
        }
        steps = len(real["turns"])
        print(
            f"real check   {name:15} paths {decided['paths_same']}/{steps}"
            f" moves {decided['moves_same']}/{steps}; fitted: paths"
            f" {costed['paths_same']}/{steps} moves {costed['moves_same']}/{steps} ttft"
            f" {got['summed_ttft_s']:7.1f}s vs real {real_ttft:7.1f}s"
            f" ({runs[name]['cost_error']:+.3f})",
            flush=True,
        )
    return {
        "decisions_equal": all(
            r["paths_equal"] == 1 and r["moves_equal"] == 1 for r in runs.values()
        ),
        "paths_equal": min(r["paths_equal"] for r in runs.values()),
        "moves_equal": min(r["moves_equal"] for r in runs.values()),
        "fitted_paths_equal": min(r["fitted_paths_equal"] for r in runs.values()),
        "fitted_moves_equal": min(r["fitted_moves_equal"] for r in runs.values()),
        "cost_error": max(abs(r["cost_error"]) for r in runs.values()),
        # The same over the policies' runs alone (the reference's turns are all hot or
        # warm: a drift of the machine's speed during it shows there first).
        "policies_cost_error": max(abs(r["cost_error"]) for n, r in runs.items() if n in POLICIES),
        "costs": dataclasses.asdict(costs),
        "manifest_bytes": dataclasses.asdict(manifests),
        "runs": runs,
    }


# -- at scale ---------------------------------------------------------------------------
def scale_trace(agents: int, seed: int) -> tuple[list[Step], list[str]]:
    """A seeded pressure trace of ``agents`` agents in the real shape's token counts: 5
    team agents to 4 one-shot subagents; documents of 2,200-3,500 (team) and 1,400-1,900
    (subagents) tokens beside a 168-token shared prompt; steps of 30-300 new tokens; the
    team takes 2 rounds, each subagent a tool loop of 1-3 steps between the team's."""
    rng = random.Random(seed)
    team = max(2, agents * 5 // 9)
    subs = agents - team
    crew = [f"te{i:05d}" for i in range(team)]
    helpers = [f"su{i:05d}" for i in range(subs)]
    docs = {a: rng.randint(2200, 3500) for a in crew} | {
        a: rng.randint(1400, 1900) for a in helpers
    }
    held: dict[str, int] = {}
    steps: list[Step] = []

    def step(agent: str, kind: str, waits: bool) -> None:
        first = agent not in held
        reused = docs[agent] if first else held[agent]
        new = rng.randint(30, 300)
        wait = math.exp(rng.uniform(math.log(0.5), math.log(5.0))) if waits else 0.0
        steps.append(
            Step(agent, reused, new, tool_wait_s=wait, imported=docs[agent] if first else 0)
        )
        held[agent] = reused + new + 3

    pressure_schedule(crew, helpers, 2, rng, step)
    return steps, crew + helpers


def at_scale(
    size: int,
    costs: Costs,
    seed: int,
    policies: Sequence[str] = POLICIES,
    lookahead: int | None = None,
    hint_every: int = 1,
) -> dict[str, Any]:
    """Each of ``policies`` on a seeded trace of ``size`` agents, hinted with every agent
    to come or the first ``lookahead``, every ``hint_every`` steps; the ratios when all
    four ran (a run split over processes is merged by :func:`merged`)."""
    steps, agents = scale_trace(size, seed)
    geometry = CacheGeometry.uniform(1, 1, 64)
    probe = Replay(
        geometry=geometry,
        codec=DEFAULT_CODEC,
        policy=kvactor.LRUPolicy(),
        budget=None,
        disk_limit=None,
        costs=costs,
    )
    final: dict[str, int] = {}
    for s in steps:
        final[s.agent] = s.reused + s.new + s.generated - 1
    working = sum(probe.stored_bytes(t) for t in final.values())
    longest = max(final.values())
    room = turn_reserve_bytes(geometry, longest + 4) + probe.stored_bytes(longest)
    budget = room + int(HOT_SHARE * working)
    brief = 168
    disk_limit = int(DISK_SHARE * working) + probe.stored_bytes(brief) + (1 << 20)
    bounds = [costs.prefill(s.new, s.reused) for s in steps]
    runs = {}
    for policy in policies:
        began = time.perf_counter()
        run = replay(
            steps,
            agents,
            policy=policy,
            geometry=geometry,
            budget=budget,
            disk_limit=disk_limit,
            costs=costs,
            brief=brief,
            brief_hot=True,
            seed=seed,
            lookahead=lookahead,
            hint_every=hint_every,
        )
        runs[policy] = figures(run, bounds) | {"wall_s": time.perf_counter() - began}
        r = runs[policy]
        print(
            f"{size:6} agents {policy:15} excess {r['summed_excess_s']:9.1f}s cold"
            f" {r['cold_turns']:5} reloads {r['warm_reloads']:5} made cold {r['made_cold']:5}"
            f" book {r['book_ms_per_step']:.2f} ms/step (wall {r['wall_s']:.0f}s)",
            flush=True,
        )
    return {
        "agents": size,
        "steps": len(steps),
        "budget_bytes": budget,
        "disk_limit_bytes": disk_limit,
        "working_set_bytes": working,
        **_held(runs, budget, disk_limit),
        "policies": runs,
    }


def _held(runs: dict[str, dict[str, Any]], budget: int, disk_limit: int) -> dict[str, Any]:
    """Whether ``runs`` kept to the budget and the disk limit; the ratios when all four
    policies ran."""
    return {
        **(policy_ratios(runs) if set(runs) >= set(POLICIES) else {}),
        "within_budget": all(r["peak_bytes"] <= budget for r in runs.values()),
        "within_disk_limit": all(r["disk_peak_bytes"] <= disk_limit for r in runs.values()),
    }


def merged(paths: Sequence[str]) -> dict[str, Any]:
    """Runs of the same sizes and seed split by ``--policies`` over processes, as one:
    the first file's check against the real run, every file's policies, the ratios."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = parts[0]
    for part in parts[1:]:
        for size, other in part["sizes"].items():
            first = out["sizes"].setdefault(size, {**other, "policies": {}})
            assert other["steps"] == first["steps"], "runs of different traces"
            first["policies"].update(other["policies"])
    for part in out["sizes"].values():
        part.update(_held(part["policies"], part["budget_bytes"], part["disk_limit_bytes"]))
    out["merged"] = list(paths)
    return out


def default_geometry(model: str) -> CacheGeometry:
    if model == "tiny":
        return make_tiny_model(0, head_dim=64).geometry
    return load_model(None).geometry


def main(args: argparse.Namespace) -> dict[str, Any]:
    real = json.loads(Path(args.real).read_text())
    pressure = real["pressure"]
    out: dict[str, Any] = {"real": args.real, "model": real.get("model")}
    out["lookahead"] = args.lookahead  # None: every agent to come, as the real run
    out["hint_every"] = args.hint_every
    check = against_real(pressure, default_geometry(real.get("model", "default")))
    out["against_real"] = check
    for key in (
        "decisions_equal",
        "paths_equal",
        "moves_equal",
        "cost_error",
        "policies_cost_error",
    ):
        out[key] = check[key]
    costs = Costs(**check["costs"])
    out["sizes"] = {}
    for size in args.sizes:
        out["sizes"][str(size)] = at_scale(
            size, costs, args.seed, args.policies, args.lookahead, args.hint_every
        )
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real", help="bench/agentic.py's JSON (its pressure shape)")
    p.add_argument("--sizes", type=int, nargs="*", default=[100, 1000, 10000])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lookahead",
        type=int,
        metavar="K",
        help="at scale, hint only the next K distinct agents (default: every agent to come)",
    )
    p.add_argument(
        "--hint-every",
        type=int,
        default=1,
        metavar="E",
        help="at scale, hint before every E-th step alone (default: every step, as the real run)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="a share of the policies (one process per core; merge: --merge)",
    )
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join split runs' JSON, then stop")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not args.merge and not args.real:
        p.error("--real is needed (or --merge)")
    if args.hint_every < 1 or (args.lookahead is not None and args.lookahead < 1):
        p.error("--hint-every and --lookahead take a count of 1 or more")
    return args


if __name__ == "__main__":
    arguments = parse()
    began = time.perf_counter()
    if arguments.merge:
        result = merged(arguments.merge)
    else:
        result = main(arguments)
        result["total_s"] = time.perf_counter() - began
    for key in ("decisions_equal", "paths_equal", "moves_equal", "cost_error"):
        print(f"{key}: {result[key]}")
    for size, part in result["sizes"].items():
        if "captured" not in part:
            continue
        print(
            f"{size} agents: oracle_vs_lru {part['oracle_vs_lru']:.3f} captured"
            f" {part['captured']:.3f} wrong_vs_lru {part['wrong_vs_lru']:.3f}"
        )
    print(f"total {result.get('total_s', 0):.0f}s")
    if arguments.json:
        write_json(arguments.json, result)
