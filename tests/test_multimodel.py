"""Several models in one session (one engine, one memory limit over everything), on tiny
random-weight models of different configurations (real MLX on the CPU, real files)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
from multimodels import MODELS, A, B, need, swap_limit

import kvactor
from kvactor.actors.engine import default_memory_limit, turn_reserve_bytes
from kvactor.actors.engine._memory import attention_heads, attention_score_bytes
from kvactor.actors.enums import Tier
from kvactor.actors.errors import ModelLoadError
from kvactor.cli._inspect import run_inspect

pytestmark = pytest.mark.one_backend  # models under one memory limit, not the event loop

PROMPTS = ["hello there", "and now something else", "a third turn"]


async def _solo(spec: Any, names: list[str]) -> dict[str, list[str]]:
    """Each agent's greedy answers with the model alone in its own session."""
    out: dict[str, list[str]] = {}
    # Deterministic here and wherever agents run together: the mode that promises answers
    # independent of the batch (README).
    async with kvactor.open(spec, deterministic=True) as session:
        for name in names:
            agent = await session.spawn_agent(name, system=f"you are {name}")
            out[name] = [(await agent.generate(p, max_tokens=6)).text for p in PROMPTS]
    return out


async def _together(session: kvactor.Session, roles: dict[str, str]) -> dict[str, list[str]]:
    """Every agent (name -> model) taking its turns at once, in one session."""
    out: dict[str, list[str]] = {}
    agents = {
        name: await session.spawn_agent(name, system=f"you are {name}", model=model)
        for name, model in roles.items()
    }

    async def run(name: str) -> None:
        out[name] = [(await agents[name].generate(p, max_tokens=6)).text for p in PROMPTS]

    async with anyio.create_task_group() as tg:
        for name in agents:
            tg.start_soon(run, name)
    return out


ROLES = {"r1": "router", "r2": "router", "c1": "coder", "c2": "coder"}


