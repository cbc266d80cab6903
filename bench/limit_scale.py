"""A turn at the disk limit with thousands of agents on disk: the store asking the engine's
policy about the 64 least recently written agents first, against asking about all of them.

``python bench/limit_scale.py --json PATH`` (issue 40, item 4: nothing per turn should scan
every agent). For each size N and policy: a cache directory of N warm agents of the tiny
model (``bench/scale.py``'s forks of one real session's cache, each then given its own copy
of its segment files, so that making one cold frees its bytes), opened with the policy and
a disk limit just above what they hold; 3 + N / 200 new agents' turns first, untimed (the
store reads its list of warm agents at the first, and its collector goes through every
folder after open, beside them); with ``workflow`` (``WorkflowPolicy``), hints then: one
agent in ten expected in 600 s, one in 500 done, one in 1,000 of priority -1 (a lower
rank than the plain agents', so that the first such asks go to all); then ``--turns`` new
agents' turns in each way, alternated (``StoreActor``'s ``SHORTLIST`` 64, or larger than
N: every agent asked). Each turn writes and so makes room for itself.

Figures per size and ``policy``: ``turn_shortlist_s`` and ``turn_all_s`` (the turn's mean, the write
included; medians in ``*_median_s``), ``engine_shortlist_ms`` and ``engine_all_ms`` (the
engine's ranking of the warm agents, ``Demotion.choose_cold``, median per question),
``early_answers`` (questions the policy answered from the shortlist, with the agents an
``AskWith`` named: ``asked_with``) and ``asked_all``,
``demoted_cold``, ``disk_peak_bytes`` against ``disk_limit_bytes`` (``within_limit``).
Before all that, the first turn at the limit in a session, in two sessions of their own:
``first_turn_at_open_s`` (at once after open: the store lists the warm agents the
collector's pass has not, most of them) and ``first_turn_after_pass_s`` (after the pass,
``collector_pass_s``, which lists them beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyio
import scale  # bench/ is the script's folder: on sys.path
from _results import figure_table, write_json

from kvactor.actors.hot import _demotion
from kvactor.actors.messages import AskWith, WarmVictims
from kvactor.actors.warm import DiskUsage, _store

ALL = 1 << 40  # a shortlist longer than any directory: every agent asked


class EngineTimer:
    """Times ``Demotion.choose_cold`` (the engine's ranking) while installed, by whether
    it was asked about a shortlist; counts the shortlist's answers."""

    def __init__(self) -> None:
        self.short: list[float] = []
        self.full: list[float] = []
        self.early = 0
        self.ask_with = 0  # answers that named agents to ask about too
        self._orig = _demotion.Demotion.choose_cold

    def __enter__(self) -> EngineTimer:
        orig, timer = self._orig, self

        def timed(demotion: _demotion.Demotion, asked: WarmVictims) -> list[str] | AskWith | None:
            began = time.perf_counter()
            answer = orig(demotion, asked)
            short = asked.beyond is not None
            (timer.short if short else timer.full).append(time.perf_counter() - began)
            timer.early += short and isinstance(answer, list)
            timer.ask_with += isinstance(answer, AskWith)
            return answer

        _demotion.Demotion.choose_cold = timed  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        _demotion.Demotion.choose_cold = self._orig  # type: ignore[method-assign]


def own_copies(root: Path) -> None:
    """Each agent's segment files its own (forks link them: making one cold frees nothing)."""
    for folder in (root / "agents").iterdir():
        for f in folder.glob("*.safetensors"):
            copy = f.with_name(f.name + ".copy")
            shutil.copyfile(f, copy)
            os.replace(copy, f)


POLICIES = ("lru", "workflow")


async def give_hints(kv: kvactor.Session, n: int) -> None:
    """Hints on agents spread over the directory (see the module's docstring)."""
    names = [scale.agent_name(i) for i in range(n)]
    await kv.hint(
        expect_in_s={a: 600.0 for a in names[::10]},
        done=names[5::500],
        priority={a: -1 for a in names[7::1000]},
        prefetch=0,
    )


async def first_turns(root: Path, options: dict[str, Any]) -> dict[str, float]:
    """The first turn at the limit after open, twice: at once (the collector's pass just
    begun, the store lists the warm agents it has not at that write) and after the pass
    (``collector_pass_s``: it listed them beside it). Each opens the directory anew."""
    out: dict[str, float] = {}
    for way in ("at_open", "after_pass"):
        async with kvactor.open(scale.MODEL, cache_dir=root, **options) as kv:
            if way == "after_pass":
                began = time.perf_counter()
                while (await kv.warm_stats()).collector_left:
                    await anyio.sleep(0.01)
                out["collector_pass_s"] = time.perf_counter() - began
            agent = await kv.spawn_agent(f"first-{way}", system=scale.SYSTEM)
            began = time.perf_counter()
            done = await agent.generate(scale.FIRST, max_tokens=4)
            out[f"first_turn_{way}_s"] = time.perf_counter() - began
            assert done.saved, done.save_error
            assert (await kv.warm_stats()).demoted_cold, "the first turn made no room"
    return out


async def one_size(n: int, turns: int, workdir: Path, policy: str = "lru") -> dict[str, Any]:
    root = workdir / f"agents-{n}-{policy}"
    identity, _ = await scale.seed(root)
    scale.grow(root, identity, 1, n)
    own_copies(root)
    async with kvactor.open(scale.MODEL, cache_dir=root, disk_limit=1 << 40) as kv:
        held = (await kv.stats()).warm_bytes
    limit = held + 20_000
    while limit < held + 20_000 + DiskUsage.headroom(limit):  # under it at open
        limit = held + 20_000 + DiskUsage.headroom(limit)
    times: dict[int, list[float]] = {_store.SHORTLIST: [], ALL: []}
    shortlist = _store.SHORTLIST
    chosen = kvactor.LRUPolicy() if policy == "lru" else kvactor.WorkflowPolicy()
    options: dict[str, Any] = {"disk_limit": limit, "policy": chosen}
    first = await first_turns(root, options)
    try:
        with EngineTimer() as timer:
            async with kvactor.open(scale.MODEL, cache_dir=root, **options) as kv:
                # The store lists its warm agents at the first room made, and its collector
                # goes through every folder after open (~1 s at 10,000 agents, beside the
                # turns): untimed turns first, until it is done.
                for i in range(3 + n // 200):
                    agent = await kv.spawn_agent(f"first-{i}", system=scale.SYSTEM)
                    done = await agent.generate(scale.FIRST, max_tokens=4)
                    assert done.saved, done.save_error
                if policy == "workflow":
                    await give_hints(kv, n)
                timer.short.clear()
                timer.full.clear()
                timer.early = timer.ask_with = 0
                for i in range(turns):
                    for way in (shortlist, ALL) if i % 2 else (ALL, shortlist):
                        _store.SHORTLIST = way
                        agent = await kv.spawn_agent(f"new-{i}-{way}", system=scale.SYSTEM)
                        began = time.perf_counter()
                        done = await agent.generate(scale.FIRST, max_tokens=4)
                        times[way].append(time.perf_counter() - began)
                        assert done.saved, done.save_error
                stats = await kv.warm_stats()
    finally:
        _store.SHORTLIST = shortlist
    return {
        "agents": n,
        "policy": policy,
        "turns": turns,
        "turn_shortlist_s": statistics.mean(times[shortlist]),
        "turn_all_s": statistics.mean(times[ALL]),
        "turn_shortlist_median_s": statistics.median(times[shortlist]),
        "turn_all_median_s": statistics.median(times[ALL]),
        "engine_shortlist_ms": 1e3 * statistics.median(timer.short) if timer.short else None,
        "engine_all_ms": 1e3 * statistics.median(timer.full) if timer.full else None,
        "early_answers": timer.early,
        "asked_with": timer.ask_with,
        "asked_all": len(timer.full),
        **first,
        "demoted_cold": stats.demoted_cold,
        "disk_peak_bytes": stats.disk_peak_bytes,
        "disk_limit_bytes": limit,
        "within_limit": stats.disk_peak_bytes <= limit,
    }


async def run(
    sizes: Sequence[int],
    turns: int,
    workdir: str | None = None,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    base = Path(workdir or tempfile.mkdtemp(prefix="kvactor-limit-scale-"))
    rows = []
    try:
        for n in sizes:
            for policy in policies:
                rows.append(await one_size(n, turns, base, policy))
                print(short(rows[-1]), flush=True)
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    return {
        "sizes": list(sizes),
        "policies": list(policies),
        "shortlist": _store.SHORTLIST,
        "rows": rows,
    }


def short(r: dict[str, Any]) -> str:
    return (
        f"{r['agents']:6} agents, {r['policy']:8}: turn"
        f" {1e3 * r['turn_shortlist_s']:.1f} ms shortlisted,"
        f" {1e3 * r['turn_all_s']:.1f} ms asking all; engine"
        f" {r['engine_shortlist_ms'] or 0:.2f} / {r['engine_all_ms'] or 0:.2f} ms;"
        f" answered early {r['early_answers']} (asked with more {r['asked_with']}),"
        f" asked of all {r['asked_all']}"
    )


def table(result: dict[str, Any]) -> str:
    rows: list[tuple[object, object, object, object]] = []
    for r in result["rows"]:
        n = f"{r['agents']:,} agents, {r['policy']}"
        ratio = r["turn_all_s"] / r["turn_shortlist_s"]
        rows += [
            (
                f"turn at the limit, {n}: shortlist / all (mean of {r['turns']})",
                f"{1e3 * r['turn_shortlist_s']:.1f} / {1e3 * r['turn_all_s']:.1f} ms"
                f" ({ratio:.2f}x)",
                "",
                "",
            ),
            (
                f"engine's ranking, {n}: shortlist / all (median)",
                f"{r['engine_shortlist_ms'] or 0:.2f} / {r['engine_all_ms'] or 0:.2f} ms",
                "",
                "",
            ),
            (
                f"answered from the shortlist / asked of all, {n}",
                f"{r['early_answers']} / {r['asked_all']}",
                "",
                "",
            ),
            (
                f"first turn at the limit, {n}: at open / after the collector's pass",
                f"{1e3 * r['first_turn_at_open_s']:.0f} / {1e3 * r['first_turn_after_pass_s']:.0f}"
                f" ms (the pass {r['collector_pass_s']:.2f} s)",
                "",
                "",
            ),
            (
                f"disk peak / limit, {n}",
                f"{r['disk_peak_bytes']:,} / {r['disk_limit_bytes']:,}",
                "peak <= limit",
                "met" if r["within_limit"] else "NOT met",
            ),
        ]
    return figure_table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--turns", type=int, default=12, help="turns each way, per size")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--quick", action="store_true", help="sizes 100 / 300, 4 turns")
    parser.add_argument("--dir", dest="workdir", help="keep the cache directories here")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    sizes, turns = ([100, 300], 4) if args.quick else (args.sizes, args.turns)
    result = anyio.run(run, sizes, turns, args.workdir, args.policies)
    print(table(result))
    if args.json:
        write_json(args.json, result)
