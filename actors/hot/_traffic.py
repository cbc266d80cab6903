"""The hot tier's traffic with the warm tier: room reserved for warm caches being staged in
(and the stagings waiting for room), their install, and exports out to the store, pinned
in the budget until they are written."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...kernels.agent_cache import AgentKV
from ...runtime import Reply
from ..enums import Room
from ..errors import AgentBusy, BudgetExceeded, UnknownAgent
from ..records import Exported
from ._demotion import Demotion
from ._entry import HotEntry
from ._ledger import Ledger
from ._residents import Residents
from ._write_back import WriteBack, export_entry

__all__ = ("WarmTraffic",)


@dataclass
class _Waiter:
    """A staging waiting for room: answered with a Room once there is."""

    agent: str
    nbytes: int
    reply: Reply


class WarmTraffic:
    """Stagings in and exports out, a part of the :class:`~kvactor.actors.hot.CachePool`.

    Invariant: the only writer of the stagings waiting for room, of the counts of
    installs and writes and of the installs in the demotion's move log; every staged or
    exported byte is in the ledger from the moment it is reserved or pinned until it is
    installed or written."""

    def __init__(
        self,
        residents: Residents,
        ledger: Ledger,
        demotion: Demotion,
        write_back: WriteBack | None = None,
    ) -> None:
        self._residents = residents
        self._ledger = ledger
        self._demotion = demotion
        self._write_back = write_back
        self._waiters: deque[_Waiter] = deque()
        self.installs = 0  # warm caches staged from disk (not forks made in memory)
        self.writes = 0  # warm writes that succeeded
        self.write_failures = 0

    # -- staging warm caches ----------------------------------------------------------
    def reserve(self, agent: str, nbytes: int, *, prefetch: bool = False) -> Room:
        """Room for staging ``nbytes`` of the agent's warm cache, now or not at all;
        ``prefetch``: staged ahead of need, so it displaces no agent hinted to run sooner."""
        entry = self._residents.get(agent)
        if entry is not None:
            if not self._residents.busy(agent):
                entry.expected(self._demotion.clock())
            return Room.HOT
        ledger = self._ledger
        if ledger.staged(agent):
            return Room.RESERVED
        if ledger.limit is not None and nbytes > ledger.limit:
            return Room.TOO_BIG
        if not self._demotion.make_room(nbytes, ahead_of=agent if prefetch else None):
            return Room.NO_ROOM
        ledger.reserve(agent, nbytes)
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
            if w.agent not in self._residents and not self._demotion.make_room(w.nbytes):
                return
            self._waiters.popleft()
            w.reply.resolve(self.reserve(w.agent, w.nbytes))

    def release(self, agent: str) -> None:
        """Give back the reservation of a staging that failed."""
        self._ledger.unreserve(agent)
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
        in memory (a fork), not counted in ``installs`` (reloads from disk) nor logged.
        ``pin``: staged for a turn (its agent's turn waits for it), else a prefetch's."""
        reserved = self._ledger.unreserve(agent)
        if agent in self._residents:
            return False
        if reserved is None and not self._demotion.make_room(nbytes):
            raise BudgetExceeded(f"no room in the hot tier for agent {agent!r}")
        kv = build()
        now = self._demotion.clock()
        entry = HotEntry(
            kv, now, persisted=len(kv.tokens), pinned=pin, next_use=None if pin else now
        )
        self._residents.add(agent, entry)
        if from_disk:
            self.installs += 1
            self._demotion.moves.installed(agent, nbytes, prefetch=not pin)
        self._ledger.measure()
        return True

    # -- writing to the warm tier -----------------------------------------------------
    def export(self, agent: str) -> Exported:
        """Host views of an idle agent's stored ranges past what is persisted, pinned in
        the budget until :meth:`written` names the export. Raises UnknownAgent / AgentBusy."""
        entry = self._residents.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache to export")
        if self._residents.busy(agent):
            raise AgentBusy(f"agent {agent!r} is generating")
        return export_entry(self._ledger, agent, entry)

    def export_admitted(self, agent: str) -> Exported | None:
        """:meth:`export` for an agent that leaves the session under a write budget: None
        (nothing exported) when the budget has no room for what is unwritten."""
        entry = self._residents.get(agent)
        back = self._write_back
        if entry is not None and back is not None and not entry.clean and not back.take(entry):
            return None
        return self.export(agent)

    def written(self, agent: str, export_id: int, upto: int, *, failed: bool = False) -> None:
        """The store made an export durable up to ``upto`` tokens (``failed``: not the
        rest): unpin it. After a failure the cache stays unclean, and, with no write on its
        way, a candidate to go cold; a later write that succeeds saves the rest. Export id
        0 says a turn's write will not come (its agent left before it)."""
        if self._ledger.unpin(export_id):  # id 0: "no write is coming"
            if failed:
                self.write_failures += 1
            else:
                self.writes += 1
        entry = self._residents.get(agent)
        sent = self._write_back.came_back(export_id) if self._write_back is not None else None
        if entry is not None and (sent is None or sent is entry):
            # whatever came of it, no write is on its way now (a write-back of an entry
            # demoted since says nothing of the agent's cache hot now)
            entry.written(upto)
        self._ledger.measure()
        self.grant_waiters()
