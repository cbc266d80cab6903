"""The runtime's own cost as agents grow (issue 40, item 4), on the tiny random-weight model:
``open()`` over a cache directory of N warm agents, a hot and a warm turn's time with all N
agents spawned (all but the turns' agents idle on disk), what spawning costs per agent, and
the memory each idle agent holds beyond its KV (it has none hot: its cache is on disk).

    python bench/scale.py [--quick] [--sizes 10 1000 10000] [--hot-sizes 10 1000 3000]
        [--rounds 5] [--max-tokens 4] [--dir DIR] [--json PATH]

How the directory is built, once, grown in place from one size to the next: a session
writes agent ``agent-00000`` for real (a system prompt and one turn), then every other
agent is the store's own fork of it (``fork_cache``: its segment files hard-linked, its
manifest committed, as ``spawn_agent(fork_of=...)`` does on disk), so each is a real warm
cache that reads and verifies; a sample is verified (``verify_cache``) at each size and the
warm turns below must resume WARM. Agent 0 takes no turns, so every fork holds the same
conversation; the turns at each size use agents no earlier size touched.

At each size N, in one process:

- ``open_s``: ``await kvactor.open(...)`` with the default disk limit, and
  ``open_nolimit_s`` with ``disk_limit=None`` (best of ``--rounds``, alternated); the
  floor is ``open_empty_s``, the same over an empty directory. ``open_parts_s``: what
  each full pass over the directory costs on its own (the collector's ``collect``, the
  disk count's ``scan_agents``, the store's ``list_agents``, and ``agent_names``, the
  folder listing a cluster's placement reads), timed directly.
- a session with the default limit spawns all N agents (``spawn_s_per_agent``: a
  manifest read each, its conversation restored), then runs ``--rounds`` rounds of three
  hot turns (six agents in turn, ``hot_turn_s``) and one warm turn (three agents in turn,
  each released before it, so that its cache is on disk only: ``warm_turn_s``): wall
  time of ``generate``, best of the runs, and without the turn's own write to disk
  (``*_nowrite_s``: each turn's fsyncs are the disk's noise); medians in the JSON.
  ``hot_turn_1_s`` is the floor: one agent in an empty directory.
- ``idle_agent_bytes``: the process's RSS grown over spawning the first N - K agents,
  per agent; ``idle_agent_traced_bytes``: Python's allocations (tracemalloc) over the
  last K, per agent, with the largest sites in the JSON.

Then the smallest and the largest size side by side, the turn ratios' target measure
(``hot_turn_10000_vs_10_paired``, ``warm_turn_10000_vs_10_paired``): each size's session
in a process of its own (its own heap and threads: what 10,000 idle agents cost a turn is
in its process alone), both open at once over their own directories, the same turns as
above run one at a time, a turn of one size then the same turn of the other (which one
goes first swapped each time), and the median over pairs of the larger's time over the
smaller's. The sizes measured minutes apart (``hot_turn_10000_vs_10``, each one's best)
swung from 0.85 to 1.36 between runs on a shared 2-core machine; a pair's two turns are
milliseconds apart, so whatever else runs falls on both alike.

Then with ``--hot-sizes`` agents hot at once (10 / 1,000 / 3,000; a turn each, ready
copies kept, a cache directory of their own): ``hot_step_s``, a decode step of one of
them, and ``hot_room_turn_s``, a new agent's turn under a hot budget that holds 95% of
theirs, so that each such turn makes room (``hot_room_moves``), and
``hot_demote_turn_s``, the same without ready copies, so that each such turn demotes
(``hot_demote_moves``): what grows with the agents hot, each against the smallest size
(``hot_step_3000_vs_10``).

``--quick`` (sizes 10 / 300, about a minute); the full mode (10 / 1,000 / 10,000) takes
a few minutes on a 2-core CPU. Targets: ``open_s`` <= 1 s at 10,000 agents, hot and warm
turn 10,000 vs 10 <= 1.1x, ``idle_agent_bytes`` <= 64 KB.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
from _process import wait_or_kill
from _results import figure_table, write_json  # bench/ is the script's folder: on sys.path

from kvactor.actors.enums import Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import (
    CacheIdentity,
    ExpectFn,
    agent_names,
    collect,
    forget_cache,
    fork_cache,
    list_agents,
    lock_cache_dir,
    scan_agents,
    verify_cache,
)

MODEL = functools.partial(make_tiny_model, 0, head_dim=64)
SYSTEM = "You are one of many agents. Answer briefly and keep to the point."
FIRST = "Tell me about the lighthouse on the northern cape and its keeper."
ASK = "And then what happened next, in one sentence?"
TEMPLATE = 0  # the agent every other one is a fork of; it takes no turns

OPEN_TARGET_S = 1.0  # at 10,000 agents
TURN_TARGET = 1.1  # 10,000 vs 10
IDLE_TARGET_BYTES = 64 << 10
HOT_PER_WARM = 3  # hot turns per round, with one warm turn
HOT_AGENTS, WARM_AGENTS = 6, 3  # whose turns are timed, in turn
STEP_TOKENS = 24  # a hot decode's length, timed per step after its first token
START_S, TURN_S = 600.0, 120.0  # a pair worker's start and turn, at most
PAIR_ROUNDS = 4  # side by side, rounds per --rounds (a pair's turns vary +-20%: fsyncs)


@dataclass(frozen=True)
class Config:
    quick: bool = False
    sizes: tuple[int, ...] = (10, 1_000, 10_000)
    rounds: int = 12
    max_tokens: int = 4
    traced: int = 300  # agents spawned under tracemalloc at each size (at most half)
    verify: int = 16  # agents verified (read whole) at each size
    hot_sizes: tuple[int, ...] = (10, 1_000, 3_000)  # agents hot at once (none: skip)
    workdir: str | None = None


QUICK = Config(quick=True, sizes=(10, 300), hot_sizes=(10, 100))


def agent_name(i: int) -> str:
    return f"agent-{i:05d}"


def rss_bytes() -> int:
    """This process's resident set now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------- the directory
