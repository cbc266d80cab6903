"""An SSD write budget (``open(write_budget=)``): write-back instead of write-through. A
turn's end commits only the conversation; a cache is written when it leaves the hot tier,
when it is hinted done and when its agent stops or is handed over, while the budget has
room, else it goes cold. Answers never change; a crash loses caches, never text (real
tiny models, real files, a real process killed)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_budget import one_turn_need
from test_warm_limits import SYSTEM, _one_agent_bytes, on_disk

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import list_agents

model = functools.partial(make_tiny_model, 0, head_dim=64)
ASKS = ["the sea " * 4, "and the hills? " * 3, "rivers then " * 3]


def segments(root: Path) -> int:
    """Bytes of segment files under the directory's agents."""
    return sum(p.stat().st_size for p in (root / "agents").glob("*/seg-*.safetensors"))


async def _interleaved(root: Path, **options: Any) -> tuple[list[list[int]], Any, dict[str, int]]:
    """Three agents taking turns in a row under a budget of one turn: each turn demotes
    the agent before it. Their answers, the stats before close, their cached tokens."""
    budget = one_turn_need(False, 128)
    opened = kvactor.open(
        model, cache_dir=root, budget_bytes=budget, attention="dequantized", **options
    )
    async with opened as kv:
        agents = [await kv.spawn_agent(f"a{i}", system="You help.") for i in range(3)]
        outs: list[list[int]] = []
        for text in ASKS:
            for agent in agents:
                done = await agent.generate(text, max_tokens=6)
                assert done.save_error is None
                assert done.saved is ("write_budget" not in options)
                outs.append(done.token_ids)
        stats = await kv.stats()
        tokens = {a.name: (await a.state()).tokens for a in agents}
    return outs, stats, tokens


async def test_write_back_writes_as_caches_leave_and_answers_the_same(tmp_path: Path) -> None:
    through, through_stats, tokens = await _interleaved(tmp_path / "through")
    back, stats, _ = await _interleaved(tmp_path / "back", write_budget=1 << 40)
    assert back == through  # what leaves warm reloads the same bytes either way
    assert through_stats.written_back == 0 and through_stats.warm_writes == 9
    # Each demotion wrote its cache (nothing at the turns' ends); the stop wrote the rest.
    assert stats.written_back == stats.demoted_warm > 0
    assert stats.warm_writes <= stats.written_back  # the last may still be under way
    assert stats.demoted_cold == 0 and stats.write_back_refused == 0
    assert 0 < stats.write_budget_spent == stats.written_back_bytes
    assert {w.agent: w.tokens for w in list_agents(tmp_path / "back")} == tokens
    # Every turn here pushes its neighbour out, so write-back writes what write-through does
    # (bench/warm_limits.py measures a trace where caches stay hot across turns).
    assert segments(tmp_path / "back") <= segments(tmp_path / "through")


