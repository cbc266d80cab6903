"""``bench/portable.py`` in its quick mode (the tiny model, a short context): every figure
the issue names is there, and the agent carried by the API and over HTTP answered as its
source."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import portable  # bench/ is not a package: its folder on sys.path

KEYS = (
    "export_bytes",
    "export_vs_fp16_bytes",
    "export_s",
    "import_s",
    "export_floor_s",
    "import_floor_s",
    "export_vs_floor",
    "import_vs_floor",
    "import_floor_plain_s",
    "import_floor_ahead_s",
    "import_durable_floor_s",
    "import_vs_durable_floor",
    "first_token_after_import_s",
    "warm_resume_s",
    "first_token_vs_warm_resume",
    "identical",
    "identical_api",
    "identical_cli",
    "identical_http",
    "mlx_lm_bytes",
    "mlx_lm_save_s",
    "mlx_lm_q4_bytes",
    "mlx_lm_q4_save_s",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # its HTTP leg serves with uvicorn, which runs on asyncio


@pytest.mark.slow  # a bench's run, seconds: the whole suite's
async def test_the_quick_bench_carries_the_agent_and_reports_every_figure() -> None:
    out = await portable.main([200], 1, True)
    figures = out["contexts"]["200"]
    assert set(KEYS) <= set(figures)
    assert figures["identical_api"] is True and figures["identical_http"] is True
    assert figures["identical_cli"] is None  # the CLI loads models by name only
    assert figures["export_bytes"] < figures["mlx_lm_bytes"]
    assert "| 200: export / fp16 |" in portable._table(out)
