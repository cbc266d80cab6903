"""The hot tier: one byte budget, the caches resident in it, and whom to demote.

A :class:`CachePool` lives inside the engine (on its thread, no locks) and owns the
accounting: every agent's stored cache, the working caches of running turns (counted at
their reserved maximum), room reserved for warm caches being staged, and exports pinned
until the store has written them. The engine asks it for room; it demotes idle agents
through an :class:`EvictionPolicy` (hot → warm when the warm copy is complete, hot → cold
without a warm tier) and answers with typed results.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..kernels.agent_cache import AgentKV
from ..runtime import Reply
from .enums import Room, Tier
from .errors import AgentBusy, BudgetExceeded, UnknownAgent
from .protocol import Exported

__all__ = ("CachePool", "Candidate", "EvictionPolicy", "HotEntry", "LRUPolicy", "Rates")


@dataclass(frozen=True)
class Candidate:
    """An idle hot cache that could be demoted, with what a policy may weigh."""

    agent: str
    nbytes: int
    tokens: int
    last_used: float  # time.monotonic() of its last turn or install
    hits: int  # turns that found it hot
    clean: bool  # its warm copy is complete: demoting it loses nothing
    demote_to: Tier  # WARM (a file to reload) or COLD (only text: re-prefill)
    reload_s: float  # estimated cost of bringing it back (from measured rates)
    next_use: float | None = None  # time.monotonic() of a hint that it runs soon
    tier: Tier = Tier.HOT
    waiting: bool = False  # its turn is queued, or it was staged for one: a reload comes soon


class EvictionPolicy(Protocol):
    """Chooses which idle agents to demote."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        """Agents to demote, in order, until ``need`` bytes are freed (fewer if impossible)."""
        ...


class LRUPolicy:
    """Least recently used first; caches whose turn is waiting last, and caches already safe
    on disk before unpersisted ones."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        chosen: list[str] = []
        freed = 0
        for c in sorted(candidates, key=lambda c: (c.waiting, not c.clean, c.last_used)):
            if freed >= need:
                break
            chosen.append(c.agent)
            freed += c.nbytes
        return chosen


@dataclass
class Rates:
    """Measured rates for reload estimates: moving averages, seeded with this machine
    class's typical figures until something is measured."""

    disk_bytes_s: float = 1.0e9  # reading and verifying a warm cache
    dequantize_bytes_s: float = 5.0e7  # stored bytes made into a float working copy
    prefill_tokens_s: float = 100.0
    weight: float = 0.3

    def _mix(self, old: float, amount: float, seconds: float) -> float:
        if amount <= 0 or seconds <= 0:
            return old
        return (1 - self.weight) * old + self.weight * (amount / seconds)

    def disk(self, nbytes: int, seconds: float) -> None:
        self.disk_bytes_s = self._mix(self.disk_bytes_s, nbytes, seconds)

    def dequantize(self, nbytes: int, seconds: float) -> None:
        self.dequantize_bytes_s = self._mix(self.dequantize_bytes_s, nbytes, seconds)

    def prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens_s = self._mix(self.prefill_tokens_s, tokens, seconds)


@dataclass
class HotEntry:
    """An agent's hot cache and its bookkeeping."""

    kv: AgentKV
    last_used: float = 0.0
    persisted: int = 0  # tokens known to be safe in the warm tier
    busy: bool = False  # a turn of it is queued or running
    pinned: bool = False  # staged for a turn about to start: demoted last
    hits: int = 0
    next_use: float | None = None
    turn_reserve: int | None = None  # while its turn's working cache exists: its maximum
    write_due: bool = False  # its turn ended: the agent is about to export the new tokens
    # Its first ranges are another agent's (source, tokens) shared at a turn's start, and
    # nothing of it is on disk yet: its first write may link that agent's segments.
    shared_from: tuple[str, int] | None = None

    @property
    def waiting(self) -> bool:
        """A turn of it is queued, or it was staged for one: a reload would come soon."""
        return self.busy or self.pinned

    @property
    def clean(self) -> bool:
        return self.persisted >= len(self.kv.tokens)


@dataclass
class _Waiter:
    agent: str
    nbytes: int
    reply: Reply