async def test_two_models_answer_as_each_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = await _solo(A, ["r1", "r2"]) | await _solo(B, ["c1", "c2"])
    async with kvactor.open(models=MODELS, cache_dir=tmp_path, deterministic=True) as session:
        assert list(session.models) == ["router", "coder"]
        fingerprints = {m.fingerprint for m in session.models.values()}
        assert len(fingerprints) == 2
        together = await _together(session, ROLES)
        assert together == alone
        assert {n: session.model_of(n) for n in ROLES} == ROLES
        stats = await session.stats()
        assert stats.models_loaded == 2 and stats.model_loads == 0
        assert stats.generated_tokens == 6 * len(PROMPTS) * len(ROLES)
        assert stats.memory_limit_bytes is not None
        assert 0 < stats.memory_bytes <= stats.memory_limit_bytes
        assert stats.weights_bytes > 0
        states = {s.name: s for s in await session.model_states()}
        assert states["router"].loaded and states["coder"].loaded
        assert states["coder"].weights_bytes > states["router"].weights_bytes
    # Each model's agents apart on disk.
    for model, names in (("router", ["r1", "r2"]), ("coder", ["c1", "c2"])):
        folder = tmp_path / "models" / model / "agents"
        assert sorted(p.name for p in folder.iterdir()) == names
    # kvactor inspect shows each model's caches and the limit they ran under.
    capsys.readouterr()
    assert run_inspect(argparse.Namespace(dir=tmp_path, json=False, verbose=False)) == 0
    shown = capsys.readouterr().out
    assert "memory limit" in shown and "over models router, coder" in shown
    assert str(tmp_path / "models" / "router") in shown and "c2" in shown
    assert run_inspect(argparse.Namespace(dir=tmp_path, json=True, verbose=False)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["memory"]["memory_limit_bytes"] == stats.memory_limit_bytes
    assert len(listed["directories"]) == 2


async def test_forks_and_contexts_stay_within_a_model() -> None:
    async with kvactor.open(models=MODELS) as session:
        r = await session.spawn_agent("r", model="router")
        await r.generate("hello", max_tokens=3)
        with pytest.raises(ValueError, match="within a model"):
            await session.fork("r", "r2", model="coder")
        fork = await session.fork("r", "r3")
        assert session.model_of("r3") == "router"
        assert (await fork.generate("more", max_tokens=3)).timings.reused_tokens > 0
        await session.context("ctx", "shared facts", model="coder")
        with pytest.raises(ValueError, match="within a model"):
            await session.spawn_agent("c", context="ctx", model="router")
        c = await session.spawn_agent("c", context="ctx")
        assert session.model_of("c") == "coder"
        assert (await c.generate("hi", max_tokens=2)).timings.reused_tokens > 0
        with pytest.raises(ValueError, match="no model 'nope'"):
            await session.spawn_agent("x", model="nope")


async def test_a_cache_offered_to_another_model_is_refused(tmp_path: Path) -> None:
    async with kvactor.open(models=MODELS, cache_dir=tmp_path) as session:
        agent = await session.spawn_agent("x", model="router")
        await agent.generate("remember this", max_tokens=4)
    # The router's cache of x, put where the coder's agents live.
    shutil.copytree(
        tmp_path / "models" / "router" / "agents" / "x",
        tmp_path / "models" / "coder" / "agents" / "x",
    )
    async with kvactor.open(models=MODELS, cache_dir=tmp_path) as session:
        infos = [i for i in await session.warm_agents() if i.agent == "x"]
        assert len(infos) == 2
        refused = [i for i in infos if i.rejected is not None]
        assert len(refused) == 1 and "model" in (refused[0].rejected or "")
        agent = await session.spawn_agent("x", model="coder")
        done = await agent.generate("remember this", max_tokens=4)
        assert done.path is Tier.COLD and done.timings.reused_tokens == 0
        # The router's own agent x still resumes warm in the router.
        await session.forget("x")
        again = await session.spawn_agent("x", model="router")
        assert (await again.generate("and more", max_tokens=2)).path is Tier.WARM


async def test_a_limit_for_one_model_swaps_them_and_holds(tmp_path: Path) -> None:
    limit = swap_limit()
    alone = await _solo(A, ["r1"]) | await _solo(B, ["c1"])
    async with kvactor.open(models=MODELS, memory_limit=limit, cache_dir=tmp_path) as session:
        r1 = await session.spawn_agent("r1", system="you are r1", model="router")
        c1 = await session.spawn_agent("c1", system="you are c1", model="coder")
        out: dict[str, list[str]] = {"r1": [], "c1": []}
        for prompt in PROMPTS:  # turn by turn: router, coder, router, ...
            out["r1"].append((await r1.generate(prompt, max_tokens=6)).text)
            out["c1"].append((await c1.generate(prompt, max_tokens=6)).text)
        stats = await session.stats()
        assert out == alone
        assert stats.generated_tokens == 6 * len(PROMPTS) * 2  # every load's counted once
        assert stats.model_loads >= 2 * len(PROMPTS) - 1
        assert stats.model_unloads >= stats.model_loads - 1
        assert stats.swap_s > 0
        assert stats.models_loaded == 1
        assert stats.memory_limit_bytes == limit
        assert stats.memory_peak_bytes <= limit
        assert stats.mlx_peak_bytes <= limit  # MLX's own peak, plus what it keeps
        loaded = [s.name for s in await session.model_states() if s.loaded]
        assert loaded == ["coder"]


async def test_a_pinned_model_stays_loaded(tmp_path: Path) -> None:
    limit = swap_limit()
    async with kvactor.open(
        models=MODELS, memory_limit=limit, pin_models=["coder"], cache_dir=tmp_path
    ) as session:
        c1 = await session.spawn_agent("c1", model="coder")
        r1 = await session.spawn_agent("r1", model="router")
        await c1.generate("hi", max_tokens=2)
        with pytest.raises(kvactor.BudgetExceeded, match="pinned"):
            await r1.generate("hi", max_tokens=2)
        assert [s.name for s in await session.model_states() if s.loaded] == ["coder"]


async def test_a_model_that_cannot_fit_one_turn_is_refused_at_open() -> None:
    (fixed_a, turn), (fixed_b, _) = need(A), need(B)
    limit = (fixed_a + fixed_b) // 2 + turn  # the router fits with a turn, the coder not
    with pytest.raises(ModelLoadError, match=r"'coder' needs \d+ bytes with one turn"):
        async with kvactor.open(models=MODELS, memory_limit=limit):
            pass


async def test_memory_limit_options_are_checked() -> None:
    with pytest.raises(ValueError, match="model or models"):
        kvactor.open(A, models=MODELS)
    with pytest.raises(ValueError, match="memory_limit"):
        kvactor.open(models=MODELS, memory_limit=0)
    with pytest.raises(ValueError, match="pinned models"):
        kvactor.open(models=MODELS, pin_models=["nope"])
    with pytest.raises(ValueError, match="several models"):
        kvactor.open(A, pin_models=["x"])


async def test_every_session_has_the_default_memory_limit_unless_told_none() -> None:
    async with kvactor.open(A) as session:  # one model, no limit given: 3/4 of RAM
        await (await session.spawn_agent("a")).generate("hello", max_tokens=3)
        stats = await session.stats()
        assert stats.memory_limit_bytes == default_memory_limit()
        assert 0 < stats.memory_bytes <= stats.memory_limit_bytes
    async with kvactor.open(A, memory_limit=None) as session:  # opted out
        await (await session.spawn_agent("a")).generate("hello", max_tokens=3)
        assert (await session.stats()).memory_limit_bytes is None
    with pytest.raises(ValueError, match="several models need a memory limit"):
        kvactor.open(models=MODELS, memory_limit=None)


async def test_one_model_under_a_memory_limit() -> None:
    async with kvactor.open(A, memory_limit=1 << 30) as session:
        agent = await session.spawn_agent("a")
        await agent.generate("hello", max_tokens=3)
        stats = await session.stats()
        assert stats.memory_limit_bytes == 1 << 30
        assert 0 < stats.memory_bytes <= 1 << 30
        # One model is named after itself, with a limit or without: one engine path.
        assert list(session.models) == [session.model.name]
        assert [s.name for s in await session.model_states()] == [session.model.name]


async def test_a_turn_of_one_model_demotes_the_others_idle_caches_first(tmp_path: Path) -> None:
    (fixed_a, _), (fixed_b, _) = need(A), need(B)
    long = "tell me about " + "the warm tier " * 60
    async with kvactor.open(A, ready_copies=False) as probe:  # one such cache's bytes
        agent = await probe.spawn_agent("p")
        done = await agent.generate(long, max_tokens=4)
        stored = (await agent.cache_info()).nbytes
    # What such a turn reserves; the same in both models (the same cache geometry).
    prompt = done.timings.prompt_tokens
    reserve = turn_reserve_bytes(A().geometry, prompt + 4)
    reserve += attention_score_bytes(attention_heads(A()), min(256, prompt), prompt)
    room = fixed_a + fixed_b + reserve + stored * 3 // 2  # both models, a turn, 1.5 caches
    limit = room * 16 // 15 + 16
    async with kvactor.open(
        models=MODELS, memory_limit=limit, cache_dir=tmp_path, ready_copies=False
    ) as session:
        routers = [await session.spawn_agent(f"r{i}", model="router") for i in range(3)]
        for agent in routers:
            await agent.generate(long, max_tokens=4)
        hot_before = [a.name for a in routers if await _hot(a)]
        coder = await session.spawn_agent("c", model="coder")
        await coder.generate(long, max_tokens=4)
        hot_after = [a.name for a in routers if await _hot(a)]
        stats = await session.stats()
        assert len(hot_after) < len(hot_before)  # the router's idle caches went warm ...
        assert stats.models_loaded == 2 and stats.model_unloads == 0  # ... not the router
        assert stats.memory_peak_bytes <= limit and stats.mlx_peak_bytes <= limit
        again = await routers[0].generate("and more", max_tokens=2)
        assert again.path is Tier.WARM


async def _hot(agent: kvactor.Agent) -> bool:
    try:
        await agent.cache_info()
    except kvactor.UnknownAgent:
        return False
    return True


async def test_a_model_idle_past_its_ttl_is_unloaded(tmp_path: Path) -> None:
    async with kvactor.open(models=MODELS, model_ttl_s=0.0, cache_dir=tmp_path) as session:
        agent = await session.spawn_agent("r", model="router")
        first = await agent.generate("hello", max_tokens=3)
        states = {s.name: s.loaded for s in await session.model_states()}
        assert states == {"router": False, "coder": False}
        again = await agent.generate("more", max_tokens=3)  # loads it again, resumes warm
        assert (
            again.path is Tier.WARM and again.timings.reused_tokens >= first.timings.prompt_tokens
        )
        assert (await session.stats()).model_loads >= 1


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_default_model_beside_a_tiny_one(anyio_backend: str) -> None:
    ask = "Name three colours."
    async with kvactor.open() as alone:
        want = await (await alone.spawn_agent("s")).generate(ask, max_tokens=8)
    async with kvactor.open(models={"tiny": A, "smol": None}) as session:
        smol = await session.spawn_agent("s", model="smol")
        tiny = await session.spawn_agent("t", model="tiny")
        got = await smol.generate(ask, max_tokens=8)
        await tiny.generate(ask, max_tokens=8)
        assert got.token_ids == want.token_ids and got.text == want.text
        stats = await session.stats()
        assert stats.weights_bytes > 100 << 20  # SmolLM2-135M in fp32, and the tiny one
        assert stats.memory_peak_bytes <= (stats.memory_limit_bytes or 0)
        assert session.models["smol"].n_layers == 30


async def test_models_take_turns_under_contention_and_answer_as_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvactor.actors.engine import _engine as models_engine

    # No fair wait: a loaded model's new turns wait behind the other model's at once, so
    # the two alternate (a turn staged for its cache still runs: no turn goes cold).
    monkeypatch.setattr(models_engine, "FAIR_WAIT_S", 0.0)
    alone = await _solo(A, ["r1", "r2"]) | await _solo(B, ["c1", "c2"])
    limit = swap_limit()
    async with kvactor.open(
        models=MODELS, memory_limit=limit, cache_dir=tmp_path, deterministic=True
    ) as session:
        with anyio.fail_after(60):
            together = await _together(session, ROLES)
        stats = await session.stats()
    assert together == alone
    assert stats.model_loads > 2  # they alternated, not one model's agents all first
    assert stats.memory_peak_bytes <= limit and stats.mlx_peak_bytes <= limit


async def test_hints_reach_each_models_part_and_change_no_answer(tmp_path: Path) -> None:
    alone = await _solo(A, ["r1"]) | await _solo(B, ["c1"])
    async with kvactor.open(models=MODELS, cache_dir=tmp_path) as session:
        agents = {
            n: await session.spawn_agent(n, system=f"you are {n}", model=m)
            for n, m in (("r1", "router"), ("c1", "coder"))
        }
        got: dict[str, list[str]] = {n: [] for n in agents}
        for prompt in PROMPTS:
            await session.hint(next=["c1", "r1", "ghost"], expect_in_s={"c1": 1.0}, done=["x"])
            for name, agent in agents.items():
                got[name].append((await agent.generate(prompt, max_tokens=6)).text)
        assert got == alone
        with pytest.raises(ValueError):
            await session.hint(next=["c1"], prefetch=-1)
