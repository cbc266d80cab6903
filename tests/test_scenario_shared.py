"""Scenarios with a shared context and forks: real engine, real files, the tiny model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvactor
from kvactor.actors.enums import Match, Tier
from kvactor.scenario import CONTEXT_AGENT, Scenario, ScenarioError, run_scenario, write_results
from kvactor.scenario._format import load_scenario, parse_scenario, resolve_model, turn_prompt
from kvactor.scenario._results import load_results

SHARED = '''
name = "tiny-shared"
task = "a tiny task"
model = "tiny"
cold_reference = false

[shared_context]
text = """Project notes. The service keeps tasks in a JSON file and serves them over HTTP.
Every task has an id, a title, a due date and a done flag. Backups run every night.
Open questions: file locking, schema changes, and who may delete a task."""

[sampling]
max_tokens = 6

[[agents]]
name = "alpha"
system = "You plan."

[[agents]]
name = "beta"
system = "You build."

[[agents]]
name = "gamma"

[[agents]]
name = "delta"
fork = "alpha"

[[phases]]
name = "start"
agents = ["alpha", "beta", "gamma"]
prompt = "Task: {task}. You are {agent}."

[[phases]]
name = "answer"
prompt = "Others said: {outputs}. Reply."
'''

FIRST = ["alpha", "beta", "gamma"]


def shared_scenario(tmp_path: Path, folder: str, **changes: Any) -> Scenario:
    base = parse_scenario(SHARED, source="shared.toml")
    return msgspec.structs.replace(base, cache_dir=str(tmp_path / folder), **changes)


async def held_tokens(root: Path, names: list[str]) -> dict[str, list[int]]:
    """The exact tokens each agent's warm cache holds: its prompts and its replies."""
    async with kvactor.open(resolve_model("tiny"), cache_dir=root) as kv:
        assert kv.warm is not None
        held = {}
        for name in names:
            saved = await kv.warm.restore(name)
            assert saved is not None, name
            held[name] = saved.tokens
        return held


async def test_agents_share_the_context_and_answer_as_without_sharing(tmp_path: Path) -> None:
    shared = await run_scenario(shared_scenario(tmp_path, "on"))
    alone = await run_scenario(shared_scenario(tmp_path, "off", share_prefixes=False))

    context = shared.context
    assert context is not None and context.path is Tier.COLD and context.tokens > 100
    first = shared.turns[:3]
    assert [t.agent for t in first] == FIRST
    for turn in first:  # the context's whole cache, shared: only the agent's own part is new
        assert turn.path is Tier.HOT and turn.match is Match.NEW
        assert turn.shared_tokens == turn.reused_tokens == context.tokens
        assert turn.prefilled_tokens == turn.prompt_tokens - context.tokens
    assert all(t.shared_tokens == 0 for t in shared.turns[3:])
    assert shared.stats.shared_turns == 3 and shared.stats.shared_tokens == 3 * context.tokens

    # Without sharing no context is made and each first turn prefills the whole prompt.
    assert alone.context is None
    assert [t.path for t in alone.turns[:3]] == [Tier.COLD] * 3
    assert all(t.shared_tokens == 0 for t in alone.turns) and alone.stats.shared_turns == 0
    assert [t.prompt_tokens for t in alone.turns] == [t.prompt_tokens for t in shared.turns]

    # The same greedy answers, token for token: compare what every cache holds.
    names = [*FIRST, "delta"]
    on = await held_tokens(tmp_path / "on", names)
    off = await held_tokens(tmp_path / "off", names)
    assert on == off
    assert [t.text for t in shared.turns] == [t.text for t in alone.turns]

    # The totals: what independent agents would have prefilled is what they did prefill.
    sharing = shared.summary.sharing
    assert sharing is not None
    assert sharing.shared_turns == 3 and sharing.shared_tokens == 3 * context.tokens
    assert sharing.context_tokens == context.tokens
    assert sharing.prefilled_tokens == sum(t.prefilled_tokens for t in shared.turns) + (
        context.tokens
    )
    prefilled_alone = sum(t.prefilled_tokens for t in alone.turns)
    assert sharing.independent_tokens - sharing.forked_tokens == prefilled_alone
    assert sharing.prefilled_tokens < prefilled_alone
    assert sharing.independent_ttft_s is not None and sharing.independent_ttft_s > 0

    # One copy of the context in memory and on disk (hard links), counted once.
    footprint = shared.footprint
    assert footprint is not None and footprint.hot_caches == 5  # four agents + the context
    assert footprint.hot_bytes_each > 1.5 * footprint.hot_bytes
    assert footprint.disk_bytes_each > 1.5 * footprint.disk_bytes
    assert alone.footprint is not None  # no context; each agent holds the text itself
    # (the fork delta shares alpha's system prompt, a range of its own, in both runs)
    assert alone.footprint.hot_bytes > 1.4 * footprint.hot_bytes
    assert alone.footprint.hot_bytes_each > 1.5 * footprint.hot_bytes
    assert alone.footprint.disk_bytes > 1.3 * footprint.disk_bytes
    for name in FIRST:  # each agent's folder links the context's first segment file
        linked = {os.stat(p).st_ino for p in (tmp_path / "on" / "agents" / name).iterdir()} & {
            os.stat(p).st_ino for p in (tmp_path / "on" / "agents" / CONTEXT_AGENT).iterdir()
        }
        assert linked, name

    out = tmp_path / "results.json"
    write_results(shared, out)
    assert load_results(out) == shared


