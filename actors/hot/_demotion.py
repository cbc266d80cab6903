"""Whom the hot tier demotes, a part of :class:`~kvactor.actors.pool.CachePool`: the
candidates its policy sees (with the application's hints and the tool-wait state), making
room, and the hints themselves (:class:`~kvactor.actors.hints.HintBook`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..enums import Tier
from ..messages import Hint
from ._entry import HotEntry
from ._hints import HintBook
from ._policy import Candidate, EvictionPolicy, Rates
from ._ready import ReadyCopies

__all__ = ("Demotion",)


class Demotion:
    """CachePool's methods for choosing and demoting caches (the state is the pool's,
    declared in ``CachePool.__init__``; these methods are its only writers)."""

    limit: int | None
    persistent: bool
    policy: EvictionPolicy
    rates: Rates
    ready: ReadyCopies
    hints: HintBook
    demotions: dict[Tier, int]
    _entries: dict[str, HotEntry]
    _turns: set[str]
    _pins: dict[int, tuple[str, int]]
    _staged: dict[str, int]
    _turn_room: int  # the reserve of the last turn that started

    if TYPE_CHECKING:  # CachePool's

        def committed(self) -> int: ...
        def _remove(self, agent: str) -> HotEntry | None: ...
        def ready_ahead(self, agent: str) -> None: ...

    # -- hints and waits --------------------------------------------------------------
    def hint(self, hint: Hint, *, ahead: int = 2) -> None:
        """Take the application's ``hint``; build ready copies for the ``ahead`` soonest
        hinted agents that are hot and idle, in room that is free now."""
        self.hints.apply(hint, time.monotonic())
        for agent in self.hints.soonest(time.monotonic(), ahead):
            self.ready_ahead(agent)

    def _waiting(self, agent: str, entry: HotEntry) -> bool:
        """A turn of it is queued, it was staged for one, or it waits on its tool calls'
        results (within their TTL): a reload would come soon."""
        return agent in self._turns or entry._pinned or self._tool_waiting(entry)

    @staticmethod
    def _tool_waiting(entry: HotEntry) -> bool:
        return entry._tool_wait_until > time.monotonic()

    def tool_wait(self, agent: str, ttl_s: float) -> None:
        """``agent``'s turn ended in tool calls: keep its cache ahead of idle ones for
        ``ttl_s`` seconds, or until its next turn is queued (no cache: nothing to keep)."""
        entry = self._entries.get(agent)
        if entry is not None:
            entry._tool_wait_until = time.monotonic() + max(ttl_s, 0.0)

    @property
    def tool_waits(self) -> int:
        """Hot agents waiting on tool results now."""
        return sum(self._tool_waiting(e) for e in self._entries.values())

    # -- candidates -------------------------------------------------------------------
    def _candidates(self, exclude: HotEntry | None = None) -> list[Candidate]:
        """Every cache that may be demoted now: all but running turns' (and ``exclude``),
        and those whose new tokens are being written or about to be."""
        writing = {agent for agent, _ in self._pins.values()}
        holders: dict[int, int] = {}  # stored array id -> how many sharing caches hold it
        for e in self._entries.values():
            if e.kv.shared:
                for a in e.kv.stored_arrays():
                    holders[id(a)] = holders.get(id(a), 0) + 1
        now = time.monotonic()
        out = []
        for agent, e in self._entries.items():
            if e is exclude or e.running or e._write_due or agent in writing:
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
            hinted = self.hints.next_use(agent, now)
            out.append(
                Candidate(
                    agent=agent,
                    nbytes=nbytes,
                    tokens=len(e.kv.tokens),
                    last_used=e._last_used,
                    hits=e._hits,
                    clean=e.clean,
                    demote_to=Tier.WARM if warm else Tier.COLD,
                    reload_s=reload_s,
                    next_use=e._next_use if hinted is None else hinted,
                    waiting=self._waiting(agent, e),
                    tool_wait=self._tool_waiting(e),
                    priority=self.hints.priority(agent),
                    done=self.hints.done(agent),
                    hinted=hinted is not None,
                )
            )
        return out

    def idle_bytes(self) -> int:
        """What demoting every idle cache (no turn queued, staged or awaited) frees now."""
        return sum(c.nbytes for c in self._candidates() if not c.waiting)

    def _sooner(self, agent: str) -> set[str]:
        """Hot agents a prefetch of ``agent`` must not displace: those hinted to run no
        later than it, or of a higher priority (empty when ``agent`` has no hint)."""
        now = time.monotonic()
        at = self.hints.next_use(agent, now)
        if at is None:
            return set()
        mine = self.hints.priority(agent)
        return {
            other
            for other in self._entries
            if ((t := self.hints.next_use(other, now)) is not None and t <= at)
            or self.hints.priority(other) > mine
        }

    def _ready_order(self, agent: str, entry: HotEntry) -> tuple[bool, int, bool, float]:
        """Whose ready copy goes first: not waiting before waiting, low priority first, then
        unhinted least recently used, then hinted furthest first."""
        at = self.hints.next_use(agent, time.monotonic())
        rank = entry._last_used if at is None else -at
        return self._waiting(agent, entry), self.hints.priority(agent), at is not None, rank

    # -- making room ------------------------------------------------------------------
    def make_room(
        self,
        need: int,
        exclude: HotEntry | None = None,
        *,
        turn: bool = False,
        ahead_of: str | None = None,
    ) -> bool:
        """Demote caches (never ``exclude``) until ``need`` more bytes fit; False (demoting
        nobody) when even demoting every candidate would not make enough room now.

        Only a starting ``turn`` may demote the caches of turns that wait (queued, or staged
        for one): stagings taking them from each other could go on forever, while every
        turn that starts is progress. ``ahead_of``: room for a prefetch of that agent, which
        never displaces an agent hinted to run before it (``_sooner``); while no turn runs
        and such an agent's turn is to come first, it leaves the room a turn took last time
        free for that turn."""
        if self.limit is None:
            return True
        keep = self._sooner(ahead_of) if ahead_of is not None else set()
        if keep and not any(e.running for e in self._entries.values()):
            need += self._turn_room
        missing = self.committed() + need - self.limit
        if missing <= 0:
            return True
        candidates = [
            c for c in self._candidates(exclude) if (turn or not c.waiting) and c.agent not in keep
        ]
        # Ready copies go first (least recently used first, those of waiting turns last):
        # the stored form stays, so bringing one back costs a dequantize, not a reload.
        ready = sorted(
            (
                (self._ready_order(agent, e), agent)
                for agent, e in self._entries.items()
                if e.kv.ready is not None
                and e is not exclude
                and not e.running
                and (turn or not self._waiting(agent, e))
                and agent not in keep
            ),
        )
        demotable = {c.agent for c in candidates}
        spare = sum(self._entries[a].kv.ready_bytes for _, a in ready if a not in demotable)
        bets = self.ready.reserved_except(keep)
        if bets + spare + sum(c.nbytes for c in candidates) < missing:
            return False
        # Ready copies being built go first of all (a bet on a turn to come), then built ones.
        missing -= self.ready.give_up(missing, keep)
        for _, agent in ready:
            if missing <= 0:
                break
            missing -= self.ready.drop(self._entries[agent].kv)
        if missing > 0:
            candidates = [
                c
                for c in self._candidates(exclude)
                if (turn or not c.waiting) and c.agent not in keep
            ]
            tiers = {c.agent: c.demote_to for c in candidates}
            for agent in self.policy.victims(candidates, missing):
                self._remove(agent)
                self.demotions[tiers[agent]] += 1
        return self.committed() + need <= self.limit

    def stuck(self, exclude: HotEntry | None = None) -> bool:
        """Nothing is on its way to free room: no running turn (but ``exclude``'s), no write,
        staging, export or ready copy being built about to end. A request that does not
        fit now never will."""
        others = (e for e in self._entries.values() if e is not exclude)
        return not (
            any(e.running or e._write_due for e in others)
            or self._pins
            or self._staged
            or self.ready.building
        )
