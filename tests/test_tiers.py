"""Hot, warm and cold tiers end to end: real engine, real files, real actors (tiny model)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_budget import one_turn_need

import kvactor
from kvactor.actors.agent._prefix_match import match_prefix
from kvactor.actors.engine import Attention
from kvactor.actors.enums import Match, StageOutcome, Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm._prefetch import Stage, StageResult
from kvactor.cli import main as cli_main


def tiny(seed: int = 0, **overrides: Any) -> Any:
    return functools.partial(make_tiny_model, seed, **{"head_dim": 64, **overrides})


SYSTEM = "You are agent seven."


ATTENTION = pytest.mark.parametrize("attention", ["dequantized", "quantized"])


async def stage(kv: kvactor.Session, agent: str) -> StageResult:
    """Ask the session's prefetch actor to stage the agent's warm cache now."""
    assert kv.prefetcher is not None
    result: StageResult = await kv.prefetcher.ask(Stage(agent), timeout=None)
    return result


async def save_then_corrupt(root: Path, agent: str) -> dict[str, bytes]:
    """Save one turn of ``agent`` under ``root``, flip a byte of its segment's tensor data
    (only a full read sees it), and return the cache's files as they are now."""
    async with kvactor.open(tiny(), cache_dir=root) as kv:
        await (await kv.spawn_agent(agent)).generate("hello there", max_tokens=6)
    folder = root / "agents" / agent
    segment = next(folder.glob("seg-*.safetensors"))
    data = bytearray(segment.read_bytes())
    data[-5] ^= 0xFF
    segment.write_bytes(bytes(data))
    return {p.name: p.read_bytes() for p in folder.iterdir()}


async def _two_turns_kept_hot(
    cache_dir: Path | None, attention: Attention = "auto"
) -> tuple[kvactor.Completion, kvactor.Completion]:
    async with kvactor.open(tiny(), cache_dir=cache_dir, attention=attention) as kv:
        agent = await kv.spawn_agent("seven", system=SYSTEM)
        first = await agent.generate("tell me about tiers", max_tokens=12)
        second = await agent.generate("and the warm one?", max_tokens=12)
        assert second.path == Tier.HOT
        return first, second


@ATTENTION
async def test_greedy_after_a_warm_reload_equals_the_cache_kept_hot(
    tmp_path: Path, attention: Attention
) -> None:
    _, hot = await _two_turns_kept_hot(None, attention)
    async with kvactor.open(tiny(), cache_dir=tmp_path, attention=attention) as kv:
        agent = await kv.spawn_agent("seven", system=SYSTEM)
        await agent.generate("tell me about tiers", max_tokens=12)
        cached = (await agent.state()).tokens
    # A new session (the engine is empty) finds the warm cache and resumes from it.
    async with kvactor.open(tiny(), cache_dir=tmp_path, attention=attention) as kv:
        agent = await kv.spawn_agent("seven", system=SYSTEM)
        state = await agent.state()
        assert state.restored and state.persisted == cached
        second = await agent.generate("and the warm one?", max_tokens=12)
        assert second.path == Tier.WARM
        # The reload reuses exactly what staying hot reuses, and decodes the same tokens.
        assert second.timings.reused_tokens == hot.timings.reused_tokens
        assert second.token_ids == hot.token_ids
        assert [m["role"] for m in await agent.history()] == ["system"] + ["user", "assistant"] * 2


