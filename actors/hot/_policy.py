"""Whom to demote: the candidates a policy sees, the policy protocol, LRU, the workflow-aware
default, and the measured rates that price a reload."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..enums import Tier

__all__ = (
    "POLICIES",
    "Candidate",
    "EvictionPolicy",
    "LRUPolicy",
    "Rates",
    "WorkflowPolicy",
    "make_policy",
)


@dataclass(frozen=True)
class Candidate:
    """An idle hot cache that could be demoted, with what a policy may weigh."""

    agent: str
    nbytes: int
    tokens: int
    last_used: float  # time.monotonic() of its last turn or install
    hits: int  # turns that found it hot
    clean: bool  # its warm copy is complete: demoting it loses nothing
    demote_to: Tier  # WARM (a file to reload) or COLD (only text: re-prefill)
    reload_s: float  # estimated cost of bringing it back (from measured rates)
    # time.monotonic() of its expected next turn: an application's hint (``hinted``), else
    # a prefetch or a queued turn said it runs soon
    next_use: float | None = None
    tier: Tier = Tier.HOT
    waiting: bool = False  # its turn is queued, or it was staged for one: a reload comes soon
    tool_wait: bool = False  # waiting on its tool calls' results (within its TTL): part of waiting
    priority: int = 0  # the application's priority: higher stays hot longer
    done: bool = False  # the application said it is done for now
    hinted: bool = False  # next_use comes from an application's hint (Session.hint)


class EvictionPolicy(Protocol):
    """Chooses which idle agents to demote."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        """Agents to demote, in order, until ``need`` bytes are freed (fewer if impossible)."""
        ...


class LRUPolicy:
    """Least recently used first; caches whose turn is waiting (queued, staged for one, or
    waiting on tool results within its TTL) last, and caches already safe on disk before
    unpersisted ones."""

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        chosen: list[str] = []
        freed = 0
        for c in sorted(candidates, key=lambda c: (c.waiting, not c.clean, c.last_used)):
            if freed >= need:
                break
            chosen.append(c.agent)
            freed += c.nbytes
        return chosen


@dataclass
class Rates:
    """Measured rates for reload estimates: moving averages, seeded with this machine
    class's typical figures until something is measured."""

    disk_bytes_s: float = 1.0e9  # reading and verifying a warm cache
    dequantize_bytes_s: float = 5.0e7  # stored bytes made into a float working copy
    prefill_tokens_s: float = 100.0
    weight: float = 0.3

    def _mix(self, old: float, amount: float, seconds: float) -> float:
        if amount <= 0 or seconds <= 0:
            return old
        return (1 - self.weight) * old + self.weight * (amount / seconds)

    def disk(self, nbytes: int, seconds: float) -> None:
        self.disk_bytes_s = self._mix(self.disk_bytes_s, nbytes, seconds)

    def dequantize(self, nbytes: int, seconds: float) -> None:
        self.dequantize_bytes_s = self._mix(self.dequantize_bytes_s, nbytes, seconds)

    def prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens_s = self._mix(self.prefill_tokens_s, tokens, seconds)


class WorkflowPolicy:
    """Demote first what the application's hints say runs furthest in the future, weighted
    by what bringing it back costs per byte freed: the cache with the largest
    ``time to next use x nbytes / reload_s`` goes first (a cache that would go cold costs a
    re-prefill to bring back, so it stays longer than one that reloads from disk).

    The order, first to last: caches the application said are done for now; caches
    without a hint, least recently used first (exactly :class:`LRUPolicy`'s order when
    nothing is hinted); hinted caches, furthest (cost-weighted) first. A lower priority goes
    before a higher one whatever else is hinted, and caches whose turn waits (queued, staged
    for one, or waiting on tool results within its TTL) go last of all. Wrong hints change
    only what stays hot, never an answer. ``clock``: the time hints are measured against.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock

    @staticmethod
    def key(c: Candidate, now: float) -> tuple[bool, int, int, float, float]:
        """Where ``c`` stands at ``now``: the smaller key is demoted first."""
        if c.done and not c.hinted:
            return c.waiting, c.priority, 0, float(not c.clean), c.last_used
        if not c.hinted or c.next_use is None:
            return c.waiting, c.priority, 1, float(not c.clean), c.last_used
        ahead = max(c.next_use - now, 0.0)
        # Seconds until it runs per second of reload per byte: larger goes first.
        worth = ahead * max(c.nbytes, 1) / max(c.reload_s, 1e-9)
        return c.waiting, c.priority, 2, -worth, c.last_used

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Every candidate, first to demote first."""
        now = self._clock()
        return sorted(candidates, key=lambda c: self.key(c, now))

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        chosen: list[str] = []
        freed = 0
        for c in self.order(candidates):
            if freed >= need:
                break
            chosen.append(c.agent)
            freed += c.nbytes
        return chosen


# The policies a name picks (``open(policy="lru")``, a scenario's ``policy``).
POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "workflow": WorkflowPolicy,
}


def make_policy(policy: object) -> EvictionPolicy:
    """``policy`` itself when it is one (it has ``victims``), or a new policy of that name
    (:data:`POLICIES`). Raises ValueError for an unknown name and TypeError for anything
    else, so that a session refuses it at ``open()`` instead of at its first demotion."""
    if isinstance(policy, str):
        make = POLICIES.get(policy)
        if make is None:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        return make()
    if isinstance(policy, type) or not callable(getattr(policy, "victims", None)):
        raise TypeError(
            f"policy must be an EvictionPolicy (an object with victims(candidates, need)) "
            f"or one of the names {', '.join(map(repr, POLICIES))}, not {policy!r}"
        )
    return policy  # type: ignore[return-value]
