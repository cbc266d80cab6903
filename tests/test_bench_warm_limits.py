"""``bench/warm_limits.py`` at a tiny size of its quick mode (the tiny model): every figure
the issue names is there, the disk limit held throughout and across the restart, and
write-back wrote less than write-through."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import warm_limits  # bench/ is not a package: its folder on sys.path

KEYS = (
    "model",
    "quick",
    "agents",
    "turns",
    "seed",
    "disk_limit_bytes",
    "warm_peak_bytes",
    "over_limit_samples",
    "demoted_cold",
    "re_prefilled_tokens",
    "written_bytes",
    "new_kv_bytes",
    "write_amplification",
    "write_amplification_limited",
    "mlx_lm_write_amplification",
    "restart_over_limit",
    "answers_identical",
    "avg_turns_between_leaving_hot",
    "write_back_written_vs_through",
    "write_back_ttft_vs_through",
    "write_back_avg_turns_between_leaving_hot",
    "write_back_floor_vs_through",
    "wall_s",
)


@pytest.mark.slow  # a bench's run, seconds: the whole suite's
async def test_the_quick_bench_keeps_the_directory_under_its_limit(tmp_path: Path) -> None:
    cfg = replace(
        warm_limits.QUICK, agents=8, turns=3, words=(6, 10), max_tokens=6, workdir=str(tmp_path)
    )
    # In two sittings, as the full mode runs: phase 1 checkpointed, then the rest from it.
    first = await warm_limits.run(replace(cfg, stop_after_unbounded=True))
    assert (tmp_path / warm_limits.CHECKPOINT).is_file() and not (tmp_path / "limited").exists()
    with pytest.raises(SystemExit, match="was made with"):
        warm_limits.load_checkpoint(tmp_path, replace(cfg, seed=1))
    result = await warm_limits.run(replace(cfg, resume=True))
    assert result["unbounded_bytes"] == first["unbounded"]["unbounded_bytes"]
    assert result["answers_identical"]  # against the records the checkpoint kept
    assert not (tmp_path / warm_limits.CHECKPOINT).exists()  # phase 4 changed unbounded/
    with pytest.raises(SystemExit, match="no finished phase 1"):
        warm_limits.load_checkpoint(tmp_path, cfg)
    assert [k for k in KEYS if k not in result] == []
    assert result["quick"] and result["turns"] == 24
    assert result["over_limit_samples"] == 0
    assert result["restart_over_limit"] == 0
    assert 0 < result["warm_peak_bytes"] <= result["disk_limit_bytes"]
    assert result["demoted_cold"] > 0  # a quarter of what they store: the limit bit
    assert result["mlx_lm_write_amplification"] > result["write_amplification"] > 1
    # Write-back: its caches written as they left (never more than left), no write lost,
    # less written than write-through under the same disk limit.
    back = result["write_back"]["back"]
    assert back["written_back"] <= back["demoted_warm"] and back["save_errors"] == 0
    assert result["write_back"]["through"]["written_back"] == 0
    assert 0 < result["write_back_written_vs_through"] < 1
    assert "| over_limit_samples |" in warm_limits.table(result)
    assert "| write_back_written_vs_through |" in warm_limits.table(result)
