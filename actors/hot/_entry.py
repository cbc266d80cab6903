"""One agent's entry in the hot tier: its cache and the pool's bookkeeping of it."""

from __future__ import annotations

from ...kernels.agent_cache import AgentKV

__all__ = ("HotEntry", "common_prefix")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with alike."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HotEntry:
    """An agent's hot cache and its bookkeeping.

    Invariant: only the CachePool (``actors/pool.py``) writes the fields; everyone else
    reads ``kv``, ``persisted``, ``clean`` and ``running``, and runs turns on ``kv``
    through the pool's methods."""

    __slots__ = (
        "_due_bytes",
        "_hits",
        "_last_used",
        "_next_use",
        "_persisted",
        "_pinned",
        "_shared_from",
        "_tool_wait_until",
        "_turn_reserve",
        "_turn_stored",
        "_write_due",
        "kv",
    )

    def __init__(
        self,
        kv: AgentKV,
        last_used: float = 0.0,
        *,
        persisted: int = 0,
        pinned: bool = False,
        next_use: float | None = None,
    ) -> None:
        self.kv = kv
        self._last_used = last_used
        self._persisted = persisted  # tokens known to be safe in the warm tier
        self._pinned = pinned  # staged for a turn about to start: demoted last
        self._hits = 0
        self._next_use = next_use
        self._turn_reserve: int | None = None  # while its turn's working cache exists
        self._turn_stored = 0  # its stored bytes when the turn started (what it adds counts)
        self._write_due = False  # its turn ended: the agent is about to export new tokens
        self._due_bytes = 0  # what that export will pin, held in the budget until it does
        # Its first ranges are another agent's (source, tokens) shared at a turn's start,
        # and nothing of it is on disk yet: its first write may link that agent's segments.
        self._shared_from: tuple[str, int] | None = None
        # time.monotonic() until which it waits on its tool calls' results (kept hot)
        self._tool_wait_until = 0.0

    @property
    def persisted(self) -> int:
        """Tokens known to be safe in the warm tier."""
        return self._persisted

    @property
    def clean(self) -> bool:
        """Its warm copy is complete: demoting it loses nothing."""
        return self._persisted >= len(self.kv.tokens)

    @property
    def running(self) -> bool:
        """Its turn's working cache exists (room was granted)."""
        return self._turn_reserve is not None

    @property
    def staged(self) -> bool:
        """Staged from the warm tier for a turn that has not started yet."""
        return self._pinned
