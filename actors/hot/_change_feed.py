"""Who changed since a reader last looked: what lets a count or an index kept by change
read again only the agents that changed, not every agent."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ("ChangeFeed", "ChangeFeeds")


class ChangeFeed:
    """The agents noted since its reader last drained it. A writer that others index (the
    hot tier's ``Residents``, the ``HintBook``) hands each reader a feed and notes every
    agent whose state the reader indexes as it changes.

    Invariant: its set is written only by :meth:`note` (the writer's) and :meth:`drain`
    (its one reader)."""

    __slots__ = ("_agents",)

    def __init__(self) -> None:
        self._agents: set[str] = set()

    def note(self, agent: str) -> None:
        self._agents.add(agent)

    def drain(self) -> set[str]:
        """The agents noted since the last drain (and forget them)."""
        agents, self._agents = self._agents, set()
        return agents


class ChangeFeeds:
    """A writer's side of its readers' feeds: each reader opens one, and the writer notes
    every change in all of them.

    Invariant: only the writer that owns it calls :meth:`open` and :meth:`note`."""

    __slots__ = ("_feeds",)

    def __init__(self) -> None:
        self._feeds: list[ChangeFeed] = []

    def open(self, agents: Iterable[str]) -> ChangeFeed:
        """A new reader's feed, ``agents`` (all the writer holds now) noted in it."""
        feed = ChangeFeed()
        for agent in agents:
            feed.note(agent)
        self._feeds.append(feed)
        return feed

    def note(self, agent: str) -> None:
        for feed in self._feeds:
            feed.note(agent)
