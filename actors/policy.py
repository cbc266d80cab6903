"""Whom to demote: the candidates a policy sees, the policy protocol, LRU, and the measured
rates that price a reload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .enums import Tier

__all__ = ("Candidate", "EvictionPolicy", "LRUPolicy", "Rates")


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
    next_use: float | None = None  # time.monotonic() of a hint that it runs soon
    tier: Tier = Tier.HOT
    waiting: bool = False  # its turn is queued, or it was staged for one: a reload comes soon
    tool_wait: bool = False  # waiting on its tool calls' results (within its TTL): part of waiting


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
