"""Ready copies: a hot agent's float working cache kept between its turns, so that its next
turn starts without dequantizing anything.

A turn that ends keeps its working cache as the agent's ready copy (``AgentKV.deactivate``
with ``keep_ready``: the turn's new tokens replaced by their stored values, so nothing
changes an answer). A cache staged from disk gets one built ahead of its turn, one layer
between engine steps, in room the budget has free (a copy built ahead of need never
demotes anyone); a turn that comes while its copy is half-built finishes it (``finish``)
instead of dequantizing the whole cache again. When room is needed, ready copies go
first: the stored form stays, so bringing one back costs a dequantize, not a reload. Only
with an attention mode whose working cache can be kept (``TurnCache.keeps_ready``:
dequantized attention).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from ...kernels.agent_cache import AgentKV, StoredRange
from ...kernels.turn_cache import TurnCache
from ._shared_ready import SharedPrefixes

__all__ = ("ReadyCopies",)


@dataclass(eq=False)  # a build is itself: removed by identity
class _Build:
    agent: str
    kv: AgentKV
    nbytes: int  # reserved in the budget until the build ends
    steps: Iterator[tuple[int, TurnCache | None]]
    ranges: list[StoredRange]  # what it is built from

    @property
    def current(self) -> bool:
        """Whether its cache is still what it is built from, between turns: a cache cut
        (a prompt that diverged), grown or given another's ranges since is not."""
        kv = self.kv
        return (
            kv.work is None
            and kv.ready is None
            and len(kv.ranges) == len(self.ranges)
            and all(a is b for a, b in zip(kv.ranges, self.ranges, strict=True))
        )


class ReadyCopies:
    """The life of every ready copy: kept at a turn's end, built ahead of a turn, dropped
    for room. Owned by the :class:`~kvactor.actors.pool.CachePool` (its reserved bytes are
    in the pool's budget); only this object makes or drops an ``AgentKV``'s ready copy."""

    def __init__(self, turn_cache: type[TurnCache], *, enabled: bool) -> None:
        self.enabled = enabled and turn_cache.keeps_ready
        self._turn_cache = turn_cache
        self._builds: deque[_Build] = deque()  # oldest first
        self.drops = 0  # ready copies dropped for room (float -> quantized)
        self.dequantized = 0.0  # stored tokens made float by builds (a layer: its share)
        # The float copies of prefixes several caches share (a part of this tier's copies).
        self.shared = SharedPrefixes(enabled=self.enabled and SharedPrefixes.active)

    @property
    def reserved(self) -> int:
        """Bytes reserved for copies being built."""
        return sum(b.nbytes for b in self._builds)

    @property
    def held(self) -> int:
        """Bytes of this tier's that no cache counts: reservations for copies being built
        and the shared prefixes' copies."""
        return self.reserved + self.shared.nbytes

    @property
    def building(self) -> bool:
        return bool(self._builds)

    def keep(self, kv: AgentKV, *, hot: bool) -> None:
        """End ``kv``'s turn: its new tokens quantized, its working cache kept as the ready
        copy when copies are enabled and the cache stays ``hot`` (else dropped)."""
        kv.deactivate(keep_ready=self.enabled and hot)

    def want(self, agent: str, kv: AgentKV, free: int | None) -> int:
        """Queue building ``kv``'s ready copy if it has none and it fits in ``free`` bytes
        (None: no budget); returns the bytes reserved for it (0: none, or one is being
        built already: its bytes are reserved once)."""
        if not self.enabled or kv.ready is not None or kv.work is not None:
            return 0
        if any(b.kv is kv and b.current for b in self._builds):
            return 0
        nbytes = self._turn_cache.ready_nbytes(kv)
        if free is not None and nbytes > free:
            return 0
        steps = self._turn_cache.ready_steps(kv)
        self._builds.append(_Build(agent, kv, nbytes, steps, list(kv.ranges)))
        return nbytes

    def finish(self, kv: AgentKV) -> bool:
        """``kv``'s turn came while its copy was being built: build the layers left now,
        and keep it as the ready copy (its reserved bytes become the copy's, which the turn
        takes as its working copy) rather than dequantizing everything again. False when
        nothing of ``kv``'s is being built."""
        build = next((b for b in self._builds if b.kv is kv), None)
        if build is None:
            return False
        self._builds.remove(build)
        if not build.current:
            return False
        for built, copy in build.steps:
            self.dequantized += len(kv.tokens) * built / kv.geometry.n_layers
            if copy is not None:
                kv.set_ready(copy)
                return True
        return False

    def step(self, held: Callable[[str, AgentKV], bool]) -> bool:
        """Build one layer of the oldest copy being built; True while any is being built.
        A build whose cache is no longer ``held`` hot or no longer what it is built from
        is given up. One whose turn is queued goes on: the turn finishes it."""
        while self._builds:
            build = self._builds[0]
            kv = build.kv
            if not held(build.agent, kv) or not build.current:
                self._builds.popleft()
                continue
            built, copy = next(build.steps)
            self.dequantized += len(kv.tokens) * built / kv.geometry.n_layers
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
        """Forget every build and shared copy (the engine stops)."""
        self._builds.clear()
        self.shared.clear()
