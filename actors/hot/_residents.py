"""Who is in the hot tier: each agent's entry, the agents with a turn queued or running,
each agent's sharing scope, and per scope the index of where stored ranges end (the
shared-prefix search)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

from ._change_feed import ChangeFeed, ChangeFeeds
from ._entry import HotEntry
from ._prefix_index import PrefixIndex
from ._use_order import UseOrder

__all__ = ("Residents",)


class Residents:
    """The hot tier's entries and what is indexed about them.

    Invariant: this is the only writer of which agents are hot, which are busy and which
    scope each is in; each resident's stored-range boundaries are in its scope's index
    exactly as its cache has them (``reindex`` after every change of its ranges); every
    resident is in the order of last uses at its last use, and in the ready one too while it
    keeps a ready copy (placed again at each change its entry or cache makes:
    ``HotEntry.watch``). Both checked by ``check``."""

    def __init__(self) -> None:
        self._entries: dict[str, HotEntry] = {}
        # Where the entries' stored ranges end, one index per sharing scope: a turn shares
        # only the ranges of agents of its own scope.
        self._indexes: dict[str, PrefixIndex] = {}
        self._scopes: dict[str, str] = {}  # agent -> its scope (its turns say it; else "")
        self._busy: set[str] = set()  # agents with a turn queued or running
        # When each entry was added (its place in _entries' order, without counting it).
        self._added: dict[str, int] = {}
        self._adds = 0
        # Each reader's agents changed since it last looked (see ChangeFeed).
        self._feeds = ChangeFeeds()
        # The residents by last use, and those keeping a ready copy (placed again at each
        # change of an entry: _changed).
        self._by_use = UseOrder()
        self._ready_by_use = UseOrder()

    # -- reading ----------------------------------------------------------------------
    def get(self, agent: str) -> HotEntry | None:
        return self._entries.get(agent)

    def __getitem__(self, agent: str) -> HotEntry:
        return self._entries[agent]

    def __contains__(self, agent: str) -> bool:
        return agent in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[str, HotEntry]]:
        return iter(self._entries.items())

    def values(self) -> Iterator[HotEntry]:
        return iter(self._entries.values())

    def busy(self, agent: str) -> bool:
        """A turn of ``agent`` is queued or running (whether or not its cache is hot)."""
        return agent in self._busy

    @property
    def busy_agents(self) -> frozenset[str]:
        return frozenset(self._busy)

    def in_order(self, agents: Iterable[str]) -> list[str]:
        """Those of ``agents`` that are hot, in the order :meth:`items` gives them (the
        order of their entries' adding: a policy breaks ties by it)."""
        added = self._added
        return sorted((a for a in agents if a in added), key=added.__getitem__)

    # -- who changed ------------------------------------------------------------------
    def feed(self) -> ChangeFeed:
        """A new reader's feed of changed agents, every resident noted in it now."""
        return self._feeds.open(self._entries)

    def _changed(self, agent: str) -> None:
        self._feeds.note(agent)
        entry = self._entries.get(agent)
        at = None if entry is None else entry.last_used
        self._by_use.place(agent, at)
        self._ready_by_use.place(agent, None if entry is None or entry.kv.ready is None else at)

    def by_use(self, start: int, count: int, *, ready: bool = False) -> list[tuple[float, str]]:
        """Up to ``count`` residents from the ``start``-th on, least recently used first
        (ties by name), as (last use, agent); ``ready``: of those keeping a ready copy
        only. Reads those alone, not every resident."""
        return (self._ready_by_use if ready else self._by_use).page(start, count)

    def ready_count(self) -> int:
        """How many residents keep a ready copy (without reading them)."""
        return len(self._ready_by_use)

    # -- writing ----------------------------------------------------------------------
    def _index(self, agent: str) -> PrefixIndex:
        scope = self._scopes.get(agent, "")
        index = self._indexes.get(scope)
        if index is None:
            index = self._indexes[scope] = PrefixIndex()
        return index

    def add(self, agent: str, entry: HotEntry) -> HotEntry:
        assert agent not in self._entries, f"agent {agent!r} is hot already"
        self._entries[agent] = entry
        self._adds += 1
        self._added[agent] = self._adds
        entry.watch(functools.partial(self._changed, agent))
        self._changed(agent)
        self.reindex(agent, entry)
        return entry

    def remove(self, agent: str) -> HotEntry | None:
        """Take ``agent``'s entry out (demoted, dropped); None when it had none."""
        self._index(agent).remove(agent)
        self._added.pop(agent, None)
        entry = self._entries.pop(agent, None)
        if entry is not None:
            entry.watch(None)
            self._changed(agent)
        return entry

    def reindex(self, agent: str, entry: HotEntry) -> None:
        """``entry``'s stored ranges changed: index where they end now (when it is the
        agent's resident entry; a turn's entry that was demoted meanwhile is not)."""
        if self._entries.get(agent) is entry:
            index = self._index(agent)
            index.update(agent, entry.kv.tokens, entry.kv.boundaries(), self._added[agent])

    def set_scope(self, agent: str, scope: str) -> None:
        """``agent``'s turns share within ``scope`` from now on (its entry re-indexed)."""
        if self._scopes.get(agent, "") == scope:
            return
        entry = self._entries.get(agent)
        if entry is not None:
            self._index(agent).remove(agent)
        self._scopes[agent] = scope
        if entry is not None:
            self.reindex(agent, entry)

    def forget_scope(self, agent: str) -> None:
        self._scopes.pop(agent, None)

    def mark_busy(self, agent: str) -> None:
        assert agent not in self._busy, f"agent {agent!r} has a turn queued already"
        self._busy.add(agent)

    def mark_idle(self, agent: str) -> None:
        self._busy.discard(agent)

    def clear(self) -> None:
        entries, self._entries = self._entries, {}
        for agent, entry in entries.items():
            entry.watch(None)
            self._changed(agent)
        self._added.clear()
        self._indexes.clear()

    # -- the shared-prefix search -----------------------------------------------------
    def longest_shared(
        self, agent: str, prompt: list[int], holds: Callable[[str, int, int], bool]
    ) -> tuple[int, str, int] | None:
        """The longest stored prefix of ``prompt`` (its last token left to feed) that
        another resident of ``agent``'s scope holds: ``(stop, source, ranges)``, or None;
        ``holds`` checks a hit against the source's cache (``PrefixIndex.longest``).
        Among sources ending there, the oldest resident wins."""
        return self._index(agent).longest(prompt, len(prompt) - 1, agent, holds)

    def check(self) -> None:
        """Debug check: each resident's index holds its boundaries as its cache has them,
        and the ready order holds the residents with a ready copy at their last use."""
        for agent, entry in self._entries.items():
            index = self._index(agent)
            assert index.stops(agent) == entry.kv.boundaries(), f"{agent}: index out of date"
        for index in self._indexes.values():
            index.check()
        self._by_use.check({a: e.last_used for a, e in self._entries.items()})
        self._ready_by_use.check(
            {a: e.last_used for a, e in self._entries.items() if e.kv.ready is not None}
        )
