"""Memory policies on agentic traces: LRU, the workflow-aware default fed right hints and
30% wrong ones, and an oracle (Belady on cost-weighted bytes, from the trace), replayed
through the Python API.

First the ``pressure`` shape, where the policy decides (issue 40): every agent has a
private context (a document or tool output, ``--team-doc-words`` / ``--sub-doc-words``:
1-4K tokens on the default model) prefilled once for the whole bench and exported as a
portable file, which each replay imports just before the agent's first step (outside its
TTFT, under the disk limit as any write is: room made by the policy). A team
(``--team``) takes turns round after round; one-shot subagents (``--subagents``) run a
tool loop of 1-3 steps between the team's turns and are done. The hot budget is one
turn's room (its float working copy and the largest stored cache: ``hot_share_mean`` /
``hot_share_max`` say what the hot tier held of the agents' caches, in tokens, while
each turn ran) and the disk limit the shared context plus 50% of what the agents store
at the end of an unbounded run, so turns come back from ready copies, stored caches,
disk and re-prefill. Its figures, reported first and at the top level:
``oracle_vs_lru`` (what the best policy reaches: the workload must leave it room),
``captured`` = (LRU excess - workflow excess) / (LRU excess - oracle excess),
``captured_wrong``, ``workflow_vs_lru``, ``workflow_vs_oracle``, ``wrong_vs_lru``,
``within_disk_limit`` (the directory, as the store counts it, after every step), and per
run ``cold_turns``, ``re_prefilled_tokens``, ``warm_reloads``, ``made_cold``,
``dequantized_tokens``, ``ready_turns``.

Then the first three shapes, under a hot budget only (25% of the working set; with
``--hot-budgets 25% 50%`` also 50%, where every turn was as hot as at 25% in every run so far),
with ``dequantized_vs_unshared``: stored tokens made float with the shared system
prompt's float copy (``SharedPrefixes``) against LRU at 25% again without it.

Each trace (``bench/_agentic_trace.py``: seeded; shapes round_robin, pipeline, fanout; a
long shared system prompt plus a role per agent; steps of tool results or messages; tool
waits) is replayed once unbounded first: its greedy tokens are the reference, and what
each turn prefilled there is what no policy can avoid (the tokens new to the
conversation). Then per budget and policy: per turn ``ttft_s``, ``bound_s`` (timed in
the same run: the prefill of the unbounded run's count of new tokens at this turn's own
prefill rate, its last chunk giving the first token) and ``excess_s = ttft_s - bound_s``
(getting the cache back: staging, dequantizing, re-prefilling, queueing); per run
``summed_ttft_s``,
``summed_excess_s``, ``p95_ttft_s``, ``wall_s``, ``reloads`` (warm caches installed from
disk, prefetches included), ``warm_bytes_read``, ``re_prefilled_tokens`` (prefilled beyond
the unbounded run's), ``hot_hits``, ``peak_bytes`` (never above the budget); per budget
``identical_outputs``. Under ``hot_only``, on summed excess at 25% (the worst shape):
``workflow_vs_lru``, ``workflow_vs_oracle``, ``wrong_vs_lru``, and ``oracle_vs_lru`` (the
best any policy reaches on this machine).

The budget is the room one turn needs (its working-cache reserve and the largest agent's
stored cache) plus the fraction of the working set (every agent's stored cache at the end;
``hot_peak_bytes``: the unbounded run's hot peak, where every agent also keeps its float
ready copy, from which a turn starts without dequantizing).
The shared system prompt (``--system-words``, ~2,000 tokens: an agent framework's
instructions and tool definitions) is a shared context (``Session.context``), prefilled
once for the whole bench and copied into each replay's cache directory as its warm cache;
its cache is shared by every agent's first turn, so each agent's context is a few
thousand tokens and a reload costs what it costs there. Each agent's role comes in its
first message.
Turns run one at a time (as a workflow engine runs its steps); a tool wait is announced
to the engine as the server does (``ToolWait``), and the replay does not sleep through it.
Hints (workflow, oracle): before each step, the distinct agents of the steps after it, as
many as there are agents, soonest first (its first two staged), and ``done`` for an agent
with no step left.

Then over HTTP (``bench/_agentic_http.py``; ``--no-http`` skips it): a round-robin trace of
``--http-agents`` (16) agents against ``kvactor serve`` and ``mlx_lm.server`` (default
prompt cache, and sized to the agents), restarted two thirds of the way through:
``vs_mlx_lm_server``, ``vs_mlx_lm_server_sized``, ``after_restart_vs_mlx_lm_server`` on
summed TTFT (before the restart for the first two, after it for the third).

With ``--settle``, a pressure step awaits the stagings its hint asks for before its
import and turn: without it, a staging and the step's turn may reach the engine in either
order (both are the runtime's), and two runs can differ at that step. It is the run
``bench/replay.py`` checks its decisions against (``settled`` in the JSON, with the
``seed`` its wrong hints were drawn with, and per policy ``manifests``: each manifest's
tokens, files, cold or not, and bytes at the run's end, which the replay fits its count
of a manifest's bytes to).

    python bench/agentic.py [--quick] [--model default|tiny] [--shapes ...] [--no-http]
        [--hot-budgets 25% 50%]
        [--settle] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import kvactor

# isort: split
import anyio
from _agentic_http import http_results
from _agentic_trace import (
    PRESSURE,
    SHAPES,
    OraclePolicy,
    Trace,
    lookahead,
    make_pressure_trace,
    make_trace,
    wrong,
)
from _results import write_json  # bench/ is the script's folder: on sys.path
from _warm_trace import agents_bytes, manifest_sizes

from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.hot._shared_ready import SharedPrefixes
from kvactor.actors.messages import ToolWait
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import Prefetch
from kvactor.kernels.float_turn import FloatPrefix
from kvactor.kernels.geometry import CacheGeometry

POLICIES = ("lru", "workflow", "workflow_wrong", "oracle")
FRACTIONS = {"25%": 0.25, "50%": 0.5}
HOT_SHARE, DISK_SHARE = 0.0, 0.5  # the pressure shape: hot room beyond one turn, disk limit
TOP_KEYS = (
    "oracle_vs_lru",
    "captured",
    "captured_wrong",
    "workflow_vs_lru",
    "workflow_vs_oracle",
    "wrong_vs_lru",
    "within_disk_limit",
    "dequantized_vs_unshared",
)
WRONG_P = 0.3
PREFETCH = 2  # the agents of a hint staged (``Session.hint``'s default)
BRIEF = "brief"  # the shared context's name


def _model(name: str) -> Any:
    if name == "tiny":
        return functools.partial(make_tiny_model, 0, head_dim=64)
    return None  # the default model


def _policy(name: str, trace: Trace) -> Any:
    if name == "lru":
        return kvactor.LRUPolicy()
    if name == "oracle":
        return OraclePolicy(trace.order)
    return kvactor.WorkflowPolicy()


async def replay(
    trace: Trace,
    model: Any,
    root: Path,
    *,
    policy: str,
    budget: int | None,
    max_tokens: int,
    seed: int,
    brief: Path,
    seeds: dict[str, Path] | None = None,
    disk_limit: int | None = None,
    settle: bool = False,
) -> dict[str, Any]:
    """One replay of ``trace`` in a new cache directory ``root`` that starts with a copy
    of ``brief`` (the shared context's warm cache): per-turn records and the run's
    counters. An agent of ``seeds`` (its private context, prefilled once: a portable
    file) is imported just before its first step, under ``disk_limit`` as any write is
    (room made by the policy); the others are spawned at the start. ``settle``: the
    stagings a step's hint asks for are awaited before its turn (see ``--settle``)."""
    rng = random.Random(seed)
    chosen = _policy(policy, trace)
    hinting = policy != "lru"
    order = trace.order
    seeds = seeds or {}
    turns: list[dict[str, Any]] = []
    options: dict[str, Any] = {"cache_dir": root, "budget_bytes": budget, "policy": chosen}
    options["disk_limit"] = disk_limit
    shutil.copytree(brief, root)  # the shared system prompt's warm cache (prefilled once)
    disk_peak = 0
    async with kvactor.open(model, **options) as kv:
        await kv.context(BRIEF, trace.system)  # resumed from its warm cache
        brief_tokens = (await kv.cache_info(BRIEF)).tokens
        agents = {n: await kv.spawn_agent(n, context=BRIEF) for n in trace.agents if n not in seeds}
        # What the tiers did, step by step (bench/replay.py replays the decisions).
        seen: dict[str, dict[str, int]] = {"hot": {}, "warm": {}}
        start_hot = sorted(c.agent for c in await kv.hot_caches())
        await _moves(kv, seen)  # the start's, left out
        imported: dict[str, int] = {}
        began = time.perf_counter()
        for at, step in enumerate(trace.steps):
            if isinstance(chosen, OraclePolicy):
                chosen.position = at
            if hinting:
                upcoming = lookahead(order, at, len(trace.agents))
                if policy == "workflow_wrong":
                    upcoming = wrong(upcoming, trace.agents, rng, WRONG_P)
                await _hint(kv, upcoming, settle=settle)
            if step.agent not in agents:  # its private context arrives (outside its TTFT)
                agents[step.agent] = await kv.import_agent(seeds[step.agent], name=step.agent)
                imported[step.agent] = next(
                    w.tokens for w in await kv.warm_agents() if w.agent == step.agent
                )
            turns.append(
                await _timed_turn(
                    kv, step.agent, agents[step.agent], step.text, max_tokens, disk_limit
                )
            )
            if step.tool_wait_s:
                await kv.engine.ask(ToolWait(step.agent, step.tool_wait_s))
            if hinting and step.agent not in order[at + 1 :]:
                await kv.hint(done=[step.agent])
            turns[-1]["moves"] = await _moves(kv, seen)
            if disk_limit is not None:  # what the directory holds, as the store counts it
                turns[-1]["disk_bytes"] = agents_bytes(root)
                disk_peak = max(disk_peak, turns[-1]["disk_bytes"])
        wall = time.perf_counter() - began
        # Its manifests' sizes, for bench/replay.py to count a manifest's bytes a token.
        manifests = manifest_sizes(root) if disk_limit is not None else []
        stats = await kv.stats()
        warm = await kv.warm_stats()
        stored = {w.agent: (w.nbytes, w.tokens) for w in await kv.warm_agents() if w.agent != BRIEF}
        assert kv.identity is not None
        geometry = CacheGeometry.from_description(kv.identity.layer_geometry(), kv.model.states)
    return {
        "turns": turns,
        "wall_s": wall,
        "reloads": stats.installs,
        "warm_bytes_read": warm.bytes_read,
        "peak_bytes": stats.peak_bytes,
        "disk_peak_bytes": disk_peak,
        "made_cold": stats.demoted_warm_to_cold,
        "dequantized_tokens": stats.dequantized_tokens,
        "ready_turns": stats.ready_turns,
        "stored": stored,
        "context_tokens": {a: t for a, (_, t) in stored.items()},
        "geometry": geometry,
        "brief_tokens": brief_tokens,
        "start_hot": start_hot,
        "imported_tokens": imported,
        "manifests": manifests,
    }


async def _hint(kv: Any, upcoming: list[str], *, settle: bool) -> None:
    """The step's hint: its first ``PREFETCH`` agents staged, as ``Session.hint`` stages
    them; with ``settle``, each staging awaited (the prefetch actor's answer) before the
    step goes on, so that no staging races the step's import or turn to the engine."""
    if not settle:
        await kv.hint(next=upcoming, prefetch=PREFETCH)
        return
    await kv.hint(next=upcoming, prefetch=0)
    for agent in upcoming[:PREFETCH]:
        await kv.prefetcher.ask(Prefetch(agent), timeout=None)


async def _timed_turn(
    kv: Any, name: str, agent: Any, text: str, max_tokens: int, disk_limit: int | None
) -> dict[str, Any]:
    """One turn of ``agent``, timed as its caller sees it, and its record."""
    sent = time.perf_counter()
    first = None
    hot = None
    async with agent.stream(text, max_tokens=max_tokens) as pieces:
        async for _ in pieces:
            if first is None:
                first = time.perf_counter()
                if disk_limit is not None:  # what the hot tier holds meanwhile
                    hot = await kv.hot_caches()
    done = pieces.completion
    assert done is not None
    ended = time.perf_counter()
    # A turn whose few tokens make no text yet yields no piece: its first token's time is
    # the engine's (rendering and tokenizing, then queue to first token).
    engine_ttft = done.timings.prompt_s + done.timings.ttft_s
    return {
        "agent": name,
        "ttft_s": first - sent if first is not None else min(engine_ttft, ended - sent),
        "turn_s": ended - sent,  # to its last token (bench/replay.py's clock)
        "path": str(done.path),
        "prefilled_tokens": done.timings.prefilled_tokens,
        "prompt_tokens": done.timings.prompt_tokens,
        "reused_tokens": done.timings.reused_tokens,
        # The prefill's own compute (its working copy made before it excluded).
        "prefill_s": done.timings.prefill_s - done.timings.dequantize_s,
        "parts": {  # where the time to first token went (the engine's figures)
            "load_s": done.timings.load_s,
            "queue_s": done.timings.queue_s,
            "dequantize_s": done.timings.dequantize_s,
        },
        "tokens": done.token_ids,
        # The agents' caches hot during the turn (its own included), in tokens: what the
        # hot tier holds when a turn needs its room.
        "hot_tokens": (sum(c.tokens for c in hot if c.agent != BRIEF) if hot is not None else None),
    }


async def _moves(kv: Any, seen: dict[str, dict[str, int]]) -> list[list[str]]:
    """The tiers' moves since the last call (``seen``: each log's last seq, updated), as
    ``[kind, agent, tier, source]``: hot-tier demotions and installs, then warm agents made
    cold."""
    out: list[list[str]] = []
    for tier, logs in (
        ("hot", await kv.tier_moves(seen["hot"])),
        ("warm", await kv.warm_moves(seen["warm"])),
    ):
        for model, log in logs.items():
            seen[tier][model] = log.last
            out += [[m.kind, m.agent, m.tier, m.source] for m in log.moves]
    return out


def budget_for(reference: dict[str, Any], fraction: float, max_tokens: int) -> tuple[int, int]:
    """(budget, working set): one turn's room plus ``fraction`` of every agent's stored
    cache at the end of the unbounded run."""
    stored = reference["stored"]
    working = sum(n for n, _ in stored.values())
    longest = max(t for _, t in stored.values())
    reserve = turn_reserve_bytes(reference["geometry"], longest + max_tokens)
    room = reserve + max(n for n, _ in stored.values())
    return room + int(fraction * working), working


def summary(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A run's figures against the unbounded run's per-turn bounds."""
    per_turn = []
    re_prefilled = 0
    for turn, ref in zip(run["turns"], reference["turns"], strict=True):
        # What no policy avoids, timed in this run: the prefill of the tokens new to the
        # conversation (the unbounded run's count), at this turn's own prefill rate; its
        # last chunk gives the first token.
        bound = turn["prefill_s"] * ref["prefilled_tokens"] / max(turn["prefilled_tokens"], 1)
        per_turn.append(
            {
                "agent": turn["agent"],
                "path": turn["path"],
                "ttft_s": turn["ttft_s"],
                "turn_s": turn["turn_s"],
                "disk_bytes": turn.get("disk_bytes"),
                "bound_s": bound,
                "excess_s": turn["ttft_s"] - bound,
                **turn["parts"],
                "prefill_s": turn["prefill_s"],
                "prefilled_tokens": turn["prefilled_tokens"],
                "prompt_tokens": turn["prompt_tokens"],
                "reused_tokens": turn["reused_tokens"],
                "moves": turn.get("moves", []),
            }
        )
        re_prefilled += max(turn["prefilled_tokens"] - ref["prefilled_tokens"], 0)
    ttfts = sorted(t["ttft_s"] for t in per_turn)
    held = sum(reference["context_tokens"].values())  # every agent's cache at the end
    hot = [t["hot_tokens"] / held for t in run["turns"] if t["hot_tokens"] is not None]
    return {
        "summed_ttft_s": sum(ttfts),
        "summed_excess_s": sum(t["excess_s"] for t in per_turn),
        "p95_ttft_s": ttfts[min(len(ttfts) - 1, math.ceil(0.95 * len(ttfts)) - 1)],
        "wall_s": run["wall_s"],
        "reloads": run["reloads"],
        "warm_bytes_read": run["warm_bytes_read"],
        "re_prefilled_tokens": re_prefilled,
        "hot_hits": sum(t["path"] == "hot" for t in per_turn),
        "cold_turns": sum(t["path"] == "cold" for t in per_turn),
        "warm_reloads": run["reloads"],
        "manifests": run["manifests"],  # [tokens, files, cold, bytes] at its end
        "made_cold": run["made_cold"],
        "dequantized_tokens": run["dequantized_tokens"],
        "ready_turns": run["ready_turns"],
        "hot_share_mean": statistics.fmean(hot) if hot else None,
        "hot_share_max": max(hot, default=None),
        "peak_bytes": run["peak_bytes"],
        "disk_peak_bytes": run["disk_peak_bytes"],
        "turns": per_turn,
    }


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Summed excess of run ``a`` over run ``b``'s, each floored at 2% of its run's summed
    bound (an excess near 0, or a little below from noise, is all the same: no policy
    can do better than that)."""

    def floored(run: dict[str, Any]) -> float:
        bound = sum(t["bound_s"] for t in run["turns"])
        return max(run["summed_excess_s"], 0.02 * bound, 1e-3)

    return floored(a) / floored(b)


async def seeded_brief(model: Any, system: str, tmp: Path) -> Path:
    """A cache directory holding only the shared context ``system``'s warm cache: prefilled
    once for the whole bench (every shape's trace has the same system prompt), copied into
    each replay's."""
    root = tmp / f"brief-{hashlib.sha256(system.encode()).hexdigest()[:12]}"
    if not root.exists():
        began = time.perf_counter()
        async with kvactor.open(model, cache_dir=root) as kv:
            await kv.context(BRIEF, system)
            tokens = (await kv.cache_info(BRIEF)).tokens
        print(
            f"shared system prompt: {tokens} tokens, prefilled once in "
            f"{time.perf_counter() - began:.1f} s",
            flush=True,
        )
    return root


async def seeded_agents(
    model: Any, trace: Trace, brief: Path, tmp: Path, max_tokens: int
) -> dict[str, Path]:
    """Each agent's private context (its role and document, one turn) prefilled once for
    the whole bench, as a portable file (``export_agent``) each replay imports."""
    digest = hashlib.sha256(repr(sorted(trace.docs.items())).encode()).hexdigest()[:12]
    folder = tmp / f"seeds-{digest}"
    files = {n: folder / f"{n}.kvagent" for n in trace.docs}
    if folder.exists():
        return files
    root = tmp / f"seeding-{digest}"
    shutil.copytree(brief, root)
    began = time.perf_counter()
    tokens = 0
    async with kvactor.open(model, cache_dir=root) as kv:
        await kv.context(BRIEF, trace.system)
        for n, doc in trace.docs.items():
            agent = await kv.spawn_agent(n, context=BRIEF)
            await agent.generate(f"{trace.roles[n]}\n{doc}", max_tokens=max_tokens)
            info = await kv.cache_info(n)
            tokens += info.tokens
            folder.mkdir(exist_ok=True)
            await kv.export_agent(n, files[n])
            print(f"  private context {n}: {info.tokens} tokens", flush=True)
    print(
        f"private contexts: {len(files)} agents, {tokens} tokens, prefilled once in "
        f"{time.perf_counter() - began:.1f} s",
        flush=True,
    )
    shutil.rmtree(root)
    return files


def captured(lru: dict[str, Any], workflow: dict[str, Any], oracle: dict[str, Any]) -> float:
    """The share of the oracle's gain over LRU that ``workflow`` reaches, on summed excess:
    (LRU - workflow) / (LRU - oracle)."""
    gain = lru["summed_excess_s"] - oracle["summed_excess_s"]
    if gain <= 0:
        return math.nan  # the oracle did not win: nothing to capture
    return (lru["summed_excess_s"] - workflow["summed_excess_s"]) / gain


async def pressure_results(args: argparse.Namespace, model: Any, tmp: Path) -> dict[str, Any]:
    """The pressure shape: every agent's private context prefilled once, the trace run
    unbounded (the reference), then under a hot budget of 25% and a disk limit of 50% of
    what the agents store, under each policy."""
    trace = make_pressure_trace(
        team=args.team,
        subagents=args.subagents,
        rounds=args.pressure_rounds,
        seed=args.seed,
        team_doc_words=tuple(args.team_doc_words),
        sub_doc_words=tuple(args.sub_doc_words),
        step_words=tuple(args.step_words),
        system_words=args.pressure_system_words,
    )
    brief = await seeded_brief(model, trace.system, tmp)
    seeds = await seeded_agents(model, trace, brief, tmp, args.max_tokens)
    run = functools.partial(
        replay,
        trace,
        model,
        max_tokens=args.max_tokens,
        seed=args.seed,
        brief=brief,
        seeds=seeds,
        settle=args.settle,
    )
    reference = await run(tmp / "pressure-ref", policy="lru", budget=None)
    budget, working = budget_for(reference, HOT_SHARE, args.max_tokens)
    disk_limit = brief_bytes(brief) + int(DISK_SHARE * working)
    runs = {}
    for policy in POLICIES:
        got = await run(
            tmp / f"pressure-{policy}", policy=policy, budget=budget, disk_limit=disk_limit
        )
        runs[policy] = summary(got, reference)
        runs[policy]["tokens"] = [t["tokens"] for t in got["turns"]]
        r = runs[policy]
        print(
            f"pressure     {policy:15} excess {r['summed_excess_s']:7.2f}s ttft"
            f" {r['summed_ttft_s']:7.2f}s hot {r['hot_hits']:3} cold {r['cold_turns']:3}"
            f" reloads {r['warm_reloads']:3} re-prefilled {r['re_prefilled_tokens']:6}"
            f" peak/budget {r['peak_bytes'] / budget:.2f}"
            f" disk/limit {r['disk_peak_bytes'] / disk_limit:.2f}",
            flush=True,
        )
    expected = [t["tokens"] for t in reference["turns"]]
    diverged = {p: r.pop("tokens") != expected for p, r in runs.items()}
    return {
        "oracle_vs_lru": ratio(runs["oracle"], runs["lru"]),
        "captured": captured(runs["lru"], runs["workflow"], runs["oracle"]),
        "captured_wrong": captured(runs["lru"], runs["workflow_wrong"], runs["oracle"]),
        "workflow_vs_lru": ratio(runs["workflow"], runs["lru"]),
        "workflow_vs_oracle": ratio(runs["workflow"], runs["oracle"]),
        "wrong_vs_lru": ratio(runs["workflow_wrong"], runs["lru"]),
        "identical_outputs": not any(diverged.values()),
        "diverged": [p for p, d in diverged.items() if d],
        "within_budget": all(r["peak_bytes"] <= budget for r in runs.values()),
        "within_disk_limit": all(r["disk_peak_bytes"] <= disk_limit for r in runs.values()),
        "agents": len(trace.agents),
        "steps": len(trace.steps),
        "context_tokens": reference["context_tokens"],
        "budget_bytes": budget,
        "disk_limit_bytes": disk_limit,
        "working_set_bytes": working,
        "hot_share": budget / working,
        "disk_share": disk_limit / working,
        "reference": summary(reference, reference),
        "policies": runs,
        # For bench/replay.py: the trace's steps, and what each run began with.
        "trace": [[s.agent, s.tool_wait_s] for s in trace.steps],
        "start_hot": reference["start_hot"],
        "imported_tokens": reference["imported_tokens"],
        "brief_tokens": reference["brief_tokens"],
        "settled": args.settle,
        "seed": args.seed,  # the trace's, and the wrong hints' picks
    }


def brief_bytes(brief: Path) -> int:
    """The shared context's bytes on disk (a replay's directory holds it besides the
    agents' caches: the disk limit makes room for it)."""
    return agents_bytes(brief)


async def shape_results(
    shape: str, args: argparse.Namespace, model: Any, tmp: Path, *, sharing: bool = False
) -> dict[str, Any]:
    trace = make_trace(
        shape,
        agents=args.agents,
        rounds=args.rounds,
        seed=args.seed,
        words=(args.min_words, args.max_words),
        system_words=args.system_words,
    )
    brief = await seeded_brief(model, trace.system, tmp)
    run = functools.partial(
        replay, trace, model, max_tokens=args.max_tokens, seed=args.seed, brief=brief
    )
    reference = await run(tmp / f"{shape}-ref", policy="lru", budget=None)
    out: dict[str, Any] = {"agents": args.agents, "steps": len(trace.steps), "budgets": {}}
    for label in args.hot_budgets:
        budget, working = budget_for(reference, FRACTIONS[label], args.max_tokens)
        runs = {}
        for policy in POLICIES:
            got = await run(tmp / f"{shape}-{label[:2]}-{policy}", policy=policy, budget=budget)
            runs[policy] = summary(got, reference)
            runs[policy]["tokens"] = [t["tokens"] for t in got["turns"]]
            print(
                f"{shape:12} {label} {policy:15} excess {runs[policy]['summed_excess_s']:7.2f}s"
                f" ttft {runs[policy]['summed_ttft_s']:7.2f}s hot {runs[policy]['hot_hits']:3}"
                f" reloads {runs[policy]['reloads']:3} peak/budget"
                f" {runs[policy]['peak_bytes'] / budget:.2f}",
                flush=True,
            )
        expected = [t["tokens"] for t in reference["turns"]]
        identical = all(r.pop("tokens") == expected for r in runs.values())
        out["budgets"][label] = {
            "budget_bytes": budget,
            "working_set_bytes": working,
            "hot_peak_bytes": reference["peak_bytes"],
            "within_budget": all(r["peak_bytes"] <= budget for r in runs.values()),
            "identical_outputs": identical,
            "policies": runs,
        }
    if sharing:
        out["shared_ready"] = await shared_ready(run, reference, tmp / shape, args.max_tokens)
    return out


async def shared_ready(
    run: Any, reference: dict[str, Any], tmp: Path, max_tokens: int
) -> dict[str, Any]:
    """The shared system prompt's float copy (``SharedPrefixes``) against none, LRU, at
    the 25% budget plus the room of that one copy (at 25% it does not fit beside a turn's
    working copy: it is as large): stored tokens dequantized and summed TTFT."""
    budget, _ = budget_for(reference, FRACTIONS["25%"], max_tokens)
    budget += FloatPrefix.nbytes_for(reference["geometry"], reference["brief_tokens"])
    runs = {}
    for active in (True, False):
        SharedPrefixes.active = active
        try:
            got = await run(
                Path(f"{tmp}-{'shared' if active else 'unshared'}"), policy="lru", budget=budget
            )
        finally:
            SharedPrefixes.active = True
        runs[active] = (summary(got, reference), [t["tokens"] for t in got["turns"]])
    (shared, tokens), (unshared, plain) = runs[True], runs[False]
    expected = [t["tokens"] for t in reference["turns"]]
    print(
        f"shared prefix copy: dequantized {shared['dequantized_tokens']} vs"
        f" {unshared['dequantized_tokens']} tokens without, ttft {shared['summed_ttft_s']:.2f}s"
        f" vs {unshared['summed_ttft_s']:.2f}s",
        flush=True,
    )
    return {
        "budget_bytes": budget,
        "dequantized_tokens": shared["dequantized_tokens"],
        "dequantized_tokens_unshared": unshared["dequantized_tokens"],
        "dequantized_vs_unshared": shared["dequantized_tokens"]
        / max(unshared["dequantized_tokens"], 1),
        "summed_ttft_s": shared["summed_ttft_s"],
        "summed_ttft_unshared_s": unshared["summed_ttft_s"],
        "ready_turns": shared["ready_turns"],
        "peak_bytes": shared["peak_bytes"],
        "within_budget": max(shared["peak_bytes"], unshared["peak_bytes"]) <= budget,
        "identical_outputs": tokens == expected and plain == expected,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    model = _model(args.model)
    results: dict[str, Any] = {"model": args.model, "quick": args.quick, "shapes": {}}
    if args.quick:
        results["note"] = "--quick: a tiny model's turns take ms, the ratios are noise"
    hot_only = [s for s in args.shapes if s != PRESSURE]
    with tempfile.TemporaryDirectory(prefix="kvactor-agentic-") as tmp:
        if PRESSURE in args.shapes:  # first: its figures are the ones that decide
            results["pressure"] = await pressure_results(args, model, Path(tmp))
        for shape in hot_only:  # the first also with and without the shared prefix copy
            results["shapes"][shape] = await shape_results(
                shape, args, model, Path(tmp), sharing=shape == hot_only[0]
            )
    if hot_only:
        results["hot_only"] = hot_only_figures(results["shapes"])
    # The top level: the pressure shape's figures where it ran, else the hot-only shapes'.
    top = results.get("pressure") or results["hot_only"]
    for key in TOP_KEYS:
        if key in top:
            results[key] = top[key]
    if "hot_only" in results:
        results["dequantized_vs_unshared"] = results["hot_only"]["dequantized_vs_unshared"]
    results["identical_outputs"] = all(
        part["identical_outputs"]
        for part in (results.get("pressure"), results.get("hot_only"))
        if part is not None
    )
    results["within_budget"] = all(
        part["within_budget"]
        for part in (results.get("pressure"), results.get("hot_only"))
        if part is not None
    )
    return results


def hot_only_figures(shapes: dict[str, Any]) -> dict[str, Any]:
    """The first three shapes (a hot budget only) on summed excess at 25%, the worst
    shape's ratio."""
    at = [s["budgets"]["25%"]["policies"] for s in shapes.values()]

    def worst(a: str, b: str) -> float:
        return max(ratio(p[a], p[b]) for p in at)

    return {
        # What the best policy reaches (the oracle knows the future): a floor for the others.
        "oracle_vs_lru": worst("oracle", "lru"),
        # Less to dequantize: the shared system prompt's float copy, the worst shape's.
        "dequantized_vs_unshared": next(
            s["shared_ready"]["dequantized_vs_unshared"]
            for s in shapes.values()
            if "shared_ready" in s
        ),
        "workflow_vs_lru": worst("workflow", "lru"),
        "workflow_vs_oracle": worst("workflow", "oracle"),
        "wrong_vs_lru": worst("workflow_wrong", "lru"),
        "identical_outputs": all(
            b["identical_outputs"] for s in shapes.values() for b in s["budgets"].values()
        )
        and all(
            s["shared_ready"]["identical_outputs"] for s in shapes.values() if "shared_ready" in s
        ),
        "within_budget": all(
            b["within_budget"] for s in shapes.values() for b in s["budgets"].values()
        ),
    }


def http_part(args: argparse.Namespace) -> dict[str, Any]:
    trace = make_trace(
        "round_robin",
        agents=args.http_agents,
        rounds=args.http_rounds,
        seed=args.seed,
        words=(args.min_words, args.max_words),
        system_words=args.http_system_words,
    )
    with tempfile.TemporaryDirectory(prefix="kvactor-agentic-http-") as tmp:
        return http_results(trace, Path(tmp), args.max_tokens)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and a small trace")
    p.add_argument("--model", choices=("default", "tiny"), default="default")
    p.add_argument("--shapes", nargs="+", choices=(PRESSURE, *SHAPES), default=[PRESSURE, *SHAPES])
    p.add_argument("--team", type=int, default=5, help="pressure: team agents")
    p.add_argument("--subagents", type=int, default=4, help="pressure: one-shot subagents")
    p.add_argument("--pressure-rounds", type=int, default=2)
    p.add_argument("--team-doc-words", type=int, nargs=2, default=(1500, 3000))
    p.add_argument("--sub-doc-words", type=int, nargs=2, default=(1000, 1500))
    p.add_argument("--step-words", type=int, nargs=2, default=(25, 230))
    p.add_argument("--pressure-system-words", type=int, default=150)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-words", type=int, default=25)
    p.add_argument("--max-words", type=int, default=60)
    p.add_argument("--system-words", type=int, default=1800)
    p.add_argument("--http-system-words", type=int, default=80)
    p.add_argument(
        "--hot-budgets",
        nargs="+",
        choices=tuple(FRACTIONS),
        default=["25%"],
        help="the hot-only shapes' budgets beyond a turn's room (50%%: every turn was hot"
        " at 25%% already; it adds ~200 s)",
    )
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-http", action="store_true", help="skip the part over HTTP")
    p.add_argument(
        "--settle",
        action="store_true",
        help="pressure: await each hint's stagings before the step (no race with its turn:"
        " the run bench/replay.py checks its decisions against)",
    )
    p.add_argument("--http-only", action="store_true", help="only the part over HTTP")
    p.add_argument("--http-agents", type=int, default=16)
    p.add_argument("--http-rounds", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.agents, args.rounds = "tiny", 5, 2
        args.min_words, args.max_words, args.system_words, args.max_tokens = 4, 16, 20, 4
        args.http_system_words = 20
        args.http_agents = 4
        # The tiny model's byte tokens: ~6.5 a word; its context is 2,048 tokens.
        args.team, args.subagents, args.pressure_rounds = 5, 4, 2
        args.team_doc_words, args.sub_doc_words = (70, 140), (40, 70)
        args.step_words, args.pressure_system_words = (5, 40), 20
    # 25% is the one the figures read (``hot_only_figures``): always run.
    args.hot_budgets = sorted({"25%", *args.hot_budgets})
    return args


if __name__ == "__main__":
    arguments = parse()
    began = time.perf_counter()
    out: dict[str, Any] = {} if arguments.http_only else anyio.run(main, arguments)
    if not arguments.no_http:
        out["http"] = http_part(arguments)
        for key in ("vs_mlx_lm_server", "vs_mlx_lm_server_sized", "after_restart_vs_mlx_lm_server"):
            out[key] = out["http"][key]
        out["kvactor_parts"] = out["http"]["kvactor_parts"]
    out["total_s"] = time.perf_counter() - began
    keys = [k for k in TOP_KEYS if k in out] + ["identical_outputs"]
    if not arguments.no_http:
        keys += ["vs_mlx_lm_server", "vs_mlx_lm_server_sized", "after_restart_vs_mlx_lm_server"]
        keys += ["kvactor_parts"]
    for key in keys:
        if key in out:
            print(f"{key}: {out[key]}")
    print(f"within_budget: {out.get('within_budget', '-')}  total {out['total_s']:.0f}s")
    if "note" in out:
        print(out["note"])
    if arguments.json:
        write_json(arguments.json, out)
