"""A replay of an agentic trace through the hot tier's own code, without model compute.

The hot tier (``CachePool``: its residents, ledger, ready copies, demotion and policy, the
hints) is the real one, on real MLX caches: each turn's new tokens go into its working copy
as zeros instead of a forward pass, and are quantized, stored, dequantized, shared and
demoted as a real turn's are. Around it this module plays, one turn at a time (as
``bench/agentic.py`` runs its steps), what the engine, the agent actors, the prefetch actor
and the warm store do with it, in their order: a hint first (the engine's part, then
prefetches of the two soonest), a turn that misses its cache stages it from disk (or starts
cold when its warm copy went cold), a turn ends with a write, and a write that would pass
the disk limit first makes agents cold in the policy's order (``CachePool.cold_victims``).
The disk is a count of segments (shared ones, a prefix linked from another agent, counted
once), not files.

Time is the replay's own (``CachePool(clock=..., wall=...)``): a turn takes what the real
run's measured rates say it takes (:class:`Costs`: a fixed part, then per token loaded from
disk, dequantized and prefilled; or, checked against the real run, that turn's own times
where the replay takes its path), so the policy's reload estimates, the hints' timing and
tool waits see the times they saw there. ``book_s`` is the wall time spent in the tier's
code and this bookkeeping (the zeros and their quantizing left out): what the runtime's
decisions cost at that many agents.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.enums import Room, Tier
from kvactor.actors.hot import CachePool, EvictionPolicy
from kvactor.actors.messages import AskWith, Hint, WarmAgent, WarmVictims
from kvactor.actors.warm import _store as store_module
from kvactor.actors.warm._manifest import CacheIdentity, segment_metadata
from kvactor.actors.warm._safetensors import build_header
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.qcodec import KVCodec

__all__ = ("Clock", "Costs", "ManifestBytes", "Observed", "Replay", "Step")

#: A manifest's bytes per token, per segment entry, per layer (the geometry) and per
#: file; a segment file's header is built as the store builds it (``build_header``). A
#: cold agent's manifest stays (its conversation and the token ids its cache held, for
#: the re-prefill: ``demote_cold``), at ``COLD_PER_TOKEN``. Both per-token figures are
#: fitted to a real pressure run's directory after each step on the default model (its
#: token ids, text and messages as JSON): the warm one was 14 and cold manifests were
#: not counted, 34-276 KB short of the real directory; now 0-48 KB (rms 16 KB). A real
#: run that lists its manifests' sizes gives its own (``ManifestBytes.fit``).
MANIFEST_PER_TOKEN, MANIFEST_PER_SEGMENT, COLD_PER_TOKEN = 22, 125, 14
MANIFEST_PER_LAYER, MANIFEST_FIXED = 16, 1024


@dataclass(frozen=True)
class ManifestBytes:
    """A manifest's bytes per token, warm and cold, and its fixed part: what its token
    ids, text and messages take as JSON, which depends on the tokenizer (the tiny model's
    byte tokens: ~6 bytes a token; the default model's: 22). ``fixed`` None: 1 KB and
    16 bytes a layer (the default model's figure)."""

    per_token: float = MANIFEST_PER_TOKEN
    cold_per_token: float = COLD_PER_TOKEN
    fixed: float | None = None

    @classmethod
    def fit(cls, samples: Sequence[Sequence[int]]) -> ManifestBytes:
        """From a real run's manifests, ``[tokens, files, cold, bytes]`` each
        (``bench/agentic.py``): a least-squares fit of the bytes beyond its files' entries
        to a fixed part and a part per token, warm and cold apart (the default for a kind
        with no manifest); all the defaults from too few manifests to fit."""
        rows = [s for s in samples if s[0] > 0]
        kinds = sorted({s[2] for s in rows})
        x = np.array([[1.0] + [float(s[0]) * (s[2] == k) for k in kinds] for s in rows])
        if not rows or np.linalg.matrix_rank(x) < x.shape[1]:  # too few to tell apart
            return cls()  # the default model's figures
        y = np.array([float(s[3] - MANIFEST_PER_SEGMENT * s[1]) for s in rows])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        got = dict(zip(kinds, coef[1:].tolist(), strict=True))
        return cls(got.get(0, MANIFEST_PER_TOKEN), got.get(1, COLD_PER_TOKEN), float(coef[0]))


@dataclass(frozen=True)
class Observed:
    """A real turn's path and measured times (``bench/agentic.py``'s record of it)."""

    path: str
    ttft_s: float
    turn_s: float
    dequantize_s: float
    prefill_s: float


@dataclass(frozen=True)
class Step:
    """One turn: ``agent`` sends a prompt whose first ``reused`` tokens are its cache's (as
    the unbounded run reused them) and ``new`` more, generates ``generated`` tokens and
    waits ``tool_wait_s`` on tools after it; ``imported``: its cache arrives just before
    (a portable file of that many tokens, the shared context's first). ``observed``: the
    real run's turn; where the replay takes the same path, its times are the turn's (what
    the engine's rates and the hints' clock learned there), else :class:`Costs`'."""

    agent: str
    reused: int
    new: int
    generated: int = 4
    tool_wait_s: float = 0.0
    imported: int = 0
    observed: Observed | None = None


@dataclass(frozen=True)
class Costs:
    """Per-path times, fitted to a real run's turns: a turn's time to first token is
    ``fixed_s`` plus per token loaded from disk and dequantized, and its prefill: per token
    ``prefill_s`` and per token and token of context before it ``context_s`` (attention
    grows with the context: on the default model a token prefilled at 3K tokens of context
    took 17 ms, at 1.3K 11 ms); ``decode_s`` the rest of the turn to its last token."""

    fixed_s: float
    load_s: float
    dequantize_s: float
    prefill_s: float
    context_s: float = 0.0
    decode_s: float = 0.3

    @classmethod
    def fit(cls, turns: Sequence[dict[str, Any]]) -> Costs:
        """From a real run's per-turn records (``bench/agentic.py``'s): load and dequantize
        as each part's seconds over the tokens it worked on, summed over the turns that
        did it; the prefill by least squares over ``n`` and ``n (reused + n / 2)``."""

        def rate(seconds: str, tokens: Any) -> float:
            used = [(t[seconds], tokens(t)) for t in turns if t[seconds] > 0 and tokens(t) > 0]
            return sum(s for s, _ in used) / max(sum(n for _, n in used), 1)

        load = rate("load_s", lambda t: t["reused_tokens"] if t["path"] == "warm" else 0)
        dequantize = rate("dequantize_s", lambda t: t["reused_tokens"])
        done = [t for t in turns if t["prefilled_tokens"] > 0]
        n = np.array([t["prefilled_tokens"] for t in done], dtype=np.float64)
        at = np.array([t["reused_tokens"] for t in done], dtype=np.float64)
        seconds = np.array([t["prefill_s"] for t in done])
        (per, context), *_ = np.linalg.lstsq(np.stack([n, n * (at + n / 2)], 1), seconds)
        rest = [t["ttft_s"] - t["load_s"] - t["dequantize_s"] - t["prefill_s"] for t in turns]
        after = [t["turn_s"] - t["ttft_s"] for t in turns if "turn_s" in t]
        return cls(
            statistics.median(rest),
            load,
            dequantize,
            float(per),
            float(context),
            statistics.median(after) if after else cls.decode_s,
        )

    def prefill(self, tokens: int, context: int) -> float:
        """Prefilling ``tokens`` after ``context`` tokens."""
        return tokens * (self.prefill_s + self.context_s * (context + tokens / 2))

    def ttft(self, *, loaded: int, dequantized: int, prefilled: int, context: int = 0) -> float:
        return (
            self.fixed_s
            + self.load_s * loaded
            + self.dequantize_s * dequantized
            + self.prefill(prefilled, context)
        )


class Clock:
    """The replay's time: monotonic seconds from 0, wall seconds from a fixed epoch."""

    EPOCH = 1.7e9

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.EPOCH + self.now


@dataclass
class _Agent:
    """What an agent actor knows: its cache's tokens and how many it believes are on disk."""

    tokens: list[int]
    persisted: int = 0
    bounds: list[int] = field(default_factory=list)  # where its stored ranges end


@dataclass
class _Warm:
    """An agent's warm copy: its segments (ids, first to last, each ending at a token) and
    tokens on disk, and when it was written."""

    segments: list[tuple[int, int]] = field(default_factory=list)  # (segment id, stop)
    tokens: list[int] = field(default_factory=list)
    updated: float = 0.0
    manifest: int = 0  # its manifest's bytes, as counted


class Replay:
    """One replay of a trace under ``policy`` with a hot ``budget`` and a ``disk_limit``
    (bytes), caches of ``geometry`` and ``codec``; ``costs`` times the turns."""

    def __init__(
        self,
        *,
        geometry: CacheGeometry,
        codec: KVCodec,
        policy: EvictionPolicy,
        budget: int | None,
        disk_limit: int | None,
        costs: Costs,
        prefetch: int = 2,
        max_tokens: int = 4,
        clock: Clock | None = None,
        settled: bool = False,
        manifests: ManifestBytes | None = None,
    ) -> None:
        self.clock = clock or Clock()
        self.manifests = manifests or ManifestBytes()
        self.pool = CachePool(
            budget,
            policy,
            persistent=True,
            codec=codec,
            geometry=geometry,
            clock=self.clock.monotonic,
            wall=self.clock.wall,
        )
        self.geometry = geometry
        self.disk_limit = disk_limit
        self.costs = costs
        self.prefetch = prefetch
        self.max_tokens = max_tokens
        self.settled = settled  # a hint's stagings done before its step (``--settle``)
        self.agents: dict[str, _Agent] = {}
        self.warm: dict[str, _Warm] = {}
        self._written: dict[str, None] = {}  # the same agents, least recently written first
        self._segments: dict[int, int] = {}  # id -> bytes
        self._refs: dict[int, int] = {}  # id -> agents holding it
        self._used = 0  # bytes of the segments held and the manifests
        self._cold: dict[str, int] = {}  # a cold agent -> its kept manifest's bytes
        self._ids = itertools.count(1)
        self._fresh = itertools.count(1_000_000)  # token ids never seen before
        self._seen = 0  # the hot tier's move log, read up to here
        self.moves: list[list[str]] = []  # this step's
        self.turns: list[dict[str, Any]] = []
        self.book_s = 0.0  # in the tier's code and this replay's bookkeeping
        self.array_s = 0.0  # making the zeros that stand in for the forward
        self.disk_peak = 0
        # What a segment header's metadata is made from (``segment_metadata`` reads the
        # fingerprint, codec and format; the shape fields are the geometry's own).
        self._identity = CacheIdentity(
            model_fingerprint="0" * 64,
            codec=codec.describe(),
            n_layers=len(geometry.layers),
            n_kv_heads=1,
            head_dim=1,
            vocab_size=1 << 20,
        )
        self._per_token = self._bytes_per_token()

    # -- arrays (the forward's stand-in: not bookkeeping) -----------------------------
    def _bytes_per_token(self) -> tuple[int, float]:
        """Stored bytes of a cache of n tokens: ``a + b n`` (the codec's sink tokens are
        stored apart)."""
        one, two = (self._filled(list(range(n)), [n]).stored_bytes for n in (256, 512))
        per = (two - one) / 256
        return round(one - 256 * per), per

    def stored_bytes(self, tokens: int) -> int:
        base, per = self._per_token
        return round(base + per * tokens) if tokens else 0

    def _filled(self, tokens: list[int], stops: Sequence[int]) -> AgentKV:
        """A cache holding ``tokens`` (zeros), stored in ranges ending at ``stops``."""
        began, before = time.perf_counter(), self.array_s
        kv = self.pool.new_kv()
        at = 0
        for stop in stops:
            self._feed(kv, tokens[at:stop])
            kv.store_so_far()
            at = stop
        kv.deactivate()
        self.array_s = before + time.perf_counter() - began
        return kv

    def _tensors(self, kv: AgentKV) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Each stored range's arrays as the store writes them (the forward's stand-in)."""
        began = time.perf_counter()
        out = [r.to_numpy() for r in kv.ranges]
        self.array_s += time.perf_counter() - began
        return out

    def _feed(self, kv: AgentKV, tokens: list[int]) -> None:
        """``tokens`` into ``kv``'s working copy, as a forward pass would add them."""
        if not tokens:
            return
        began = time.perf_counter()
        work = kv.activate()
        g = self.geometry
        for i, layer in enumerate(work.layers):
            lg = g.layer(i)
            k = mx.zeros((1, lg.n_kv_heads, len(tokens), lg.dim("key")), dtype=mx.float16)
            v = mx.zeros((1, lg.n_kv_heads, len(tokens), lg.dim("value")), dtype=mx.float16)
            layer.update_and_fetch(k, v)
            # The Hadamard basis's guard waits for the attention that a forward runs next
            # (``RotatedBasis.check_attended``); the stand-in has none to run.
            if getattr(layer, "_unattended", False):
                layer._unattended = False
        kv.tokens.extend(tokens)
        mx.eval(work.arrays())
        self.array_s += time.perf_counter() - began

    def disk_used(self) -> int:
        """What the directory holds (a running count, as the store keeps one)."""
        return self._used

    def recount(self) -> int:
        """:meth:`disk_used` counted from scratch (a check)."""
        held = {s for w in self.warm.values() for s, _ in w.segments}
        manifests = sum(w.manifest for w in self.warm.values()) + sum(self._cold.values())
        return sum(self._segments[s] for s in held) + manifests

    def _ref(self, segment: int, by: int) -> None:
        """``segment`` held by ``by`` more agents (fewer, negative): counted while held."""
        before = self._refs[segment]
        self._refs[segment] = before + by
        if before == 0 or self._refs[segment] == 0:
            self._used += self._segments[segment] if before == 0 else -self._segments[segment]

    def _manifest_bytes(self, tokens: int, segments: int, *, cold: bool = False) -> int:
        m = self.manifests
        fixed = MANIFEST_FIXED + MANIFEST_PER_LAYER * len(self.geometry.layers)
        per = m.cold_per_token if cold else m.per_token
        base = fixed if m.fixed is None else round(m.fixed)
        return base + round(per * tokens) + MANIFEST_PER_SEGMENT * segments

    def _manifest(self, w: _Warm, tokens: list[int] | None) -> None:
        """``w``'s manifest now lists ``tokens`` and its segments (None: removed)."""
        self._used -= w.manifest
        w.manifest = 0
        if tokens is not None:
            w.tokens = tokens
            w.manifest = self._manifest_bytes(len(tokens), len(w.segments))
            self._used += w.manifest

    def _segment_bytes(
        self, agent: str, start: int, stop: int, tensors: dict[str, np.ndarray[Any, Any]]
    ) -> int:
        """A segment file of ``agent``'s tokens ``start:stop``: its header as the store
        builds it for ``tensors`` (the range's), then their bytes."""
        began = time.perf_counter()  # the store's work, not the tier's: left out of book_s
        meta = segment_metadata(self._identity, agent, start, stop)
        header = len(build_header(tensors.items(), meta))
        self.array_s += time.perf_counter() - began
        return header + self.stored_bytes(stop) - self.stored_bytes(start)

    def _own_bytes(self, agent: str) -> int:
        w = self.warm[agent]
        return w.manifest + sum(self._segments[s] for s, _ in w.segments if self._refs[s] == 1)

    @property
    def _brief(self) -> int:
        """The shared context's tokens (0: none)."""
        brief = self.agents.get("brief")
        return len(brief.tokens) if brief is not None else 0

    # -- the warm store ----------------------------------------------------------------
    def _went_cold(self, agent: str) -> None:
        held = len(self.warm[agent].tokens)
        self._drop_warm(agent)
        self._cold[agent] = nbytes = self._manifest_bytes(held, 0, cold=True)
        self._used += nbytes
        self.moves.append(["demoted", agent, "cold", "warm"])

    def _warm_again(self, agent: str) -> None:
        """``agent``'s cold manifest (if any) replaced by a warm one (written next)."""
        self._used -= self._cold.pop(agent, 0)

    def _make_room(self, agent: str, more: int) -> bool:
        """Agents cold (never ``agent``) in the policy's order until ``more`` bytes fit
        under the limit and its headroom (``DiskUsage.headroom``); whether they do."""
        limit = self.disk_limit
        if limit is None:
            return True
        headroom = min(max(64 << 10, limit // 64), limit // 8)
        tried = {agent}

        def mine(names: Iterable[str]) -> Iterator[str]:
            return (a for a in names if a in self.warm and a not in tried)

        while (need := self.disk_used() + more + headroom - limit) > 0:
            victims = self._victims_of(mine, need)
            if not victims:
                return False
            for victim in victims:
                tried.add(victim)
                self._went_cold(victim)
                if self.disk_used() + more + headroom <= limit:
                    break
        return True

    def _when(self, agent: str) -> float:
        return self.warm[agent].updated

    def _victims_of(self, mine: Callable[[Iterable[str]], Iterator[str]], need: int) -> list[str]:
        """The pool's victims among the warm agents ``mine`` gives, the first ``SHORTLIST``
        in write order asked first (with the first of those an ``AskWith`` names), as the
        store asks (``StoreActor._victims_of``)."""

        def sized(names: Iterable[str]) -> list[WarmAgent]:
            warm = self.warm
            return [
                WarmAgent(a, self._own_bytes(a), len(warm[a].tokens), warm[a].updated)
                for a in names
            ]

        head = list(itertools.islice(mine(self._written), store_module.SHORTLIST + 1))
        if len(head) > store_module.SHORTLIST:
            beyond = self.warm[head[-1]].updated
            asked = sized(head[:-1])
            early = self.pool.cold_victims(WarmVictims(asked, need, beyond))
            if isinstance(early, AskWith):
                have = set(head[:-1])
                named = sorted(mine(a for a in early.agents if a not in have), key=self._when)
                held = named[store_module.SHORTLIST :]
                again = WarmVictims(
                    asked + sized(named[: store_module.SHORTLIST]),
                    need,
                    beyond,
                    checked=early.agents,
                    held_back=tuple(held),
                    held_beyond=self._when(held[0]) if held else 0.0,
                )
                early = self.pool.cold_victims(again)
            if isinstance(early, list):
                return early
        # All of them, in the store's order of its warm list: each write puts its agent
        # last (``WarmList.remember``), and a policy's ties go to the first.
        victims = self.pool.cold_victims(WarmVictims(sized(mine(self._written)), need))
        assert isinstance(victims, list)
        return victims

    def _append(
        self,
        agent: str,
        tokens: list[int],
        start: int,
        stop: int,
        tensors: dict[str, np.ndarray[Any, Any]],
    ) -> bool:
        """Write ``agent``'s tokens ``start:stop`` (``tensors``: its range's arrays) as a
        segment (room made first)."""
        nbytes = self._segment_bytes(agent, start, stop, tensors)
        bound = nbytes + 8 * stop + 4096
        if not self._make_room(agent, bound):
            return False
        self._warm_again(agent)
        w = self.warm.setdefault(agent, _Warm())
        self._written.pop(agent, None)  # written now: last in write order, as the store
        self._written[agent] = None
        s = next(self._ids)
        self._segments[s], self._refs[s] = nbytes, 0
        self._ref(s, 1)
        w.segments.append((s, stop))
        self._manifest(w, tokens[:stop])
        w.updated = self.clock.wall()
        return True

    def _link(self, agent: str, source: str, upto: int) -> bool:
        """``agent``'s first ``upto`` tokens are ``source``'s segments: linked, not written."""
        src = self.warm.get(source)
        if src is None or agent in self.warm:
            return False
        linked = [(s, stop) for s, stop in src.segments if stop <= upto]
        if not linked or linked[-1][1] != upto:
            return False
        if not self._make_room(agent, self._manifest_bytes(upto, len(linked))):
            return False
        for s, _ in linked:
            self._ref(s, 1)
        self._warm_again(agent)
        w = self.warm[agent] = _Warm(list(linked), [], self.clock.wall())
        self._written[agent] = None
        self._manifest(w, src.tokens[:upto])
        return True

    # -- agents arriving ----------------------------------------------------------------
    def seed(self, agent: str, tokens: list[int], *, hot: bool) -> None:
        """``agent`` with a warm copy of ``tokens`` (hot too with ``hot``)."""
        self.agents[agent] = _Agent(list(tokens), len(tokens), [len(tokens)])
        kv = self._filled(tokens, [len(tokens)])
        self._append(agent, tokens, 0, len(tokens), self._tensors(kv)[0])
        if hot:
            assert self.pool.warm.install(agent, kv.stored_bytes, lambda: kv, pin=False)
        self._log()

    def _import(self, agent: str, tokens: list[int], brief: int) -> None:
        """A portable file's cache arrives (its ranges: the shared context's, then its
        own): written to the warm tier, under the limit."""
        stops = sorted({b for b in (brief, len(tokens)) if 0 < b <= len(tokens)})
        self.agents[agent] = _Agent(list(tokens), 0, stops)
        at = 0
        for stop, tensors in zip(stops, self._tensors(self._filled(tokens, stops)), strict=True):
            if not self._append(agent, tokens, at, stop, tensors):
                return
            at = self.agents[agent].persisted = stop

    # -- staging -----------------------------------------------------------------------
    def _stage(self, agent: str, *, prefetch: bool) -> tuple[bool, int]:
        """The prefetch actor's staging: its manifest read, room reserved (a hot agent is
        told it is expected), the file read and installed: (staged, tokens read)."""
        w = self.warm.get(agent)
        if w is None or not w.tokens:
            return False, 0
        nbytes = self.stored_bytes(len(w.tokens))
        # The prefetch actor reserves its segment files' bytes (headers too) while it reads.
        files = sum(self._segments[s] for s, _ in w.segments)
        room = self.pool.reserve(agent, files, prefetch=prefetch)
        if room is not Room.RESERVED:
            return False, 0
        kv = self._filled(list(w.tokens), [stop for _, stop in w.segments])
        assert kv.stored_bytes == nbytes, (kv.stored_bytes, nbytes)
        self.pool.rates.disk(nbytes, self.costs.load_s * len(w.tokens))
        self.pool.warm.install(agent, nbytes, lambda: kv, pin=not prefetch)
        if prefetch:
            self.pool.ready_ahead(agent)
        return True, len(w.tokens)

    def _build_ready(self) -> None:
        """The engine's steps between turns: every ready copy being built, finished."""
        while self.pool.build_ready_step():
            pass

    def _prefetch(self, hint: Hint) -> None:
        for agent in hint.next[: self.prefetch]:
            if agent in self.agents:
                self._stage(agent, prefetch=True)
        self._build_ready()

    # -- a step ------------------------------------------------------------------------
    def run(self, step: Step, hint: Hint | None, done: Hint | None) -> dict[str, Any]:
        """One step: its hint, its turn, its write, its tool wait and ``done`` hint. The
        order is the runtime's: the engine takes the hint (ready copies wanted) and the
        prefetch actor is told to stage; an import the application awaits next runs beside
        those stagings, which reserve first (they ask before the import's write is done); a
        turn whose cache is hot starts before they reserve, and they find room once it
        ended (a race: in most real runs they did, in some they reserved first); a turn
        that misses its cache stages it behind them (one prefetch actor). ``settled``
        (the real run awaited them: ``bench/agentic.py --settle``): they are staged
        before anything else of the step."""
        began, arrays = time.perf_counter(), self.array_s
        self.moves = []
        pool = self.pool
        if hint is not None:
            pool.hint(hint)
        stagings = hint  # the hint whose prefetches are still to be staged
        if stagings is not None and self.settled:
            self._prefetch(stagings)
            stagings = None
        if step.imported:
            if stagings is not None:
                self._prefetch(stagings)
                stagings = None
            tokens = self.agents["brief"].tokens[: step.imported] if self._brief else []
            tokens += [next(self._fresh) for _ in range(step.imported - len(tokens))]
            self._import(step.agent, tokens, self._brief)
        me = self.agents[step.agent]
        prompt = me.tokens[: step.reused] + [next(self._fresh) for _ in range(step.new)]
        path, loaded = Tier.HOT, 0
        hot = step.agent in pool
        if not hot:
            if stagings is not None:
                self._prefetch(stagings)
                stagings = None
            if me.persisted > 0 and step.agent not in pool:
                path = Tier.WARM
                staged, loaded = self._stage(step.agent, prefetch=False)
                if not staged:
                    me.persisted, path = 0, Tier.COLD
        entry = pool.claim(step.agent)
        keep, _ = pool.base(step.agent, entry, prompt, share=True)
        if keep == 0:
            path = Tier.COLD
        reserve = turn_reserve_bytes(self.geometry, len(prompt) + self.max_tokens)
        assert pool.start_turn(entry, reserve), "a turn that fits alone never waits here"
        ready = entry.kv.ready is not None
        dequantized = pool.working_copy(step.agent, entry)
        # The prefill, range by range at the conversation's earlier bounds (as the agent
        # cuts a re-prefill), then the answer's tokens.
        at = keep
        for cut in sorted(b for b in {*me.bounds, self._brief} if keep < b < len(prompt)):
            self._feed(entry.kv, prompt[at:cut])
            pool.store_so_far(step.agent, entry)
            at = cut
        self._feed(entry.kv, prompt[at:])
        prefilled = len(prompt) - keep
        seen = step.observed if step.observed and step.observed.path == str(path) else None
        if seen is not None:
            ttft, took = seen.ttft_s, max(seen.turn_s, seen.ttft_s)
            prefill_s, dequantize_s = seen.prefill_s, seen.dequantize_s
        else:
            ttft = self.costs.ttft(
                loaded=loaded, dequantized=dequantized, prefilled=prefilled, context=keep
            )
            took = ttft + self.costs.decode_s
            prefill_s = self.costs.prefill(prefilled, keep)
            dequantize_s = self.costs.dequantize_s * dequantized
        # What the engine tells its rates (``actors/engine/_runner.py``).
        pool.rates.prefill(prefilled, prefill_s)
        if dequantized:
            pool.rates.dequantize(self.stored_bytes(dequantized), dequantize_s)
        self._feed(entry.kv, [next(self._fresh) for _ in range(step.generated - 1)])
        self.clock.now += took
        pool.end_turn(step.agent, entry, finished=True)
        me.tokens = list(entry.kv.tokens)
        me.bounds = sorted({b for b in me.bounds if b < keep} | {keep} - {0} | {len(me.tokens)})
        self._write(step.agent, me)
        if stagings is not None:  # a hot turn's: staged once it ended
            self._prefetch(stagings)
        if step.tool_wait_s:
            pool.tool_wait(step.agent, step.tool_wait_s)
        if done is not None:
            pool.hint(done)
        self._build_ready()
        self._log()
        self.disk_peak = max(self.disk_peak, self.disk_used())
        turn = {
            "agent": step.agent,
            "path": str(path),
            "ready": ready,
            "ttft_s": ttft,
            "prefilled_tokens": prefilled,
            "reused_tokens": keep,
            "dequantized_tokens": dequantized,
            "loaded_tokens": loaded,
            "peak_bytes": pool.peak,
            "moves": self.moves,
        }
        self.turns.append(turn)
        self.book_s += time.perf_counter() - began - (self.array_s - arrays)
        return turn

    def _write(self, agent: str, me: _Agent) -> None:
        """The agent actor's write after its turn: an export pinned, what the warm tier
        lacks appended (a shared prefix linked), the export unpinned."""
        exported = self.pool.export(agent)
        upto = me.persisted = exported.persisted
        if upto == 0:
            self._drop_warm(agent)
        shared = exported.shared_upto and upto == 0 and exported.shared_from
        if shared and self._link(agent, exported.shared_from, exported.shared_upto):
            upto = me.persisted = exported.shared_upto
        for start, stop, tensors in exported.ranges:
            if stop <= upto:
                continue
            if not self._append(agent, exported.tokens, max(start, upto), stop, tensors):
                break
            upto = me.persisted = stop
        self.pool.written(agent, exported.export_id, me.persisted)

    def _drop_warm(self, agent: str) -> None:
        """``agent``'s warm copy removed (made cold, or replaced by a whole write)."""
        w = self.warm.pop(agent, None)
        self._written.pop(agent, None)
        if w is not None:
            self._manifest(w, None)
            for s, _ in w.segments:
                self._ref(s, -1)

    def _log(self) -> None:
        log = self.pool.moves.after(self._seen)
        self._seen = log.last
        for m in log.moves:
            self.moves.append([m.kind, m.agent, m.tier, m.source])
