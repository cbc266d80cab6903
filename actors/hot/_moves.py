"""A tier's moves: a bounded log of each cache demoted out of the hot tier and each warm
cache installed into it (the hot tier's log), or of each warm cache made cold (the warm
tier's), numbered, for a dashboard to show every move however fast they come (a sampler
comparing who is hot now and then misses a demote-and-reload between looks)."""

from __future__ import annotations

import itertools
import time
from collections import deque

from ..enums import Tier
from ..records import TierMove, TierMoves

__all__ = ("MAX_MOVES", "MoveLog")

MAX_MOVES = 4096  # the latest moves kept; older ones are counted as lost to a late reader


class MoveLog:
    """The last ``limit`` moves of one model's hot tier (or of its warm tier), each
    numbered by ``seq`` from 1.

    Invariant: only :meth:`demoted` and :meth:`installed` write a hot tier's (its
    :class:`Demotion` and :class:`WarmTraffic`), only :meth:`went_cold` a warm tier's (its
    store); ``last`` is the seq of the latest move
    and the kept moves' seqs are consecutive, so recording and reading a move are O(1)
    each (nothing scans the agents or the older moves). It outlives the model's loads:
    its runner hands the same log to each new pool, so seqs never go back."""

    def __init__(self, limit: int = MAX_MOVES) -> None:
        self._moves: deque[TierMove] = deque(maxlen=limit)
        self.last = 0

    def _add(self, kind: str, agent: str, nbytes: int, tier: str = "", source: str = "") -> None:
        self.last += 1
        self._moves.append(TierMove(self.last, time.time(), kind, agent, nbytes, tier, source))

    def demoted(self, agent: str, to: Tier, nbytes: int) -> None:
        """``agent``'s cache left the hot tier for ``to`` (warm or cold), freeing ``nbytes``."""
        self._add("demoted", agent, nbytes, tier=str(to))

    def went_cold(self, agent: str, nbytes: int) -> None:
        """``agent``'s warm cache left the warm tier (its files removed, ``nbytes`` freed;
        its conversation kept): a demotion to cold ``source`` warm."""
        self._add("demoted", agent, nbytes, tier=str(Tier.COLD), source=str(Tier.WARM))

    def installed(self, agent: str, nbytes: int, *, prefetch: bool) -> None:
        """``agent``'s warm cache of ``nbytes`` was staged from disk into the hot tier,
        for a turn or ahead of one (``prefetch``)."""
        self._add("installed", agent, nbytes, source="prefetch" if prefetch else "turn")

    def after(self, since: int) -> TierMoves:
        """The moves after seq ``since``, oldest first (a ``since`` ahead of the log, as
        after a restart: every kept move)."""
        if since > self.last:
            since = 0
        wanted = self.last - since
        kept = min(wanted, len(self._moves))
        moves = list(itertools.islice(reversed(self._moves), kept))
        moves.reverse()
        return TierMoves(moves, self.last, lost=wanted - kept)