async def test_a_fork_starts_from_its_source_at_the_phase_where_it_first_speaks(
    tmp_path: Path,
) -> None:
    results = await run_scenario(shared_scenario(tmp_path, "warm"))
    alpha_first = results.turns[0]
    delta = next(t for t in results.turns if t.agent == "delta")
    assert delta.phase == "answer"
    # Its first turn extends alpha's cache as it was at the end of the first phase.
    assert delta.match is Match.EXTEND and delta.path is Tier.HOT
    # (all of it that the re-rendered conversation spells the same: at least its prompt)
    assert delta.forked_tokens == delta.reused_tokens
    assert alpha_first.prompt_tokens <= delta.forked_tokens <= alpha_first.cache_tokens
    assert delta.shared_tokens == 0
    sharing = results.summary.sharing
    assert sharing is not None and sharing.forked_turns == 1
    assert sharing.forked_tokens == delta.forked_tokens
    held = await held_tokens(tmp_path / "warm", ["alpha", "delta"])
    assert held["delta"][: delta.forked_tokens] == held["alpha"][: delta.forked_tokens]

    # A second run resumes everything from disk, the context and the fork included.
    again = await run_scenario(shared_scenario(tmp_path, "warm"))
    assert again.context is not None and again.context.path is Tier.WARM
    assert again.resumed == [*FIRST, "delta"]
    assert all(t.match is Match.EXTEND for t in again.turns)
    firsts = {t.agent: t for t in reversed(again.turns)}  # each agent's first turn
    assert {t.path for t in firsts.values()} == {Tier.WARM}  # reloaded from disk
    assert all(t.forked_tokens == t.shared_tokens == 0 for t in again.turns)


def test_an_agents_role_opens_its_first_prompt_under_a_shared_context() -> None:
    s = parse_scenario(SHARED)
    start = s.phases[0]
    assert turn_prompt(s, start, "alpha", {}, first=True) == (
        "You plan.\n\nTask: a tiny task. You are alpha."
    )
    assert turn_prompt(s, start, "alpha", {}) == "Task: a tiny task. You are alpha."
    assert turn_prompt(s, start, "gamma", {}, first=True) == "Task: a tiny task. You are gamma."
    # Without a shared context ``system`` is the system prompt, not part of the turn's.
    plain = msgspec.structs.replace(s, shared_context=None)
    assert turn_prompt(plain, start, "alpha", {}, first=True) == (
        "Task: a tiny task. You are alpha."
    )


