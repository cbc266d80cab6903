"""The warm agents a store may make cold: every agent with tokens on disk, the least
recently written first.

The store asks its policy about them when a write would pass the disk limit, and looks
through them for agents past the TTL. Listing them reads every manifest (0.5 s at 10,000
agents), so the list is made lazily: a few folders at a time beside the collector's pass
after open (``begin``, ``listed``), the rest at once when the store first needs it
(``pending``, then ``listed`` and ``complete``); or all at once (``fill``) where no pass
was begun. The store's writes keep it up to date as they happen (``remember``,
``unlist``): a folder listed later is read as it is then, after those writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..messages import WarmAgent
from ._manifest import WarmInfo

__all__ = ["WarmList"]


class WarmList:
    """The warm agents, by name, and their order of writes (least recent first, by the
    time each manifest says). Its store is its only writer."""

    def __init__(self) -> None:
        self._agents: dict[str, WarmAgent] = {}
        self._order: dict[str, None] = {}  # kept once complete
        # Folders of a pass begun, yet to be listed (None: no pass begun).
        self._pending: set[str] | None = None
        self.complete = False

    # -- being made --------------------------------------------------------------------
    def begin(self, folders: Iterable[str]) -> None:
        """A pass over ``folders`` (every agent folder, listed now) begins: ``listed``
        will be given them a few at a time."""
        if not self.complete and self._pending is None:
            self._pending = set(folders)

    @property
    def begun(self) -> bool:
        return self.complete or self._pending is not None

    def pending(self) -> list[str]:
        """The folders of the pass not yet listed, sorted."""
        return sorted(self._pending or ())

    def listed(self, names: Iterable[str], infos: Iterable[WarmInfo]) -> None:
        """``names`` were listed now (``infos``: those that are folders still); the last
        of the pass's folders completes the list."""
        if self.complete:
            return
        if self._pending is not None:
            self._pending.difference_update(names)
        for info in infos:
            self._put(info)
        if not self._pending:
            self.finish()

    def fill(self, infos: Iterable[WarmInfo]) -> None:
        """Every agent folder, listed now: the list complete at once."""
        self._agents.clear()
        self._pending = None
        for info in infos:
            self._put(info)
        self.finish()

    def finish(self) -> None:
        """Every folder of the pass listed: in write order from now on."""
        self._pending = None
        self._order = dict.fromkeys(sorted(self._agents, key=lambda a: self._agents[a].updated))
        self.complete = True

    def abandon(self) -> None:
        """The pass stopped short: the list is made whole again when next needed."""
        if not self.complete:
            self._agents.clear()
            self._pending = None

    def _put(self, info: WarmInfo) -> None:
        if info.rejected is None and info.tokens:
            self._agents[info.agent] = WarmAgent(info.agent, info.nbytes, info.tokens, info.updated)
        else:
            self._agents.pop(info.agent, None)

    # -- kept up to date ---------------------------------------------------------------
    def remember(self, info: WarmInfo) -> None:
        """``info.agent``'s cache was written now: last in write order, as a rule."""
        agent = info.agent
        self.unlist(agent)
        if not self.begun or not info.tokens:
            return
        agents = self._agents
        agents[agent] = WarmAgent(agent, info.nbytes, info.tokens, info.updated)
        if not self.complete:
            return  # ordered when the pass ends
        order = self._order
        last = next(reversed(order), None)
        order[agent] = None
        if last is not None and agents[last].updated > info.updated:
            # Written with an earlier time: an import keeps the one it was exported with
            # (a clock set back would do it too). ``WarmVictims.beyond`` holds only if the
            # order is by that time: sorted again (stable, rare).
            self._order = dict.fromkeys(sorted(order, key=lambda a: agents[a].updated))

    def unlist(self, agent: str) -> None:
        """``agent`` holds no warm tokens now (made cold, forgotten, about to be written)."""
        self._agents.pop(agent, None)
        self._order.pop(agent, None)

    # -- read --------------------------------------------------------------------------
    @property
    def agents(self) -> dict[str, WarmAgent]:
        """By name (complete only once ``complete``); not to be changed."""
        return self._agents

    @property
    def by_write(self) -> dict[str, None]:
        """The names, the least recently written first (once ``complete``)."""
        return self._order
