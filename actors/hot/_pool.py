"""The hot tier: one byte budget, the caches resident in it, and the turns run on them.

A :class:`CachePool` lives inside the engine (on its thread, no locks). It is composed of
parts, each the only writer of its own state: the :class:`Residents` (entries, busy agents,
scopes, the shared-prefix index), the :class:`Ledger` (the budget's counts), the
:class:`ReadyCopies`, the :class:`Demotion` (whom to demote for room, through an
:class:`EvictionPolicy` weighing the application's hints) and the :class:`WarmTraffic`
(stagings in, exports out). The engine asks the pool for room and runs turns on its
entries through the methods here; the pool answers with typed results.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...kernels.agent_cache import DEFAULT_CHECKPOINTS, AgentKV
from ...kernels.geometry import CacheGeometry
from ...kernels.qcodec import KVCodec
from ...kernels.turn_cache import FloatTurnCache, TurnCache
from ...runtime import DEBUG, Reply
from ..enums import Room, Tier
from ..errors import AgentBusy, UnknownAgent
from ..messages import AskWith, Hint, WarmVictims
from ..records import CacheInfo, Exported
from ._demotion import Demotion
from ._entry import HotEntry, common_prefix
from ._hints import HintBook
from ._ledger import Ledger
from ._moves import MoveLog
from ._policy import Candidate, EvictionPolicy, Rates
from ._ready import ReadyCopies
from ._residents import Residents
from ._traffic import WarmTraffic
from ._write_back import PostWrite, WriteBack, WriteBudget

__all__ = ("CachePool",)


class CachePool:
    """The hot tier's byte budget and residents.

    ``limit``: the budget (None: unbounded). ``persistent``: a warm tier exists, so only
    caches complete on disk may be demoted (to warm); without one, demotion drops a cache to
    cold. New agents' caches are of ``codec``, ``geometry`` and the attention mode's
    ``turn_cache``; ``ready_copies``: keep float copies between turns (:class:`ReadyCopies`).
    ``moves``: the log its demotions and installs go to (:class:`MoveLog`; None: its own),
    handed in by a runner whose log outlives each load's pool. ``write_budget`` (with a
    warm tier): write-back (:class:`WriteBack`): a turn's end writes nothing, and a cache
    the budget admits is handed to ``post`` (its agent writes it) as it leaves the tier.
    ``clock`` and ``wall``: the monotonic and unix seconds the tier weighs its caches by
    (a replay without model compute, ``bench/replay.py``, runs the tier on its own time;
    a write budget's window keeps real time).

    The engine runs turns on the entries' caches through the methods here (claim, base,
    start, store a cut, end) and reports its running batch's bytes. The pool is the only
    writer of what is shared between entries; its parts own the rest.
    """

    def __init__(
        self,
        limit: int | None,
        policy: EvictionPolicy,
        *,
        persistent: bool,
        codec: KVCodec,
        geometry: CacheGeometry,
        turn_cache: type[TurnCache] = FloatTurnCache,
        ready_copies: bool = True,
        checkpoints: int = DEFAULT_CHECKPOINTS,
        moves: MoveLog | None = None,
        write_budget: WriteBudget | None = None,
        post: PostWrite | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self._checkpoints = checkpoints
        self.persistent = persistent
        self._codec, self._geometry, self._turn_cache = codec, geometry, turn_cache
        self.residents = Residents()
        self.ready = ReadyCopies(turn_cache, enabled=ready_copies)
        self.ledger = Ledger(limit, self.residents, self.ready)
        self.rates = Rates()
        self.hints = HintBook()  # the application's advice
        self.write_back = (
            WriteBack(self.ledger, write_budget, post)
            if persistent and write_budget is not None
            else None
        )
        self.demotion = Demotion(
            self.residents,
            self.ledger,
            self.ready,
            self.hints,
            self.rates,
            policy,
            persistent=persistent,
            moves=moves,
            write_back=self.write_back,
            clock=clock,
            wall=wall,
        )
        self.warm = WarmTraffic(self.residents, self.ledger, self.demotion, self.write_back)
        # Agents told to wait on their tool calls' results: a count of those waiting reads
        # these, not every resident (a wait ends by itself, at its agent's next turn, or
        # with its entry). Names only: an entry that left must not be kept alive here.
        self._tool_waits: set[str] = set()
        self.shared_turns = 0  # turns based on another cache's stored ranges
        self.shared_tokens = 0  # the tokens they reused so

    # -- the parts' figures, as the engine reads them ---------------------------------
    @property
    def limit(self) -> int | None:
        return self.ledger.limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self.ledger.limit = value

    @property
    def used(self) -> int:
        return self.ledger.used

    @property
    def peak(self) -> int:
        return self.ledger.peak

    @property
    def policy(self) -> EvictionPolicy:
        return self.demotion.policy

    @property
    def demotions(self) -> dict[Tier, int]:
        return self.demotion.demotions

    @property
    def moves(self) -> MoveLog:
        return self.demotion.moves

    def measure(self) -> int:
        return self.ledger.measure()

    def committed(self) -> int:
        return self.ledger.committed()

    def make_room(self, need: int, exclude: HotEntry | None = None, *, turn: bool = False) -> bool:
        return self.demotion.make_room(need, exclude, turn=turn)

    def stuck(self, exclude: HotEntry | None = None) -> bool:
        return self.demotion.stuck(exclude)

    def cold_victims(self, asked: WarmVictims) -> list[str] | AskWith | None:
        return self.demotion.cold_victims(asked)

    def idle_bytes(self, enough: int | None = None) -> int:
        return self.demotion.idle_bytes(enough)

    def candidates(self) -> list[Candidate]:
        return self.demotion.candidates()

    # -- residents --------------------------------------------------------------------
    def get(self, agent: str) -> HotEntry | None:
        return self.residents.get(agent)

    def __contains__(self, agent: str) -> bool:
        return agent in self.residents

    def __len__(self) -> int:
        return len(self.residents)

    def entries(self) -> list[HotEntry]:
        return list(self.residents.values())

    def busy(self, agent: str) -> bool:
        """A turn of ``agent`` is queued or running (whether or not its cache is hot)."""
        return self.residents.busy(agent)

    def info(self, agent: str) -> CacheInfo:
        """What ``agent``'s hot cache holds. Raises UnknownAgent when it has none."""
        entry = self.residents.get(agent)
        if entry is None:
            raise UnknownAgent(f"agent {agent!r} has no hot cache")
        kv = entry.kv
        return CacheInfo(
            agent=agent,
            tokens=len(kv.tokens),
            nbytes=kv.nbytes,
            busy=self.busy(agent),
            persisted=entry.persisted,
            tool_wait_s=max(entry.tool_wait_until - self.clock(), 0.0),
            last_used=entry.last_used,
            checkpoints=kv.checkpoint_count,
            checkpoint_tokens=[r.stop for r in kv.ranges if r.states],
            checkpoint_bytes=kv.checkpoint_bytes,
        )

    def infos(self) -> list[CacheInfo]:
        """What every hot cache holds (:meth:`info` of each)."""
        return [self.info(agent) for agent in list(self.residents)]

    def new_kv(self) -> AgentKV:
        """An empty cache of this pool's codec, geometry and attention mode."""
        return AgentKV(
            self._codec, self._geometry, turn_cache=self._turn_cache, checkpoints=self._checkpoints
        )

    def claim(self, agent: str, scope: str = "") -> HotEntry:
        """The agent's entry (a new empty one if it has none), marked busy for a turn that
        is queued now; ``scope``: the agents whose stored ranges it may share (and that may
        share its). Raises AgentBusy when a turn of it is queued or running.

        A queued turn's cache stays a demotion candidate (demoted last) until the turn
        starts: a turn that fits alone must never wait on caches of turns queued behind it.
        """
        if self.residents.busy(agent):
            raise AgentBusy(f"agent {agent!r} already has a generation in flight")
        self.residents.set_scope(agent, scope)
        self.residents.mark_busy(agent)
        return self._queue(agent, hit=True)

    def adopt(self, agent: str) -> HotEntry:
        """For a queued turn whose cache was demoted while it waited: the agent's entry now
        (staged again meanwhile) or a new empty one."""
        assert self.residents.busy(agent), "only a queued turn adopts an entry"
        return self._queue(agent, hit=False)

    def _queue(self, agent: str, *, hit: bool) -> HotEntry:
        """The agent's entry (made when it has none) marked for a queued turn; ``hit``: a
        turn found it hot."""
        entry = self.residents.get(agent)
        if entry is None:
            entry = self.residents.add(agent, HotEntry(self.new_kv()))
            hit = False
        self.hints.queued(agent)
        entry.queued(self.clock(), hit=hit)
        return entry

    def drop(self, agent: str) -> bool:
        """Forget an idle agent's hot cache (and a staging reservation); False if it had
        none. Raises AgentBusy while a turn of it is queued or running."""
        if self.residents.busy(agent):
            raise AgentBusy(f"agent {agent!r} is generating; cancel it first")
        self.ledger.unreserve(agent)
        self.hints.forget(agent)
        dropped = self.residents.remove(agent) is not None
        self.ready.shared.left(agent)
        self.residents.forget_scope(agent)
        self.ledger.measure()
        return dropped

    def close(self) -> None:
        """Drop every cache and build (the engine stops: its MLX arrays must go first)."""
        self.ready.clear()
        for entry in self.residents.values():
            entry.kv.clear_working()
        self.residents.clear()

    def check(self) -> None:
        """The expensive consistency checks (run between engine steps under
        ``kvactor.runtime.DEBUG``): the index and the count against a recount."""
        self.residents.check()
        self.ledger.check()
        self.demotion.check()

    # -- accounting -------------------------------------------------------------------
    def batch_bytes(self, nbytes: int) -> None:
        """The engine's running batch holds ``nbytes`` now (working caches that left their
        agents' entries); measures when that changed (a decode step that did not grow the
        batch's buffers changes no byte of the tier)."""
        if self.ledger.batch(nbytes):
            self.ledger.measure()

    @property
    def ready_agents(self) -> int:
        """Hot agents keeping a ready copy."""
        return self.residents.ready_count()

    @property
    def ready_bytes(self) -> int:
        """Ready copies' bytes, shared prefixes' copies included."""
        return self.ledger.ready_bytes() + self.ready.shared.nbytes

    # -- turns ------------------------------------------------------------------------
    def base(
        self, agent: str, entry: HotEntry, prompt: list[int], *, share: bool
    ) -> tuple[int, int]:
        """Base a queued turn of ``prompt`` on ``entry``: keep the longest common prefix of
        its tokens that a turn can resume at (the last prompt token is always fed again, so
        that its logits are there to sample from) and forget the rest; with ``share`` and
        nothing of its own kept, take another hot cache's stored ranges that ``prompt``
        begins with (:meth:`_share`). Returns ``(kept, shared)`` tokens (shared <= kept)."""
        kv = entry.kv
        keep = kv.reusable(min(common_prefix(kv.tokens, prompt), len(prompt) - 1))
        kv.trim(keep)
        entry.trimmed(keep)
        shared = 0
        if keep == 0 and share:
            keep = shared = self._share(agent, entry, prompt)
        self.residents.reindex(agent, entry)
        return keep, shared

    def _share(self, agent: str, entry: HotEntry, prompt: list[int]) -> int:
        """Base ``entry`` (empty) on the longest run of another hot cache's stored ranges
        that ``prompt`` begins with, token for token (the last prompt token stays to be
        fed): the arrays are shared, not copied. Returns the tokens it reuses (0: none)."""

        def holds(other: str, stop: int, count: int) -> bool:
            kv = self.residents[other].kv
            bounds = kv.boundaries()
            return (
                len(bounds) >= count
                and bounds[count - 1] == stop
                and kv.resumable_at(count)  # with recurrent layers: a checkpoint there
                and (kv.tokens[:stop] == prompt[:stop])
            )

        found = self.residents.longest_shared(agent, prompt, holds)
        if found is None:
            return 0
        stop, source, count = found
        kv = entry.kv
        self.residents[source].kv.share_into(kv, count)
        if kv.reusable(stop) != stop:  # a sliding window no longer held there
            kv.trim(0)
            return 0
        self.ready.shared.note(kv.ranges, (source, agent))
        entry.shares(source, stop)
        self.shared_turns += 1
        self.shared_tokens += stop
        self.ledger.measure()
        return stop

    def start_turn(self, entry: HotEntry, reserve: int) -> bool:
        """Room for a turn's working cache of up to ``reserve`` bytes besides the entry's
        stored cache; False to wait (or, when ``stuck``, to refuse)."""
        # Its own ready copy becomes its working copy, which the reserve covers; one that
        # is half-built is finished first (its bytes are reserved already).
        if self.ready.finish(entry.kv):
            self.ledger.measure()
        need = max(reserve - entry.kv.ready_bytes, 0)
        if not self.demotion.make_room(need, exclude=entry, turn=True):
            return False
        entry.turn_started(reserve)
        self.ledger.turn_room = reserve
        return True

    def working_copy(self, agent: str, entry: HotEntry, *, first: int = 0) -> int:
        """Make the working copy of ``entry``'s turn (started: :meth:`start_turn`): its
        ready copy, else its stored ranges made float, a shared prefix's copy taken as it
        is (made now if there is room for it, idle agents' ready copies dropped for it:
        ``SharedPrefixes``). ``first``: the queries a row of the turn's first forward,
        which attends over the stored form where it can (``FloatTurnCache.defers``: the
        float copy is made after it, :meth:`float_after_stored`). Returns the stored tokens
        dequantized for it."""
        kv = entry.kv
        if kv.work is not None or kv.ready is not None or not kv.ranges:
            kv.activate()
            return 0
        if kv.turn_cache.quantized:  # attention over the stored form: nothing made float
            kv.activate()
            return 0
        if first and issubclass(kv.turn_cache, FloatTurnCache) and kv.turn_cache.defers(kv, first):
            kv.activate_stored()
            return 0
        prefix, made = self.ready.shared.copy_for(agent, kv, lambda n: self._room(entry, n))
        kv.activate(prefix, beside=True)  # the turn's first forward follows at once
        if made:
            self.ledger.measure()
        return len(kv.tokens) - (prefix.tokens if prefix is not None else 0) + made

    def float_after_stored(self, agent: str, entry: HotEntry) -> int:
        """The float working copy of a turn whose first forward attended over the stored
        form (:meth:`working_copy` with ``first``), a shared prefix's copy taken as there.
        Returns the stored tokens dequantized for it."""
        kv = entry.kv
        prefix, made = self.ready.shared.copy_for(agent, kv, lambda n: self._room(entry, n))
        kv.finish_stored(prefix)
        self.ledger.measure()
        return kv.stored_tokens - (prefix.tokens if prefix is not None else 0) + made

    def _room(self, entry: HotEntry, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit, idle agents' ready copies dropped for them."""
        free = self.ledger.free()
        if free is not None and free < nbytes:
            self.demotion.drop_ready(nbytes - free, exclude=entry)
            free = self.ledger.free()
        return free is None or free >= nbytes

    def store_so_far(self, agent: str, entry: HotEntry) -> None:
        """During ``entry``'s turn: store its tokens so far as a range of their own (a cut:
        ``AgentKV.store_so_far``), where other caches may share them from now on."""
        entry.kv.store_so_far()
        self.residents.reindex(agent, entry)

    def end_turn(self, agent: str, entry: HotEntry, *, finished: bool = False) -> None:
        """The agent's turn is over: its new tokens quantized into a range, its working
        cache dropped or kept as its ready copy, its reserve freed; waiters granted.
        ``finished``: it ended normally, so the agent writes the new tokens next."""
        hot = self.residents.get(agent) is entry
        kv = entry.kv
        self.ready.keep(kv, hot=hot)
        # Without a warm tier nothing is ever written: every range may go.
        kv.slide(entry.persisted if self.persistent else len(kv.tokens))
        self.residents.reindex(agent, entry)
        self.residents.mark_idle(agent)
        now = self.clock()
        self.hints.turn_took(now - entry.last_used)  # queued at last_used
        # Under a write budget nothing is written at a turn's end (write-back).
        write_due = finished and self.persistent and self.write_back is None and not entry.clean
        # its export pins these: the room stays taken until it does
        due = sum(r.nbytes for r in kv.ranges_from(entry.persisted)) if write_due else 0
        entry.turn_ended(now, write_due=write_due, due_bytes=due)
        self.ledger.measure()
        self.warm.grant_waiters()

    def fork(self, source: str, new: str, tokens: list[int]) -> bool:
        """``new`` hot with ``source``'s stored ranges, shared, when ``source`` is hot, idle
        and holds exactly ``tokens``; False otherwise (``new`` stages from disk instead).
        Raises BudgetExceeded when it does not fit."""
        entry = self.residents.get(source)
        if entry is None or self.busy(source) or entry.kv.tokens != tokens:
            return False
        kv = entry.kv.fork(self.new_kv())
        if not self.warm.install(new, kv.stored_bytes, lambda: kv, pin=False, from_disk=False):
            return False
        self.ready.shared.note(kv.ranges, (source, new))
        return True

    # -- the warm tier's traffic (WarmTraffic) -----------------------------------------
    def reserve(self, agent: str, nbytes: int, *, prefetch: bool = False) -> Room:
        return self.warm.reserve(agent, nbytes, prefetch=prefetch)

    def wait_for_room(self, agent: str, nbytes: int, reply: Reply) -> None:
        self.warm.wait_for_room(agent, nbytes, reply)

    def grant_waiters(self) -> None:
        self.warm.grant_waiters()

    def release(self, agent: str) -> None:
        self.warm.release(agent)

    def export(self, agent: str) -> Exported:
        return self.warm.export(agent)

    def export_admitted(self, agent: str) -> Exported | None:
        return self.warm.export_admitted(agent)

    def written(self, agent: str, export_id: int, upto: int, *, failed: bool = False) -> None:
        self.warm.written(agent, export_id, upto, failed=failed)

    # -- hints, tool waits and ready copies built ahead of a turn --------------------
    def hint(self, hint: Hint, *, ahead: int = 2) -> None:
        """Take the application's ``hint``; build ready copies for the ``ahead`` soonest
        hinted agents that are hot and idle, in room that is free now."""
        self.hints.apply(hint, self.clock())
        for agent in hint.done:
            self._write_done(agent)
        for agent in self.hints.soonest(self.clock(), ahead):
            self.ready_ahead(agent)

    def _write_done(self, agent: str) -> None:
        """Under a write budget: an idle agent told done has its unwritten ranges written
        now (if the budget admits them), so that it leaves the tier later without a write
        (its pin adds nothing to the count while it stays: the ranges are its own)."""
        back, entry = self.write_back, self.residents.get(agent)
        if back is None or entry is None or entry.clean or self.busy(agent) or entry.running:
            return
        if entry.write_due or agent in self.ledger.writing():
            return
        if back.admits(entry, hinted=True):
            back.send(agent, entry)

    def tool_wait(self, agent: str, ttl_s: float) -> None:
        """``agent``'s turn ended in tool calls: keep its cache ahead of idle ones for
        ``ttl_s`` seconds, or until its next turn is queued (no cache: nothing to keep)."""
        entry = self.residents.get(agent)
        if entry is not None:
            entry.wait_for_tools(self.clock() + max(ttl_s, 0.0))
            self._tool_waits.add(agent)

    @property
    def tool_waits(self) -> int:
        """Hot agents waiting on tool results now (those told to wait, the waits that ended
        forgotten)."""
        now, get = self.clock(), self.residents.get
        waits = self._tool_waits
        waits.difference_update(
            [a for a in waits if (e := get(a)) is None or not e.tool_waiting(now)]
        )
        assert not DEBUG or len(waits) == (
            scratch := sum(e.tool_waiting(now) for e in self.residents.values())
        ), f"{len(waits)} agents counted waiting on tools, not {scratch}"
        return len(waits)

    def ready_ahead(self, agent: str) -> None:
        """Build an idle hot agent's ready copy between engine steps, in room that is free
        now (a copy built ahead of need never demotes anyone): its turn to come starts
        without dequantizing."""
        entry = self.residents.get(agent)
        if entry is None or self.busy(agent):
            return
        if self.ready.want(agent, entry.kv, self.ledger.free()):
            self.ledger.measure()

    def build_ready_step(self) -> bool:
        """One layer of the oldest ready copy being built; True while any is."""
        building = self.ready.step(
            lambda agent, kv: (e := self.residents.get(agent)) is not None and e.kv is kv
        )
        if building:
            self.ledger.measure()
        if DEBUG:
            self.check()
        return building
