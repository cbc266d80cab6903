"""``bench/scale.py`` at a tiny size (the tiny model): every figure the issue names is
there, the directory it builds holds real warm caches (a sample resumes WARM in a new
session), and the turns it timed ran on the tiers it meant."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import kvactor
from kvactor.actors.enums import Tier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scale  # bench/ is not a package: its folder on sys.path

KEYS = (
    "sizes",
    "open_s",
    "open_nolimit_s",
    "open_empty_s",
    "hot_turn_s",
    "hot_turn_1_s",
    "warm_turn_s",
    "spawn_s_per_agent",
    "idle_agent_bytes",
    "idle_agent_traced_bytes",
    "hot_turn_14_vs_10",
    "warm_turn_14_vs_10",
    "hot_turn_14_vs_10_paired",
    "warm_turn_14_vs_10_paired",
    "rows",
    "hot_step_s",
    "hot_room_turn_s",
    "hot_step_14_vs_10",
    "hot_room_turn_14_vs_10",
    "hot_demote_turn_s",
    "hot_demote_turn_14_vs_10",
)


@pytest.mark.slow  # a bench's run, seconds: the whole suite's
async def test_the_bench_measures_real_warm_agents(tmp_path: Path) -> None:
    cfg = replace(
        scale.QUICK,
        sizes=(10, 14),
        hot_sizes=(10, 14),
        rounds=2,
        traced=2,
        verify=4,
        workdir=str(tmp_path),
    )
    result = await scale.run(cfg)
    assert [k for k in KEYS if k not in result] == []
    assert sorted(result["open_s"]) == ["10", "14"]
    assert [w for row in result["rows"] for w in row["wrong_paths"]] == []
    # Side by side: both sizes' turns, each pair's on the tiers meant.
    pair = result["paired"]
    assert pair["pair_agents"] == [10, 14] and pair["pair_wrong_paths"] == []
    rounds = 2 * scale.PAIR_ROUNDS
    assert [len(side) for side in pair["hot_paired_runs"]] == [rounds * scale.HOT_PER_WARM] * 2
    assert [len(side) for side in pair["warm_paired_runs"]] == [rounds, rounds]
    assert all(row["verified"] > 0 for row in result["rows"])
    assert "| hot_turn_14_vs_10_paired (side by side, median of pairs) |" in scale.table(result)
    assert "| hot_step_14_vs_10 |" in scale.table(result)
    # Each timed turn under the full hot budget made room (a ready copy or a demotion).
    assert all(result["hot_room_moves"][n] >= 2 for n in ("10", "14"))
    assert all(result["hot_demote_moves"][n] >= 2 for n in ("10", "14"))
    # A sample of the forks the bench made, never turned: each resumes from disk.
    root = tmp_path / "agents-cache"
    async with kvactor.open(scale.MODEL, cache_dir=root) as kv:
        assert len(await kv.warm_agents()) == 14
        for i in (1, 3, 5):
            agent = await kv.spawn_agent(scale.agent_name(i), system=scale.SYSTEM)
            done = await agent.generate(scale.ASK, max_tokens=2)
            assert done.path == Tier.WARM