def test_a_cache_saved_by_one_process_loads_in_another(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import anyio, functools, json, kvactor
        from kvactor.actors.models import make_tiny_model
        model = functools.partial(make_tiny_model, 0, head_dim=64)
        async def main():
            async with kvactor.open(model, cache_dir={str(tmp_path)!r}) as kv:
                agent = await kv.spawn_agent("seven", system={SYSTEM!r})
                done = await agent.generate("tell me about tiers", max_tokens=12)
                print(json.dumps(done.token_ids))
        anyio.run(main)
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    first_elsewhere = json.loads(out.stdout.strip().splitlines()[-1])

    async def resume() -> tuple[list[int], str]:
        async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
            agent = await kv.spawn_agent("seven", system=SYSTEM)
            done = await agent.generate("and the warm one?", max_tokens=12)
            return done.token_ids, done.path

    first_here, hot = anyio.run(_two_turns_kept_hot, None)
    second, path = anyio.run(resume)
    assert first_elsewhere == first_here.token_ids
    assert path == Tier.WARM
    assert second == hot.token_ids


@ATTENTION
async def test_demotion_to_warm_under_a_budget_changes_no_output(
    tmp_path: Path, attention: Attention
) -> None:
    prompts = [f"agent {i}: {'xyz'[i % 3] * (2 + i)}" for i in range(8)]

    async def run_all(**options: Any) -> tuple[list[list[int]], kvactor.EngineStats]:
        async with kvactor.open(tiny(), max_batch=4, attention=attention, **options) as kv:
            agents = [await kv.spawn_agent(f"a{i}") for i in range(len(prompts))]
            outs: list[list[int]] = [[] for _ in prompts]

            async def turn(i: int, text: str) -> None:
                outs[i] += (await agents[i].generate(text, max_tokens=8)).token_ids

            # Phase by phase, like a workflow: after the first phase most caches had to
            # leave the hot tier, so the second phase reloads them.
            for phase in range(2):
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(turn, i, prompts[i] if phase == 0 else "go on")
            return outs, await kv.stats()

    unbounded, _ = await run_all()
    # One turn's need (conversations here stay under 128 tokens): whatever the timing,
    # idle caches must leave for the next turn.
    budget = one_turn_need(attention == "quantized", 128)
    bounded, stats = await run_all(budget_bytes=budget, cache_dir=tmp_path)
    assert bounded == unbounded  # warm reloads are byte-identical to staying hot
    assert stats.demoted_warm > 0 and stats.installs > 0
    assert stats.peak_bytes <= budget


async def test_prefetch_stages_a_warm_cache_before_the_turn(tmp_path: Path) -> None:
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("p")
        await agent.generate("remember this", max_tokens=6)
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("p")
        await kv.prefetch("p")
        # Handled after the hint (one message at a time, in order): the stage is installed.
        await stage(kv, "nobody")
        assert (await kv.stats()).installs == 1
        done = await agent.generate("what was it?", max_tokens=4)
        assert done.path == Tier.HOT  # the reload happened before the turn, not in it
        assert done.timings.reused_tokens > 0
        again = await stage(kv, "p")
        assert again.outcome is StageOutcome.HOT and again.staged
        nobody = await stage(kv, "nobody")
        assert nobody.outcome is StageOutcome.NO_WARM_CACHE and not nobody.staged
    async with kvactor.open(tiny(), cache_dir=tmp_path, budget_bytes=1) as kv:
        big = await stage(kv, "p")
        assert big.outcome is StageOutcome.TOO_BIG and not big.staged


async def test_a_cache_from_another_model_is_refused_and_set_aside(tmp_path: Path) -> None:
    async with kvactor.open(tiny(0), cache_dir=tmp_path) as kv:
        await (await kv.spawn_agent("x")).generate("hello", max_tokens=4)
    async with kvactor.open(tiny(1), cache_dir=tmp_path) as kv:
        infos = await kv.warm_agents()
        assert [i.agent for i in infos] == ["x"]
        assert infos[0].rejected and "made by model" in infos[0].rejected
        agent = await kv.spawn_agent("x")
        assert not (await agent.state()).restored
        done = await agent.generate("hello", max_tokens=4)
        assert done.path == Tier.COLD
    assert (tmp_path / "rejected").exists()  # kept for inspection, not silently reused


async def test_a_corrupt_segment_falls_back_to_cold_with_the_right_answer(tmp_path: Path) -> None:
    await save_then_corrupt(tmp_path, "c")
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("c")
        done = await agent.generate("again", max_tokens=6)
        assert done.path == Tier.COLD
    async with kvactor.open(tiny()) as kv:  # the same turns with no warm tier at all
        agent = await kv.spawn_agent("c")
        await agent.generate("hello there", max_tokens=6)
        reference = await agent.generate("again", max_tokens=6)
    # Cold re-prefill recomputes the history exactly; kept hot it was quantized: compare
    # only that the turn completed with the requested length and a sane reuse count.
    assert len(done.token_ids) == len(reference.token_ids) == 6


async def test_a_cache_refused_while_staging_is_set_aside_and_listed_with_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read whole before it is staged (a streamed stage answers before the checksums are
    # known: tests/test_streamed_load.py refuses it as the turn's first forward ends).
    monkeypatch.setenv("KVACTOR_STREAM", "0")
    refused = await save_then_corrupt(tmp_path, "c")
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        result = await stage(kv, "c")
        assert result.outcome is StageOutcome.REJECTED and not result.staged
        assert "checksum mismatch" in result.detail
        # Kept in place until the agent rewrites it, and listed with the store's reason.
        assert [(i.agent, i.rejected) for i in await kv.warm_agents()] == [("c", result.detail)]
        agent = await kv.spawn_agent("c")
        done = await agent.generate("again", max_tokens=6)
        assert done.path == Tier.COLD
        await agent.state()  # queued behind the turn, which ends by saving the cache
        assert [(i.agent, i.rejected) for i in await kv.warm_agents()] == [("c", None)]
    # Rewriting it from token 0 set the refused copy aside, byte for byte.
    aside = tmp_path / "rejected" / "c"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == refused
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("c")
        assert (await agent.generate("and again", max_tokens=4)).path == Tier.WARM


async def test_delete_rejected_deletes_a_cache_refused_while_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVACTOR_STREAM", "0")  # read whole before it is staged (as above)
    await save_then_corrupt(tmp_path, "c")
    async with kvactor.open(tiny(), cache_dir=tmp_path, delete_rejected=True) as kv:
        result = await stage(kv, "c")
        assert result.outcome is StageOutcome.REJECTED and not result.staged
        assert "checksum mismatch" in result.detail and "deleted" in result.detail
        assert not (tmp_path / "agents" / "c").exists()
        assert await kv.warm_agents() == []
    assert not (tmp_path / "rejected").exists()


async def test_forget_deletes_every_byte(tmp_path: Path) -> None:
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("gone")
        await agent.generate("secret", max_tokens=4)
        await agent.state()  # queued behind the turn, which ends by saving the cache
        folder = tmp_path / "agents" / "gone"
        assert any(folder.iterdir())
        done = await kv.forget("gone")
        assert done.freed > 0 and not done.kept and not folder.exists()
        assert (await kv.stats()).agents_cached == 0
        with pytest.raises(kvactor.InvalidAgentId):
            await kv.forget("../etc")


async def test_raw_prompts_extend_exact_and_diverge(tmp_path: Path) -> None:
    # max_tokens=1: the one sampled token is never fed, so the cache holds the prompt
    # exactly (a random model's text may be invalid UTF-8, which never matches text).
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        agent = await kv.spawn_agent("raw")
        base = "Phase one: the plan is to build a cache."
        first = await agent.complete(base, max_tokens=1)
        assert first.match is Match.NEW and first.path == Tier.COLD
        second = await agent.complete(base + " Phase two: the coder reports.", max_tokens=1)
        assert second.match is Match.EXTEND
        assert second.timings.reused_tokens == first.timings.prompt_tokens
        third = await agent.complete(base + " Something else entirely.", max_tokens=1)
        assert third.match is Match.DIVERGE
        assert first.timings.prompt_tokens <= third.timings.reused_tokens
        assert third.timings.reused_tokens < second.timings.prompt_tokens
        fourth = await agent.complete(base + " Something else entirely.", max_tokens=1)
        assert fourth.match is Match.EXACT
        assert fourth.timings.reused_tokens == fourth.timings.prompt_tokens - 1


def test_match_prefix_keeps_a_verified_token_boundary() -> None:
    tok = make_tiny_model(0).tokenizer
    text = "hello world"
    tokens = tok.encode(text)
    same, kind = match_prefix(tok, tokens, text, text)
    assert (same, kind) == (tokens, Match.EXACT)
    longer, kind = match_prefix(tok, tokens, text, text + " and more")
    assert kind is Match.EXTEND and longer[: len(tokens)] == tokens
    assert tok.decode(longer) == text + " and more"
    other, kind = match_prefix(tok, tokens, text, "hello there")
    assert kind is Match.DIVERGE and tok.decode(other) == "hello there"
    shared = next(i for i, (a, b) in enumerate(zip(other, tokens, strict=False)) if a != b)
    assert shared > 0 and "hello ".startswith(tok.decode(tokens[:shared]))
    fresh, kind = match_prefix(tok, [], "", "abc")
    assert kind is Match.NEW and tok.decode(fresh) == "abc"


def test_cli_inspect_and_forget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def make() -> None:
        async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
            await (await kv.spawn_agent("listed")).generate("hi", max_tokens=2)

    anyio.run(make)

    def cli(*args: str) -> tuple[int, str]:
        # The CLI's main in this process (a new process for each costs ~1 s of imports;
        # test_persist runs `python -m kvactor` in other processes).
        code = cli_main(list(args))
        return code, capsys.readouterr().out

    code, out = cli("inspect", str(tmp_path))
    assert code == 0
    assert "listed" in out and Tier.WARM in out and "ok" in out
    assert cli("forget", "../etc", "--dir", str(tmp_path))[0] == 2
    code, out = cli("forget", "listed", "--dir", str(tmp_path))
    assert code == 0 and "bytes deleted" in out
    assert not (tmp_path / "agents" / "listed").exists()
    assert cli("forget", "listed", "--dir", str(tmp_path))[0] == 1
    assert "no warm caches" in cli("inspect", str(tmp_path))[1]
