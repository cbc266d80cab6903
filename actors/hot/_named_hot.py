"""Which hot agents a hint names, kept by change: what the hot tier's demotion asks about
apart from the agents no hint names, read without a pass over every agent the book names.
The book keeps done marks for warm agents too (its ``lowest_rank`` and the store's
questions at the disk limit need them): 1,793 of them beside ~700 hot agents at the end of
a 3,000-agent replay, each of which every demotion read again before."""

from __future__ import annotations

from ._hints import HintBook
from ._residents import Residents

__all__ = ("NamedHot",)


class NamedHot:
    """The residents that ``hints`` names (``HintBook.is_named``).

    Invariant: :meth:`agents` is the only writer of its set, and after each call the set is
    exactly those residents: it reads again the agents that came into the hot tier or left
    it, or whose hints began or ended, since the last call (a ``ChangeFeed`` of each)."""

    __slots__ = ("_agents", "_hint_feed", "_hints", "_hot_feed", "_residents")

    def __init__(self, residents: Residents, hints: HintBook) -> None:
        self._residents, self._hints = residents, hints
        self._hot_feed = residents.feed()
        self._hint_feed = hints.feed()
        self._agents: set[str] = set()

    def agents(self) -> frozenset[str]:
        """The residents a hint names now."""
        changed = self._hot_feed.drain()
        changed |= self._hint_feed.drain()
        residents, hints, agents = self._residents, self._hints, self._agents
        for agent in changed:
            if agent in residents and hints.is_named(agent):
                agents.add(agent)
            else:
                agents.discard(agent)
        return frozenset(agents)

    def check(self) -> None:
        """Debug check: the set is the residents the book names."""
        assert self.agents() == {a for a in self._hints.named() if a in self._residents}
