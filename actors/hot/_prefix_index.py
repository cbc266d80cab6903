"""Where the hot caches' stored ranges end, so that a new turn finds the longest prefix of
its prompt that another cache holds without scanning every cache's tokens.

Each boundary (the token count at which a cache's stored range ends) is indexed by the
hash of the tokens before it. A lookup hashes the prompt's prefixes at the boundary
lengths that exist, longest first, and checks a hit token for token (a hash collision
never shares a wrong cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ("PrefixIndex",)


def _key(tokens: list[int], stop: int) -> int:
    return hash(tuple(tokens[:stop]))


class PrefixIndex:
    """Boundaries of stored ranges by agent. Owned by the hot tier's Residents, which call
    :meth:`update` whenever an agent's stored ranges change and :meth:`remove` when its cache
    leaves the hot tier."""

    def __init__(self) -> None:
        # (stop, hash of tokens[:stop]) -> agents whose ranges end there -> ranges up to it
        self._at: dict[tuple[int, int], dict[str, int]] = {}
        # agent -> its (stop, hash) keys, in range order
        self._of: dict[str, list[tuple[int, int]]] = {}
        self._stops: dict[int, int] = {}  # boundary length -> how many keys have it

    def update(self, agent: str, tokens: list[int], stops: list[int]) -> None:
        """``agent``'s stored ranges now end at ``stops`` (increasing) of ``tokens``. Keys
        of a prefix that did not change are kept, not hashed again."""
        old = self._of.get(agent, [])
        keep = 0
        while keep < min(len(old), len(stops)) and old[keep][0] == stops[keep]:
            keep += 1
        # A cut inside the last kept range changes no earlier boundary's tokens; a trim
        # that kept a boundary kept its tokens too (tokens before it are never edited).
        self._drop(agent, old[keep:])
        keys = old[:keep]
        for count, stop in enumerate(stops[keep:], start=keep + 1):
            key = (stop, _key(tokens, stop))
            self._at.setdefault(key, {})[agent] = count
            self._stops[stop] = self._stops.get(stop, 0) + 1
            keys.append(key)
        if keys:
            self._of[agent] = keys
        else:
            self._of.pop(agent, None)

    def stops(self, agent: str) -> list[int]:
        """Where ``agent``'s indexed ranges end, in order."""
        return [stop for stop, _ in self._of.get(agent, [])]

    def remove(self, agent: str) -> None:
        """Forget ``agent``'s boundaries (its cache left the hot tier)."""
        self._drop(agent, self._of.pop(agent, []))

    def _drop(self, agent: str, keys: Iterable[tuple[int, int]]) -> None:
        for key in keys:
            holders = self._at.get(key)
            if holders is not None:
                holders.pop(agent, None)
                if not holders:
                    del self._at[key]
            left = self._stops[key[0]] - 1
            if left:
                self._stops[key[0]] = left
            else:
                del self._stops[key[0]]

    def longest(
        self,
        prompt: list[int],
        limit: int,
        exclude: str,
        holds: Callable[[str, int, int], bool],
        order: Callable[[str], int],
    ) -> tuple[int, str, int] | None:
        """The longest boundary ``stop <= limit`` of another agent than ``exclude`` whose
        tokens ``prompt`` begins with: ``(stop, agent, ranges up to it)``, or None.
        ``holds(agent, stop, count)`` checks a hit against the cache itself (its first
        ``count`` ranges end at ``stop`` and its tokens are the prompt's up to there);
        among agents ending there, the one first in ``order`` wins."""
        for stop in sorted((s for s in self._stops if s <= limit), reverse=True):
            holders = self._at.get((stop, _key(prompt, stop)))
            if not holders:
                continue
            for agent in sorted(holders, key=order):
                if agent != exclude and holds(agent, stop, holders[agent]):
                    return stop, agent, holders[agent]
        return None
