"""Whom the hot tier demotes: the candidates its policy sees (with the application's hints
and the tool-wait state), making room, and whether anything is on its way to free some."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence

from ..enums import Tier
from ..messages import AskWith, WarmAgent, WarmVictims
from ._entry import HotEntry
from ._hints import PLAIN_RANK, HintBook
from ._ledger import Ledger
from ._moves import MoveLog
from ._named_hot import NamedHot
from ._policy import Candidate, EvictionPolicy, LRUPolicy, Rates, WorkflowPolicy
from ._ready import ReadyCopies
from ._residents import Residents
from ._write_back import WriteBack

__all__ = ("Demotion", "cold_candidates", "early_victims", "unloaded_victims")

# What orders ready copies for room (``Demotion._ready_order``), and how many of the
# residents' orders by use ``Demotion`` reads at a time.
_ReadyKey = tuple[bool, int, bool, float]
_PAGE = 64
#: The least recently used hot caches a policy is asked about first to demote.
SHORTLIST = 64


def _used_at(updated: float, now: float, at: float) -> float:
    """A warm cache written at unix time ``updated`` as a last use on the monotonic clock
    (``now``, read with the wall clock's ``at``): never later than ``now``. The candidates
    and the bound of ``early_victims`` convert alike, so that they compare exactly."""
    return now - max(at - updated, 0.0)


def cold_candidates(
    agents: Sequence[WarmAgent],
    hints: HintBook | None,
    rates: Rates,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    hot: Mapping[str, float] | None = None,
) -> list[Candidate]:
    """``agents`` (warm) as candidates to go cold: their last use is when their warm
    cache was written (``updated``, on the ``wall`` clock), or for those ``hot`` names
    their last turn there (on ``clock``); bringing one back is a re-prefill, and the hints
    in force (None: none) say when each runs next (on ``clock``), its priority and
    whether it is done."""
    now, at = clock(), wall()
    hot = hot or {}
    out = []
    for a in agents:
        hinted = None if hints is None else hints.next_use(a.agent, now)
        used = hot.get(a.agent)
        out.append(
            Candidate(
                agent=a.agent,
                nbytes=a.nbytes,
                tokens=a.tokens,
                last_used=_used_at(a.updated, now, at) if used is None else used,
                hits=0,
                clean=True,
                demote_to=Tier.COLD,
                reload_s=a.tokens / rates.prefill_tokens_s,
                next_use=hinted,
                tier=Tier.WARM if used is None else Tier.HOT,
                priority=0 if hints is None else hints.priority(a.agent),
                done=hints is not None and hints.done(a.agent),
                hinted=hinted is not None,
            )
        )
    return out


def early_victims(
    policy: EvictionPolicy,
    candidates: Sequence[Candidate],
    need: int,
    beyond: float,
    lowest: tuple[int, int] = PLAIN_RANK,
) -> list[str] | None:
    """``policy``'s victims of ``candidates`` for ``need`` bytes when they are the ones it
    would pick were more candidates added, each idle, clean, last used at ``beyond`` or
    later and of a ``HintBook.rank`` no lower than ``lowest``; None when that cannot be
    told. Either policy picks a prefix of the candidates in its order until ``need`` is
    freed, so the answer holds when every such later candidate sorts after the last one
    picked:

    - :class:`LRUPolicy` orders by (waiting, not clean, last used) alone;
    - :class:`WorkflowPolicy` puts (waiting, priority, done / plain / hinted) first, and
      a later one may be hinted (its rank a lower bound, its worth unknown), so it can
      answer when the last one picked is done or plain, clean and used before
      ``beyond``, or of a lower priority than any later one.

    Any other policy (its order unknown here): None."""
    if type(policy) is LRUPolicy:

        def key(c: Candidate) -> tuple[float, ...]:
            return float(c.waiting), float(not c.clean), c.last_used

        bound: tuple[float, ...] = (0.0, 0.0, beyond)
    elif type(policy) is WorkflowPolicy:

        def key(c: Candidate) -> tuple[float, ...]:
            return tuple(map(float, WorkflowPolicy.key(c, 0.0)))

        bound = (0.0, float(lowest[0]), float(lowest[1]), 0.0, beyond)
    else:
        return None
    victims = policy.victims(candidates, need)
    by_agent = {c.agent: c for c in candidates}
    if sum(by_agent[v].nbytes for v in victims) < need:
        return None  # the candidates left out might have been picked too
    if victims and not key(by_agent[victims[-1]]) < bound:
        return None
    return victims


def unloaded_victims(
    policy: EvictionPolicy, agents: Sequence[WarmAgent], need: int, beyond: float | None
) -> list[str] | None:
    """A ``WarmVictims``'s answer while the model is unloaded: nothing hot and no hints,
    the policy alone."""
    now, at = time.monotonic(), time.time()
    candidates = cold_candidates(agents, None, Rates(), clock=lambda: now, wall=lambda: at)
    if beyond is None:
        return policy.victims(candidates, need)
    return early_victims(policy, candidates, need, _used_at(beyond, now, at))


class Demotion:
    """Chooses and demotes idle caches to make room, a part of the
    :class:`~kvactor.actors.hot.CachePool`. ``persistent``: a warm tier exists, so a cache
    complete on disk goes warm; any other goes cold.

    Invariant: the only remover of residents for room, and the only writer of
    ``demotions`` and of the demotions in ``moves``; a cache with a turn running, or a
    write due or under way, is never demoted. ``clock`` (monotonic seconds) and ``wall``
    (unix seconds, as the warm tier dates its writes): the times it weighs."""

    def __init__(
        self,
        residents: Residents,
        ledger: Ledger,
        ready: ReadyCopies,
        hints: HintBook,
        rates: Rates,
        policy: EvictionPolicy,
        *,
        persistent: bool,
        moves: MoveLog | None = None,
        write_back: WriteBack | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock, self._wall = clock, wall
        self._residents = residents
        self._ledger = ledger
        self._ready = ready
        self._hints = hints
        self._named = NamedHot(residents, hints)  # the hot agents a hint names
        self._rates = rates
        self.policy = policy
        self.persistent = persistent
        self.demotions = {Tier.WARM: 0, Tier.COLD: 0}
        self.moves = moves if moves is not None else MoveLog()  # each demotion logged
        self.write_back = write_back
        # How often the answer to a demotion came from the shortlist or from all (_victims).
        self.asked = {"shortlist": 0, "all": 0}

    # -- who waits --------------------------------------------------------------------
    def waiting(self, agent: str, entry: HotEntry) -> bool:
        """A turn of it is queued, it was staged for one, or it waits on its tool calls'
        results (within their TTL): a reload would come soon."""
        return self._residents.busy(agent) or entry.staged or entry.tool_waiting(self.clock())

    def _demotable(
        self, exclude: HotEntry | None, among: Iterable[str] | None = None
    ) -> Iterator[tuple[str, HotEntry, int]]:
        """Every cache (of those ``among``, when given) that may be demoted now, with what
        demoting it frees (arrays another cache holds too stay): all but running turns'
        (and ``exclude``), and those whose new tokens are being written or about to be."""
        writing = self._ledger.writing()
        stored = self._ledger.stored()  # what each cache alone holds
        residents = self._residents
        if among is None:
            pairs: Iterable[tuple[str, HotEntry | None]] = residents.items()
        else:
            pairs = ((agent, residents.get(agent)) for agent in among)
        for agent, e in pairs:
            if e is None or e is exclude or e.running or e.write_due or agent in writing:
                continue
            yield agent, e, stored.own(agent) + e.kv.copies_bytes

    def candidates(
        self, exclude: HotEntry | None = None, among: Iterable[str] | None = None
    ) -> list[Candidate]:
        """Every cache that may be demoted now (:meth:`_demotable`; of those ``among``,
        when given), as the policy sees it."""
        now = self.clock()
        rates = self._rates
        out = []
        for agent, e, nbytes in self._demotable(exclude, among):
            # A cache not complete on disk (a cancelled turn's, or one whose write failed)
            # goes cold: its warm copy, if any, is older; under a write budget one that it
            # admits is written as it leaves.
            hinted = self._hints.next_use(agent, now)
            warm = self.persistent and (
                e.clean
                or (
                    self.write_back is not None
                    and self.write_back.admits(e, hinted=hinted is not None, now=now)
                )
            )
            if warm:
                reload_s = nbytes / rates.disk_bytes_s
                if not e.kv.turn_cache.quantized:
                    reload_s += nbytes / rates.dequantize_bytes_s
            else:
                reload_s = len(e.kv.tokens) / rates.prefill_tokens_s
            out.append(
                Candidate(
                    agent=agent,
                    nbytes=nbytes,
                    tokens=len(e.kv.tokens),
                    last_used=e.last_used,
                    hits=e.hits,
                    clean=e.clean,
                    demote_to=Tier.WARM if warm else Tier.COLD,
                    reload_s=reload_s,
                    next_use=e.next_use if hinted is None else hinted,
                    waiting=self.waiting(agent, e),
                    tool_wait=e.tool_waiting(now),
                    priority=self._hints.priority(agent),
                    done=self._hints.done(agent),
                    hinted=hinted is not None,
                )
            )
        return out

    def idle_bytes(self, enough: int | None = None) -> int:
        """What demoting idle caches (no turn queued, staged or awaited) frees now: the
        candidates' bytes, counted without making them, least recently used first a page
        at a time; with ``enough``, the count stops at the first page that reaches it (all
        of them only when they are not enough)."""
        total = start = 0
        while page := self._residents.by_use(start, _PAGE):
            start += len(page)
            agents = (agent for _, agent in page)
            total += sum(
                n for agent, e, n in self._demotable(None, agents) if not self.waiting(agent, e)
            )
            if enough is not None and total >= enough:
                break
        return total

    def _sooner(self, agent: str) -> set[str]:
        """Hot agents a prefetch of ``agent`` must not displace: those hinted to run no
        later than it, or of a higher priority (empty when ``agent`` has no hint)."""
        hints, now = self._hints, self.clock()
        at = hints.next_use(agent, now)
        if at is None:
            return set()
        mine = hints.priority(agent)
        # An agent no hint names has no expected turn and priority 0: of a priority of 0 or
        # more, ``agent`` keeps named ones alone (a few, not every hot agent). Both sets
        # hold hot agents alone.
        others = self._named.agents() if mine >= 0 else self._residents
        return {
            other
            for other in others
            if ((t := hints.next_use(other, now)) is not None and t <= at)
            or hints.priority(other) > mine
        }

    def _ready_order(self, agent: str, entry: HotEntry) -> _ReadyKey:
        """Whose ready copy goes first: not waiting before waiting, low priority first, then
        unhinted least recently used, then hinted furthest first."""
        at = self._hints.next_use(agent, self.clock())
        rank = entry.last_used if at is None else -at
        return self.waiting(agent, entry), self._hints.priority(agent), at is not None, rank

    # -- making room ------------------------------------------------------------------
    def make_room(
        self,
        need: int,
        exclude: HotEntry | None = None,
        *,
        turn: bool = False,
        ahead_of: str | None = None,
    ) -> bool:
        """Demote caches (never ``exclude``) until ``need`` more bytes fit; False (demoting
        nobody) when even demoting every candidate would not make enough room now.

        Only a starting ``turn`` may demote the caches of turns that wait (queued, or staged
        for one): stagings taking them from each other could go on forever, while every
        turn that starts is progress. ``ahead_of``: room for a prefetch of that agent, which
        never displaces an agent hinted to run before it (``_sooner``); while no turn runs
        and such an agent's turn is to come first, it leaves the room a turn took last time
        free for that turn."""
        ledger = self._ledger
        if ledger.limit is None:
            return True
        keep = self._sooner(ahead_of) if ahead_of is not None else set()
        if keep and not any(e.running for e in self._residents.values()):
            need += ledger.turn_room
        missing = ledger.committed() + need - ledger.limit
        if missing <= 0:
            return True
        # Caches that left to be written free their bytes once written: wait for them
        # rather than demote more (under write-back, demoting frees nothing until then).
        missing -= ledger.freeing()
        if missing <= 0:
            return False
        # Ready copies go first (least recently used first, those of waiting turns last):
        # the stored form stays, so bringing one back costs a dequantize, not a reload.
        bets = self._ready.reserved_except(keep) + self._ready.shared.nbytes
        ready = self._ready_copies(exclude, turn=turn, keep=keep, upto=missing - bets)
        copies = sum(self._residents[a].kv.ready_bytes for a in ready)
        candidates = part = short = None
        if bets + copies < missing:  # the copies alone are not room enough: can demoting?
            # Demoting the shortlist's caches after the copies went would free this much
            # (a lower bound of what all would free); if it is not enough, ask all.
            short = self._shortlist()
            part = None if short is None else self._candidates(exclude, turn, keep, short[0])
            if bets + copies + sum(self._past_copy(c) for c in part or ()) < missing:
                candidates = self._candidates(exclude, turn, keep)
                demotable = {c.agent for c in candidates}
                spare = sum(self._residents[a].kv.ready_bytes for a in ready if a not in demotable)
                if bets + spare + sum(c.nbytes for c in candidates) < missing:
                    return False
        # Ready copies being built go first of all (a bet on a turn to come), then built
        # ones, then shared prefixes' copies (each serves every agent sharing it).
        before = missing
        missing -= self._ready.give_up(missing, keep)
        if missing > 0:
            missing -= self._drop_ready(missing, exclude, turn=turn, keep=keep, first=ready)
        if missing > 0:
            missing -= self._ready.shared.drop_copies(missing)
        if missing > 0:
            if missing < before:  # a copy dropped: the candidates' bytes changed
                candidates = part = None
            victims, chosen = self._victims(missing, exclude, turn, keep, candidates, short, part)
            for agent in victims:
                assert agent in chosen, f"the policy chose {agent!r}, not a candidate"
                entry = self._residents.remove(agent)
                assert entry is not None
                self._ready.shared.left(agent)
                self._demoted(agent, entry, chosen[agent])
        return ledger.committed() + need <= ledger.limit

    def _candidates(
        self,
        exclude: HotEntry | None,
        turn: bool,
        keep: Collection[str],
        among: Iterable[str] | None = None,
    ) -> list[Candidate]:
        """The candidates room may be made of (of those ``among``, when given): waiting
        turns' only for a starting ``turn``, none in ``keep``."""
        return [
            c
            for c in self.candidates(exclude, among)
            if (turn or not c.waiting) and c.agent not in keep
        ]

    def _victims(
        self,
        need: int,
        exclude: HotEntry | None,
        turn: bool,
        keep: Collection[str],
        candidates: list[Candidate] | None,
        short: tuple[list[str], float] | None = None,
        part: list[Candidate] | None = None,
    ) -> tuple[list[str], dict[str, Candidate]]:
        """The policy's victims for ``need`` bytes, and the candidates by agent (``short``
        and ``part``: the shortlist and its candidates, when made already). Unless
        ``candidates`` (all of them) are made already, :class:`LRUPolicy` and
        :class:`WorkflowPolicy` are asked first about the :data:`SHORTLIST` least recently used
        caches and the hot ones a hint names (``NamedHot``), whose answer is theirs for all
        when every cache left out would come after the last one picked (``early_victims``:
        each is of the plain rank, used no earlier than the first one left out); else they
        are asked about all."""
        if candidates is None and part is None:
            short = self._shortlist()
            part = None if short is None else self._candidates(exclude, turn, keep, short[0])
        if candidates is None and short is not None and part is not None:
            early = early_victims(self.policy, part, need, short[1])
            if early is not None:
                self.asked["shortlist"] += 1
                return early, {c.agent: c for c in part}
        if candidates is None:
            candidates = self._candidates(exclude, turn, keep)
        self.asked["all"] += 1
        return self.policy.victims(candidates, need), {c.agent: c for c in candidates}

    def _shortlist(self) -> tuple[list[str], float] | None:
        """The caches to ask about first (:meth:`_victims`): those a hint names and the
        :data:`SHORTLIST` least recently used of the others, and the last use of the first one
        left out (every other was used then or later); None when all are to be asked (a
        policy whose order is not known here, or no more caches than that)."""
        residents, short = self._residents, SHORTLIST
        if len(residents) <= short:
            return None
        if type(self.policy) not in (LRUPolicy, WorkflowPolicy):
            return None
        named = self._named.agents()
        plain: list[str] = []
        start = 0
        while page := residents.by_use(start, _PAGE):
            start += len(page)
            for at, agent in page:
                if agent in named:
                    continue
                if len(plain) == short:
                    # In the residents' order, as when all are asked: a policy keeps it
                    # among ties.
                    return residents.in_order(named.union(plain)), at
                plain.append(agent)
        return None  # all of them were read

    def _past_copy(self, c: Candidate) -> int:
        """What demoting ``c`` frees once its ready copy has gone."""
        return c.nbytes - self._residents[c.agent].kv.ready_bytes

    def _ready_copies(
        self,
        exclude: HotEntry | None,
        *,
        turn: bool,
        keep: Collection[str] = (),
        upto: int | None = None,
    ) -> list[str]:
        """The agents whose ready copies may go for room, first to go first
        (:meth:`_ready_order`): not running, not ``exclude``'s, waiting turns' only for a
        starting ``turn``, none in ``keep``. With ``upto``, only the first ones whose copies
        hold ``upto`` bytes (all of them when they hold less).

        Agents no hint names come from the residents' ready order (least recently used
        first), a page at a time; the hot ones a hint names (``NamedHot``) are ordered
        apart and merged in. So the work grows with the copies taken and the hot agents
        named, not with the agents hot or the agents the hints name in other tiers."""
        residents, named = self._residents, self._named.agents()

        def may(agent: str, e: HotEntry) -> bool:
            return e is not exclude and not e.running and agent not in keep

        apart: list[tuple[_ReadyKey, str]] = []
        later: list[tuple[_ReadyKey, str]] = []  # waiting turns' (a starting turn's only)
        for agent in named:
            e = residents.get(agent)
            if e is not None and e.kv.ready is not None and may(agent, e):
                order = self._ready_order(agent, e)
                if not order[0]:
                    apart.append((order, agent))
                elif turn:
                    later.append((order, agent))
        apart.sort()

        def plain() -> Iterator[tuple[_ReadyKey, str]]:
            start = 0
            while page := residents.by_use(start, _PAGE, ready=True):
                start += len(page)
                for _, agent in page:
                    e = residents[agent]
                    if agent in named or not may(agent, e):
                        continue
                    if not self.waiting(agent, e):
                        yield (False, 0, False, e.last_used), agent
                    elif turn:
                        later.append(((True, 0, False, e.last_used), agent))

        def waiting_last() -> Iterator[tuple[_ReadyKey, str]]:
            yield from sorted(later)  # complete once plain() is spent

        out: list[str] = []
        held = 0
        for _, agent in itertools.chain(heapq.merge(plain(), apart), waiting_last()):
            if upto is not None and held >= upto:
                break
            out.append(agent)
            if upto is not None:
                held += residents[agent].kv.ready_bytes
        return out

    def _drop_ready(
        self,
        need: int,
        exclude: HotEntry | None,
        *,
        turn: bool,
        keep: Collection[str] = (),
        first: list[str] | None = None,
    ) -> int:
        """Drop ready copies in :meth:`_ready_copies`' order until ``need`` bytes are freed
        (or none is left), starting with ``first`` (the head of that order, listed
        already); the bytes freed."""
        freed = 0
        pending = first or []
        while freed < need:
            agents = pending or self._ready_copies(exclude, turn=turn, keep=keep, upto=need - freed)
            pending = []
            if not agents:
                break
            for agent in agents:
                if freed >= need:
                    break
                freed += self._ready.drop(self._residents[agent].kv)
        return freed

    def drop_ready(self, need: int, exclude: HotEntry | None = None) -> int:
        """Drop idle agents' ready copies (no turn of theirs waits), in the order room is
        made, until ``need`` bytes are freed; demotes nobody. The bytes freed."""
        return self._drop_ready(need, exclude, turn=False)

    def _demoted(self, agent: str, entry: HotEntry, victim: Candidate) -> None:
        """Count and log ``agent``'s demotion (out of the residents now); a dirty cache the
        write budget admitted goes to its agent to write (its pin holds the unwritten
        ranges until then), or cold when the budget no longer has room for it."""
        to = victim.demote_to
        back = self.write_back
        if back is not None and not victim.clean:
            if to is Tier.WARM and not back.send(agent, entry):
                to = Tier.COLD
            if to is Tier.COLD:
                back.went_cold()
        self.demotions[to] += 1
        self.moves.demoted(agent, to, victim.nbytes)

    def cold_victims(self, asked: WarmVictims) -> list[str] | AskWith | None:
        """Which of the warm agents ``asked`` about go cold on disk first
        (:meth:`choose_cold`); a hot idle one may: it stays hot, and its hot entry learns
        that nothing of it is on disk any more (its next write is whole, and it is never
        demoted as if it had a copy). One not hot loses its done mark
        (``HintBook.went_cold``)."""
        victims = self.choose_cold(asked)
        if not isinstance(victims, list):
            return victims
        for agent in victims:
            entry = self._residents.get(agent)
            if entry is not None:
                entry.warm_copy_gone()
            else:
                self._hints.went_cold(agent)
        return victims

    def choose_cold(self, asked: WarmVictims) -> list[str] | AskWith | None:
        """Which of the warm agents ``asked`` about would go cold first for its ``need``
        bytes (the policy's order, with the hints), changing nothing. Never one staged,
        busy or being written. With ``beyond`` (only the least recently written asked
        about: see ``WarmVictims``, ``checked`` and ``held_back`` too), an ``AskWith``
        naming the agents left out that the hints rank first, or None when the answer
        could differ with them."""
        agents, need, beyond = asked.agents, asked.need, asked.beyond
        writing = self._ledger.writing()
        idle = []
        hot: dict[str, float] = {}  # a hot one's last use is its last turn, not its write
        for a in agents:
            entry = self._residents.get(a.agent)
            if self._residents.busy(a.agent) or self._ledger.staged(a.agent):
                continue
            if entry is not None:
                if entry.staged or entry.write_due or a.agent in writing:
                    continue
                hot[a.agent] = entry.last_used
            idle.append(a)
        now, at = self.clock(), self._wall()
        candidates = cold_candidates(
            idle, self._hints, self._rates, clock=lambda: now, wall=lambda: at, hot=hot
        )
        if beyond is None:
            return self.policy.victims(candidates, need)
        # A warm agent left out is used no earlier than its write, or than its last turn
        # if it is hot (each hot one counted, whether warm or not).
        given = {a.agent for a in agents}.union(asked.checked)
        first = min(_used_at(beyond, now, at), self._first_use(given))
        lowest = self._hints.lowest_rank(given)
        if asked.held_back:  # the answer must stop short of them too: the lower bound
            held = self._held_bound(asked.held_back, asked.held_beyond, now, at)
            lowest, first = min((lowest, first), held)
        early = early_victims(self.policy, candidates, need, first, lowest)
        if early is None and lowest < PLAIN_RANK and type(self.policy) is WorkflowPolicy:
            # Agents left out that the hints put first (done, or of a lower priority): the
            # answer with them is told from them and these, not from every agent.
            named = self._hints.below_plain(given)
            if named:  # none: those held back stood in the way, ask all
                return AskWith(tuple(named))
        return early

    def _first_use(self, skip: Collection[str]) -> float:
        """The earliest last use of a hot agent not in ``skip`` (inf: none), read from the
        residents' order by use: a page or two past those skipped, not every resident."""
        start = 0
        while page := self._residents.by_use(start, _PAGE):
            for used, agent in page:
                if agent not in skip:
                    return used
            start += len(page)
        return math.inf

    def _held_bound(
        self, agents: Collection[str], written: float, now: float, at: float
    ) -> tuple[tuple[int, int], float]:
        """The lowest rank of the warm ``agents`` left out though named (``held_back``),
        and the earliest each may have been used: at its write (``written`` or later), or its
        last turn where it is hot."""
        first = _used_at(written, now, at)
        for agent in agents:
            entry = self._residents.get(agent)
            if entry is not None:
                first = min(first, entry.last_used)
        return min(self._hints.rank(a) for a in agents), first

    def check(self) -> None:
        """Debug check: the hot agents it asks about apart are those the hints name."""
        self._named.check()

    def stuck(self, exclude: HotEntry | None = None) -> bool:
        """Nothing is on its way to free room: no running turn (but ``exclude``'s), no write,
        staging, export or ready copy being built about to end. A request that does not
        fit now never will."""
        others = (e for e in self._residents.values() if e is not exclude)
        return not (
            any(e.running or e.write_due for e in others)
            or self._ledger.pending
            or self._ready.building
        )
