"""Seeded multi-agent tool-loop traces for ``bench/agentic.py``, and the oracle policy that
knows a trace's future.

A trace is N agents with one shared system prompt plus a role each (said in the agent's
first message), and a list of steps: an agent's turn whose message adds a tool result or a
message of a sampled length, and which may end in a tool call (its agent then waits for a
sampled time). Three shapes:

- ``round_robin``: a team speaks in turn, round after round;
- ``pipeline``: a planner, then each worker, then a reviewer, again and again;
- ``fanout``: a coordinator hands out work, every worker answers, the coordinator merges.

And ``pressure`` (:func:`make_pressure_trace`), where the memory policy decides: every agent
has a private context of its own (a document, tool outputs), so the caches do not fit the
tiers. A team takes turns round after round; between their turns, one-shot subagents
(each with a larger document: a file read, a search result) run a short tool loop and are
done.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvactor.actors.hot import Candidate

SHAPES = ("round_robin", "pipeline", "fanout")
PRESSURE = "pressure"

_SENTENCE = (
    "file parser cache token budget agent worker result review plan error test queue "
    "latency memory index schema request reply branch merge commit build deploy metric "
    "vector batch thread socket buffer record field value input output config module"
)
_WORDS = tuple(_SENTENCE.split(" "))


@dataclass(frozen=True)
class Step:
    """One turn: ``agent`` reads ``text`` (a tool result or a message); with
    ``tool_wait_s`` > 0 its turn ends in a tool call it waits that long for."""

    agent: str
    text: str
    tool_wait_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    shape: str
    system: str
    roles: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    # An agent's private context (its first message, before its first step), prefilled
    # once for a whole bench and carried into each replay: none in the first three shapes.
    docs: dict[str, str] = field(default_factory=dict)

    @property
    def agents(self) -> list[str]:
        return list(self.roles)

    @property
    def order(self) -> list[str]:
        return [s.agent for s in self.steps]


def _text(rng: random.Random, words: int, kind: str) -> str:
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"{kind}: {body}."


def _order(shape: str, agents: list[str], rounds: int) -> list[str]:
    if shape == "round_robin":
        return [a for _ in range(rounds) for a in agents]
    if shape == "pipeline":  # planner -> workers -> reviewer
        planner, *workers, reviewer = agents
        return [a for _ in range(rounds) for a in (planner, *workers, reviewer)]
    if shape == "fanout":  # coordinator -> every worker -> coordinator merges
        coordinator, *workers = agents
        return [a for _ in range(rounds) for a in (coordinator, *workers, coordinator)]
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def make_trace(
    shape: str,
    *,
    agents: int,
    rounds: int,
    seed: int,
    words: tuple[int, int] = (30, 500),
    system_words: int = 120,
    tool_p: float = 0.4,
    tool_wait_s: tuple[float, float] = (0.5, 5.0),
) -> Trace:
    """A seeded trace of ``shape`` for ``agents`` agents over ``rounds`` rounds; each step
    adds ``words`` (a range) words, ends in a tool call with probability ``tool_p``,
    waiting a log-uniform time in ``tool_wait_s``. Raises ValueError for an unknown shape
    or fewer than 3 agents."""
    if agents < 3:
        raise ValueError("a trace needs at least 3 agents")
    rng = random.Random(seed)
    names = [f"{shape[:2]}{i:02d}" for i in range(agents)]
    system = "You are one of a team of agents. " + _text(rng, system_words, "Shared brief")
    roles = {n: f"Your role: {_text(rng, 12, n)}" for n in names}
    steps: list[Step] = []
    waiting: set[str] = set()
    lo, hi = tool_wait_s
    for agent in _order(shape, names, rounds):
        kind = "Tool result" if agent in waiting else "Message"
        waiting.discard(agent)
        text = _text(rng, rng.randint(*words), kind)
        if all(s.agent != agent for s in steps):
            text = f"{roles[agent]}\n{text}"
        wait = 0.0
        if rng.random() < tool_p:
            wait = math.exp(rng.uniform(math.log(lo), math.log(hi)))
            waiting.add(agent)
        steps.append(Step(agent, text, wait))
    return Trace(shape, system, roles, steps)


def make_pressure_trace(
    *,
    team: int,
    subagents: int,
    rounds: int,
    seed: int,
    team_doc_words: tuple[int, int],
    sub_doc_words: tuple[int, int],
    step_words: tuple[int, int],
    system_words: int = 120,
    tool_wait_s: tuple[float, float] = (0.5, 5.0),
) -> Trace:
    """A seeded ``pressure`` trace: ``team`` agents (documents of ``team_doc_words``) take
    a step each, in turn, for ``rounds`` rounds; ``subagents`` one-shot agents (documents of
    ``sub_doc_words``) are spread over the team's steps, each right after one: a tool loop
    of 1-3 steps (every step but its last ends in a tool call) and then never again. Steps
    add ``step_words`` words each. Raises ValueError for fewer than 2 team agents or no
    round."""
    if team < 2 or rounds < 1 or subagents < 0:
        raise ValueError("a pressure trace needs 2 or more team agents and 1 or more rounds")
    rng = random.Random(seed)
    crew = [f"te{i:02d}" for i in range(team)]
    subs = [f"su{i:02d}" for i in range(subagents)]
    system = "You are one of a team of agents. " + _text(rng, system_words, "Shared brief")
    roles = {n: f"Your role: {_text(rng, 12, n)}" for n in crew + subs}
    docs = {n: _text(rng, rng.randint(*team_doc_words), "Document") for n in crew}
    docs |= {n: _text(rng, rng.randint(*sub_doc_words), "Tool output") for n in subs}
    lo, hi = tool_wait_s
    steps: list[Step] = []

    def step(agent: str, kind: str, waits: bool) -> None:
        wait = math.exp(rng.uniform(math.log(lo), math.log(hi))) if waits else 0.0
        steps.append(Step(agent, _text(rng, rng.randint(*step_words), kind), wait))

    pressure_schedule(crew, subs, rounds, rng, step)
    return Trace(PRESSURE, system, roles, steps, docs)


def pressure_schedule(
    crew: Sequence[str],
    subs: Sequence[str],
    rounds: int,
    rng: random.Random,
    step: Callable[[str, str, bool], None],
) -> None:
    """The pressure shape's order of steps: ``crew`` takes a step each, in turn, for
    ``rounds`` rounds, and the one-shot ``subs`` are spread over the team's steps, each
    right after one, a tool loop of 1-3 steps. Calls ``step(agent, kind, waits)`` for each
    in order (``kind``: "Message", "Task" or "Tool result"; ``waits``: it ends in a tool
    call), drawing from ``rng`` as it goes (a team step's wait before its call, a loop's
    length before its steps)."""
    slots = len(crew) * rounds
    after: dict[int, list[str]] = {}  # a team step's index -> the subagents run after it
    for i, sub in enumerate(subs):
        after.setdefault(i * slots // max(len(subs), 1), []).append(sub)
    for at in range(slots):
        step(crew[at % len(crew)], "Message", rng.random() < 0.3)
        for sub in after.get(at, []):
            loop = rng.randint(1, 3)
            for k in range(loop):
                step(sub, "Task" if k == 0 else "Tool result", k < loop - 1)


def lookahead(order: Sequence[str], at: int, count: int) -> list[str]:
    """The next ``count`` distinct agents after step ``at``, soonest first (the agent of
    step ``at`` itself only once it comes again after others)."""
    out: dict[str, None] = {}  # an ordered set: a list's ``in`` made this O(agents²) a step
    for i in range(at + 1, len(order)):  # not a slice: a copy of the rest, each step
        agent = order[i]
        if agent not in out:
            out[agent] = None
            if len(out) == count:
                break
    return list(out)


def wrong(names: list[str], agents: Sequence[str], rng: random.Random, p: float) -> list[str]:
    """``names`` with each replaced by a random other agent with probability ``p``.

    The draw is ``rng.choice`` over the agents less ``name``, made without building that
    list (a list per name made this O(agents²) a step: over an hour at 10,000 agents)."""
    where = {agent: i for i, agent in enumerate(agents)}
    out: dict[str, None] = {}
    for name in names:
        if rng.random() < p:
            pick = rng.randrange(len(agents) - 1)
            name = agents[pick + (pick >= where[name])]
        out[name] = None
    return list(out)


class OraclePolicy:
    """Belady's rule on cost-weighted bytes, from the trace: demote first the cache whose
    next use lies furthest ahead in steps times bytes freed per second of reload (never
    used again: first of all); caches whose turn waits last. The replay sets
    ``position`` to the step about to run. For measuring only: it knows the future."""

    def __init__(self, order: Sequence[str]) -> None:
        self.order = list(order)
        self.position = 0

    def _ahead(self, agent: str) -> float:
        for j in range(self.position, len(self.order)):
            if self.order[j] == agent:
                return j - self.position + 1
        return math.inf

    def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
        def key(c: Candidate) -> tuple[bool, float]:
            ahead = self._ahead(c.agent)
            if math.isinf(ahead):
                return c.waiting, -math.inf
            return c.waiting, -ahead * max(c.nbytes, 1) / max(c.reload_s, 1e-9)

        chosen: list[str] = []
        freed = 0
        for c in sorted(candidates, key=key):
            if freed >= need:
                break
            chosen.append(c.agent)
            freed += c.nbytes
        return chosen
