"""Hints from the application: which agents run next and in what order, when an agent's next
turn is expected, how much an agent matters, and which agents are done for now.

The hot tier's owner (the engine's :class:`~kvactor.actors.pool.CachePool`) keeps them in a
:class:`HintBook` and hands them to its policy as each candidate's ``next_use``,
``priority`` and ``done`` (:class:`~kvactor.actors.policy.Candidate`). Hints are advice: a
wrong or missing hint changes which caches stay hot and so how long a turn waits, never
what a turn answers. An agent's expectation ends when its next turn is queued, or when it
is long overdue (then the agent is ranked as if unhinted again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..ids import check_agent_id
from ..messages import Hint

__all__ = ("HintBook", "PRIORITY_LIMIT", "make_hint", "split_hint")

#: Priorities lie in [-PRIORITY_LIMIT, PRIORITY_LIMIT]; 0 is every agent's default.
PRIORITY_LIMIT = 1000
#: Agents a HintBook keeps each kind of hint for (the oldest hints go past it): hints may
#: name agents that never run, and a server takes them from its clients.
BOOK_LIMIT = 10_000
_MAX_WAIT_S = 86_400.0


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
    """The hints in force, per agent, and how long a turn takes (what turns a place in a
    ``next`` order into a time). Invariant: only the CachePool writes it (on the engine's
    thread); a policy sees it through the candidates."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}  # agent -> time.monotonic() of its expected turn
        self._priority: dict[str, int] = {}
        self._done: dict[str, None] = {}  # an ordered set: the oldest go first past the limit
        self.turn_s = 1.0  # moving average of a turn's time, queued to ended
        self.given = 0  # hints applied

    def apply(self, hint: Hint, now: float) -> None:
        """Take ``hint`` at ``now`` (later hints about an agent replace earlier ones)."""
        self.given += 1
        for rank, agent in enumerate(hint.next):
            self._at.pop(agent, None)  # re-inserted: the newest last
            self._at[agent] = now + rank * self.turn_s
            self._done.pop(agent, None)
        for agent, seconds in hint.expect_in_s:
            self._at.pop(agent, None)
            self._at[agent] = now + seconds
            self._done.pop(agent, None)
        for agent, value in hint.priority:
            if value:
                self._priority[agent] = value
            else:
                self._priority.pop(agent, None)
        for agent in hint.done:
            self._at.pop(agent, None)
            self._done[agent] = None
        for book in (self._at, self._priority, self._done):
            while len(book) > BOOK_LIMIT:
                del book[next(iter(book))]

    def queued(self, agent: str) -> None:
        """A turn of ``agent`` was queued: what was expected of it came (or came early)."""
        self._at.pop(agent, None)
        self._done.pop(agent, None)

    def turn_took(self, seconds: float) -> None:
        if seconds > 0:
            self.turn_s = 0.7 * self.turn_s + 0.3 * seconds

    def forget(self, agent: str) -> None:
        """``agent`` is gone: every hint about it goes too."""
        self._at.pop(agent, None)
        self._priority.pop(agent, None)
        self._done.pop(agent, None)

    def next_use(self, agent: str, now: float) -> float | None:
        """When ``agent``'s next turn is expected (None: no hint, or one long overdue)."""
        at = self._at.get(agent)
        if at is not None and now > at + max(10.0, 4 * self.turn_s):
            del self._at[agent]  # overdue: the hint was wrong, rank it as unhinted
            return None
        return at

    def priority(self, agent: str) -> int:
        return self._priority.get(agent, 0)

    def done(self, agent: str) -> bool:
        return agent in self._done

    def soonest(self, now: float, count: int) -> list[str]:
        """Up to ``count`` hinted agents, soonest expected first (overdue ones dropped)."""
        live = [(at, a) for a in list(self._at) if (at := self.next_use(a, now)) is not None]
        return [a for _, a in sorted(live)[:count]]
