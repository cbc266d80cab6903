"""Where the hot caches' stored ranges end, so that a new turn finds the longest prefix of
its prompt that another cache holds without scanning every cache's tokens.

Each boundary (the token count at which a cache's stored range ends) is indexed by the
hash of the tokens before it. A lookup hashes the prompt once, every prefix in one pass
(:func:`prefix_hashes`), then looks up the boundary lengths that exist, longest first,
and checks a hit token for token: a hash collision never shares a wrong cache, it only
costs that check.

The hash is a polynomial one modulo 2^64 (a random odd base per process), so that every
prefix's hash comes out of one vectorized cumulative sum: hashing each boundary's prefix
on its own (``hash(tuple(prompt[:stop]))``) cost O(boundaries x prompt) a lookup, 13 ms
with 500 hot caches of 2K tokens and growing with the hot agents
(``bench/replay.py`` at 2,000 agents).
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ("PrefixIndex", "prefix_hashes")

_BASE = np.uint64(secrets.randbits(64) | 1)
_powers = np.ones(1, dtype=np.uint64)  # _BASE ** i modulo 2^64, grown on demand


def _powers_upto(n: int) -> np.ndarray:
    global _powers
    have = _powers
    if len(have) < n:
        size = max(n, 2 * len(have))
        steps = np.full(size, _BASE, dtype=np.uint64)
        steps[0] = 1
        have = np.cumprod(steps, dtype=np.uint64)  # wraps modulo 2^64, as meant
        _powers = have
    return have[:n]


def prefix_hashes(tokens: Sequence[int], upto: int) -> np.ndarray:
    """``out[i]``: the hash of ``tokens[:i]``, for ``i`` in ``0..upto``."""
    upto = min(upto, len(tokens))
    out = np.zeros(upto + 1, dtype=np.uint64)
    if upto:
        # as int64 read as uint64: any id a list may hold hashes (a negative one too)
        some = tokens[:upto] if upto < len(tokens) else tokens
        codes = np.fromiter(some, np.int64, upto).view(np.uint64)
        # token + 1: a zero token still moves the hash (each prefix's hash is its own)
        np.cumsum((codes + np.uint64(1)) * _powers_upto(upto), dtype=np.uint64, out=out[1:])
    return out


class PrefixIndex:
    """Boundaries of stored ranges by agent. Owned by the hot tier's Residents, which call
    :meth:`update` whenever an agent's stored ranges change and :meth:`remove` when its cache
    leaves the hot tier.

    Invariant: the agents ending at a boundary are kept in the order of their ranks (given
    at :meth:`update`), so that a lookup takes the first that holds the hit instead of
    sorting every holder: thousands of agents share one system prompt's boundary. An agent
    comes in last almost always (a newly hot agent has the highest rank); one that does not
    (an older agent's ranges came to end at a boundary after a younger one's did) costs that
    boundary's sort."""

    def __init__(self) -> None:
        # (stop, hash of tokens[:stop]) -> agents whose ranges end there (by rank) -> ranges
        # up to it
        self._at: dict[tuple[int, int], dict[str, int]] = {}
        self._rank: dict[str, int] = {}  # agent -> its rank (the holders' order)
        # agent -> its (stop, hash) keys, in range order
        self._of: dict[str, list[tuple[int, int]]] = {}
        self._stops: dict[int, int] = {}  # boundary length -> how many keys have it
        self._sorted: list[int] = []  # the lengths of _stops, ascending

    def update(self, agent: str, tokens: list[int], stops: list[int], rank: int) -> None:
        """``agent``'s stored ranges now end at ``stops`` (increasing) of ``tokens``. Keys
        of a prefix that did not change are kept, not hashed again. Among agents ending at
        one boundary, a lookup prefers the lowest ``rank`` (an agent keeps its rank until
        :meth:`remove`)."""
        self._rank[agent] = rank
        old = self._of.get(agent, [])
        keep = 0
        while keep < min(len(old), len(stops)) and old[keep][0] == stops[keep]:
            keep += 1
        # A cut inside the last kept range changes no earlier boundary's tokens; a trim
        # that kept a boundary kept its tokens too (tokens before it are never edited).
        self._drop(agent, old[keep:])
        keys = old[:keep]
        hashes = prefix_hashes(tokens, stops[-1]) if len(stops) > keep else None
        for count, stop in enumerate(stops[keep:], start=keep + 1):
            assert hashes is not None
            key = (stop, int(hashes[stop]))
            self._hold(key, agent, count, rank)
            self._count_stop(stop, 1)
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
        self._rank.pop(agent, None)

    def _hold(self, key: tuple[int, int], agent: str, count: int, rank: int) -> None:
        holders = self._at.get(key)
        if holders is None:
            self._at[key] = {agent: count}
            return
        ranks = self._rank
        behind = rank < ranks[next(reversed(holders))]  # rarely: keep the order
        holders[agent] = count
        if behind:
            self._at[key] = {a: holders[a] for a in sorted(holders, key=ranks.__getitem__)}

    def _drop(self, agent: str, keys: Iterable[tuple[int, int]]) -> None:
        for key in keys:
            holders = self._at.get(key)
            if holders is not None:
                holders.pop(agent, None)
                if not holders:
                    del self._at[key]
            self._count_stop(key[0], -1)

    def _count_stop(self, stop: int, by: int) -> None:
        left = self._stops.get(stop, 0) + by
        if left:
            if stop not in self._stops:
                bisect.insort(self._sorted, stop)
            self._stops[stop] = left
        else:
            del self._stops[stop]
            del self._sorted[bisect.bisect_left(self._sorted, stop)]

    def longest(
        self,
        prompt: list[int],
        limit: int,
        exclude: str,
        holds: Callable[[str, int, int], bool],
    ) -> tuple[int, str, int] | None:
        """The longest boundary ``stop <= limit`` of another agent than ``exclude`` whose
        tokens ``prompt`` begins with: ``(stop, agent, ranges up to it)``, or None.
        ``holds(agent, stop, count)`` checks a hit against the cache itself (its first
        ``count`` ranges end at ``stop`` and its tokens are the prompt's up to there);
        among agents ending there, the one of lowest rank wins."""
        below = bisect.bisect_right(self._sorted, limit)
        if not below:
            return None
        hashes = prefix_hashes(prompt, self._sorted[below - 1]).tolist()
        for stop in reversed(self._sorted[:below]):
            if stop > len(prompt):
                continue
            holders = self._at.get((stop, hashes[stop]))
            if not holders:
                continue
            for agent in holders:  # by rank
                if agent != exclude and holds(agent, stop, holders[agent]):
                    return stop, agent, holders[agent]
        return None

    def check(self) -> None:
        """Debug check: every boundary's agents are in rank order, and each is indexed."""
        for key, holders in self._at.items():
            ranks = [self._rank[agent] for agent in holders]
            assert ranks == sorted(ranks), f"boundary {key[0]}: holders out of rank order"
            assert all(key in self._of[agent] for agent in holders), "a holder not indexed"
