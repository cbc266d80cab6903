"""Scenarios end to end: real engine, real files, real actors; the CLI in a subprocess."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import kvactor  # noqa: F401 - first: it loads the BLAS, which must precede mlx.core
from kvactor import scenario as sc
from kvactor.actors.enums import FinishReason, Match, Tier, TurnPath
from kvactor.actors.warm import list_agents
from kvactor.cli import main
from kvactor.cli._demo import demo_scenario, plot_ttft
from kvactor.scenario import (
    LiveView,
    Scenario,
    ScenarioError,
    format_summary,
    run_scenario,
    write_results,
)
from kvactor.scenario._format import load_scenario, parse_scenario
from kvactor.scenario._results import (
    Event,
    PhaseStarted,
    RunStarted,
    TurnFinished,
    TurnRecord,
    TurnStarted,
    load_results,
    summarize,
)

SCENARIOS = Path(sc.__file__).parent.parent / "scenarios"

TINY = """
name = "tiny-team"
task = "a tiny task"
model = "tiny"

[sampling]
max_tokens = 8

[[agents]]
name = "alpha"
system = "You plan."

[[agents]]
name = "beta"
system = "You build."

[[agents]]
name = "gamma"
system = "You check."

[[phases]]
name = "start"
prompt = "Task: {task}. You are {agent}."

[[phases]]
name = "answer"
prompt = "Others said: {outputs}. Reply."

