"""The hot tier's traffic with the warm tier, a part of :class:`~kvactor.actors.pool.CachePool`:
room reserved for warm caches being staged in (and the stagings waiting for room), their
install, and exports out to the store, pinned in the budget until they are written."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...kernels.agent_cache import AgentKV
from ...runtime import Reply
from ..enums import Room
from ..errors import AgentBusy, BudgetExceeded, UnknownAgent
from ..records import Exported
from ._entry import HotEntry

__all__ = ("Waiter", "WarmTraffic")


@dataclass
class Waiter:
    """A staging waiting for room: answered with a Room once there is."""

    agent: str
    nbytes: int
    reply: Reply


class WarmTraffic:
    """CachePool's methods for stagings and exports (the state is the pool's, declared in
    ``CachePool.__init__``; these methods are its only writers)."""

    limit: int | None
    installs: int
    writes: int
    write_failures: int
    _entries: dict[str, HotEntry]
    _staged: dict[str, int]  # agent -> bytes reserved for a staging warm cache
    _pins: dict[int, tuple[str, int]]  # export id -> (agent, bytes) being written
    _exports: int
    _waiters: deque[Waiter]

    if TYPE_CHECKING:  # CachePool's

        def busy(self, agent: str) -> bool: ...
        def make_room(
            self,
            need: int,
            exclude: HotEntry | None = None,
            *,
            turn: bool = False,
            ahead_of: str | None = None,
        ) -> bool: ...
        def measure(self) -> int: ...
        def _add(self, agent: str, entry: HotEntry) -> HotEntry: ...

    # -- staging warm caches ----------------------------------------------------------
    def reserve(self, agent: str, nbytes: int, *, prefetch: bool = False) -> Room:
        """Room for staging ``nbytes`` of the agent's warm cache, now or not at all;
        ``prefetch``: staged ahead of need, so it displaces no agent hinted to run sooner."""
        entry = self._entries.get(agent)
        if entry is not None:
            if not self.busy(agent):
                entry._next_use = time.monotonic()
            return Room.HOT
        if agent in self._staged:
            return Room.RESERVED
        if self.limit is not None and nbytes > self.limit:
            return Room.TOO_BIG
        if not self.make_room(nbytes, ahead_of=agent if prefetch else None):
            return Room.NO_ROOM
        self._staged[agent] = nbytes
        self.measure()
        return Room.RESERVED

    def wait_for_room(self, agent: str, nbytes: int, reply: Reply) -> None:
        """Answer ``reply`` with a Room once running turns or writes have made room."""
        self._waiters.append(Waiter(agent, nbytes, reply))

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
        entry = HotEntry(
            kv, now, persisted=len(kv.tokens), pinned=pin, next_use=None if pin else now
        )
        self._add(agent, entry)
        self.installs += from_disk
        self.measure()
        return True

    # -- writing to the warm tier -----------------------------------------------------
    def export(self, agent: str) -> Exported:
        """Host views of an idle agent's stored ranges past what is persisted, pinned in
        the budget until :meth:`written` names the export. Raises UnknownAgent / AgentBusy."""
        entry = self._entries.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache to export")
        if self.busy(agent):
            raise AgentBusy(f"agent {agent!r} is generating")
        ranges = entry.kv.ranges_from(entry.persisted)
        self._exports += 1
        self._pins[self._exports] = (agent, sum(r.nbytes for r in ranges))
        entry._write_due = False
        shared = entry._shared_from if entry.persisted == 0 else None
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
            entry._write_due = False  # whatever came of it, no write is on its way now
            if upto <= len(entry.kv.tokens):
                entry._persisted = max(entry._persisted, upto)
            if entry._persisted:
                entry._shared_from = None  # its warm copy exists: later writes append
        self.measure()
        self.grant_waiters()
