"""The hot budget's counts: what the tier holds now and at its peak, the room reserved for
warm caches being staged, the exports pinned until they are written, the engine's running
batch, and the bound in force."""

from __future__ import annotations

from ...runtime import DEBUG
from ._entry import HotEntry
from ._ready import ReadyCopies
from ._residents import Residents
from ._stored_counts import StoredCounts

__all__ = ("Ledger",)


class Ledger:
    """Every byte the hot tier counts, against one bound.

    ``budget``: the configured hot budget (None: unbounded), never exceeded: each
    :meth:`measure` checks it. ``limit``: the bound in force now, at most the budget (an
    engine under a memory limit lowers it while other models need room).

    Invariant: the ledger is the only writer of these counts (``used``, ``peak``, the
    stagings, the pins, the batch's bytes); it reads the residents and the ready copies
    being built, whose bytes it counts."""

    def __init__(self, budget: int | None, residents: Residents, ready: ReadyCopies) -> None:
        self.budget = budget
        self._limit = budget
        self._residents = residents
        self._ready = ready
        self._stored = StoredCounts()  # the residents' stored bytes, kept by change
        self._changed = residents.feed()  # who changed since the last count
        self.used = 0
        self.peak = 0
        self._staged: dict[str, int] = {}  # agent -> bytes reserved for its staging warm cache
        # export id -> (agent, bytes being written, the entry they are views of)
        self._pins: dict[int, tuple[str, int, HotEntry]] = {}
        self._exports = 0  # the last export id given
        self._batch_bytes = 0  # the engine's running batch (working caches out of entries)
        self.turn_room = 0  # the reserve of the last turn that started
        # The residents without a turn (no working cache, no reserve): their copies' and
        # due writes' bytes, each kept until its entry or cache changes (``_changed``),
        # and their sum; the rest, a few, are counted at each measure (a working cache
        # grows in place).
        self._quiet: dict[str, int] = {}
        self._quiet_sum = 0
        self._live: dict[str, HotEntry] = {}
        # The residents' ready copies' bytes, each kept until its entry or cache changes
        # (a feed of its own, read at :meth:`ready_bytes`: the stats ask it, a step does
        # not), and their sum.
        self._ready_changed = residents.feed()
        self._ready_of: dict[str, int] = {}
        self._ready_sum = 0

    # -- the bound --------------------------------------------------------------------
    @property
    def limit(self) -> int | None:
        return self._limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        assert self.budget is None or (value is not None and value <= self.budget), (
            f"a bound of {value} bytes over the hot budget of {self.budget}"
        )
        self._limit = value

    def free(self) -> int | None:
        """Bytes left under the bound, running turns counted at their reserve (None: no
        bound)."""
        return None if self._limit is None else self._limit - self.committed()

    # -- stagings and pins ------------------------------------------------------------
    def staged(self, agent: str) -> bool:
        return agent in self._staged

    def reserve(self, agent: str, nbytes: int) -> None:
        """Hold ``nbytes`` for ``agent``'s warm cache being staged."""
        assert agent not in self._staged, f"agent {agent!r} is being staged already"
        self._staged[agent] = nbytes
        self.measure()

    def unreserve(self, agent: str) -> int | None:
        """Give back ``agent``'s staging reservation; its bytes (None: it had none)."""
        nbytes = self._staged.pop(agent, None)
        self.measure()
        return nbytes

    def pin(self, agent: str, nbytes: int, entry: HotEntry) -> int:
        """Hold ``nbytes`` of ``agent``'s export (views of ``entry``'s stored arrays) until
        :meth:`unpin` names it; its id. While ``entry`` is resident its count holds them;
        once it is not (demoted, dropped), the pin does."""
        self._exports += 1
        self._pins[self._exports] = (agent, nbytes, entry)
        return self._exports

    def unpin(self, export_id: int) -> bool:
        """Release an export's pin; False when it had none (id 0: no write is coming)."""
        return self._pins.pop(export_id, None) is not None

    def writing(self) -> set[str]:
        """Agents whose exports are being written."""
        return {agent for agent, _, _ in self._pins.values()}

    @property
    def pending(self) -> bool:
        """A write or a staging is on its way to change the counts."""
        return bool(self._pins or self._staged)

    def batch(self, nbytes: int) -> bool:
        """The engine's running batch holds ``nbytes`` now; whether that changed."""
        changed = nbytes != self._batch_bytes
        self._batch_bytes = nbytes
        return changed

    # -- counting ---------------------------------------------------------------------
    def measure(self) -> int:
        """Bytes in use now (and the peak so far). A stored array that several caches hold
        (forks share their source's) counts once; a cache's stored arrays are read again
        only when they changed (:class:`StoredCounts`). Checks the budget (and, with
        ``kvactor.runtime.DEBUG``, the count against one made from scratch)."""
        return self._measure()[0]

    def _measure(self) -> tuple[int, int, int]:
        """:meth:`measure`, with what :meth:`committed` needs of the same pass over the
        residents: (bytes in use, running turns' working caches, their reserves' room)."""
        used = self._batch_bytes + self._catch_up() + self._quiet_sum
        working = reserved = 0
        for e in self._live.values():
            kv = e.kv
            used += kv.copies_bytes + e.due_bytes
            if kv.work is not None:
                working += kv.work_bytes
            if (reserve := e.turn_reserve) is not None:
                reserved += max(reserve - max(kv.stored_bytes - e.turn_stored, 0), 0)
        used += self.freeing() + sum(self._staged.values())
        used += self._ready.held
        self.used = used
        self.peak = max(self.peak, used)
        assert self.budget is None or used <= self.budget, (
            f"the hot tier holds {used} bytes, over its budget of {self.budget}"
        )
        assert not DEBUG or used == (scratch := self._scratch()), (
            f"the hot count {used} is not {scratch}, counted from scratch"
        )
        return used, working + self._batch_bytes, reserved

    def _catch_up(self) -> int:
        """Read again the residents that changed since the last count (or came, or left):
        their stored bytes, and whether each is quiet (its copies' and due write's bytes
        kept) or live. The residents' stored bytes."""
        changed = self._changed.drain()
        if not changed:
            return self._stored.total
        residents, quiet, live = self._residents, self._quiet, self._live
        for agent in changed:
            self._quiet_sum -= quiet.pop(agent, 0)
            live.pop(agent, None)
            e = residents.get(agent)
            if e is None:
                continue
            if e.kv.work is not None or e.turn_reserve is not None:
                live[agent] = e
            else:
                quiet[agent] = nbytes = e.kv.copies_bytes + e.due_bytes
                self._quiet_sum += nbytes
        return self._stored.sync(residents, changed)

    def stored(self) -> StoredCounts:
        """The stored bytes of the residents, synced now (what each cache alone holds:
        ``own``)."""
        self._catch_up()
        return self._stored

    def ready_bytes(self) -> int:
        """The residents' ready copies' bytes (not the shared prefixes' copies), read again
        only for the residents that changed since the last call: a ready copy is never
        changed in place (``AgentKV.ready``)."""
        residents, of = self._residents, self._ready_of
        for agent in self._ready_changed.drain():
            self._ready_sum -= of.pop(agent, 0)
            e = residents.get(agent)
            if e is not None and (nbytes := e.kv.ready_bytes):
                of[agent] = nbytes
                self._ready_sum += nbytes
        assert not DEBUG or self._ready_sum == (
            scratch := sum(e.kv.ready_bytes_now() for e in residents.values())
        ), f"the ready copies' count {self._ready_sum} is not {scratch}, counted from scratch"
        return self._ready_sum

    def freeing(self) -> int:
        """Bytes that writes under way free when they end: the pins of exports whose entry
        is no longer resident (demoted for write-back, or dropped). A resident entry's
        pins are views of its arrays, counted with it."""
        get = self._residents.get
        return sum(n for agent, n, entry in self._pins.values() if get(agent) is not entry)

    def working(self) -> int:
        """Bytes of running turns' working caches now (in :meth:`measure`'s count)."""
        return self._measure()[1]

    def committed(self) -> int:
        """Bytes in use, counting running turns' working caches at their reserved maximum
        (the reserve covers the batch's padding and the merge copy, and what a turn stores
        before it ends: a cut's range, a recurrent layer's checkpoint). One pass over the
        residents, as :meth:`measure`."""
        used, working, reserved = self._measure()
        return used - working + max(working, reserved)

    def reset_peak(self) -> None:
        """Count the peak from now on."""
        self.peak = self.measure()

    def check(self) -> None:
        """Debug check: the count equals one made from scratch, every array by its id."""
        used = self.measure()
        assert used == (scratch := self._scratch()), f"the hot count {used} is not {scratch}"

    def _scratch(self) -> int:
        """Bytes in use now, counted from scratch (what :meth:`measure` keeps by change)."""
        seen: set[int] = set()
        used = self._batch_bytes + self._ready.held
        for e in self._residents.values():
            used += e.kv.work_bytes + e.kv.ready_bytes_now() + e.due_bytes
            for a in e.kv.stored_arrays():
                if id(a) not in seen:
                    seen.add(id(a))
                    used += a.nbytes
        return used + self.freeing() + sum(self._staged.values())
