"""Write-back: under an SSD write budget the warm tier stops writing every turn through;
a cache is written when it leaves the hot tier (or is told done), if the budget has room
and it is likely to be read again. The budget's window and the exports it sent out."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ..records import Exported
from ._entry import HotEntry
from ._ledger import Ledger

__all__ = ("WriteBack", "WriteBudget", "export_entry")

#: What a write-back sends: (agent, export) to the agent's actor, which writes it and
#: answers the engine with Written (a thread-safe post onto the event loop).
PostWrite = Callable[[str, Exported], None]


class WriteBudget:
    """``nbytes`` that may be written per ``window_s`` seconds, counted over a sliding
    window of the writes taken. Invariant: the only writer of its window."""

    def __init__(self, nbytes: int, window_s: float, *, spent: int = 0) -> None:
        self.nbytes = nbytes
        self.window_s = window_s
        # (time.monotonic(), bytes) of each write taken; ``spent`` (a count this process
        # did not make: the day's writes so far, from the directory's record) is one of them
        self._taken: deque[tuple[float, int]] = deque([(time.monotonic(), spent)] if spent else ())
        self._spent = spent

    def spent(self, now: float) -> int:
        """Bytes taken within the last ``window_s`` seconds."""
        taken = self._taken
        while taken and taken[0][0] <= now - self.window_s:
            self._spent -= taken.popleft()[1]
        return self._spent

    def room(self, now: float) -> int:
        return max(self.nbytes - self.spent(now), 0)

    def take(self, nbytes: int, now: float) -> bool:
        """Count a write of ``nbytes`` if it fits the window's room; whether it did."""
        if nbytes > self.room(now):
            return False
        if nbytes:
            self._taken.append((now, nbytes))
            self._spent += nbytes
        return True


def export_entry(ledger: Ledger, agent: str, entry: HotEntry) -> Exported:
    """Host views of ``entry``'s stored ranges past what is persisted, pinned in the ledger
    until a Written names the export (the views hold the arrays: once ``entry`` is not
    resident, the pin counts them)."""
    ranges = entry.kv.ranges_from(entry.persisted)
    export_id = ledger.pin(agent, sum(r.nbytes for r in ranges), entry)
    entry.export_pinned()
    shared = entry.shared_from if entry.persisted == 0 else None
    return Exported(
        export_id=export_id,
        persisted=entry.persisted,
        tokens=list(entry.kv.tokens),
        ranges=[(r.start, r.stop, r.to_numpy()) for r in ranges],
        shared_from=shared[0] if shared else "",
        shared_upto=shared[1] if shared else 0,
    )


class WriteBack:
    """Which caches the hot tier writes back, and the writes it sent, a part of the
    :class:`~kvactor.actors.hot.CachePool` (only with a warm tier and a write budget).

    A cache is admitted when its unwritten bytes fit the budget's room and it is likely to
    be read again: while less than half of the window is spent, any; past that, one that
    was reused hot (a second turn), came from disk, or is hinted to run again. ``post``
    hands an export to its agent's actor (None: no one to write it: nothing is admitted).

    Invariant: the only writer of the budget's window, of its counts and of the exports it
    sent (export id -> the entry it came from), until their Written comes."""

    def __init__(self, ledger: Ledger, budget: WriteBudget, post: PostWrite | None) -> None:
        self._ledger = ledger
        self.budget = budget
        self.post = post
        self._sent: dict[int, HotEntry] = {}
        self.sent = 0  # caches handed to their agents to write
        self.sent_bytes = 0
        self.refused = 0  # dirty caches that left the hot tier unwritten (cold)

    @staticmethod
    def due(entry: HotEntry) -> int:
        """The stored bytes of ``entry`` not yet on disk."""
        return sum(r.nbytes for r in entry.kv.ranges_from(entry.persisted))

    def admits(self, entry: HotEntry, *, hinted: bool, now: float | None = None) -> bool:
        """Whether ``entry`` (dirty) would be written if it left the hot tier now."""
        if self.post is None:
            return False
        now = time.monotonic() if now is None else now
        due = self.due(entry)
        budget = self.budget
        if due > budget.room(now):
            return False
        likely = entry.hits > 0 or entry.persisted > 0 or hinted
        return likely or budget.spent(now) + due <= budget.nbytes // 2

    def send(self, agent: str, entry: HotEntry) -> bool:
        """Export ``entry``'s unwritten ranges (pinned) and hand them to its agent to write,
        its bytes taken from the budget; False (nothing done) when they do not fit it."""
        if self.post is None or not self.budget.take(self.due(entry), time.monotonic()):
            return False
        exported = export_entry(self._ledger, agent, entry)
        self._sent[exported.export_id] = entry
        self.sent += 1
        self.sent_bytes += sum(a.nbytes for *_, t in exported.ranges for a in t.values())
        self.post(agent, exported)
        return True

    def take(self, entry: HotEntry) -> bool:
        """Count ``entry``'s unwritten bytes against the budget for a write its agent asked
        for (it leaves the session); False (counted refused) when they do not fit."""
        if self.budget.take(self.due(entry), time.monotonic()):
            return True
        self.went_cold()
        return False

    def went_cold(self) -> None:
        """A dirty cache left the hot tier (or the session) unwritten."""
        self.refused += 1

    def came_back(self, export_id: int) -> HotEntry | None:
        """A Written for ``export_id``: the entry it was sent from, if it was a write-back
        (that entry, if still resident, is the only one the write may mark persisted)."""
        return self._sent.pop(export_id, None)
