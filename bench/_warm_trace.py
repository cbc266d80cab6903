"""The trace ``bench/warm_limits.py`` replays and what watches it: agents' turns in a
seeded interleaving, a process that samples the cache directory's bytes, the files the
turns' writes made, and the replay itself (each agent's turns in order, a few at once)."""

from __future__ import annotations

import inspect
import json
import os
import random
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
import mlx.core as mx
from mlx.utils import tree_map_with_path

from kvactor.actors.enums import Tier
from kvactor.actors.errors import CacheRejected, InvalidAgentId
from kvactor.actors.models import LoadedModel, make_tiny_model
from kvactor.actors.warm._manifest import held_state, load_manifest

_WORD_TEXT = (
    "the a of to and in that it for on with as at by from this be are was or an not but "
    "we can all which will one has more when there if so what about up out into them "
    "then some could time these two may first been way like other than now its only "
    "over also new after most where through back much before good well between never "
    "under last long great little own right old same big high small large next early "
    "river stone light storm harbor engine ledger signal market garden winter report "
    "number window valley letter mirror circle bridge forest rocket coffee island "
    "tower planet silver copper paper cable sensor module kernel buffer vector matrix"
)
WORDS = _WORD_TEXT.split()
ROLES = ("planner", "coder", "reviewer", "tester", "writer", "analyst", "librarian", "critic")
EXTRA = "Summarize what we said so far in one sentence."


# ---------------------------------------------------------------------------- the trace
@dataclass(frozen=True)
class Turn:
    agent: str
    index: int  # the agent's k-th turn
    text: str


@dataclass(frozen=True)
class Trace:
    systems: dict[str, str]
    turns: list[Turn]


def make_trace(agents: int, turns: int, words: tuple[int, int], seed: int) -> Trace:
    """``agents`` agents of ``turns`` turns each in a random interleaving; each turn a
    new user message of ``words`` (inclusive range) random words."""
    rng = random.Random(seed)
    names = [f"agent-{i:03d}" for i in range(agents)]
    systems = {
        name: f"You are {name}, the team's {ROLES[i % len(ROLES)]}. Keep your notes short."
        for i, name in enumerate(names)
    }
    order = [name for name in names for _ in range(turns)]
    rng.shuffle(order)
    seen: dict[str, int] = {}
    out = []
    for name in order:
        k = seen.get(name, 0)
        seen[name] = k + 1
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        out.append(Turn(name, k, f"Note {k + 1} for {name}: {body}."))
    return Trace(systems, out)


def lively_tiny(seed: int = 0, scale: float = 10.0) -> LoadedModel:
    """The tiny llama (heads 64 wide) with its layers' weights scaled up, embeddings and
    norms as they are: its greedy answers depend on the whole context (tests/lively.py)."""
    lm = make_tiny_model(seed, head_dim=64)

    def scaled(path: str, array: mx.array) -> mx.array:
        return array if "embed" in path or "norm" in path else array * scale

    lm.model.update(tree_map_with_path(scaled, lm.model.parameters()))
    mx.eval(lm.model.parameters())
    return lm