[[phases]]
name = "close"
prompt = "You said {own}; others: {outputs}. Close."
"""

# The tiny model (2 layers, 2 KV heads, head_dim 64) costs 2,048 bytes of float working
# copy per token; a turn reserves twice that for prompt + max_tokens rounded up to 256.
# Every turn here stays under 512 tokens: the budget holds one running turn and ~100 kB
# of idle caches, fewer than the three agents' caches by the last phase.
TINY_BUDGET_MB = (2 * 512 * 2048 + 100_000) / 1e6


def tiny_scenario(tmp_path: Path, **changes: Any) -> Scenario:
    base = parse_scenario(TINY, source="tiny.toml")
    fields = {"cache_dir": str(tmp_path / "warm"), "budget_mb": TINY_BUDGET_MB, **changes}
    return msgspec.structs.replace(base, **fields)


async def test_a_run_demotes_reloads_and_a_second_run_resumes_from_disk(tmp_path: Path) -> None:
    events: list[Event] = []
    first = await run_scenario(tiny_scenario(tmp_path), on_event=events.append)

    assert [type(e) for e in events[:2]] == [RunStarted, PhaseStarted]
    started = events[0]
    assert isinstance(started, RunStarted)
    assert started.resumed == [] and started.found_warm == [] and started.reset is None
    assert [e.name for e in events if isinstance(e, PhaseStarted)] == ["start", "answer", "close"]
    finished = [e for e in events if isinstance(e, TurnFinished)]
    assert len(finished) == len([e for e in events if isinstance(e, TurnStarted)]) == 9
    assert {row.agent for row in finished[-1].agents} == {"alpha", "beta", "gamma"}

    turns = first.turns
    assert [t.index for t in turns] == list(range(9))
    assert [(t.phase, t.agent) for t in turns[:3]] == [
        ("start", "alpha"),
        ("start", "beta"),
        ("start", "gamma"),
    ]
    assert all(t.path is Tier.COLD and t.match is Match.NEW for t in turns[:3])
    later = turns[3:]
    assert all(t.match is Match.EXTEND and t.reused_tokens > 0 for t in later)
    assert {t.path for t in later} >= {Tier.WARM}  # demoted, then reloaded from disk
    assert first.stats.demoted_warm > 0 and first.stats.installs > 0
    assert first.stats.peak_bytes <= (first.budget_bytes or 0)
    labels = {p.label: p for p in first.summary.paths}
    assert labels[TurnPath.COLD].turns == 3 and labels[Match.EXTEND].turns == 6
    assert len(first.summary.references) == 1 and first.summary.savings is not None
    on_disk = {w.agent for w in list_agents(tmp_path / "warm")}
    assert on_disk == {"alpha", "beta", "gamma"}  # the cold reference's agent is forgotten

    out = tmp_path / "results.json"
    write_results(first, out)
    assert load_results(out) == first
    assert any("TTFT by path" in line for line in format_summary(first))

    # A new session on the same folder: every agent resumes; nothing is hot yet.
    events.clear()
    one_phase = tiny_scenario(tmp_path)
    one_phase = msgspec.structs.replace(one_phase, phases=one_phase.phases[1:2])
    second = await run_scenario(one_phase, on_event=events.append)
    started = events[0]
    assert isinstance(started, RunStarted)
    assert started.found_warm == started.resumed == ["alpha", "beta", "gamma"]
    assert {row.tier for row in started.agents} == {Tier.WARM}
    assert [t.path for t in second.turns] == [Tier.WARM] * 3
    assert all(t.match is Match.EXTEND for t in second.turns)
    assert second.resumed == ["alpha", "beta", "gamma"]


async def test_a_run_past_resume_max_tokens_starts_fresh(tmp_path: Path) -> None:
    """docs/scenarios.md: ``resume_max_tokens``: a run forgets the earlier run's caches
    instead of resuming them when any holds more tokens (and resumes them otherwise)."""
    one_phase = tiny_scenario(tmp_path, budget_mb=None)
    one_phase = msgspec.structs.replace(one_phase, phases=one_phase.phases[:1])
    await run_scenario(one_phase)
    starts: list[RunStarted] = []
    limits: list[int] = []
    for over in (0, 1):  # at the longest conversation: resumed; one token under it: fresh
        limit = max(w.tokens for w in list_agents(tmp_path / "warm")) - over
        events: list[Event] = []
        again = msgspec.structs.replace(one_phase, resume_max_tokens=limit)
        done = await run_scenario(again, on_event=events.append)
        started = events[0]
        assert isinstance(started, RunStarted)
        starts.append(started)
        limits.append(limit)
        assert {t.path for t in done.turns} == ({Tier.COLD} if over else {Tier.WARM})
    assert starts[0].reset is None and starts[0].resumed == ["alpha", "beta", "gamma"]
    fresh = starts[1]
    assert fresh.resumed == [] and fresh.found_warm == ["alpha", "beta", "gamma"]
    assert fresh.reset is not None and f"resume_max_tokens = {limits[1]}" in fresh.reset


async def test_concurrent_turns_and_a_fresh_start(tmp_path: Path) -> None:
    batched = await run_scenario(
        tiny_scenario(tmp_path, concurrency=3, budget_mb=None, cache_dir="none")
    )
    assert batched.cache_dir is None and len(batched.turns) == 9
    # A phase starts when the previous one is over: its prompts quote all of it.
    for earlier, later in zip(batched.turns, batched.turns[3:], strict=False):
        if later.phase_index > earlier.phase_index:
            assert later.start_s >= earlier.start_s + earlier.wall_s

    await run_scenario(tiny_scenario(tmp_path, cold_reference=False))
    events: list[Event] = []
    fresh = tiny_scenario(tmp_path, resume=False, cold_reference=False)
    again = await run_scenario(fresh, on_event=events.append)
    started = events[0]
    assert isinstance(started, RunStarted)
    assert started.reset == "asked to start fresh" and started.resumed == []
    assert started.found_warm == ["alpha", "beta", "gamma"]
    assert [t.path for t in again.turns[:3]] == [Tier.COLD] * 3


def _kvactor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVACTOR_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "kvactor", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=240,
    )


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_kvactor_run_writes_json_results(tmp_path: Path) -> None:
    (tmp_path / "team.toml").write_text(TINY.replace("max_tokens = 8", "max_tokens = 4"))
    done = _kvactor("run", "team.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no warm caches from a previous run: starting cold" in done.stdout
    assert "TTFT by path (9 turns)" in done.stdout
    assert "run it again: a new process resumes every agent from disk" in done.stdout
    results = load_results(tmp_path / "tiny-team-results.json")
    assert results.scenario.name == "tiny-team" and len(results.turns) == 9
    assert results.cache_dir == str(tmp_path / "cache" / "scenarios" / "tiny-team" / "tiny")

    again = _kvactor("run", "team.toml", "--json", "again.json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "found warm caches for 3 agents from a previous run" in again.stdout
    assert load_results(tmp_path / "again.json").resumed == ["alpha", "beta", "gamma"]

    # --fresh starts this run over; the scenario still resumes, so the next run does too.
    fresh = _kvactor("run", "team.toml", "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "asked to start fresh" in fresh.stdout
    assert "run it again: a new process resumes every agent from disk" in fresh.stdout


#: ``kvactor ARGS`` in a process that records each backend ``anyio.run`` is given (a spy:
#: the call goes on unchanged), printed last as ``BACKENDS [...]``.
SPY = """
import sys, anyio
from kvactor.cli import main
real, used = anyio.run, []
def spy(*args, backend="asyncio", **kwargs):
    used.append(backend)
    return real(*args, backend=backend, **kwargs)
