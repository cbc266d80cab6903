"""``bench/limit_scale.py`` at a tiny size: every figure is there, the disk limit held, and
LRU and the hinted workflow policy answered from the shortlist while the other way asked
about every agent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import limit_scale  # bench/ is not a package: its folder on sys.path

from kvactor.actors.warm import _store

KEYS = (
    "turn_shortlist_s",
    "turn_all_s",
    "turn_shortlist_median_s",
    "turn_all_median_s",
    "engine_shortlist_ms",
    "engine_all_ms",
    "early_answers",
    "asked_all",
    "demoted_cold",
    "disk_peak_bytes",
    "disk_limit_bytes",
    "within_limit",
    "first_turn_at_open_s",
    "first_turn_after_pass_s",
    "collector_pass_s",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_bench_answers_from_the_shortlist_and_holds_the_limit(tmp_path: Path) -> None:
    result = await limit_scale.run([90], 3, str(tmp_path))
    assert [r["policy"] for r in result["rows"]] == ["lru", "workflow"]
    for row in result["rows"]:
        assert [k for k in KEYS if k not in row] == []
        assert row["within_limit"] and row["demoted_cold"] > 0
        assert row["early_answers"] > 0 and row["asked_all"] > 0, row
    assert _store.SHORTLIST == 64  # the bench put it back
    assert "turn at the limit, 90 agents" in limit_scale.table(result)
