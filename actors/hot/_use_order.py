"""Agents in the order of their last use, kept as uses change: what lets the hot tier read
its least recently used caches first without sorting every one of them."""

from __future__ import annotations

from sortedcontainers import SortedList

__all__ = ("UseOrder",)


class UseOrder:
    """Agents by last use (monotonic seconds), least recent first, ties by name.

    ``sortedcontainers.SortedList`` keeps the order: a change is O(log n) and reading
    ``count`` agents from any place is O(log n + count), where a sort of 3,000 hot caches
    at each turn that makes room is what this replaces (see docs/benchmarks.md).

    Invariant: :meth:`place` is the only writer; each agent placed is in the order once,
    at the last use it was placed with."""

    __slots__ = ("_at", "_order")

    def __init__(self) -> None:
        self._order: SortedList = SortedList()  # (last use, agent)
        self._at: dict[str, float] = {}

    def place(self, agent: str, at: float | None) -> None:
        """``agent`` last used at ``at`` (None: out of the order)."""
        was = self._at.get(agent)
        if was == at:
            return
        if was is not None:
            self._order.remove((was, agent))
        if at is None:
            del self._at[agent]
        else:
            self._at[agent] = at
            self._order.add((at, agent))

    def __len__(self) -> int:
        return len(self._at)

    def page(self, start: int, count: int) -> list[tuple[float, str]]:
        """Up to ``count`` (last use, agent) pairs from the ``start``-th on."""
        return list(self._order.islice(start, start + count))

    def check(self, expected: dict[str, float]) -> None:
        """Debug check: the order holds exactly ``expected`` (agent -> last use)."""
        assert self._at == expected, "an order of last uses is out of date"
        assert list(self._order) == sorted((at, a) for a, at in expected.items())