class CachePool:
    """The hot tier's byte budget and residents.

    ``limit``: the budget (None: unbounded). ``persistent``: a warm tier exists, so only
    caches complete on disk may be demoted (to warm); without one, demotion drops a cache to
    cold. ``make_kv`` makes an empty cache for a new agent; ``batch_bytes`` says what the
    engine's running batch holds (working caches that left their agents' entries).
    """

    def __init__(
        self,
        limit: int | None,
        policy: EvictionPolicy,
        *,
        persistent: bool,
        make_kv: Callable[[], AgentKV],
        batch_bytes: Callable[[], int],
    ) -> None:
        self.limit = limit
        self.policy = policy
        self.persistent = persistent
        self._make_kv = make_kv
        self._batch_bytes = batch_bytes
        self.rates = Rates()
        self.used = 0
        self.peak = 0
        self.demotions = {Tier.WARM: 0, Tier.COLD: 0}
        self.ready_drops = 0  # ready copies dropped for room (float -> quantized)
        self.installs = 0
        self.writes = 0  # warm writes that succeeded
        self.write_failures = 0
        self._entries: dict[str, HotEntry] = {}
        self._staged: dict[str, int] = {}  # agent -> bytes reserved for a staging warm cache
        self._readying: dict[str, int] = {}  # agent -> bytes of a ready copy being built
        self._pins: dict[int, tuple[str, int]] = {}  # export id -> (agent, bytes) being written
        self._exports = 0
        self._turns: set[str] = set()  # agents with a turn queued or running
        self._waiters: deque[_Waiter] = deque()

    # -- residents --------------------------------------------------------------------
    def get(self, agent: str) -> HotEntry | None:
        return self._entries.get(agent)

    def __contains__(self, agent: str) -> bool:
        return agent in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[HotEntry]:
        return list(self._entries.values())

    def items(self) -> list[tuple[str, HotEntry]]:
        return list(self._entries.items())

    def claim(self, agent: str) -> HotEntry:
        """The agent's entry (a new empty one if it has none), marked busy for a turn that
        is queued now. Raises AgentBusy when a turn of it is queued or running.

        A queued turn's cache stays a demotion candidate (demoted last) until the turn
        starts: a turn that fits alone must never wait on caches of turns queued behind it.
        """
        if agent in self._turns:
            raise AgentBusy(f"agent {agent!r} already has a generation in flight")
        self._turns.add(agent)
        return self._queue(agent, hit=True)

    def adopt(self, agent: str) -> HotEntry:
        """For a queued turn whose cache was demoted while it waited: the agent's entry now
        (staged again meanwhile) or a new empty one, marked busy."""
        return self._queue(agent, hit=False)

    def _queue(self, agent: str, *, hit: bool) -> HotEntry:
        """The agent's entry (made when it has none) marked for a queued turn; ``hit``: a
        turn found it hot."""
        entry = self._entries.get(agent)
        if entry is None:
            entry = self._entries[agent] = HotEntry(self._make_kv())
        elif hit:
            entry.hits += 1
        entry.busy = True
        entry.pinned = False
        entry.write_due = False
        entry.next_use = entry.last_used = time.monotonic()  # soon: its turn is queued
        return entry

    def drop(self, agent: str) -> bool:
        """Forget an idle agent's hot cache (and a staging reservation); False if it had
        none. Raises AgentBusy while a turn of it is queued or running."""
        if agent in self._turns:
            raise AgentBusy(f"agent {agent!r} is generating; cancel it first")
        self._staged.pop(agent, None)
        dropped = self._entries.pop(agent, None) is not None
        self.measure()
        return dropped

    # -- accounting -------------------------------------------------------------------
    def measure(self) -> int:
        """Bytes in use now (and the peak so far). A stored array that several caches hold
        (forks share their source's) counts once."""
        seen: set[int] = set()
        used = self._batch_bytes()
        for e in self._entries.values():
            used += e.kv.work_bytes + e.kv.ready_bytes
            if not e.kv.shared:  # the common case, per decode step: no set of ids
                used += e.kv.stored_bytes
                continue
            for a in e.kv.stored_arrays():
                if id(a) not in seen:
                    seen.add(id(a))
                    used += a.nbytes
        used += sum(n for _, n in self._pins.values()) + sum(self._staged.values())
        used += sum(self._readying.values())
        self.used = used
        self.peak = max(self.peak, used)
        return used

    def committed(self) -> int:
        """Bytes in use, counting running turns' working caches at their reserved maximum
        (the reserve covers the batch's padding and the merge copy)."""
        used = self.measure()
        working = sum(e.kv.work_bytes for e in self._entries.values()) + self._batch_bytes()
        reserved = sum(e.turn_reserve or 0 for e in self._entries.values())
        return used - working + max(working, reserved)

    def _candidates(self, exclude: HotEntry | None = None) -> list[Candidate]:
        """Every cache that may be demoted now: all but running turns' (and ``exclude``),
        and those whose new tokens are being written or about to be."""
        writing = {agent for agent, _ in self._pins.values()}
        holders: dict[int, int] = {}  # stored array id -> how many sharing caches hold it
        for e in self._entries.values():
            if e.kv.shared:
                for a in e.kv.stored_arrays():
                    holders[id(a)] = holders.get(id(a), 0) + 1
        out = []
        for agent, e in self._entries.items():
            if e is exclude or e.turn_reserve is not None or e.write_due or agent in writing:
                continue
            # What demoting it frees: arrays another cache holds too stay.
            own = (
                sum(a.nbytes for a in e.kv.stored_arrays() if holders[id(a)] == 1)
                if e.kv.shared
                else e.kv.stored_bytes
            )
            nbytes = own + e.kv.work_bytes + e.kv.ready_bytes
            # A cache not complete on disk (a cancelled turn's, or one whose write failed)
            # goes cold: its warm copy, if any, is older.
            warm = self.persistent and e.clean
            if warm:
                reload_s = nbytes / self.rates.disk_bytes_s
                if not e.kv.turn_cache.quantized:
                    reload_s += nbytes / self.rates.dequantize_bytes_s
            else:
                reload_s = len(e.kv.tokens) / self.rates.prefill_tokens_s
            out.append(
                Candidate(
                    agent=agent,
                    nbytes=nbytes,
                    tokens=len(e.kv.tokens),
                    last_used=e.last_used,
                    hits=e.hits,
                    clean=e.clean,
                    demote_to=Tier.WARM if warm else Tier.COLD,
                    reload_s=reload_s,
                    next_use=e.next_use,
                    waiting=e.waiting,
                )
            )
        return out

    def make_room(self, need: int, exclude: HotEntry | None = None, *, turn: bool = False) -> bool:
        """Demote caches (never ``exclude``) until ``need`` more bytes fit; False (demoting
        nobody) when even demoting every candidate would not make enough room now.

        Only a starting ``turn`` may demote the caches of turns that wait (queued, or staged
        for one): stagings taking them from each other could go on forever, while every
        turn that starts is progress."""
        if self.limit is None:
            return True
        missing = self.committed() + need - self.limit
        if missing <= 0:
            return True
        candidates = [c for c in self._candidates(exclude) if turn or not c.waiting]
        # Ready copies go first (least recently used first, those of waiting turns last):
        # the stored form stays, so bringing one back costs a dequantize, not a reload.
        ready = sorted(
            (
                e
                for e in self._entries.values()
                if e.kv.ready is not None
                and e is not exclude
                and e.turn_reserve is None
                and (turn or not e.waiting)
            ),
            key=lambda e: (e.waiting, e.last_used),
        )
        demotable = {id(self._entries[c.agent]) for c in candidates}
        spare = sum(e.kv.ready_bytes for e in ready if id(e) not in demotable)
        if spare + sum(c.nbytes for c in candidates) < missing:
            return False
        for e in ready:
            if missing <= 0:
                break
            missing -= e.kv.drop_ready()
            self.ready_drops += 1
        if missing > 0:
            candidates = [c for c in self._candidates(exclude) if turn or not c.waiting]
            tiers = {c.agent: c.demote_to for c in candidates}
            for agent in self.policy.victims(candidates, missing):
                del self._entries[agent]
                self.demotions[tiers[agent]] += 1
        return self.committed() + need <= self.limit

    def stuck(self, exclude: HotEntry | None = None) -> bool:
        """Nothing is on its way to free room: no running turn (but ``exclude``'s), no write,
        staging, export or ready copy being built about to end. A request that does not
        fit now never will."""
        others = (e for e in self._entries.values() if e is not exclude)
        return not (
            any(e.turn_reserve is not None or e.write_due for e in others)
            or self._pins
            or self._staged
            or self._readying
        )

    # -- turns ------------------------------------------------------------------------
    def start_turn(self, entry: HotEntry, reserve: int) -> bool:
        """Room for a turn's working cache of up to ``reserve`` bytes besides the entry's
        stored cache; False to wait (or, when ``stuck``, to refuse)."""
        # Its own ready copy becomes its working copy, which the reserve covers.
        if not self.make_room(max(reserve - entry.kv.ready_bytes, 0), exclude=entry, turn=True):
            return False
        entry.turn_reserve = reserve
        return True

    def end_turn(self, agent: str, entry: HotEntry, *, write_due: bool = False) -> None:
        """The agent's turn is over (its working cache is gone): free its reserve, grant
        waiters. ``write_due``: it finished and the agent will export its new tokens next."""
        self._turns.discard(agent)
        entry.turn_reserve = None
        entry.busy = False
        entry.next_use = None
        entry.last_used = time.monotonic()
        entry.write_due = write_due and self.persistent and not entry.clean
        self.measure()
        self.grant_waiters()

    # -- staging warm caches ----------------------------------------------------------
    def reserve(self, agent: str, nbytes: int) -> Room:
        """Room for staging ``nbytes`` of the agent's warm cache, now or not at all."""
        entry = self._entries.get(agent)
        if entry is not None:
            if not entry.busy:
                entry.next_use = time.monotonic()
            return Room.HOT
        if agent in self._staged:
            return Room.RESERVED
        if self.limit is not None and nbytes > self.limit:
            return Room.TOO_BIG
        if not self.make_room(nbytes):
            return Room.NO_ROOM
        self._staged[agent] = nbytes
        self.measure()
        return Room.RESERVED

    def wait_for_room(self, agent: str, nbytes: int, reply: Reply) -> None:
        """Answer ``reply`` with a Room once running turns or writes have made room."""
        self._waiters.append(_Waiter(agent, nbytes, reply))

    def grant_waiters(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.reply.cancelled:
                self._waiters.popleft()
                continue
            if w.agent not in self._entries and not self.make_room(w.nbytes):
                return
            self._waiters.popleft()
            w.reply.resolve(self.reserve(w.agent, w.nbytes))

    def release(self, agent: str) -> None:
        """Give back the reservation of a staging that failed."""
        self._staged.pop(agent, None)
        self.measure()
        self.grant_waiters()

    def install(
        self,
        agent: str,
        nbytes: int,
        build: Callable[[], AgentKV],
        *,
        pin: bool,
        from_disk: bool = True,
    ) -> bool:
        """Make a staged warm cache of ``nbytes`` hot (``build`` makes it); False when the
        agent is hot already (that copy is at least as new). Raises BudgetExceeded when
        nothing was reserved for it and it does not fit. ``from_disk=False``: a cache made
        in memory (a fork), not counted in ``installs`` (reloads from disk)."""
        reserved = self._staged.pop(agent, None)
        if agent in self._entries:
            return False
        if reserved is None and not self.make_room(nbytes):
            raise BudgetExceeded(f"no room in the hot tier for agent {agent!r}")
        kv = build()
        now = time.monotonic()
        self._entries[agent] = HotEntry(
            kv, now, persisted=len(kv.tokens), pinned=pin, next_use=None if pin else now
        )
        self.installs += from_disk
        self.measure()
        return True

    # -- ready copies built ahead of a turn ------------------------------------------
    def reserve_ready(self, agent: str, nbytes: int) -> bool:
        """Room for building the agent's ready copy of up to ``nbytes``, if it is free now:
        a copy built ahead of need never demotes anyone."""
        if self.limit is not None and self.committed() + nbytes > self.limit:
            return False
        self._readying[agent] = nbytes
        self.measure()
        return True

    def ready_done(self, agent: str) -> None:
        """The build ended (the copy is the entry's now, or was given up)."""
        self._readying.pop(agent, None)
        self.measure()

    # -- writing to the warm tier -----------------------------------------------------
    def export(self, agent: str) -> Exported:
        """Host views of an idle agent's stored ranges past what is persisted, pinned in
        the budget until :meth:`written` names the export. Raises UnknownAgent / AgentBusy."""
        entry = self._entries.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache to export")
        if entry.busy:
            raise AgentBusy(f"agent {agent!r} is generating")
        ranges = entry.kv.ranges_from(entry.persisted)
        self._exports += 1
        self._pins[self._exports] = (agent, sum(r.nbytes for r in ranges))
        entry.write_due = False
        shared = entry.shared_from if entry.persisted == 0 else None
        return Exported(
            export_id=self._exports,
            persisted=entry.persisted,
            tokens=list(entry.kv.tokens),
            ranges=[(r.start, r.stop, r.to_numpy()) for r in ranges],
            shared_from=shared[0] if shared else "",
            shared_upto=shared[1] if shared else 0,
        )

    def written(self, agent: str, export_id: int, upto: int, *, failed: bool = False) -> None:
        """The store made an export durable up to ``upto`` tokens (``failed``: not the
        rest): unpin it. After a failure the cache stays unclean, and, with no write on its
        way, a candidate to go cold; a later write that succeeds saves the rest. Export id
        0 says a turn's write will not come (its agent left before it)."""
        if self._pins.pop(export_id, None) is not None:  # id 0: "no write is coming"
            if failed:
                self.write_failures += 1
            else:
                self.writes += 1
        entry = self._entries.get(agent)
        if entry is not None:
            entry.write_due = False  # whatever came of it, no write is on its way now
            if upto <= len(entry.kv.tokens):
                entry.persisted = max(entry.persisted, upto)
            if entry.persisted:
                entry.shared_from = None  # its warm copy exists: later writes append
        self.measure()
        self.grant_waiters()