# --------------------------------------------------------------------- the disk sampler
def agents_bytes(root: Path) -> int:
    """The real bytes under ``root/agents``: every regular file, a hard-linked file once
    (what the store counts against its limit, temporary files of a write included)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, names in os.walk(root / "agents"):
        for name in names:
            try:
                info = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:  # removed while we walked
                continue
            if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def manifest_sizes(root: Path) -> list[list[int]]:
    """Each manifest under ``root/agents`` as ``[tokens, files, cold, bytes]``: the tokens
    it lists (a cold one's, those its cache held), its segment files, 1 when cold, and its
    size. ``bench/replay.py`` fits a manifest's bytes per token to them: the token ids and
    text a manifest spells out take more bytes a token on one tokenizer than another."""
    out = []
    for folder in sorted((root / "agents").iterdir()):
        try:
            loaded = load_manifest(folder, None, folder.name)
        except (CacheRejected, InvalidAgentId):  # a write's staging folder, say
            continue
        if loaded is None:
            continue
        m, nbytes = loaded
        held = held_state(m)[0]
        cold = not m.n_tokens and bool(held)
        tokens = len(held) if cold else m.n_tokens
        out.append([tokens, len(m.all_segments), int(cold), nbytes])
    return out


#: The sampling loop of the sampler's own process (``agents_bytes`` is prepended): a
#: process, so that neither the bench's event loop nor its GIL spaces the samples out.
SAMPLER_LOOP = """
import json, sys, threading, time
root, limit, period = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seen, gaps, over, last = 0, [], [], None
peak = 0
print("ready", flush=True)
while not stop.is_set():
    start = time.perf_counter()
    if last is not None:
        gaps.append(start - last)
    last = start
    n = agents_bytes(root)
    seen += 1
    peak = max(peak, n)
    if 0 <= limit < n:
        over.append(n)
    stop.wait(max(0.0, period - (time.perf_counter() - start)))
print(json.dumps({"samples": seen, "peak": peak, "over": over, "gaps": gaps}), flush=True)
"""


class DiskSampler:
    """Samples ``agents_bytes(root)``: every ``period_s`` (start to start) in a process of
    its own between :meth:`start` and :meth:`stop`, and whenever :meth:`sample` is
    awaited. :meth:`watch_loop` measures how late the event loop wakes a task (how long
    it was blocked)."""

    def __init__(self, root: Path, limit: int | None, period_s: float) -> None:
        self.root, self.limit, self.period_s = root, limit, period_s
        self.samples = self.peak = 0
        self.over: list[int] = []
        self.gaps: list[float] = []
        self.loop_lag = 0.0
        self._proc: subprocess.Popen[str] | None = None

    def _record(self, n: int) -> int:
        self.samples += 1
        self.peak = max(self.peak, n)
        if self.limit is not None and n > self.limit:
            self.over.append(n)
        return n

    async def sample(self) -> int:
        return self._record(await anyio.to_thread.run_sync(agents_bytes, self.root))

    def start(self) -> None:
        """Start the sampling process; return once it samples."""
        code = "import os, stat\nfrom pathlib import Path\n"
        code += inspect.getsource(agents_bytes) + SAMPLER_LOOP
        limit = -1 if self.limit is None else self.limit
        args = [sys.executable, "-c", code, str(self.root), str(limit), str(self.period_s)]
        pipe = subprocess.PIPE
        self._proc = subprocess.Popen(args, stdin=pipe, stdout=pipe, text=True)
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        """Stop the sampling process and take its samples."""
        if self._proc is None:
            return
        out, _ = self._proc.communicate("", timeout=60)
        self._proc = None
        got = json.loads(out)
        self.samples += got["samples"]
        self.peak = max(self.peak, got["peak"])
        self.over += got["over"]
        self.gaps += got["gaps"]

    async def watch_loop(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(self.period_s)
            self.loop_lag = max(self.loop_lag, time.perf_counter() - start - self.period_s)

    def figures(self) -> dict[str, Any]:
        gaps = sorted(self.gaps) or [0.0]
        return {
            "samples": self.samples,
            "peak_bytes": self.peak,
            "over_limit_samples": len(self.over),
            "max_over_bytes": max(self.over) - self.limit if self.over and self.limit else 0,
            "sample_gap_mean_ms": round(1000 * sum(gaps) / len(gaps), 1),
            "sample_gap_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 1),
            "sample_gap_max_ms": round(1000 * gaps[-1], 1),
            "sample_gaps_over_50ms": sum(g > 0.05 for g in gaps),
            "event_loop_lag_max_ms": round(1000 * self.loop_lag, 1),
        }


@dataclass
class WriteTally:
    """The bytes of the files that appear in an agent's folder, each file (device, inode,
    mtime) once: what its writes made, looked at after each of its turns (its next turn
    waits for the look, so no write of it is half done or missed)."""

    root: Path
    seen: set[tuple[int, int, int]] = field(default_factory=set)
    written: int = 0

    def scan(self, agent: str) -> None:
        folder = self.root / "agents" / agent
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for name in names:
            try:
                info = os.lstat(folder / name)
            except FileNotFoundError:
                continue
            key = (info.st_dev, info.st_ino, info.st_mtime_ns)
            if stat.S_ISREG(info.st_mode) and key not in self.seen:
                self.seen.add(key)
                self.written += info.st_size


# ------------------------------------------------------------------------- the replay
class Paced(Protocol):
    """What :func:`replay` needs of the bench's configuration."""

    @property
    def concurrency(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


class Progress:
    """A line to stderr every ~5% of a phase's turns, with its ETA."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.began = time.perf_counter()
        self.every = max(1, total // 20)
        print(f"[{label}] {total} turns ...", file=sys.stderr, flush=True)

    def step(self) -> None:
        self.done += 1
        if self.done % self.every and self.done != self.total:
            return
        spent = time.perf_counter() - self.began
        eta = spent / self.done * (self.total - self.done)
        print(
            f"[{self.label}] {self.done}/{self.total} turns, {spent:.0f} s, ETA {eta:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def stored_tokens(root: Path, agent: str) -> int:
    """The tokens of ``agent``'s warm manifest (0 without one)."""
    try:
        raw = json.loads((root / "agents" / agent / "manifest.json").read_bytes())
    except FileNotFoundError:
        return 0
    return len(raw["manifest"]["token_ids"])


async def cache_tokens(kv: kvactor.Session, root: Path, agent: str) -> tuple[int, bool]:
    """The tokens ``agent``'s cache holds after its turn: its hot cache's, else (demoted
    already by another turn) its warm manifest's; and whether that fallback was used."""
    try:
        return (await kv.cache_info(agent)).tokens, False
    except kvactor.UnknownAgent:
        return stored_tokens(root, agent), True


def turn_record(turn: Turn, done: kvactor.Completion, added: int) -> dict[str, Any]:
    t = done.timings
    return {
        "agent": turn.agent,
        "index": turn.index,
        "path": done.path.value if isinstance(done.path, Tier) else str(done.path),
        "prompt": t.prompt_tokens,
        "reused": t.reused_tokens,
        "prefilled": t.prefilled_tokens,
        "generated": t.generated_tokens,
        "added": added,
        "ttft_s": t.ttft_s,
        "saved": done.saved,
        "save_error": done.save_error,
        "tokens": list(done.token_ids),
    }


async def replay(
    kv: kvactor.Session,
    root: Path,
    trace: Trace,
    cfg: Paced,
    label: str,
    sampler: DiskSampler | None,
) -> tuple[list[dict[str, Any]], int, int]:
    """Every turn of ``trace`` through ``kv``, ``cfg.concurrency`` at a time, each agent's
    turns in order: their records (trace order), how many ``added`` counts came from the
    manifest, and the bytes of the files the turns' writes made (a WriteTally)."""
    agents = {n: await kv.spawn_agent(n, system=s) for n, s in trace.systems.items()}
    records: list[dict[str, Any]] = [{} for _ in trace.turns]
    previous: dict[str, anyio.Event] = {}
    cursor = iter(enumerate(trace.turns))
    progress = Progress(label, len(trace.turns))
    fallbacks = 0
    tally = WriteTally(root)

    async def worker() -> None:
        nonlocal fallbacks
        for i, turn in cursor:  # one iterator: each turn taken once, in trace order
            before, mine = previous.get(turn.agent), anyio.Event()
            previous[turn.agent] = mine
            if before is not None:
                await before.wait()  # the agent's previous turn first
            try:
                done = await agents[turn.agent].generate(turn.text, max_tokens=cfg.max_tokens)
                tokens, fell_back = await cache_tokens(kv, root, turn.agent)
                fallbacks += fell_back
                await anyio.to_thread.run_sync(tally.scan, turn.agent)
                if sampler is not None:
                    await sampler.sample()  # right after the turn's write
            finally:
                mine.set()
            records[i] = turn_record(turn, done, tokens - done.timings.reused_tokens)
            progress.step()

    async with anyio.create_task_group() as tg:
        for _ in range(cfg.concurrency):
            tg.start_soon(worker)
    return records, fallbacks, tally.written


async def sampled(sampler: DiskSampler, body: Callable[[], Any]) -> Any:
    """``await body()`` with the sampler's process running, and its event-loop watch."""
    await anyio.to_thread.run_sync(sampler.start)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.watch_loop)
            try:
                return await body()
            finally:
                tg.cancel_scope.cancel()
    finally:
        await anyio.to_thread.run_sync(sampler.stop)