anyio.run = spy
code = main(sys.argv[1:])
print("BACKENDS", used)
sys.exit(code)
"""


@pytest.mark.slow  # subprocesses: the whole suite's
def test_kvactor_run_runs_on_trio_with_backend_trio(tmp_path: Path) -> None:
    """docs/cli.md: ``kvactor run --backend trio`` (and ``demo``: the same code path)
    runs the scenario on trio, to its end and its results."""
    (tmp_path / "team.toml").write_text(TINY.replace("max_tokens = 8", "max_tokens = 4"))
    env = {**os.environ, "KVACTOR_CACHE_DIR": str(tmp_path / "cache")}
    for backend in ("asyncio", "trio"):
        done = subprocess.run(
            [sys.executable, "-c", SPY, "run", "team.toml", "--backend", backend, "--fresh"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "TTFT by path (9 turns)" in done.stdout
        assert done.stdout.splitlines()[-1] == f"BACKENDS [{backend!r}]"
        assert len(load_results(tmp_path / "tiny-team-results.json").turns) == 9


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
def test_the_demo_command_on_the_tiny_model(tmp_path: Path) -> None:
    # The random tiny model's replies are invalid UTF-8 that quotes back as 3 bytes per
    # token, beyond what the hot_agents estimate assumes: give it a budget in MB.
    args = ("--model", "tiny", "--cache-dir", "warm", "--budget-mb", "40", "--json", "demo.json")
    done = _kvactor("demo", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "6 agents, 3 phases, 18 turns" in done.stdout
    assert "no warm caches from a previous run: starting cold" in done.stdout
    assert "TTFT by path (18 turns)" in done.stdout and "demo done in" in done.stdout
    # The random model's replies are long in bytes: past resume_max_tokens in one run.
    assert "resume_max_tokens = 1024: the next run starts fresh." in done.stdout
    # Then the shared document: every reviewer's first turn shares the context's cache.
    assert "Shared prefixes: 10 agents review one long design document" in done.stdout
    assert "10 agents, 3 phases, 10 turns" in done.stdout
    assert "(6120 shared + " in done.stdout  # the document, in the byte tokenizer's tokens
    for row in ("tokens prefilled", "time to first tokens", "hot caches (11)", "warm tier on disk"):
        assert row in done.stdout
    shared = load_results(tmp_path / "demo-shared.json")
    assert shared.scenario.name == "shared-doc" and shared.budget_bytes == 240_000_000
    assert shared.context is not None and shared.context.tokens == 6120
    assert sum(t.shared_tokens > 0 for t in shared.turns) == 9  # the reviewers, the lead
    assert sum(t.forked_tokens > 0 for t in shared.turns) == 1  # the skeptic
    sharing, footprint = shared.summary.sharing, shared.footprint
    assert sharing is not None and sharing.independent_tokens > 5 * sharing.prefilled_tokens
    assert footprint is not None and footprint.disk_bytes_each > 5 * footprint.disk_bytes
    results = load_results(tmp_path / "demo.json")
    assert [a.name for a in results.scenario.agents] == [
        "planner",
        "coder",
        "reviewer",
        "tester",
        "writer",
        "critic",
    ]
    assert results.budget_bytes == 40_000_000


def test_the_shipped_scenarios_are_valid() -> None:
    demo = demo_scenario()
    assert len(demo.agents) >= 6 and len(demo.phases) >= 3
    assert len({a.system for a in demo.agents}) == len(demo.agents)
    assert demo.hot_agents is not None  # the budget forces demotions
    shipped = sorted(p.name for p in SCENARIOS.glob("*.toml"))
    assert shipped == ["code_review.toml", "debate.toml", "demo.toml", "shared_doc.toml"]
    for path in SCENARIOS.glob("*.toml"):
        load_scenario(path)


GOOD_AGENTS = '[[agents]]\nname = "a"\n[[agents]]\nname = "b"\n'
GOOD_PHASE = '[[phases]]\nname = "p"\nprompt = "hi {agent}"\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f'name = "x"\n{GOOD_AGENTS}{GOOD_PHASE}'
            '[[phases]]\nname = "q"\nprompt = "go"\nmax_tokens = "many"\n',
            "got `str` - at `$.phases[1].max_tokens`",
        ),
        (
            f'name = "x"\n[sampling]\nmax_token = 3\n{GOOD_AGENTS}{GOOD_PHASE}',
            "unknown field `max_token` - at `$.sampling`",
        ),
        (
            f'name = "x"\nbudget_mb = 0\n{GOOD_AGENTS}{GOOD_PHASE}',
            "Expected `float` > 0.0 - at `$.budget_mb`",
        ),
        (
            f'name = "x"\nconcurrency = 0\n{GOOD_AGENTS}{GOOD_PHASE}',
            "Expected `int` >= 1 - at `$.concurrency`",
        ),
        (f'name = "x"\n{GOOD_PHASE}', "missing required field `agents`"),
        ('name = "x"\ntask = "t\n', "invalid TOML: "),
        ('name = "x"\n\nmodel = = "tiny"\n', "(at line 3, column"),
        (
            f'name = "x"\n{GOOD_AGENTS}[[phases]]\nname = "p"\nprompt = "go"\n'
            'agents = ["a", "c"]\n',
            "unknown agent 'c'; agents: a, b - at `$.phases[0].agents[1]`",
        ),
        (
            f'name = "x"\n{GOOD_AGENTS}[[agents]]\nname = "a"\n{GOOD_PHASE}',
            "duplicate agent name 'a' - at `$.agents[2].name`",
        ),
        (
            f'name = "x"\n[[agents]]\nname = "../etc"\n{GOOD_PHASE}',
            "- at `$.agents[0].name`",
        ),
        (f'name = "x"\npolicy = "mru"\n{GOOD_AGENTS}{GOOD_PHASE}', "unknown policy 'mru'"),
        (f'name = "x"\nphases = []\n{GOOD_AGENTS}', "at least one phase - at `$.phases`"),
        (
            f'name = "x"\n{GOOD_AGENTS}[[phases]]\nname = "p"\nprompt = "see {{others}}"\n',
            "unknown placeholder {others}; known: {task}",
        ),
        (
            f'name = "x"\n{GOOD_AGENTS}[[phases]]\nname = "p"\nprompt = "a {{ b"\n',
            "- at `$.phases[0].prompt`",
        ),
        (
            f'name = "x"\nbudget_mb = 10\nhot_agents = 2\n{GOOD_AGENTS}{GOOD_PHASE}',
            "set budget_mb or hot_agents, not both - at `$.hot_agents`",
        ),
        (f'name = "a b"\n{GOOD_AGENTS}{GOOD_PHASE}', "bad scenario name"),
    ],
)
def test_a_malformed_scenario_names_the_bad_field(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_kvactor_run_exits_2_on_a_bad_scenario_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.toml").write_text(TINY.replace("max_tokens = 8", 'max_tokens = "8"'))
    done = _kvactor("run", "bad.toml", cwd=tmp_path)
    assert done.returncode == 2
    assert "bad.toml: Expected `int`, got `str` - at `$.sampling.max_tokens`" in done.stderr
    assert "Traceback" not in done.stderr
    assert main(["run", str(tmp_path / "nowhere.toml")]) == 2
    assert "nowhere.toml: cannot read: No such file or directory" in capsys.readouterr().err


def test_without_matplotlib_plot_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "team.toml").write_text(TINY)
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "from kvactor.cli import main\n"
        "sys.exit(main(['run', 'team.toml', '--plot', 'ttft.png']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 2
    assert "pip install 'kvactor[plot]'" in done.stderr
    assert not (tmp_path / "tiny-team-results.json").exists()  # checked before running


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs kvactor[plot]")
async def test_plot_draws_ttft_per_turn(tmp_path: Path) -> None:
    results = await run_scenario(tiny_scenario(tmp_path))
    out = tmp_path / "ttft.png"
    await anyio.to_thread.run_sync(plot_ttft, results, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("redraw", [True, False])
async def test_the_live_view_redraws_only_on_a_terminal(tmp_path: Path, redraw: bool) -> None:
    out = io.StringIO()
    view = LiveView(out, redraw=redraw)
    results = await run_scenario(tiny_scenario(tmp_path, cold_reference=False), on_event=view)
    text = out.getvalue()
    assert ("\x1b[" in text) is redraw  # cursor up + clear: the table is redrawn in place
    assert text.count("phase 3/3 close: alpha, beta, gamma") == 1
    assert text.count("[9/9] gamma") == 1
    # Each phase's final table stays on screen either way.
    assert text.count("agent  tier") >= 3
    assert len(results.turns) == 9


def _turn(
    index: int, path: Tier, prompt: int, ttft: float, match: Match = Match.EXTEND
) -> TurnRecord:
    return TurnRecord(
        index=index,
        phase="p",
        phase_index=0,
        agent=f"a{index}",
        path=path,
        match=Match.NEW if path is Tier.COLD else match,
        prefetched=False,
        ttft_s=ttft,
        queue_s=0.0,
        prefill_s=ttft,
        decode_s=1.0,
        prompt_tokens=prompt,
        reused_tokens=0 if path is Tier.COLD else prompt // 2,
        prefilled_tokens=prompt if path is Tier.COLD else prompt // 2,
        generated_tokens=8,
        decode_tok_s=7.0,
        finish_reason=FinishReason.LENGTH,
        cache_tokens=prompt + 7,
        cache_bytes=1000,
        start_s=float(index),
        wall_s=1.0,
        text="x",
    )


def test_the_saving_is_interpolated_from_measured_cold_prefills() -> None:
    turns = [
        _turn(0, Tier.COLD, 100, 1.0),
        _turn(1, Tier.COLD, 100, 1.0),
        _turn(2, Tier.WARM, 300, 1.5),
    ]
    reference = sc.ColdReference(
        index=2, agent="a2", prompt_tokens=500, ttft_s=6.0, turn_ttft_s=1.5, turn_path=Tier.WARM
    )
    summary = summarize(turns, [reference])
    assert summary.savings is not None
    # 300 tokens lies halfway between (100, 1.0 s) and (500, 6.0 s): 3.5 s if cold.
    assert summary.savings.est_cold_ttft_s == pytest.approx(1.0 + 1.0 + 3.5)
    assert summary.savings.saved_s == pytest.approx(2.0)
    assert "2 cold turns" in summary.savings.method
    warm = next(p for p in summary.paths if p.label == TurnPath.WARM)
    assert warm.est_cold_ttft_s == pytest.approx(3.5)
    # Several references: piecewise linear between them, proportional beyond the last.
    short = msgspec.structs.replace(reference, index=0, prompt_tokens=200, ttft_s=2.0)
    model = sc.cold_model([_turn(0, Tier.HOT, 300, 1.0)], [reference, short])
    assert model is not None and "200 and 500 tokens" in model[1]
    assert model[0](350) == pytest.approx(2.0 + 150 * 4.0 / 300)
    assert model[0](1000) == pytest.approx(12.0)
    # Without cold turns or a reference: the prefill rate of the new parts, said so.
    alone = summarize([_turn(0, Tier.HOT, 400, 2.0)])
    assert alone.savings is not None and "no cold prefill" in alone.savings.method
    assert alone.savings.est_cold_ttft_s == pytest.approx(400 / 100)


def test_all_names_are_exported() -> None:
    for name in sc.__all__:
        assert hasattr(sc, name), name


@pytest.mark.slow
def test_a_short_scenario_on_the_default_model(tmp_path: Path) -> None:
    text = """
    name = "pair"
    task = "naming a command-line tool"
    hot_agents = 0
    [sampling]
    max_tokens = 12
    [[agents]]
    name = "ideas"
    system = "You suggest names."
    [[agents]]
    name = "judge"
    system = "You pick the best name."
    [[phases]]
    name = "suggest"
    prompt = "Suggest one name for {task}."
    [[phases]]
    name = "pick"
    prompt = "The other said: {outputs}. One sentence."
    """
    scenario = msgspec.structs.replace(parse_scenario(text), cache_dir=str(tmp_path / "warm"))
    first = anyio.run(run_scenario, scenario)
    assert [t.path for t in first.turns[:2]] == [Tier.COLD, Tier.COLD]
    assert all(t.match is Match.EXTEND and t.reused_tokens > 0 for t in first.turns[2:])
    # hot_agents = 0: the budget is sized for the running turn alone, so an idle agent
    # is demoted to disk; the estimate was large enough for every turn.
    assert first.budget_bytes is not None and first.stats.peak_bytes <= first.budget_bytes
    assert first.stats.demoted_warm >= 1
    [reference] = first.summary.references  # the run had cold turns: one reference
    assert reference.index == 3
    assert abs(reference.prompt_tokens - first.turns[3].prompt_tokens) <= 2

    second = anyio.run(run_scenario, scenario)
    assert second.resumed == ["ideas", "judge"]
    assert [t.path for t in second.turns[:2]] == [Tier.WARM, Tier.WARM]  # restored from disk
    assert second.stats.installs >= 2
    assert second.summary.references[0].index == 3  # the longest turn, measured cold
