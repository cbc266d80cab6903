"""Shared ready prefixes: one float copy of the stored ranges that several hot caches share
(a shared context's, a fork's source's, a prefix another turn shared), so that each of
their turns dequantizes only its own ranges after it.

A cache is known to share ranges when the hot tier gives them to it (``note``: a fork, a
shared prefix). The float copy is made at the first turn of one of them that finds room
for it (``copy_for``): it may take the room of idle agents' own ready copies, since it
serves every agent that shares it, but it never demotes a cache. It is counted once in
the budget, dropped for room before anything else (the stored form stays: a turn then
dequantizes it, as without), and dropped when the last cache that shares it leaves the
hot tier (``left``). Which ranges are the same is told by their arrays: ranges made from
the same arrays hold the same values, so a copy serves only caches holding those very
arrays (a cache reloaded from disk holds arrays of its own, and dequantizes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ...kernels.agent_cache import AgentKV, StoredRange
from ...kernels.float_turn import FloatPrefix

__all__ = ("SharedPrefixes",)

#: Fewer shared tokens than this are not worth a copy of their own.
MIN_TOKENS = 64
#: Shared prefixes kept track of at once (the oldest go past it, with their copies).
LIMIT = 16


def _first(r: StoredRange) -> object:
    """A range's identity: its first array (shared ranges hold the same array objects)."""
    return next(r.arrays())


@dataclass(eq=False)
class _Shared:
    ranges: list[StoredRange]  # what the caches share (their arrays keep the identity)
    users: set[str] = field(default_factory=set)  # hot agents known to share them
    copy: FloatPrefix | None = None

    def covers(self, kv: AgentKV) -> bool:
        """Whether ``kv``'s stored ranges begin with exactly these."""
        mine, theirs = self.ranges, kv.ranges
        return len(theirs) >= len(mine) and all(
            _first(a) is _first(b) for a, b in zip(mine, theirs, strict=False)
        )


class SharedPrefixes:
    """The shared prefixes of one hot tier and their float copies. Owned by its
    :class:`~kvactor.actors.hot._ready.ReadyCopies` (the pool's budget counts ``nbytes``);
    only this object makes or drops a ``FloatPrefix``."""

    active: ClassVar[bool] = True
    """False: every turn dequantizes its whole stored cache (what ``bench/agentic.py``
    compares against); the working copies are the same, bit for bit."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._known: list[_Shared] = []  # oldest first
        self.made = 0  # copies made
        self.used = 0  # turns that started from a copy
        self.saved_tokens = 0  # stored tokens those turns did not dequantize

    @property
    def nbytes(self) -> int:
        return sum(s.copy.nbytes for s in self._known if s.copy is not None)

    def note(self, ranges: Sequence[StoredRange], users: Sequence[str]) -> None:
        """``users`` now hold the same stored ``ranges`` (the first ranges of each)."""
        if not self.enabled or not ranges or ranges[-1].stop < MIN_TOKENS:
            return
        for known in self._known:
            if len(known.ranges) == len(ranges) and all(
                _first(a) is _first(b) for a, b in zip(known.ranges, ranges, strict=True)
            ):
                known.users.update(users)
                return
        self._known.append(_Shared(list(ranges), set(users)))
        while len(self._known) > LIMIT:
            self._known.pop(0)

    def copy_for(
        self, agent: str, kv: AgentKV, room: Callable[[int], bool]
    ) -> tuple[FloatPrefix | None, int]:
        """The float copy of the longest known prefix ``kv`` begins with, made now when
        there is none and ``room(nbytes)`` finds room for it; returns it (None: no copy
        for it) and the stored tokens dequantized to make it (0: it was there)."""
        if not self.enabled or not kv.ranges or not FloatPrefix.serves(kv.geometry):
            return None, 0
        fits = [s for s in self._known if s.covers(kv)]
        if not fits:
            return None, 0
        shared = max(fits, key=lambda s: len(s.ranges))
        shared.users.add(agent)
        made = 0
        if shared.copy is None:
            tokens = shared.ranges[-1].stop
            if not room(FloatPrefix.nbytes_for(kv.geometry, tokens)):
                return None, 0
            shared.copy = FloatPrefix(kv, len(shared.ranges))
            self.made += 1
            made = tokens
        self.used += 1
        self.saved_tokens += shared.copy.tokens - made
        return shared.copy, made

    def left(self, agent: str) -> None:
        """``agent``'s cache left the hot tier: a prefix no hot cache shares any more goes,
        and its copy with it."""
        for known in self._known:
            known.users.discard(agent)
        self._known = [s for s in self._known if s.users]

    def drop_copies(self, need: int) -> int:
        """Drop copies, the oldest first, until ``need`` bytes are freed (the prefixes stay
        known: a later turn may make one again); the bytes freed."""
        freed = 0
        for known in self._known:
            if freed >= need:
                break
            if known.copy is not None:
                freed += known.copy.nbytes
                known.copy = None
        return freed

    def clear(self) -> None:
        self._known.clear()
