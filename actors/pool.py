"""One byte budget for the hot tier, and the policy that picks whom to demote."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ("Candidate", "EvictionPolicy", "LRUPolicy", "MemoryBudget")


@dataclass(frozen=True)
class Candidate:
    """An idle hot cache that could be demoted."""

    agent: str
    nbytes: int
    last_used: float
    clean: bool  # its warm copy is complete: demoting it loses nothing


class EvictionPolicy(Protocol):
    """Chooses which idle agents to demote (hot → warm, or hot → cold when unpersisted)."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        """Agents to demote, in order, until ``need`` bytes are freed (fewer if impossible)."""
        ...


class LRUPolicy:
    """Least recently used first; caches already safe on disk before unpersisted ones."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        chosen: list[str] = []
        freed = 0
        for c in sorted(candidates, key=lambda c: (not c.clean, c.last_used)):
            if freed >= need:
                break
            chosen.append(c.agent)
            freed += c.nbytes
        return chosen


@dataclass
class MemoryBudget:
    """The hot tier's bytes: stored caches, working copies of decoding agents, caches being
    written to disk and prefetches being staged all count against ``limit``."""

    limit: int | None  # None: unbounded
    used: int = 0
    peak: int = 0

    def fits(self, extra: int) -> bool:
        return self.limit is None or self.used + extra <= self.limit

    def set_used(self, used: int) -> None:
        self.used = used
        self.peak = max(self.peak, used)
