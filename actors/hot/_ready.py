"""Ready copies: a hot agent's float working cache kept between its turns, so that its next
turn starts without dequantizing anything.

A turn that ends keeps its working cache as the agent's ready copy (``AgentKV.deactivate``
with ``keep_ready``: the turn's new tokens replaced by their stored values, so nothing
changes an answer). A cache staged from disk gets one built ahead of its turn, one layer
between engine steps, in room the budget has free (a copy built ahead of need never
demotes anyone). When room is needed, ready copies go first: the stored form stays, so
bringing one back costs a dequantize, not a reload. Only with an attention mode whose
working cache can be kept (``TurnCache.keeps_ready``: dequantized attention).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from ...kernels.agent_cache import AgentKV
from ...kernels.turn_cache import TurnCache

__all__ = ("ReadyCopies",)


@dataclass
class _Build:
    agent: str
    kv: AgentKV
    nbytes: int  # reserved in the budget until the build ends
    steps: Iterator[TurnCache | None]


class ReadyCopies:
    """The life of every ready copy: kept at a turn's end, built ahead of a turn, dropped
    for room. Owned by the :class:`~kvactor.actors.pool.CachePool` (its reserved bytes are
    in the pool's budget); only this object makes or drops an ``AgentKV``'s ready copy."""

    def __init__(self, turn_cache: type[TurnCache], *, enabled: bool) -> None:
        self.enabled = enabled and turn_cache.keeps_ready
        self._turn_cache = turn_cache
        self._builds: deque[_Build] = deque()  # oldest first
        self.drops = 0  # ready copies dropped for room (float -> quantized)

    @property
    def reserved(self) -> int:
        """Bytes reserved for copies being built."""
        return sum(b.nbytes for b in self._builds)

    @property
    def building(self) -> bool:
        return bool(self._builds)

    def keep(self, kv: AgentKV, *, hot: bool) -> None:
        """End ``kv``'s turn: its new tokens quantized, its working cache kept as the ready
        copy when copies are enabled and the cache stays ``hot`` (else dropped)."""
        kv.deactivate(keep_ready=self.enabled and hot)

    def want(self, agent: str, kv: AgentKV, free: int | None) -> int:
        """Queue building ``kv``'s ready copy if it has none and it fits in ``free`` bytes
        (None: no budget); returns the bytes reserved for it (0: none)."""
        if not self.enabled or kv.ready is not None or kv.work is not None:
            return 0
        nbytes = self._turn_cache.ready_nbytes(kv)
        if free is not None and nbytes > free:
            return 0
        self._builds.append(_Build(agent, kv, nbytes, self._turn_cache.ready_steps(kv)))
        return nbytes

    def step(self, idle: Callable[[str, AgentKV], bool]) -> bool:
        """Build one layer of the oldest copy being built; True while any is being built.
        A build whose cache is no longer ``idle`` (gone, or its turn came first: the turn
        dequantizes) is given up."""
        while self._builds:
            build = self._builds[0]
            kv = build.kv
            if not idle(build.agent, kv) or kv.work is not None or kv.ready is not None:
                self._builds.popleft()
                continue
            copy = next(build.steps)
            if copy is not None:
                self._builds.popleft()
                kv.set_ready(copy)
            return True
        return False

    def reserved_except(self, keep: Collection[str]) -> int:
        """Bytes reserved for copies being built of agents not in ``keep``."""
        return sum(b.nbytes for b in self._builds if b.agent not in keep)

    def give_up(self, need: int, keep: Collection[str] = ()) -> int:
        """Give up copies being built (but those of agents in ``keep``), the newest first,
        until ``need`` bytes of their reservations are freed (room is needed now: a copy
        built ahead is only a bet); the bytes freed."""
        freed = 0
        gone: set[int] = set()
        for build in reversed(self._builds):
            if freed >= need:
                break
            if build.agent not in keep:
                gone.add(id(build))
                freed += build.nbytes
        if gone:
            self._builds = deque(b for b in self._builds if id(b) not in gone)
        return freed

    def drop(self, kv: AgentKV) -> int:
        """Drop ``kv``'s ready copy for room (the stored form stays); the bytes freed."""
        freed = kv.drop_ready()
        self.drops += freed > 0
        return freed

    def clear(self) -> None:
        """Forget every build (the engine stops)."""
        self._builds.clear()
