"""What happened lately, for the dashboard: a bounded log of events (turns with their
path, TTFT and decode rate; caches leaving the hot tier and warm caches reloaded into
it; hints) and each agent's last turn and hint. Never a prompt's or an answer's text:
only figures and agent ids.

Whoever sees turns end feeds it (the server's routes, ``kvactor run``'s events); the
dashboard's sampler hands it the hot tiers' own logs of moves (:meth:`Activity.moved`),
each demotion and reload as the engine made it, however fast they came. It keeps at
most ``max_events`` events and ``max_agents`` agents' last turns (the least recently
seen go first): its size is bounded however long a server runs."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..actors.enums import Tier
from ..actors.records import Completion, TierMoves

__all__ = ("Activity", "TurnSeen")

MAX_EVENTS = 2000
MAX_AGENTS = 100_000


@dataclass(frozen=True)
class TurnSeen:
    """One finished turn as the dashboard shows it: its agent (the session's id), the
    tier its cache came from (``hot``, ``warm``, ``cold``; ``prefetched``: hot because a
    prefetch staged it), and its figures."""

    agent: str
    path: str
    ttft_s: float
    decode_tok_s: float
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int

    @classmethod
    def of(cls, agent: str, done: Completion, prefetched: bool = False) -> TurnSeen:
        """The turn ``done`` of ``agent``."""
        t = done.timings
        path = "prefetched" if prefetched and done.path == Tier.HOT else str(done.path)
        return cls(
            agent=agent,
            path=path,
            ttft_s=t.ttft_s,
            decode_tok_s=t.decode_tok_s,
            prompt_tokens=t.prompt_tokens,
            reused_tokens=t.reused_tokens,
            generated_tokens=t.generated_tokens,
        )


class Activity:
    """The recent events and each agent's last turn and hint (see the module doc)."""

    def __init__(self, max_events: int = MAX_EVENTS, max_agents: int = MAX_AGENTS) -> None:
        # Invariant: only this class's methods write these; ``seq`` numbers every event
        # ever recorded (the events' ``seq``), so a reader asks for what came after one.
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._last: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._hints: OrderedDict[str, str] = OrderedDict()
        self._max_agents = max_agents
        self.seq = 0
        self.turns = 0
        self.moves_lost = 0  # moves that left a hot tier's log before they were read

    def _add(self, kind: str, agent: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        when = time.time() if t is None else t
        event = {"seq": self.seq, "t": when, "kind": kind, "agent": agent, **fields}
        self._events.append(event)
        return event

    def _remember(self, table: OrderedDict[str, Any], agent: str, value: Any) -> None:
        table[agent] = value
        table.move_to_end(agent)
        while len(table) > self._max_agents:
            table.popitem(last=False)

    def turn(self, seen: TurnSeen) -> None:
        """A turn ended: an event (``reprefill``: a cold turn of an agent that had turns
        before, whose cache was lost) and the agent's last turn."""
        fields = asdict(seen)
        agent = fields.pop("agent")
        fields["reprefill"] = seen.path == "cold" and agent in self._last
        event = self._add("turn", agent, **fields)
        self.turns += 1
        self._remember(self._last, agent, event)

    def hinted(self, agent: str, hint: str) -> None:
        """The application hinted ``agent`` (``hint`` as people read it: "next",
        "in 5 s", "priority 2", "done")."""
        self._remember(self._hints, agent, hint)

    def moved(self, moves: Mapping[str, TierMoves]) -> None:
        """New moves of each model's hot tier or warm tier (by model name), as its log
        numbered them: an event per move, at the time it was made. ``demoted`` (``to``
        warm or cold, ``bytes`` freed; ``from`` warm for an agent the warm tier made
        cold, else hot) or ``reloaded`` (a warm cache installed, ``bytes`` of it,
        ``source`` ``prefetch`` or ``turn``)."""
        for model, part in moves.items():
            self.moves_lost += part.lost
            for m in part.moves:
                if m.kind == "demoted":
                    where = m.source or "hot"
                    self._add(
                        "demoted",
                        m.agent,
                        m.t,
                        to=m.tier,
                        bytes=m.nbytes,
                        model=model,
                        **{"from": where},
                    )
                else:
                    self._add(
                        "reloaded", m.agent, m.t, source=m.source, bytes=m.nbytes, model=model
                    )

    def last_turn(self, agent: str) -> dict[str, Any] | None:
        """``agent``'s last turn event (None: none seen)."""
        return self._last.get(agent)

    def hint(self, agent: str) -> str | None:
        """The last hint about ``agent`` (None: none)."""
        return self._hints.get(agent)

    def events(
        self, owns: Callable[[str], bool], since: int = 0, limit: int = 500
    ) -> list[dict[str, Any]]:
        """The last ``limit`` events after ``since`` of the agents ``owns`` says yes to,
        oldest first."""
        out: list[dict[str, Any]] = []
        for event in reversed(self._events):
            if event["seq"] <= since or len(out) >= limit:
                break
            if owns(event["agent"]):
                out.append(event)
        out.reverse()
        return out
