"""The hot tier: one byte budget, the caches resident in it, and whom to demote.

A :class:`CachePool` lives inside the engine (on its thread, no locks) and owns the
accounting: every agent's stored cache, the working caches of running turns (counted at
their reserved maximum), room reserved for warm caches being staged, and exports pinned
until the store has written them. The engine asks it for room; it demotes idle agents
through an :class:`EvictionPolicy` (hot → warm when the warm copy is complete, hot → cold
without a warm tier), weighing the application's hints (``_pool_demote.py``), and answers
with typed results.
"""

from __future__ import annotations

import time
from collections import deque

from ...kernels.agent_cache import DEFAULT_CHECKPOINTS, AgentKV
from ...kernels.geometry import CacheGeometry
from ...kernels.qcodec import KVCodec
from ...kernels.turn_cache import FloatTurnCache, TurnCache
from ..enums import Tier
from ..errors import AgentBusy, UnknownAgent
from ..records import CacheInfo
from ._demotion import Demotion
from ._entry import HotEntry, common_prefix
from ._hints import HintBook
from ._policy import EvictionPolicy, Rates
from ._prefix_index import PrefixIndex
from ._ready import ReadyCopies
from ._traffic import Waiter, WarmTraffic

__all__ = ("CachePool",)


class CachePool(Demotion, WarmTraffic):
    """The hot tier's byte budget and residents.

    ``limit``: the budget (None: unbounded). ``persistent``: a warm tier exists, so only
    caches complete on disk may be demoted (to warm); without one, demotion drops a cache to
    cold. New agents' caches are of ``codec``, ``geometry`` and the attention mode's
    ``turn_cache``; ``ready_copies``: keep float copies between turns (:class:`ReadyCopies`).

    The engine runs turns on the entries' caches through the methods here (claim, base,
    start, store a cut, end) and reports its running batch's bytes; the pool is the only
    writer of its entries, of what is shared between them, and of its index of stored-range
    boundaries (the shared-prefix search).
    """

    def __init__(
        self,
        limit: int | None,
        policy: EvictionPolicy,
        *,
        persistent: bool,
        codec: KVCodec,
        geometry: CacheGeometry,
        turn_cache: type[TurnCache] = FloatTurnCache,
        ready_copies: bool = True,
        checkpoints: int = DEFAULT_CHECKPOINTS,
    ) -> None:
        self.limit = limit
        self._checkpoints = checkpoints
        self.policy = policy
        self.persistent = persistent
        self._codec, self._geometry, self._turn_cache = codec, geometry, turn_cache
        self.ready = ReadyCopies(turn_cache, enabled=ready_copies)
        self.rates = Rates()
        self.hints = HintBook()  # the application's advice (Demotion.hint)
        self.used = 0
        self.peak = 0
        self.demotions = {Tier.WARM: 0, Tier.COLD: 0}
        self.installs = 0
        self.writes = 0  # warm writes that succeeded
        self.write_failures = 0
        self.shared_turns = 0  # turns based on another cache's stored ranges
        self.shared_tokens = 0  # the tokens they reused so
        self._entries: dict[str, HotEntry] = {}
        # Where the entries' stored ranges end, one index per sharing scope: a turn shares
        # only the ranges of agents of its own scope.
        self._indexes: dict[str, PrefixIndex] = {}
        self._scopes: dict[str, str] = {}  # agent -> its scope (its turns say it; else "")
        self._staged: dict[str, int] = {}  # agent -> bytes reserved for a staging warm cache
        self._pins: dict[int, tuple[str, int]] = {}  # export id -> (agent, bytes) being written
        self._exports = 0
        self._turns: set[str] = set()  # agents with a turn queued or running: "busy"
        self._waiters: deque[Waiter] = deque()
        self._batch_bytes = 0  # the engine's running batch (working caches out of entries)
        self._turn_room = 0  # the reserve of the last turn that started (Demotion.make_room)

    # -- residents --------------------------------------------------------------------
    def get(self, agent: str) -> HotEntry | None:
        return self._entries.get(agent)

    def __contains__(self, agent: str) -> bool:
        return agent in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[HotEntry]:
        return list(self._entries.values())

    def busy(self, agent: str) -> bool:
        """A turn of ``agent`` is queued or running (whether or not its cache is hot)."""
        return agent in self._turns

    def info(self, agent: str) -> CacheInfo:
        """What ``agent``'s hot cache holds. Raises UnknownAgent when it has none."""
        entry = self._entries.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache")
        kv = entry.kv
        return CacheInfo(
            agent=agent,
            tokens=len(kv.tokens),
            nbytes=kv.nbytes,
            busy=self.busy(agent),
            persisted=entry.persisted,
            tool_wait_s=max(entry._tool_wait_until - time.monotonic(), 0.0),
            checkpoints=kv.checkpoint_count,
            checkpoint_tokens=[r.stop for r in kv.ranges if r.states],
            checkpoint_bytes=kv.checkpoint_bytes,
        )

    def new_kv(self) -> AgentKV:
        """An empty cache of this pool's codec, geometry and attention mode."""
        return AgentKV(
            self._codec, self._geometry, turn_cache=self._turn_cache, checkpoints=self._checkpoints
        )

    def _index(self, agent: str) -> PrefixIndex:
        scope = self._scopes.get(agent, "")
        index = self._indexes.get(scope)
        if index is None:
            index = self._indexes[scope] = PrefixIndex()
        return index

    def _reindex(self, agent: str, entry: HotEntry) -> None:
        self._index(agent).update(agent, entry.kv.tokens, entry.kv.boundaries())

    def _add(self, agent: str, entry: HotEntry) -> HotEntry:
        self._entries[agent] = entry
        self._reindex(agent, entry)
        return entry

    def _remove(self, agent: str) -> HotEntry | None:
        self._index(agent).remove(agent)
        return self._entries.pop(agent, None)

    def claim(self, agent: str, scope: str = "") -> HotEntry:
        """The agent's entry (a new empty one if it has none), marked busy for a turn that
        is queued now; ``scope``: the agents whose stored ranges it may share (and that may
        share its). Raises AgentBusy when a turn of it is queued or running.

        A queued turn's cache stays a demotion candidate (demoted last) until the turn
        starts: a turn that fits alone must never wait on caches of turns queued behind it.
        """
        if agent in self._turns:
            raise AgentBusy(f"agent {agent!r} already has a generation in flight")
        if self._scopes.get(agent, "") != scope:
            entry = self._entries.get(agent)
            if entry is not None:
                self._index(agent).remove(agent)
            self._scopes[agent] = scope
            if entry is not None:
                self._reindex(agent, entry)
        self._turns.add(agent)
        return self._queue(agent, hit=True)

    def adopt(self, agent: str) -> HotEntry:
        """For a queued turn whose cache was demoted while it waited: the agent's entry now
        (staged again meanwhile) or a new empty one."""
        return self._queue(agent, hit=False)

    def _queue(self, agent: str, *, hit: bool) -> HotEntry:
        """The agent's entry (made when it has none) marked for a queued turn; ``hit``: a
        turn found it hot."""
        entry = self._entries.get(agent)
        if entry is None:
            entry = self._add(agent, HotEntry(self.new_kv()))
        elif hit:
            entry._hits += 1
        self.hints.queued(agent)
        entry._pinned = False
        entry._write_due = False
        entry._tool_wait_until = 0.0  # the turn that brings the results is here
        entry._next_use = entry._last_used = time.monotonic()  # soon: its turn is queued
        return entry

    def drop(self, agent: str) -> bool:
        """Forget an idle agent's hot cache (and a staging reservation); False if it had
        none. Raises AgentBusy while a turn of it is queued or running."""
        if agent in self._turns:
            raise AgentBusy(f"agent {agent!r} is generating; cancel it first")
        self._staged.pop(agent, None)
        self.hints.forget(agent)
        dropped = self._remove(agent) is not None
        self._scopes.pop(agent, None)
        self.measure()
        return dropped

    def close(self) -> None:
        """Drop every cache and build (the engine stops: its MLX arrays must go first)."""
        self.ready.clear()
        for entry in self._entries.values():
            entry.kv.clear_working()
        self._entries.clear()
        self._indexes.clear()

    # -- accounting -------------------------------------------------------------------
    def batch_bytes(self, nbytes: int) -> None:
        """The engine's running batch holds ``nbytes`` now (working caches that left their
        agents' entries); measures when that changed (a decode step that did not grow the
        batch's buffers changes no byte of the tier)."""
        if nbytes != self._batch_bytes:
            self._batch_bytes = nbytes
            self.measure()

    def measure(self) -> int:
        """Bytes in use now (and the peak so far). A stored array that several caches hold
        (forks share their source's) counts once."""
        seen: set[int] = set()
        used = self._batch_bytes
        for e in self._entries.values():
            used += e.kv.work_bytes + e.kv.ready_bytes + (e._due_bytes if e._write_due else 0)
            if not e.kv.shared:  # the common case, per decode step: no set of ids
                used += e.kv.stored_bytes
                continue
            for a in e.kv.stored_arrays():
                if id(a) not in seen:
                    seen.add(id(a))
                    used += a.nbytes
        used += sum(n for _, n in self._pins.values()) + sum(self._staged.values())
        used += self.ready.reserved
        self.used = used
        self.peak = max(self.peak, used)
        return used

    def committed(self) -> int:
        """Bytes in use, counting running turns' working caches at their reserved maximum
        (the reserve covers the batch's padding and the merge copy, and what a turn stores
        before it ends: a cut's range, a recurrent layer's checkpoint)."""
        used = self.measure()
        working = sum(e.kv.work_bytes for e in self._entries.values()) + self._batch_bytes
        reserved = sum(
            max(e._turn_reserve - max(e.kv.stored_bytes - e._turn_stored, 0), 0)
            for e in self._entries.values()
            if e._turn_reserve is not None
        )
        return used - working + max(working, reserved)

    @property
    def ready_agents(self) -> int:
        """Hot agents keeping a ready copy."""
        return sum(e.kv.ready is not None for e in self._entries.values())

    @property
    def ready_bytes(self) -> int:
        return sum(e.kv.ready_bytes for e in self._entries.values())

    # -- turns ------------------------------------------------------------------------
    def base(
        self, agent: str, entry: HotEntry, prompt: list[int], *, share: bool
    ) -> tuple[int, int]:
        """Base a queued turn of ``prompt`` on ``entry``: keep the longest common prefix of
        its tokens that a turn can resume at (the last prompt token is always fed again, so
        that its logits are there to sample from) and forget the rest; with ``share`` and
        nothing of its own kept, take another hot cache's stored ranges that ``prompt``
        begins with (:meth:`_share`). Returns ``(kept, shared)`` tokens (shared <= kept)."""
        kv = entry.kv
        keep = kv.reusable(min(common_prefix(kv.tokens, prompt), len(prompt) - 1))
        kv.trim(keep)
        entry._persisted = min(entry._persisted, keep)
        if entry._shared_from is not None and keep < entry._shared_from[1]:
            entry._shared_from = None  # cut below what it shared: its write is its own
        shared = 0
        if keep == 0 and share:
            keep = shared = self._share(agent, entry, prompt)
        self._reindex(agent, entry)
        return keep, shared

    def _share(self, agent: str, entry: HotEntry, prompt: list[int]) -> int:
        """Base ``entry`` (empty) on the longest run of another hot cache's stored ranges
        that ``prompt`` begins with, token for token (the last prompt token stays to be
        fed): the arrays are shared, not copied. Returns the tokens it reuses (0: none)."""

        def holds(other: str, stop: int, count: int) -> bool:
            kv = self._entries[other].kv
            bounds = kv.boundaries()
            return (
                len(bounds) >= count
                and bounds[count - 1] == stop
                and kv.resumable_at(count)  # with recurrent layers: a checkpoint there
                and (kv.tokens[:stop] == prompt[:stop])
            )

        order = {name: i for i, name in enumerate(self._entries)}
        found = self._index(agent).longest(prompt, len(prompt) - 1, agent, holds, order.__getitem__)
        if found is None:
            return 0
        stop, source, count = found
        kv = entry.kv
        self._entries[source].kv.share_into(kv, count)
        if kv.reusable(stop) != stop:  # a sliding window no longer held there
            kv.trim(0)
            return 0
        entry._shared_from = (source, stop)
        self.shared_turns += 1
        self.shared_tokens += stop
        self.measure()
        return stop

    def start_turn(self, entry: HotEntry, reserve: int) -> bool:
        """Room for a turn's working cache of up to ``reserve`` bytes besides the entry's
        stored cache; False to wait (or, when ``stuck``, to refuse)."""
        # Its own ready copy becomes its working copy, which the reserve covers.
        if not self.make_room(max(reserve - entry.kv.ready_bytes, 0), exclude=entry, turn=True):
            return False
        entry._turn_reserve = reserve
        entry._turn_stored = entry.kv.stored_bytes
        self._turn_room = reserve
        return True

    def store_so_far(self, agent: str, entry: HotEntry) -> None:
        """During ``entry``'s turn: store its tokens so far as a range of their own (a cut:
        ``AgentKV.store_so_far``), where other caches may share them from now on."""
        entry.kv.store_so_far()
        if self._entries.get(agent) is entry:
            self._reindex(agent, entry)

    def end_turn(self, agent: str, entry: HotEntry, *, finished: bool = False) -> None:
        """The agent's turn is over: its new tokens quantized into a range, its working
        cache dropped or kept as its ready copy, its reserve freed; waiters granted.
        ``finished``: it ended normally, so the agent writes the new tokens next."""
        hot = self._entries.get(agent) is entry
        kv = entry.kv
        self.ready.keep(kv, hot=hot)
        # Without a warm tier nothing is ever written: every range may go.
        kv.slide(entry._persisted if self.persistent else len(kv.tokens))
        if hot:
            self._reindex(agent, entry)
        self._turns.discard(agent)
        entry._turn_reserve = None
        entry._next_use = None
        self.hints.turn_took(time.monotonic() - entry._last_used)  # queued at _last_used
        entry._last_used = time.monotonic()
        entry._write_due = finished and self.persistent and not entry.clean
        if entry._write_due:  # its export pins these: the room stays taken until it does
            entry._due_bytes = sum(r.nbytes for r in kv.ranges_from(entry.persisted))
        self.measure()
        self.grant_waiters()

    def fork(self, source: str, new: str, tokens: list[int]) -> bool:
        """``new`` hot with ``source``'s stored ranges, shared, when ``source`` is hot, idle
        and holds exactly ``tokens``; False otherwise (``new`` stages from disk instead).
        Raises BudgetExceeded when it does not fit."""
        entry = self._entries.get(source)
        if entry is None or self.busy(source) or entry.kv.tokens != tokens:
            return False
        kv = entry.kv.fork(self.new_kv())
        return self.install(new, kv.stored_bytes, lambda: kv, pin=False, from_disk=False)

    # -- ready copies built ahead of a turn ------------------------------------------
    def ready_ahead(self, agent: str) -> None:
        """Build an idle hot agent's ready copy between engine steps, in room that is free
        now (a copy built ahead of need never demotes anyone): its turn to come starts
        without dequantizing."""
        entry = self._entries.get(agent)
        if entry is None or self.busy(agent):
            return
        free = None if self.limit is None else self.limit - self.committed()
        if self.ready.want(agent, entry.kv, free):
            self.measure()

    def build_ready_step(self) -> bool:
        """One layer of the oldest ready copy being built; True while any is."""
        building = self.ready.step(
            lambda agent, kv: (
                (e := self._entries.get(agent)) is not None and e.kv is kv and not self.busy(agent)
            )
        )
        if building:
            self.measure()
        return building
