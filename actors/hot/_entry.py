"""One agent's entry in the hot tier: its cache and the bookkeeping the tier keeps of it."""

from __future__ import annotations

from collections.abc import Callable

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
    """An agent's hot cache (``kv``) and its bookkeeping.

    Invariant: the entry is the only writer of its fields; the hot tier's parts change them
    through the transitions below (a turn queued, started, ended; a write pinned and done;
    a tool wait), each of which checks what it needs. Everyone else reads them through the
    properties, and runs turns on ``kv`` through the pool's methods."""

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
        "_watch",
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
        assert 0 <= persisted <= len(kv.tokens), "persisted tokens are tokens the cache holds"
        self.kv = kv
        self._last_used = last_used  # time.monotonic(): when its last turn ended (or queued)
        self._persisted = persisted  # tokens known to be safe in the warm tier
        self._pinned = pinned  # staged for a turn about to start: demoted last
        self._hits = 0  # turns that found it hot
        self._next_use = next_use  # when its next turn is expected (None: not known)
        self._turn_reserve: int | None = None  # while its turn's working cache exists
        self._turn_stored = 0  # its stored bytes when the turn started (what it adds counts)
        self._write_due = False  # its turn ended: the agent is about to export new tokens
        self._due_bytes = 0  # what that export will pin, held in the budget until it does
        # Its first ranges are another agent's (source, tokens) shared at a turn's start,
        # and nothing of it is on disk yet: its first write may link that agent's segments.
        self._shared_from: tuple[str, int] | None = None
        # time.monotonic() until which it waits on its tool calls' results (kept hot)
        self._tool_wait_until = 0.0
        self._watch: Callable[[], None] | None = None

    def watch(self, call: Callable[[], None] | None) -> None:
        """Call ``call`` (None: nobody) at each change of what the budget counts of it: a
        turn's reserve, a due write's bytes (the transitions below), and its cache's
        stored ranges, working cache and ready copy (``AgentKV.on_change``). The hot
        tier's ``Residents`` watches its residents, so that a count reads again only the
        entries that changed."""
        self._watch = self.kv.on_change = call

    def _changed(self) -> None:
        if self._watch is not None:
            self._watch()

    # -- what others read -------------------------------------------------------------
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

    @property
    def last_used(self) -> float:
        return self._last_used

    @property
    def next_use(self) -> float | None:
        return self._next_use

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def write_due(self) -> bool:
        """Its turn ended and its agent's export of the new tokens has not pinned them yet."""
        return self._write_due

    @property
    def due_bytes(self) -> int:
        """What its due export will pin (0 when none is due): counted in the budget now."""
        return self._due_bytes if self._write_due else 0

    @property
    def shared_from(self) -> tuple[str, int] | None:
        return self._shared_from

    @property
    def tool_wait_until(self) -> float:
        return self._tool_wait_until

    def tool_waiting(self, now: float) -> bool:
        return self._tool_wait_until > now

    @property
    def turn_reserve(self) -> int | None:
        return self._turn_reserve

    @property
    def turn_stored(self) -> int:
        return self._turn_stored

    # -- transitions ------------------------------------------------------------------
    def queued(self, now: float, *, hit: bool) -> None:
        """A turn of it is queued (``hit``: it found this cache hot): it is expected now,
        no longer staged, waiting on tools or due to write."""
        self._hits += hit
        self._pinned = False
        self._write_due = False
        self._tool_wait_until = 0.0  # the turn that brings the results is here
        self._next_use = self._last_used = now  # soon: its turn is queued
        self._changed()

    def expected(self, now: float) -> None:
        """Its turn is expected now (a staging for it found it hot)."""
        self._next_use = now

    def trimmed(self, keep: int) -> None:
        """Its cache was cut to ``keep`` tokens: what was persisted beyond is no more, and a
        cut below what it shared makes its first write its own."""
        self._persisted = min(self._persisted, keep)
        if self._shared_from is not None and keep < self._shared_from[1]:
            self._shared_from = None

    def shares(self, source: str, upto: int) -> None:
        """Its (empty) cache now begins with ``source``'s stored ranges, ``upto`` tokens."""
        assert self._persisted == 0, "only a cache with nothing on disk takes shared ranges"
        self._shared_from = (source, upto)

    def turn_started(self, reserve: int) -> None:
        """Room for its turn's working cache of up to ``reserve`` bytes was granted."""
        assert self._turn_reserve is None, "one turn at a time"
        self._turn_reserve = reserve
        self._turn_stored = self.kv.stored_bytes
        self._changed()

    def turn_ended(self, now: float, *, write_due: bool, due_bytes: int) -> None:
        """Its turn is over (or never started); ``write_due``: its agent exports the new
        tokens next, pinning ``due_bytes``, held in the budget until then."""
        self._turn_reserve = None
        self._next_use = None
        self._last_used = now
        self._write_due = write_due
        self._due_bytes = due_bytes if write_due else 0
        self._changed()

    def export_pinned(self) -> None:
        """Its export was taken: the pins hold its bytes from now on."""
        self._write_due = False
        self._due_bytes = 0
        self._changed()

    def written(self, upto: int) -> None:
        """An export of it is over: ``upto`` tokens are safe on disk (an ``upto`` past what
        it holds, from a write of tokens it no longer has, changes nothing)."""
        self._write_due = False
        self._due_bytes = 0
        if upto <= len(self.kv.tokens):
            self._persisted = max(self._persisted, upto)
        if self._persisted:
            self._shared_from = None  # its warm copy exists: later writes append
        self._changed()

    def warm_copy_gone(self) -> None:
        """Its warm copy was made cold (the disk limit): nothing of it is on disk now, so
        its next write is whole and it is never demoted as if it were safe there."""
        assert not self._write_due, "a cache whose write is due keeps its warm copy"
        self._persisted = 0
        self._shared_from = None

    def wait_for_tools(self, until: float) -> None:
        """Its turn ended in tool calls: keep it ahead of idle caches until ``until``."""
        self._tool_wait_until = until
