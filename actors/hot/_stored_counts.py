"""The stored bytes of the hot tier's caches, an array several caches share (a fork and its
source, agents over one shared prefix) counted once, kept by change: a cache's arrays are
read again only when its stored ranges changed (``AgentKV.stored_gen``), and a count looks
only at the caches that changed since the last (the residents' ``ChangeFeed``), not at
each cache or each of its arrays. The ledger keeps it (its only writer, through
:meth:`StoredCounts.sync`); demotion reads what each cache alone holds."""

from __future__ import annotations

import weakref
from collections.abc import Collection

from ...kernels.agent_cache import AgentKV
from ._residents import Residents

__all__ = ("StoredCounts",)


class _Counted:
    """What was counted for one cache: which cache, at which change, shared or not, its
    stored bytes and (shared) each of its arrays' id and bytes."""

    __slots__ = ("arrays", "gen", "kv", "nbytes", "own", "own_at", "shared")

    def __init__(self, kv: AgentKV, nbytes: int, arrays: tuple[tuple[int, int], ...]) -> None:
        self.kv = weakref.ref(kv)  # no reference: a cache let go is freed at once
        self.gen = kv.stored_gen
        self.shared = kv.shared
        self.nbytes = nbytes
        self.arrays = arrays
        self.own = nbytes  # a shared cache's own bytes, as of ``StoredCounts._epoch`` own_at
        self.own_at = -1


class StoredCounts:
    """Stored bytes of a set of caches (see the module doc).

    Invariant: ``total`` is the bytes of the union of the stored arrays of the caches last
    synced (a cache's arrays that are no other cache's are summed from its ranges);
    ``_holders`` counts, for each array of a shared cache, the synced caches holding it;
    ``_epoch`` changes whenever an array's holders go from one to two or from two to one
    (the only changes that move bytes between caches' own counts)."""

    def __init__(self) -> None:
        self.total = 0
        self._counted: dict[str, _Counted] = {}
        self._holders: dict[int, int] = {}  # id of a shared cache's array -> caches holding it
        self._epoch = 0

    def sync(self, residents: Residents, changed: Collection[str]) -> int:
        """Count the caches of ``residents`` now, given the agents ``changed`` since the
        last sync (a ``ChangeFeed``'s): a cache gone or changed (another cache, another
        change of its ranges, or shared since) is taken out first (an array freed since
        may share an id with a new one), then one new or changed is read. Returns
        :attr:`total`."""
        counted = self._counted
        for agent in changed:
            c = counted.get(agent)
            e = residents.get(agent)
            if c is not None and (
                e is None
                or (kv := e.kv) is not c.kv()
                or c.gen != kv.stored_gen
                or c.shared != kv.shared
            ):
                self._take_out(agent)
            if e is not None and agent not in counted:
                self._count(agent, e.kv)
        return self.total

    def own(self, agent: str) -> int:
        """Stored bytes that ``agent``'s cache alone holds (what demoting it frees), as
        last synced; 0 for one not counted."""
        c = self._counted.get(agent)
        if c is None:
            return 0
        if not c.shared:
            return c.nbytes
        if c.own_at != self._epoch:  # some array's sole holder changed since: count again
            holders = self._holders
            c.own = sum(n for i, n in c.arrays if holders[i] == 1)
            c.own_at = self._epoch
        return c.own

    def _count(self, agent: str, kv: AgentKV) -> None:
        if not kv.shared:  # the common case: no array of it is another cache's
            nbytes = kv.stored_bytes
            self.total += nbytes
            self._counted[agent] = _Counted(kv, nbytes, ())
            return
        sizes: dict[int, int] = {}
        for a in kv.stored_arrays():
            sizes[id(a)] = a.nbytes
        holders = self._holders
        for i, n in sizes.items():
            held = holders.get(i, 0)
            if not held:
                self.total += n
            elif held == 1:
                self._epoch += 1  # its one holder no longer holds it alone
            holders[i] = held + 1
        self._counted[agent] = _Counted(kv, sum(sizes.values()), tuple(sizes.items()))

    def _take_out(self, agent: str) -> None:
        c = self._counted.pop(agent)
        if not c.shared:
            self.total -= c.nbytes
            return
        holders = self._holders
        for i, n in c.arrays:
            held = holders[i] - 1
            if held:
                holders[i] = held
                if held == 1:
                    self._epoch += 1  # its last holder holds it alone now
            else:
                del holders[i]
                self.total -= n
