"""The agentic traces of ``bench/agentic.py``: seeded, of the three shapes and the pressure
shape, with steps of the asked sizes and tool waits; the lookahead hints, wrong hints, and
the oracle policy (Belady on cost-weighted bytes) that knows a trace's future."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from kvactor.actors.enums import Tier
from kvactor.actors.hot import Candidate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _agentic_trace import (  # bench/ is not a package: its folder on sys.path
    PRESSURE,
    SHAPES,
    OraclePolicy,
    Trace,
    lookahead,
    make_pressure_trace,
    make_trace,
    wrong,
)


def test_traces_are_seeded_and_shaped() -> None:
    for shape in SHAPES:
        a = make_trace(shape, agents=5, rounds=2, seed=1, words=(30, 60))
        assert a == make_trace(shape, agents=5, rounds=2, seed=1, words=(30, 60))
        assert a != make_trace(shape, agents=5, rounds=2, seed=2, words=(30, 60))
        assert set(a.order) == set(a.agents) and len(a.agents) == 5
        firsts = {a.order.index(n) for n in a.agents}
        for at, s in enumerate(a.steps):
            words = s.text.split("\n")[-1].split(": ", 1)[1].split()
            assert 30 <= len(words) <= 60
            assert (at in firsts) == s.text.startswith(a.roles[s.agent])
        assert any(s.tool_wait_s > 0 for s in a.steps)
    rr = make_trace("round_robin", agents=4, rounds=2, seed=0)
    assert rr.order == rr.agents * 2
    fan = make_trace("fanout", agents=4, rounds=1, seed=0)
    assert fan.order == [fan.agents[0], *fan.agents[1:], fan.agents[0]]
    pipe = make_trace("pipeline", agents=4, rounds=1, seed=0)
    assert pipe.order == pipe.agents
    with pytest.raises(ValueError):
        make_trace("star", agents=4, rounds=1, seed=0)


def test_lookahead_and_wrong_hints() -> None:
    order = ["a", "b", "a", "c", "b", "d"]
    assert lookahead(order, 0, 3) == ["b", "a", "c"]
    assert lookahead(order, 4, 3) == ["d"]
    rng = random.Random(0)
    names = ["a", "b", "c", "d"]
    assert wrong(names, names, rng, 0.0) == names
    assert wrong(names, names, rng, 1.0) != names
    # a wrong hint names another agent, never the one it replaces, drawn over all others
    for name in names:
        drawn = {wrong([name], names, rng, 1.0)[0] for _ in range(200)}
        assert drawn == set(names) - {name}


def _candidate(agent: str, nbytes: int, reload_s: float, waiting: bool = False) -> Candidate:
    return Candidate(
        agent=agent,
        nbytes=nbytes,
        tokens=1,
        last_used=0.0,
        hits=0,
        clean=True,
        demote_to=Tier.WARM,
        reload_s=reload_s,
        waiting=waiting,
    )


def test_the_oracle_demotes_the_furthest_cost_weighted_use_first() -> None:
    oracle = OraclePolicy(["a", "b", "c", "a", "b", "c"])
    oracle.position = 1  # b runs now
    caches = [_candidate("a", 100, 1.0), _candidate("c", 100, 1.0), _candidate("z", 1, 9.0)]
    assert oracle.victims(caches, 300) == ["z", "a", "c"]  # z: never again
    # A cache that is dear to bring back per byte stays longer.
    caches = [_candidate("a", 100, 10.0), _candidate("c", 100, 1.0)]
    assert oracle.victims(caches, 1) == ["c"]
    assert oracle.victims([_candidate("a", 100, 1.0, waiting=True), *caches[1:]], 1) == ["c"]


def test_a_pressure_trace_has_private_contexts_and_one_shot_subagents() -> None:
    def make(seed: int) -> Trace:
        return make_pressure_trace(
            team=3,
            subagents=4,
            rounds=2,
            seed=seed,
            team_doc_words=(50, 80),
            sub_doc_words=(90, 120),
            step_words=(5, 20),
        )

    trace = make(1)
    assert trace == make(1) and trace != make(2)
    assert trace.shape == PRESSURE and set(trace.docs) == set(trace.agents)
    team = [a for a in trace.agents if a.startswith("te")]
    subs = [a for a in trace.agents if a.startswith("su")]
    assert len(team) == 3 and len(subs) == 4
    for agent, doc in trace.docs.items():
        low, high = (50, 80) if agent in team else (90, 120)
        assert low <= len(doc.split(": ", 1)[1].split()) <= high
    # The team speaks in turn, round after round; each subagent runs once, in one burst
    # of 1-3 steps whose steps but the last end in a tool call, and never comes back.
    assert [a for a in trace.order if a in team] == team * 2
    for sub in subs:
        at = [i for i, a in enumerate(trace.order) if a == sub]
        assert 1 <= len(at) <= 3 and at == list(range(at[0], at[0] + len(at)))
        assert trace.order[at[0] - 1] in team
        waits = [trace.steps[i].tool_wait_s > 0 for i in at]
        assert waits == [True] * (len(at) - 1) + [False]
    for step in trace.steps:
        assert 5 <= len(step.text.split(": ", 1)[1].split()) <= 20
    with pytest.raises(ValueError):
        make_pressure_trace(
            team=1,
            subagents=0,
            rounds=1,
            seed=0,
            team_doc_words=(1, 2),
            sub_doc_words=(1, 2),
            step_words=(1, 2),
        )
