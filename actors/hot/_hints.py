"""Hints from the application: which agents run next and in what order, when an agent's next
turn is expected, how much an agent matters, and which agents are done for now.

The hot tier's owner (the engine's :class:`~kvactor.actors.pool.CachePool`) keeps them in a
:class:`HintBook` and hands them to its policy as each candidate's ``next_use``,
``priority`` and ``done`` (:class:`~kvactor.actors.policy.Candidate`). Hints are advice: a
wrong or missing hint changes which caches stay hot and so how long a turn waits, never
what a turn answers. An agent's expectation ends when its next turn is queued, or when it
is long overdue (then the agent is ranked as if unhinted again).

A place in a ``next`` order is kept as a count of turns, not as a time: the agent at place
``p`` is expected once ``p + 1`` more turns have been queued (a hint usually comes just
before a turn of the agent that gives it, which counts), so an order given once still
ranks its agents rightly while turns take ten times longer than the last ones did, or
while nothing runs (a time made of the place and the average turn, as before, expired it
within a few slow turns, or after 10 s of waiting).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from ..ids import check_agent_id
from ..messages import Hint
from ._change_feed import ChangeFeed, ChangeFeeds

__all__ = ("PLAIN_RANK", "PRIORITY_LIMIT", "HintBook", "make_hint", "split_hint")

#: Priorities lie in [-PRIORITY_LIMIT, PRIORITY_LIMIT]; 0 is every agent's default.
PRIORITY_LIMIT = 1000
#: Agents a HintBook keeps each kind of hint for (the oldest hints go past it): hints may
#: name agents that never run, and a server takes them from its clients.
BOOK_LIMIT = 10_000
_MAX_WAIT_S = 86_400.0
#: Turns past twice the turns to its place that a ``next`` hint's agent is still awaited
#: (an agent at place 10, expected 11 turns on, is forgotten after 26 turns).
GRACE_TURNS = 4
#: ``HintBook.rank`` of an agent no priority or done hint names.
PLAIN_RANK = (0, 1)


def make_hint(
    next: Sequence[str] = (),
    *,
    expect_in_s: Mapping[str, float] | None = None,
    priority: Mapping[str, int] | None = None,
    done: Sequence[str] = (),
) -> Hint:
    """A checked :class:`Hint`. Raises InvalidAgentId for an unsafe agent id, TypeError for
    a str where a list of agents belongs or a value of the wrong type, ValueError for a
    time outside [0, 86400] seconds or a priority outside [-1000, 1000]."""
    for name, agents in (("next", next), ("done", done)):
        if isinstance(agents, str):
            raise TypeError(f"{name} must be a list of agent ids, not a str")
    waits: list[tuple[str, float]] = []
    for agent, seconds in (expect_in_s or {}).items():
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(f"expect_in_s[{agent!r}] must be a number of seconds")
        if not (math.isfinite(seconds) and 0 <= seconds <= _MAX_WAIT_S):
            raise ValueError(f"expect_in_s[{agent!r}] must be in [0, 86400], got {seconds}")
        waits.append((check_agent_id(agent), float(seconds)))
    ranks: list[tuple[str, int]] = []
    for agent, value in (priority or {}).items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"priority[{agent!r}] must be an int")
        if not -PRIORITY_LIMIT <= value <= PRIORITY_LIMIT:
            raise ValueError(f"priority[{agent!r}] must be in [-1000, 1000], got {value}")
        ranks.append((check_agent_id(agent), value))
    return Hint(
        next=tuple(check_agent_id(a) for a in next),
        expect_in_s=tuple(waits),
        priority=tuple(ranks),
        done=tuple(check_agent_id(a) for a in done),
    )


def split_hint(hint: Hint, where: Mapping[str, str], default: str | None = None) -> dict[str, Hint]:
    """``hint`` in parts by the host (``where``: agent -> host) that holds each agent it
    names, each part keeping its agents' order; agents held nowhere go to ``default``
    (None: they are left out)."""
    parts: dict[str, dict[str, list[Any]]] = {}

    def part(agent: str) -> dict[str, list[Any]] | None:
        host = where.get(agent, default)
        if host is None:
            return None
        return parts.setdefault(host, {"next": [], "wait": [], "rank": [], "done": []})

    for agent in hint.next:
        if (p := part(agent)) is not None:
            p["next"].append(agent)
    for field, pairs in (("wait", hint.expect_in_s), ("rank", hint.priority)):
        for pair in pairs:
            if (p := part(pair[0])) is not None:
                p[field].append(pair)
    for agent in hint.done:
        if (p := part(agent)) is not None:
            p["done"].append(agent)
    return {
        host: Hint(tuple(p["next"]), tuple(p["wait"]), tuple(p["rank"]), tuple(p["done"]))
        for host, p in parts.items()
    }


class HintBook:
    """The hints in force, per agent, the turns queued, and how long a turn takes (what
    turns a count of turns still to come into a time). Invariant: only the CachePool writes
    it (on the engine's thread); a policy sees it through the candidates."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}  # agent -> time.monotonic() of its expected turn
        # agent -> (the count of turns queued at which its turn is expected, the count past
        # which it is overdue): its place in a ``next`` order. An agent is in at most one of
        # _at and _placed (the later hint wins).
        self._placed: dict[str, tuple[int, int]] = {}
        self._turns = 0  # turns queued (``queued``)
        self._priority: dict[str, int] = {}
        self._done: dict[str, None] = {}  # an ordered set: the oldest go first past the limit
        # The agents whose ``rank`` is below the plain one, and those holding each such
        # rank, but those in ``_away``: agents that went cold, in no tier to rank in (an
        # ordered set: past the limit the oldest count again, which only errs towards
        # asking all).
        self._low: dict[str, None] = {}
        self._ranks: dict[tuple[int, int], set[str]] = {}
        self._away: dict[str, None] = {}
        self.turn_s = 1.0  # moving average of a turn's time, queued to ended
        self.given = 0  # hints applied
        # Each reader's agents whose being named (``is_named``) may have changed since it
        # last looked (see ChangeFeed).
        self._feeds = ChangeFeeds()

    def apply(self, hint: Hint, now: float) -> None:
        """Take ``hint`` at ``now`` (later hints about an agent replace earlier ones)."""
        self.given += 1
        done = self._done
        # A hint may name every agent: an agent not done is passed over without ranking it
        # again (641 agents a step did that in bench/replay.py at 1,000 agents).
        at, placed, turns = self._at, self._placed, self._turns
        for place, agent in enumerate(hint.next):
            was = at.pop(agent, None) is not None
            if placed.pop(agent, None) is None and not was:  # re-inserted: the newest last
                self._note(agent)  # named now (an agent named already is not noted again)
            placed[agent] = (turns + place + 1, turns + 2 * (place + 1) + GRACE_TURNS)
            if agent in done:
                self._set_done(agent, False)
        for agent, seconds in hint.expect_in_s:
            was = placed.pop(agent, None) is not None
            if at.pop(agent, None) is None and not was:
                self._note(agent)
            at[agent] = now + seconds
            if agent in done:
                self._set_done(agent, False)
        for agent, value in hint.priority:
            self._set_priority(agent, value)
        for agent in hint.done:  # named still: by its done mark
            at.pop(agent, None)
            placed.pop(agent, None)
            self._set_done(agent, True)
        for book in (at, placed):
            while len(book) > BOOK_LIMIT:
                agent = next(iter(book))
                del book[agent]
                self._note(agent)
        while len(self._priority) > BOOK_LIMIT:
            self._set_priority(next(iter(self._priority)), 0)
        while len(self._done) > BOOK_LIMIT:
            self._set_done(next(iter(self._done)), False)

    def _set_priority(self, agent: str, value: int) -> None:
        before = self._counted(agent)
        if value:
            if agent not in self._priority:
                self._note(agent)
            self._priority[agent] = value
        elif self._priority.pop(agent, None) is not None:
            self._note(agent)
        self._reranked(agent, before)

    def _set_done(self, agent: str, done: bool) -> None:
        before = self._counted(agent)
        if done:
            if agent not in self._done:
                self._done[agent] = None  # one already done keeps its place
                self._note(agent)
        elif agent in self._done:
            del self._done[agent]
            self._note(agent)
        self._reranked(agent, before)

    # -- who is named, for readers that index it ----------------------------------------
    def feed(self) -> ChangeFeed:
        """A new reader's feed of the agents whose being named (:meth:`is_named`) may
        have changed, every agent named now noted in it."""
        return self._feeds.open(self.named())

    def _note(self, agent: str) -> None:
        self._feeds.note(agent)

    def is_named(self, agent: str) -> bool:
        """``agent`` has an expected turn (an overdue one too), a priority other than 0
        or a done mark: :meth:`named` holds it."""
        return (
            agent in self._placed
            or agent in self._at
            or agent in self._priority
            or agent in self._done
        )

    def _counted(self, agent: str) -> tuple[int, int]:
        return PLAIN_RANK if agent in self._away else self.rank(agent)

    def _reranked(self, agent: str, before: tuple[int, int]) -> None:
        after = self._counted(agent)
        if after == before:
            return
        if before < PLAIN_RANK:
            holders = self._ranks[before]
            holders.discard(agent)
            if not holders:
                del self._ranks[before]
        if after < PLAIN_RANK:
            self._ranks.setdefault(after, set()).add(agent)
            self._low[agent] = None
        else:
            self._low.pop(agent, None)

    def rank(self, agent: str) -> tuple[int, int]:
        """``(priority, 0 if done else 1)``: what orders ``agent`` before any time does, in
        :class:`~kvactor.actors.hot.WorkflowPolicy`, but for a hint of its next turn (which
        puts it after every plain agent of its priority). An agent no hint names has
        ``PLAIN_RANK``."""
        return self._priority.get(agent, 0), 0 if agent in self._done else 1

    def below_plain(self, excluding: Collection[str] = ()) -> list[str]:
        """The agents ``lowest_rank`` counts below the plain rank (done, or of a priority
        below 0), but those in ``excluding``: the ones a policy with the hints puts before
        every agent no hint names."""
        return [a for a in self._low if a not in excluding]

    def lowest_rank(self, excluding: AbstractSet[str] = frozenset()) -> tuple[int, int]:
        """The lowest ``rank`` any agent but those in ``excluding`` may have in a tier,
        agents no hint names counted (``PLAIN_RANK``), agents that went cold not
        (``went_cold``): a subset test per rank in use, lowest first, each stopping at the
        first holder not excluded (the store's re-ask excludes every done agent it checked:
        thousands, tested in C, not read one by one in Python)."""
        for rank in sorted(self._ranks):
            if not self._ranks[rank].issubset(excluding):
                return rank
        return PLAIN_RANK

    def queued(self, agent: str) -> None:
        """A turn of ``agent`` was queued: what was expected of it came (or came early),
        and every place in a ``next`` order is a turn nearer."""
        self._turns += 1
        was = self._at.pop(agent, None) is not None
        if self._placed.pop(agent, None) is not None or was:
            self._note(agent)
        self._set_done(agent, False)
        self._set_away(agent, False)  # back in a tier: its priority counts again

    def went_cold(self, agent: str) -> None:
        """``agent`` is leaving the warm tier, not hot: in no tier to rank in until its
        next turn (``queued``), so that ``lowest_rank`` leaves it out. Its done mark has
        done its work (it ranked it first to go): dropped, as its next turn would. Its
        priority stays for that turn. (An import comes back through ``forget``; a cold
        demotion that failed leaves it out until its next turn, so that the first agents
        asked may then answer as if it were cold.)"""
        self._set_done(agent, False)
        self._set_away(agent, True)
        while len(self._away) > BOOK_LIMIT:
            self._set_away(next(iter(self._away)), False)

    def _set_away(self, agent: str, away: bool) -> None:
        before = self._counted(agent)
        self._away.pop(agent, None)
        if away:
            self._away[agent] = None  # the newest last
        self._reranked(agent, before)

    def turn_took(self, seconds: float) -> None:
        if seconds > 0:
            self.turn_s = 0.7 * self.turn_s + 0.3 * seconds

    def forget(self, agent: str) -> None:
        """``agent`` is gone: every hint about it goes too."""
        self._at.pop(agent, None)
        self._placed.pop(agent, None)
        self._note(agent)
        self._set_priority(agent, 0)
        self._set_done(agent, False)
        self._set_away(agent, False)

    def _grace(self) -> float:
        """How long past its expected time a turn is still awaited."""
        return max(10.0, 4 * self.turn_s)

    def _place_time(self, expected: int, now: float) -> float:
        """A place expected at the ``expected``-th turn queued, as a time: ``now`` plus the
        turns still to come before it at the average turn's time (a place passed: now)."""
        return now + max(expected - self._turns, 0) * self.turn_s

    def next_use(self, agent: str, now: float) -> float | None:
        """When ``agent``'s next turn is expected (None: no hint, or one long overdue): for
        a place in a ``next`` order, ``now`` plus the turns still to come before it at the
        average turn's time."""
        placed = self._placed.get(agent)
        if placed is not None:
            expected, late = placed
            if self._turns > late:
                del self._placed[agent]  # overdue: the hint was wrong, rank it as unhinted
                self._note(agent)
                return None
            return self._place_time(expected, now)
        at = self._at.get(agent)
        if at is not None and now > at + self._grace():
            del self._at[agent]  # overdue: the hint was wrong, rank it as unhinted
            self._note(agent)
            return None
        return at

    def priority(self, agent: str) -> int:
        return self._priority.get(agent, 0)

    def named(self) -> set[str]:
        """The agents with an expected turn (overdue ones too), a priority other than 0 or
        a done mark: those a hint may rank apart from the agents no hint names."""
        return self._at.keys() | self._placed.keys() | self._priority.keys() | self._done.keys()

    def done(self, agent: str) -> bool:
        return agent in self._done

    def soonest(self, now: float, count: int) -> list[str]:
        """Up to ``count`` hinted agents, soonest expected first (overdue ones dropped).
        One pass over the book, not a sort of it: it is asked at every hint."""
        grace, turns = self._grace(), self._turns
        for agent in [a for a, at in self._at.items() if now > at + grace]:
            del self._at[agent]
            self._note(agent)
        for agent in [a for a, (_, late) in self._placed.items() if turns > late]:
            del self._placed[agent]
            self._note(agent)
        # The soonest places first, by the turn each was expected at (a C-level key: 3.8x
        # faster than a time made for each of 10,000 places), then as times among the
        # expected times (a place already passed counts as now).
        soon = heapq.nsmallest(count, self._placed.items(), key=operator.itemgetter(1))
        placed = ((self._place_time(e, now), a) for a, (e, _) in soon)
        timed = ((at, a) for a, at in self._at.items())
        return [a for _, a in heapq.nsmallest(count, itertools.chain(timed, placed))]