async def test_a_spent_budget_writes_no_cache_and_loses_no_text(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _, stats, tokens = await _interleaved(root, write_budget=0)
    assert stats.written_back == 0 and stats.demoted_warm == 0
    assert stats.write_back_refused >= stats.demoted_cold > 0
    assert segments(root) == 0  # only the manifests: each agent's conversation
    async with kvactor.open(model, cache_dir=root, write_budget=0) as kv:
        agent = await kv.spawn_agent("a0", system="You help.")
        assert len(await agent.history()) == 1 + 2 * len(ASKS)
        assert (await agent.state()).tokens == tokens["a0"]
        again = await agent.generate("and now?", max_tokens=4)
        assert again.path is Tier.COLD and again.timings.prefilled_tokens > tokens["a0"]


async def test_done_and_release_write_a_hot_cache(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, write_budget=1 << 40) as kv:
        a = await kv.spawn_agent("a", system="You help.")
        b = await kv.spawn_agent("b", system="You help.")
        await a.generate(ASKS[0], max_tokens=6)
        await b.generate(ASKS[0], max_tokens=6)
        assert {w.agent: w.tokens for w in list_agents(root)} == {"a": 0, "b": 0}
        await kv.hint(done=["a"])  # written now, kept hot
        stats = await kv.stats()
        assert stats.written_back == 1 and stats.agents_cached == 2
        await kv.release("b")  # handed over: written whatever the budget says
        held = {w.agent: w.tokens for w in list_agents(root)}
        assert held == {"a": (await a.state()).tokens, "b": held["b"]} and held["b"] > 0
    async with kvactor.open(model, cache_dir=root, write_budget=1 << 40) as kv:
        again = await (await kv.spawn_agent("b", system="You help.")).generate("more", max_tokens=3)
        assert again.path is Tier.WARM and again.timings.reused_tokens == held["b"]


async def test_a_close_writes_what_the_disk_limit_keeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvactor.cli import main as cli

    one = await _one_agent_bytes(tmp_path)  # one agent's cache after one turn, on disk
    root = tmp_path / "cache"
    limit = int(one * 3.5)  # a0 (two turns) and one other
    names = [f"a{i}" for i in range(6)]
    async with kvactor.open(model, cache_dir=root, disk_limit=limit, write_budget=1 << 40) as kv:
        agents = [await kv.spawn_agent(name, system=SYSTEM) for name in names]
        for agent in agents:
            await agent.generate("hello there " * 5, max_tokens=8)
        await agents[0].generate("hello there " * 5, max_tokens=8)  # a0 the most recent
        stats = await kv.stats()
        assert stats.written_back == 0 and stats.agents_cached == 6  # all hot: notes only
        noted = stats.warm_written_bytes
        recent = (await agents[0].state()).tokens
    # The six caches leave at close, the most recently used first: the limit keeps the
    # first written, and once they fill it the rest are not written only to push each
    # other out.
    assert on_disk(root) <= limit
    held = {w.agent: w.tokens for w in list_agents(root)}
    assert held["a0"] == recent  # the most recent kept
    assert sum(n > 20 for n in held.values()) <= 2  # others may link the system prompt
    capsys.readouterr()
    assert cli(["inspect", str(root), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)["written_today_bytes"]
    assert written - noted < 4 * one  # a0's two turns and one other's: not six caches
    async with kvactor.open(model, cache_dir=root, disk_limit=limit, write_budget=1 << 40) as kv:
        for name in names:  # every conversation kept, cached or not
            agent = await kv.spawn_agent(name, system=SYSTEM)
            assert len(await agent.history()) == (5 if name == "a0" else 3)


async def test_a_days_budget_holds_across_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, write_budget=1 << 40) as kv:
        await (await kv.spawn_agent("a", system=SYSTEM)).generate(ASKS[0], max_tokens=6)
    # Its close wrote the cache, and the directory recorded the day's bytes: spent already.
    async with kvactor.open(model, cache_dir=root, write_budget=1 << 40) as kv:
        stats = await kv.stats()
        assert stats.write_budget_spent == stats.warm_written_today_bytes > 0
    hourly = kvactor.open(model, cache_dir=root, write_budget=1 << 40, write_window_s=3600)
    async with hourly as kv:
        assert (await kv.stats()).write_budget_spent == 0  # the record is per day


def test_a_crash_loses_the_cache_of_unwritten_turns_not_their_text(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import json, os, anyio, kvactor
        from kvactor.actors.models import make_tiny_model

        async def main():
            kv = await kvactor.open(lambda: make_tiny_model(0, head_dim=64),
                                    cache_dir={str(root)!r}, write_budget=1 << 40)
            agent = await kv.spawn_agent("a", system="You help.")
            for text in {ASKS[:2]!r}:
                await agent.generate(text, max_tokens=6)
            state = await agent.state()
            print(json.dumps([state.tokens, await agent.history()]), flush=True)
            os._exit(9)  # no close: what was written is all there is

        anyio.run(main)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 9, out.stderr
    tokens, history = json.loads(out.stdout.strip().splitlines()[-1])
    assert segments(root) == 0  # no cache was written: it never left the hot tier

    async def resume() -> None:
        async with kvactor.open(model, cache_dir=root, write_budget=1 << 40) as kv:
            agent = await kv.spawn_agent("a", system="You help.")
            assert await agent.history() == history
            assert (await agent.state()).tokens == tokens
            done = await agent.generate("and then?", max_tokens=4)
            assert done.path is Tier.COLD  # its turns' cache is prefilled again

    import anyio

    anyio.run(resume)


def test_write_budget_needs_a_warm_tier() -> None:
    with pytest.raises(ValueError, match="cache_dir"):
        kvactor.open(model, write_budget=1 << 30)
    with pytest.raises(ValueError, match="write_budget"):
        kvactor.open(model, cache_dir="/nonexistent", write_budget=-1)