def test_a_shared_context_file_is_relative_to_the_scenario(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("Some notes everyone reads.\n")
    text = SHARED.replace(
        SHARED[SHARED.index("text = ") : SHARED.index("[sampling]")], 'file = "docs/notes.md"\n\n'
    )
    (tmp_path / "s.toml").write_text(text)
    scenario = load_scenario(tmp_path / "s.toml")
    assert scenario.shared_context is not None
    assert scenario.shared_context.file == str(tmp_path / "docs" / "notes.md")
    assert kvactor.scenario.shared_text(scenario) == "Some notes everyone reads.\n"


AGENTS = '[[agents]]\nname = "a"\n[[agents]]\nname = "b"\n'
PHASES = (
    '[[phases]]\nname = "one"\nagents = ["a"]\nprompt = "go"\n'
    '[[phases]]\nname = "two"\nprompt = "go on"\n'
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f'{AGENTS}[[agents]]\nname = "c"\nfork = "z"\n{PHASES}',
            "unknown fork source 'z'; agents: a, b, c - at `$.agents[2].fork`",
        ),
        (
            '[[agents]]\nname = "a"\nfork = "b"\n[[agents]]\nname = "b"\nfork = "a"\n' + PHASES,
            "fork cycle: a -> b -> a - at `$.agents[0].fork`",
        ),
        (
            '[[agents]]\nname = "a"\nfork = "a"\n[[agents]]\nname = "b"\n' + PHASES,
            "fork cycle: a -> a - at `$.agents[0].fork`",
        ),
        (
            f'{AGENTS}[[agents]]\nname = "c"\nfork = "a"\nsystem = "You check."\n{PHASES}',
            "give fork or system, not both - at `$.agents[2].fork`",
        ),
        (
            '[[agents]]\nname = "a"\n[[agents]]\nname = "b"\nfork = "a"\n'
            '[[phases]]\nname = "one"\nprompt = "go"\n',
            "fork source 'a' must speak in a phase before 'one', where 'b' first speaks",
        ),
        (
            f'{AGENTS}[[agents]]\nname = "c"\nfork = "a"\n'
            '[[phases]]\nname = "one"\nagents = ["a", "b"]\nprompt = "go"\n',
            "agent 'c' forks 'a' but speaks in no phase - at `$.agents[2].fork`",
        ),
        (
            f'[shared_context]\nfile = "missing.md"\n{AGENTS}{PHASES}',
            "missing.md: No such file or directory - at `$.shared_context.file`",
        ),
        (
            f'[shared_context]\ntext = "x"\nfile = "doc.md"\n{AGENTS}{PHASES}',
            "give text or file, not both or neither - at `$.shared_context`",
        ),
        (
            f'[shared_context]\ntext = "  "\n{AGENTS}{PHASES}',
            "the shared context is empty - at `$.shared_context.text`",
        ),
        (
            f'[shared_context]\ntext = "x"\n{AGENTS}[[agents]]\nname = "shared"\n{PHASES}',
            "'shared' names the shared context; rename the agent - at `$.agents[2].name`",
        ),
        (
            f'[shared_context]\ntext = "x"\nlink = "y"\n{AGENTS}{PHASES}',
            "unknown field `link` - at `$.shared_context`",
        ),
    ],
)
def test_a_bad_fork_or_shared_context_names_the_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'name = "x"\n{text}')
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_the_shipped_shared_document_scenario() -> None:
    s = load_scenario(
        Path(kvactor.scenario.__file__).parent.parent / "scenarios" / "shared_doc.toml"
    )
    text = kvactor.scenario.shared_text(s)
    assert text is not None and len(text) > 6000  # ~1,700 tokens of the default model
    reviewers = [a for a in s.agents if a.fork is None]
    assert len(reviewers) >= 8 and len({a.system for a in reviewers}) == len(reviewers)
    assert any(a.fork for a in s.agents)
    assert not s.resume and s.share_prefixes