async def seed(root: Path) -> tuple[CacheIdentity, ExpectFn]:
    """Write the template agent for real; the identity and layout its caches have."""
    async with kvactor.open(MODEL, cache_dir=root, disk_limit=None) as kv:
        agent = await kv.spawn_agent(agent_name(TEMPLATE), system=SYSTEM)
        done = await agent.generate(FIRST, max_tokens=8)
        assert done.saved, f"the template was not written: {done.save_error}"
        assert kv.identity is not None and kv.layout is not None
        return kv.identity, kv.layout


def grow(root: Path, identity: CacheIdentity, have: int, want: int) -> None:
    """Agents ``have`` .. ``want - 1``: forks of the template, by the store's own
    ``fork_cache`` (links and a committed manifest), under the directory's lock."""
    lock = lock_cache_dir(root)
    try:
        for i in range(max(have, TEMPLATE + 1), want):
            info = fork_cache(root, identity, agent_name(TEMPLATE), agent_name(i))
            assert info is not None and info.tokens > 0
    finally:
        lock.release()


def verify_sample(root: Path, identity: CacheIdentity, layout: ExpectFn, n: int, k: int) -> int:
    """Read and verify ``k`` agents spread over the first ``n`` (raises if one fails)."""
    step = max(n // k, 1)
    picked = range(TEMPLATE, n, step)
    for i in picked:
        verify_cache(root, identity, layout, agent_name(i))
    return len(picked)


def open_parts(root: Path, identity: CacheIdentity) -> dict[str, float]:
    """What each full pass over the directory costs on its own (seconds)."""
    out = {}
    for key, fn in (
        ("collect", lambda: collect(root)),
        ("scan_agents", lambda: scan_agents(root)),
        ("list_agents", lambda: list_agents(root, identity)),
        ("agent_names", lambda: agent_names(root)),
    ):
        t0 = time.perf_counter()
        fn()
        out[key] = round(time.perf_counter() - t0, 4)
    return out


# -------------------------------------------------------------------------- measures
async def open_once(root: Path, **options: Any) -> tuple[float, float]:
    """Seconds to open a session over ``root``, and to close it."""
    t0 = time.perf_counter()
    kv = await kvactor.open(MODEL, cache_dir=root, **options)
    t1 = time.perf_counter()
    await kv.aclose()
    return t1 - t0, time.perf_counter() - t1


async def open_times(root: Path, rounds: int) -> dict[str, Any]:
    """``open_s`` (default disk limit) and ``open_nolimit_s``, alternated, best of each."""
    runs: dict[str, list[float]] = {"open_s": [], "open_nolimit_s": [], "close_s": []}
    for _ in range(rounds):
        opened, closed = await open_once(root)
        runs["open_s"].append(opened)
        runs["close_s"].append(closed)
        runs["open_nolimit_s"].append((await open_once(root, disk_limit=None))[0])
    out: dict[str, Any] = {k: round(min(v), 4) for k, v in runs.items()}
    out["open_runs"] = {k: [round(x, 4) for x in v] for k, v in runs.items()}
    return out


async def timed(turn: Callable[[], Awaitable[kvactor.Completion]]) -> Timed:
    """A turn's wall time, the part of it its write to disk took, and its tier."""
    t0 = time.perf_counter()
    done = await turn()
    return Timed(time.perf_counter() - t0, done.timings.write_s, done.path)


@dataclass(frozen=True)
class Timed:
    wall_s: float
    write_s: float
    path: Tier


def figures(key: str, runs: list[Timed]) -> dict[str, Any]:
    """Best and median wall time of ``runs``, and without their writes to disk (each
    turn's write-through fsyncs: the disk's noise, not the runtime's)."""
    walls = [t.wall_s for t in runs]
    rest = [t.wall_s - t.write_s for t in runs]
    return {
        f"{key}_s": round(min(walls), 5),
        f"{key}_median_s": round(statistics.median(walls), 5),
        f"{key}_nowrite_s": round(min(rest), 5),
        f"{key}_write_median_s": round(statistics.median(t.write_s for t in runs), 5),
    }


async def spawn_all(kv: kvactor.Session, n: int, traced: int) -> dict[str, Any]:
    """Spawn agents 0 .. n-1: the first ``n - traced`` measured by RSS, the rest under
    tracemalloc; their handles stay in the session."""
    plain = n - traced
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    for i in range(plain):
        await kv.spawn_agent(agent_name(i), system=SYSTEM)
    spawn_s = time.perf_counter() - t0
    gc.collect()
    grown = rss_bytes() - before
    tracemalloc.start()
    first = tracemalloc.take_snapshot()
    for i in range(plain, n):
        await kv.spawn_agent(agent_name(i), system=SYSTEM)
    gc.collect()
    last = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stats = last.compare_to(first, "filename")
    total = sum(s.size_diff for s in stats)
    top = [
        {"file": str(s.traceback).rsplit("site-packages/", 1)[-1], "bytes": s.size_diff}
        for s in stats[:8]
    ]
    return {
        "spawn_s_per_agent": round(spawn_s / max(plain, 1), 6),
        "idle_agent_bytes": round(grown / max(plain, 1)),
        "idle_agent_traced_bytes": round(total / max(traced, 1)),
        "traced_top": top,
    }


class Turns:
    """The timed turns of a session with every agent spawned: hot turns of ``HOT_AGENTS``
    agents in turn (each hot since an untimed first turn) and warm turns of
    ``WARM_AGENTS`` in turn (each released before its next, so its cache is on disk
    only). The same agents' conversations grow the same way at every size, and stay
    short (a turn's time grows with its context)."""

    def __init__(self, kv: kvactor.Session, n: int, max_tokens: int) -> None:
        assert n > TEMPLATE + HOT_AGENTS + WARM_AGENTS, f"{n} agents are too few"
        self.kv, self.max_tokens = kv, max_tokens
        self.hot_agents = [agent_name(i) for i in turn_agents(n)[:HOT_AGENTS]]
        self.warm_agents = [agent_name(i) for i in turn_agents(n)[HOT_AGENTS:]]

    async def start(self) -> None:
        """The hot agents' first turns (from disk, untimed)."""
        for name in self.hot_agents:
            first = await self.kv.agent(name).generate(FIRST, max_tokens=self.max_tokens)
            assert first.path == Tier.WARM, (name, first.path)

    async def hot(self, k: int) -> Timed:
        """The ``k``-th hot turn (of the hot agents in turn)."""
        turn = self.kv.agent(self.hot_agents[k % HOT_AGENTS]).generate
        return await timed(functools.partial(turn, ASK, max_tokens=self.max_tokens))

    async def warm(self, r: int) -> Timed:
        """The ``r``-th warm turn (of the warm agents in turn)."""
        name = self.warm_agents[r % WARM_AGENTS]
        if r >= WARM_AGENTS:  # it was hot since its last turn: on disk only again
            await self.kv.release(name)
            await self.kv.spawn_agent(name, system=SYSTEM)
        turn = self.kv.agent(name).generate
        return await timed(functools.partial(turn, FIRST, max_tokens=self.max_tokens))


def turn_agents(n: int) -> list[int]:
    """The agents whose turns are timed with ``n`` spawned: the last ones, which no
    smaller size touched (hot ones first)."""
    return [n - 1 - i for i in range(HOT_AGENTS + WARM_AGENTS)]


async def turn_times(root: Path, n: int, cfg: Config) -> dict[str, Any]:
    """With all ``n`` agents spawned: ``HOT_PER_WARM`` hot turns a round and a warm turn
    (:class:`Turns`), and what spawning cost."""
    traced = min(cfg.traced, n // 2)
    hot: list[Timed] = []
    warm: list[Timed] = []
    async with kvactor.open(MODEL, cache_dir=root) as kv:
        memory = await spawn_all(kv, n, traced)
        turns = Turns(kv, n, cfg.max_tokens)
        await turns.start()
        for r in range(cfg.rounds):
            for i in range(HOT_PER_WARM):
                hot.append(await turns.hot(r * HOT_PER_WARM + i))
            warm.append(await turns.warm(r))
        stats = await kv.stats()
    return {
        **memory,
        **figures("hot_turn", hot),
        **figures("warm_turn", warm),
        "turn_runs": {
            "hot": [round(t.wall_s, 5) for t in hot],
            "warm": [round(t.wall_s, 5) for t in warm],
            "hot_write": [round(t.write_s, 5) for t in hot],
            "warm_write": [round(t.write_s, 5) for t in warm],
        },
        "wrong_paths": wrong_paths(hot, warm),
        "warm_bytes": stats.warm_bytes,
    }


def wrong_paths(hot: list[Timed], warm: list[Timed]) -> list[str]:
    wrong = [f"hot turn {i}: {t.path}" for i, t in enumerate(hot) if t.path != Tier.HOT]
    return wrong + [f"warm turn {i}: {t.path}" for i, t in enumerate(warm) if t.path != Tier.WARM]


async def fill_hot(kv: kvactor.Session, n: int, prefix: str, cfg: Config) -> list[Any]:
    """``n`` agents of one turn each, hot (and idle) in ``kv``; their handles."""
    agents = []
    for i in range(n):
        agent = await kv.spawn_agent(f"{prefix}{i:05d}", system=SYSTEM)
        await agent.generate(FIRST, max_tokens=cfg.max_tokens)
        agents.append(agent)
    return agents


async def hot_times(root: Path, n: int, cfg: Config) -> dict[str, Any]:
    """With ``n`` agents hot and idle (a turn each; ready copies kept, the default):
    ``hot_step_s``, one of them decoding ``STEP_TOKENS`` tokens, its time after the first
    token per token (median of ``cfg.rounds`` turns of different agents), without a hot
    budget; then ``hot_room_turn_s``, a new agent's turn in a session whose hot budget
    holds 95% of what the ``n`` hold plus one turn's room, so that each such turn makes
    room (drops ready copies or demotes: ``hot_room_moves``): the bookkeeping that
    grows with the agents hot, each figure against its own at the smallest size."""
    steps = []
    shutil.rmtree(root, ignore_errors=True)
    async with kvactor.open(MODEL, cache_dir=root) as kv:
        agents = await fill_hot(kv, n, "hot-", cfg)
        stats = await kv.stats()
        held, stored = stats.cache_bytes, stats.cache_bytes - stats.ready_bytes
        for r in range(cfg.rounds):
            t0 = time.perf_counter()
            done = await agents[r % n].generate(ASK, max_tokens=STEP_TOKENS)
            after_first = time.perf_counter() - t0 - done.timings.ttft_s
            steps.append(after_first / max(len(done.token_ids) - 1, 1))
            assert done.path == Tier.HOT, (r, done.path)
    shutil.rmtree(root, ignore_errors=True)
    budget = int(held * 0.95) + (1 << 20)  # a short turn's room: 1 MiB (tiny model)
    rooms, moves = await room_turns(root, n, cfg, budget, ready_copies=True)
    # Without ready copies each such turn demotes (the policy chooses among the caches).
    stored_budget = int(stored * 0.95) + (1 << 20)
    demotes, demotions = await room_turns(root, n, cfg, stored_budget, ready_copies=False)
    return {
        "hot_agents": n,
        "hot_step_s": round(statistics.median(steps), 6),
        "hot_room_turn_s": round(statistics.median(t.wall_s for t in rooms), 5),
        "hot_room_turn_nowrite_s": round(statistics.median(t.wall_s - t.write_s for t in rooms), 5),
        "hot_room_moves": moves,
        "hot_demote_turn_s": round(statistics.median(t.wall_s for t in demotes), 5),
        "hot_demote_turn_nowrite_s": round(
            statistics.median(t.wall_s - t.write_s for t in demotes), 5
        ),
        "hot_demote_moves": demotions,
        "hot_budget_bytes": budget,
    }


async def room_turns(
    root: Path, n: int, cfg: Config, budget: int, *, ready_copies: bool
) -> tuple[list[Timed], int]:
    """``cfg.rounds`` new agents' turns with ``n`` agents hot in a session of hot budget
    ``budget``; the turns, and the ready copies dropped and caches demoted meanwhile."""
    async with kvactor.open(
        MODEL, cache_dir=root, budget_bytes=budget, ready_copies=ready_copies
    ) as kv:
        await fill_hot(kv, n, "hot-", cfg)
        before = await kv.stats()
        rooms = []
        for r in range(cfg.rounds):
            agent = await kv.spawn_agent(f"new-{r:03d}", system=SYSTEM)
            rooms.append(
                await timed(functools.partial(agent.generate, FIRST, max_tokens=cfg.max_tokens))
            )
        after = await kv.stats()
    shutil.rmtree(root, ignore_errors=True)
    moves = (after.demoted_warm + after.demoted_cold + after.dropped_ready) - (
        before.demoted_warm + before.demoted_cold + before.dropped_ready
    )
    return rooms, moves


async def floor(root: Path, cfg: Config) -> dict[str, Any]:
    """The floors: open over an empty directory, and a hot turn with one agent."""
    opened = [(await open_once(root))[0] for _ in range(cfg.rounds)]
    hot = []
    async with kvactor.open(MODEL, cache_dir=root) as kv:
        agent = await kv.spawn_agent("solo", system=SYSTEM)
        await agent.generate(FIRST, max_tokens=cfg.max_tokens)
        for _ in range(cfg.rounds * HOT_PER_WARM // HOT_AGENTS):  # as many as each one's
            hot.append(
                await timed(functools.partial(agent.generate, ASK, max_tokens=cfg.max_tokens))
            )
    assert all(t.path == Tier.HOT for t in hot), [t.path for t in hot]
    return {"open_empty_s": round(min(opened), 4), **figures("hot_turn_1", hot)}


# ------------------------------------------------------------------ paired sizes
async def pair_worker(root: str, n: str, max_tokens: str) -> None:
    """One side of :func:`alternate` (``scale.py --pair-worker ROOT N MAX_TOKENS``): a
    session over ``root`` with its ``n`` agents spawned, running the turn each line of
    stdin names (``hot K`` or ``warm R``, :class:`Turns`) and answering each with one
    line of JSON on stdout (wall and write seconds, tier); it stops at the end of stdin."""
    count = int(n)
    async with kvactor.open(MODEL, cache_dir=Path(root)) as kv:
        for i in range(count):
            await kv.spawn_agent(agent_name(i), system=SYSTEM)
        turns = Turns(kv, count, int(max_tokens))
        await turns.start()
        print("ready", flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            kind, k = line.split()
            t = await (turns.hot if kind == "hot" else turns.warm)(int(k))
            print(json.dumps([t.wall_s, t.write_s, str(t.path)]), flush=True)


def refresh(root: Path, identity: CacheIdentity, n: int) -> None:
    """The agents whose turns are timed at ``n`` made fresh forks of the template again
    (their conversations grew in that size's own turns), under the directory's lock."""
    lock = lock_cache_dir(root)
    try:
        for i in turn_agents(n):
            forget_cache(root, agent_name(i))
            assert fork_cache(root, identity, agent_name(TEMPLATE), agent_name(i)) is not None
    finally:
        lock.release()


async def paired_times(
    work: Path, root: Path, identity: CacheIdentity, cfg: Config
) -> dict[str, Any]:
    """The smallest and the largest size side by side (:func:`alternate`): a directory
    of the smallest size built afresh, the largest one's (``root``) with its turn
    agents fresh again."""
    a, b = min(cfg.sizes), max(cfg.sizes)
    small = work / "pair-small"
    shutil.rmtree(small, ignore_errors=True)
    small_identity, _ = await seed(small)
    await anyio.to_thread.run_sync(grow, small, small_identity, 1, a)
    await anyio.to_thread.run_sync(refresh, root, identity, b)
    return await anyio.to_thread.run_sync(alternate, [(small, a), (root, b)], cfg)


def alternate(sides: list[tuple[Path, int]], cfg: Config) -> dict[str, Any]:
    """Both sizes' sessions open at once, each in its own process (its own heap and
    threads), taking turns one at a time: each hot or warm turn of one size, then the
    same turn of the other, which goes first swapped every time, so that whatever else
    the machine does at a moment falls on both alike. Per kind, the median over pairs of
    the larger size's turn over the smaller's (``{kind}_paired``), and the runs."""
    command = [sys.executable, str(Path(__file__).resolve()), "--pair-worker"]
    procs = [
        subprocess.Popen(
            [*command, str(root), str(n), str(cfg.max_tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for root, n in sides
    ]
    runs: dict[str, tuple[list[Timed], list[Timed]]] = {"hot": ([], []), "warm": ([], [])}
    try:
        for p in procs:  # spawning 10,000 agents takes ~15 s
            if (ready := _line(p, START_S)).strip() != "ready":
                raise RuntimeError(f"a pair worker did not start (said {ready!r})")
        plan = [  # each round: its hot turns, then its warm turn (as turn_times)
            (kind, k)
            for r in range(cfg.rounds * PAIR_ROUNDS)
            for kind, k in [
                *(("hot", r * HOT_PER_WARM + i) for i in range(HOT_PER_WARM)),
                ("warm", r),
            ]
        ]
        for at, (kind, k) in enumerate(plan):
            for side in (0, 1) if at % 2 == 0 else (1, 0):
                runs[kind][side].append(_ask(procs[side], f"{kind} {k}"))
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            wait_or_kill(p, 120)
            if p.stdout is not None:
                p.stdout.close()
    out: dict[str, Any] = {"pair_agents": [n for _, n in sides]}
    for kind, (small, large) in runs.items():
        out[f"{kind}_paired"] = round(
            statistics.median(y.wall_s / x.wall_s for x, y in zip(small, large, strict=True)), 3
        )
        out[f"{kind}_paired_nowrite"] = round(
            statistics.median(
                (y.wall_s - y.write_s) / (x.wall_s - x.write_s)
                for x, y in zip(small, large, strict=True)
            ),
            3,
        )
        out[f"{kind}_paired_best"] = round(
            min(t.wall_s for t in large) / min(t.wall_s for t in small), 3
        )
        out[f"{kind}_paired_runs"] = [[round(t.wall_s, 5) for t in side] for side in (small, large)]
        out[f"{kind}_paired_writes"] = [
            [round(t.write_s, 5) for t in side] for side in (small, large)
        ]
    out["pair_wrong_paths"] = [
        f"{n} agents: {w}"
        for (_, n), side in zip(sides, (0, 1), strict=True)
        for w in wrong_paths(runs["hot"][side], runs["warm"][side])
    ]
    return out


def _ask(proc: subprocess.Popen[str], command: str) -> Timed:
    """One turn of a pair worker: the command sent, its answer read."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    answer = _line(proc, TURN_S)
    if not answer:
        raise RuntimeError(f"a pair worker stopped before answering {command!r}")
    wall, write, path = json.loads(answer)
    return Timed(wall, write, Tier(path))


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The worker's next line ("" once it stopped); TimeoutError after ``timeout``
    seconds without one (it writes whole lines, each flushed)."""
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    if not readable:
        raise TimeoutError(f"a pair worker said nothing for {timeout:.0f} s")
    return proc.stdout.readline()


# ------------------------------------------------------------------------------- run
async def measure_size(
    root: Path, identity: CacheIdentity, layout: ExpectFn, n: int, cfg: Config
) -> dict[str, Any]:
    row: dict[str, Any] = {"agents": n}
    row["verified"] = verify_sample(root, identity, layout, n, cfg.verify)
    row["open_parts_s"] = open_parts(root, identity)
    row.update(await open_times(root, cfg.rounds))
    row.update(await turn_times(root, n, cfg))
    return row


async def run(cfg: Config) -> dict[str, Any]:
    """Every size in a work directory (``cfg.workdir``, else a temporary one, removed)."""
    began = time.perf_counter()
    work = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="scale-"))
    root, empty = work / "agents-cache", work / "empty"
    for old in (root, empty):
        shutil.rmtree(old, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    hot_rows: list[dict[str, Any]] = []
    try:
        base = await floor(empty, cfg)
        identity, layout = await seed(root)
        have = 1
        for n in sorted(cfg.sizes):
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(grow, root, identity, have, n)
            build_s = time.perf_counter() - t0
            have = n
            print(f"[{n} agents] built in {build_s:.1f} s", file=sys.stderr, flush=True)
            row = await measure_size(root, identity, layout, n, cfg)
            row["build_s"] = round(build_s, 2)
            rows.append(row)
            print(f"[{n} agents] {short(row)}", file=sys.stderr, flush=True)
        pair = await paired_times(work, root, identity, cfg) if len(rows) > 1 else {}
        print(
            f"[paired] hot {pair.get('hot_paired')} warm {pair.get('warm_paired')}", file=sys.stderr
        )
        for n in sorted(cfg.hot_sizes):
            hot_rows.append(await hot_times(work / "hot-cache", n, cfg))
            print(f"[{n} hot] {hot_rows[-1]}", file=sys.stderr, flush=True)
    finally:
        if not cfg.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return summary(cfg, base, rows, hot_rows, pair, time.perf_counter() - began)


def short(row: dict[str, Any]) -> str:
    keys = ("open_s", "open_nolimit_s", "hot_turn_s", "warm_turn_s", "idle_agent_bytes")
    return ", ".join(f"{k} {row[k]}" for k in keys)


def summary(
    cfg: Config,
    base: dict[str, Any],
    rows: list[dict[str, Any]],
    hot_rows: list[dict[str, Any]],
    pair: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    """The figures the issue names, by size (keys: the sizes, as str), and the ratios."""
    small, large = rows[0], rows[-1]
    by = {
        key: {str(r["agents"]): r[key] for r in rows}
        for key in (
            "open_s",
            "open_nolimit_s",
            "hot_turn_s",
            "hot_turn_nowrite_s",
            "warm_turn_s",
            "warm_turn_nowrite_s",
            "spawn_s_per_agent",
        )
    }
    a, b = small["agents"], large["agents"]
    out: dict[str, Any] = {
        "model": "tiny llama, head_dim 64 (random weights)",
        "quick": cfg.quick,
        "config": {k: v for k, v in asdict(cfg).items() if k != "workdir"},
        "sizes": [r["agents"] for r in rows],
        **base,
        **by,
        "idle_agent_bytes": large["idle_agent_bytes"],
        "idle_agent_traced_bytes": large["idle_agent_traced_bytes"],
        # The target's measure: the two sizes side by side, turn for turn (paired_times).
        f"hot_turn_{b}_vs_{a}_paired": pair.get("hot_paired"),
        f"warm_turn_{b}_vs_{a}_paired": pair.get("warm_paired"),
        f"hot_turn_nowrite_{b}_vs_{a}_paired": pair.get("hot_paired_nowrite"),
        f"warm_turn_nowrite_{b}_vs_{a}_paired": pair.get("warm_paired_nowrite"),
        "paired": pair,
        # Each size's best, measured minutes apart.
        f"hot_turn_{b}_vs_{a}": round(large["hot_turn_s"] / small["hot_turn_s"], 3),
        f"warm_turn_{b}_vs_{a}": round(large["warm_turn_s"] / small["warm_turn_s"], 3),
        # Round by round (the same agents at the same point of their conversations).
        f"hot_turn_{b}_vs_{a}_by_round": by_round(small, large, "hot"),
        f"warm_turn_{b}_vs_{a}_by_round": by_round(small, large, "warm"),
        f"hot_turn_nowrite_{b}_vs_{a}": round(
            large["hot_turn_nowrite_s"] / small["hot_turn_nowrite_s"], 3
        ),
        f"warm_turn_nowrite_{b}_vs_{a}": round(
            large["warm_turn_nowrite_s"] / small["warm_turn_nowrite_s"], 3
        ),
        "rows": rows,
        **hot_summary(hot_rows),
        "wall_s": round(wall, 1),
    }
    return out


def hot_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The hot figures by agents hot (keys: the sizes, as str), and the largest over the
    smallest."""
    if not rows:
        return {}
    keys = (
        "hot_step_s",
        "hot_room_turn_s",
        "hot_room_turn_nowrite_s",
        "hot_room_moves",
        "hot_demote_turn_s",
        "hot_demote_turn_nowrite_s",
        "hot_demote_moves",
    )
    out: dict[str, Any] = {"hot_sizes": [r["hot_agents"] for r in rows]}
    out.update({k: {str(r["hot_agents"]): r[k] for r in rows} for k in keys})
    a, b = rows[0], rows[-1]
    for k in ("hot_step", "hot_room_turn", "hot_demote_turn"):
        out[f"{k}_{b['hot_agents']}_vs_{a['hot_agents']}"] = round(b[f"{k}_s"] / a[f"{k}_s"], 3)
    return out


def by_round(small: dict[str, Any], large: dict[str, Any], kind: str) -> float:
    """The median over rounds of one size's turn time over the other's, round for round."""
    pairs = zip(small["turn_runs"][kind], large["turn_runs"][kind], strict=True)
    return round(statistics.median(b / a for a, b in pairs), 3)


def table(r: dict[str, Any]) -> str:
    """The figures as a markdown table, with the issue's targets."""
    ok = {True: "met", False: "**not met**"}
    sizes = r["sizes"]
    a, b = sizes[0], sizes[-1]
    full = b >= 10_000

    def per(key: str, unit: float = 1.0, fmt: str = "{:.3f}") -> str:
        return " / ".join(fmt.format(r[key][str(n)] * unit) for n in sizes)

    at = str(b)
    open_ok = ok[r["open_s"][at] <= OPEN_TARGET_S] if full else "(full mode)"
    # One size alone has no pair: its own ratios (1.0).
    hot_ratio = r[f"hot_turn_{b}_vs_{a}_paired"] or r[f"hot_turn_{b}_vs_{a}"]
    warm_ratio = r[f"warm_turn_{b}_vs_{a}_paired"] or r[f"warm_turn_{b}_vs_{a}"]
    tail = "" if full else " (full mode: 10,000)"
    rows = [
        ("agents", " / ".join(f"{n:,}" for n in sizes), "", ""),
        ("open_s (default disk limit)", per("open_s"), "<= 1 s at 10,000", open_ok),
        ("open_nolimit_s (disk_limit=None)", per("open_nolimit_s"), "", ""),
        ("open_empty_s (floor: an empty directory)", f"{r['open_empty_s']:.3f}", "", ""),
        ("spawn per agent, ms", per("spawn_s_per_agent", 1e3, "{:.2f}"), "", ""),
        ("hot_turn_s", per("hot_turn_s", 1.0, "{:.4f}"), "", ""),
        ("hot_turn_1_s (floor: one agent)", f"{r['hot_turn_1_s']:.4f}", "", ""),
        (
            f"hot_turn_{b}_vs_{a}_paired (side by side, median of pairs)",
            hot_ratio,
            f"<= {TURN_TARGET}{tail}",
            ok[hot_ratio <= TURN_TARGET],
        ),
        (
            f"hot_turn_{b}_vs_{a} (each size's best, minutes apart)",
            r[f"hot_turn_{b}_vs_{a}"],
            "",
            "",
        ),
        (f"hot_turn_{b}_vs_{a}_by_round (median)", r[f"hot_turn_{b}_vs_{a}_by_round"], "", ""),
        (f"hot_turn_nowrite_{b}_vs_{a}_paired", r[f"hot_turn_nowrite_{b}_vs_{a}_paired"], "", ""),
        ("hot turn without its write to disk", per("hot_turn_nowrite_s", 1.0, "{:.4f}"), "", ""),
        (f"hot_turn_nowrite_{b}_vs_{a}", r[f"hot_turn_nowrite_{b}_vs_{a}"], "", ""),
        ("warm_turn_s", per("warm_turn_s", 1.0, "{:.4f}"), "", ""),
        (
            f"warm_turn_{b}_vs_{a}_paired (side by side, median of pairs)",
            warm_ratio,
            f"<= {TURN_TARGET}{tail}",
            ok[warm_ratio <= TURN_TARGET],
        ),
        (
            f"warm_turn_{b}_vs_{a} (each size's best, minutes apart)",
            r[f"warm_turn_{b}_vs_{a}"],
            "",
            "",
        ),
        (f"warm_turn_{b}_vs_{a}_by_round (median)", r[f"warm_turn_{b}_vs_{a}_by_round"], "", ""),
        (f"warm_turn_nowrite_{b}_vs_{a}_paired", r[f"warm_turn_nowrite_{b}_vs_{a}_paired"], "", ""),
        ("warm turn without its write", per("warm_turn_nowrite_s", 1.0, "{:.4f}"), "", ""),
        (f"warm_turn_nowrite_{b}_vs_{a}", r[f"warm_turn_nowrite_{b}_vs_{a}"], "", ""),
        (
            f"idle_agent_bytes (RSS, at {b:,})",
            f"{r['idle_agent_bytes']:,}",
            "<= 64 KB",
            ok[r["idle_agent_bytes"] <= IDLE_TARGET_BYTES],
        ),
        ("idle_agent_traced_bytes (tracemalloc)", f"{r['idle_agent_traced_bytes']:,}", "", ""),
    ]
    for row in r["rows"]:
        parts = row["open_parts_s"]
        rows.append(
            (
                f"full passes at {row['agents']:,}: collect / scan_agents / list_agents"
                " / agent_names, s",
                f"{parts['collect']:.3f} / {parts['scan_agents']:.3f}"
                f" / {parts['list_agents']:.3f} / {parts['agent_names']:.3f}",
                "",
                "",
            )
        )
    wrong = [w for row in r["rows"] for w in row["wrong_paths"]] + r["paired"].get(
        "pair_wrong_paths", []
    )
    rows.append(("turns not on their expected tier", len(wrong), "0", ok[not wrong]))
    rows += hot_rows(r)
    return figure_table(rows)


def hot_rows(r: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The table's rows of the agents-hot figures (none when they were not measured)."""
    if not r.get("hot_sizes"):
        return []
    hot = r["hot_sizes"]
    x, y = hot[0], hot[-1]

    def per_hot(key: str, unit: float, fmt: str) -> str:
        return " / ".join(fmt.format(r[key][str(n)] * unit) for n in hot)

    def row(label: str, key: str, unit: float = 1e3, fmt: str = "{:.1f}") -> tuple[Any, ...]:
        return label, per_hot(key, unit, fmt), "", ""

    def ratio(key: str) -> tuple[Any, ...]:
        name = f"{key}_{y}_vs_{x}"
        return name, r[name], "", ""

    return [
        ("agents hot at once", " / ".join(f"{n:,}" for n in hot), "", ""),
        row("hot_step_s (a decode step), ms", "hot_step_s", fmt="{:.2f}"),
        ratio("hot_step"),
        row("hot_room_turn_s (a turn that makes room), ms", "hot_room_turn_s"),
        ratio("hot_room_turn"),
        row("hot_room_moves (ready copies dropped, demotions)", "hot_room_moves", 1, "{:.0f}"),
        row("hot_demote_turn_s (the same, no ready copies: it demotes), ms", "hot_demote_turn_s"),
        ratio("hot_demote_turn"),
        row("the same without its write to disk, ms", "hot_demote_turn_nowrite_s"),
        row("hot_demote_moves (demotions)", "hot_demote_moves", 1, "{:.0f}"),
    ]


def parse(argv: list[str] | None = None) -> tuple[Config, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 10 / 300")
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--hot-sizes", type=int, nargs="*", help="agents hot at once (none: skip)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--dir", dest="workdir", help="keep the cache directories here")
    parser.add_argument("--json", metavar="PATH")
    args = vars(parser.parse_args(argv))
    json_path = args.pop("json")
    base = QUICK if args.pop("quick") else Config()
    given: dict[str, Any] = {k: v for k, v in args.items() if v is not None}
    for key in ("sizes", "hot_sizes"):
        if key in given:
            given[key] = tuple(sorted(given[key]))
    return replace(base, **given), json_path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pair-worker"]:  # one side of alternate(), not for people
        root_arg, n_arg, tokens_arg = sys.argv[2:5]
        anyio.run(pair_worker, root_arg, n_arg, tokens_arg)
        sys.exit(0)
    config, json_path = parse()
    result = anyio.run(run, config)
    print(table(result))
    if json_path:
        write_json(json_path, result)
