"""Scenarios of several models: roles assigned to models in the file, one session (real
engine, real files, tiny random models)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvactor  # noqa: F401 - first: it loads the BLAS, which must precede mlx.core
from kvactor.scenario import ScenarioError, format_summary, run_scenario
from kvactor.scenario._format import parse_scenario
from kvactor.scenario._results import Event, RunStarted
from kvactor.scenario._view import agent_table

TWO = """
name = "two-models"
task = "a tiny task"
cache_dir = "{cache}"

[models]
router = "tiny"
coder = "tiny:1"

[sampling]
max_tokens = 6

[[agents]]
name = "plan"
system = "You route."
model = "router"

[[agents]]
name = "code"
system = "You code."
model = "coder"

[[agents]]
name = "check"
system = "You check."

[[agents]]
name = "recheck"
fork = "code"

[[phases]]
name = "start"
agents = ["plan", "code", "check"]
prompt = "Do {{task}}."

[[phases]]
name = "again"
prompt = "Go on after {{outputs}}."
"""


async def test_roles_run_their_models_in_one_session(tmp_path: Path) -> None:
    scenario = parse_scenario(TWO.format(cache=tmp_path / "warm"))
    events: list[Event] = []
    results = await run_scenario(scenario, on_event=events.append)
    assert len(results.turns) == 3 + 4
    started = next(e for e in events if isinstance(e, RunStarted))
    models = {row.agent: row.model for row in started.agents}
    assert models == {"plan": "router", "code": "coder", "check": "router", "recheck": None}
    table = agent_table(started.agents)
    assert table[0].split()[:3] == ["agent", "model", "tier"]
    assert "coder" in table[2]
    assert results.stats.memory_limit_bytes is not None
    assert any(line.startswith("memory: peak") for line in format_summary(results))
    warm = tmp_path / "warm" / "models"
    assert sorted(p.name for p in (warm / "coder" / "agents").iterdir()) == ["code", "recheck"]
    assert sorted(p.name for p in (warm / "router" / "agents").iterdir()) == ["check", "plan"]
    # A second run resumes every role from its own model's warm tier.
    again = await run_scenario(scenario)
    assert sorted(again.resumed) == ["check", "code", "plan", "recheck"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('model = "coder"', 'model = "nope"'), "unknown model 'nope'"),
        (('fork = "code"', 'fork = "code"\nmodel = "router"'), "a fork runs its source's model"),
        (('coder = "tiny:1"', 'coder = "tiny:1"\n[shared_context]\ntext = "x"'), "one model"),
        (("[models]", "hot_agents = 1\n[models]"), "hot_agents"),
    ],
)
def test_models_in_a_scenario_are_checked(change: tuple[str, str], message: str) -> None:
    text = TWO.format(cache="none").replace(*change)
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(text)


def test_a_role_names_a_model_only_with_models() -> None:
    text = TWO.format(cache="none").replace('router = "tiny"\ncoder = "tiny:1"', "")
    with pytest.raises(ScenarioError, match=r"agents\[0\]\.model"):
        parse_scenario(text.replace("[models]", ""))
