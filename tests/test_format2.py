"""Caches written by kvactor's format 2 (before recurrent states, checkpoints and format
3) still load: ``tests/data/format2/`` holds two agents' warm caches written by that code
(a tiny llama, and the tiny gemma3_text with its window segments) and the tokens that code
gave for the next turn after reloading them. The fixture is copied, never written."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.models import make_tiny_model

DATA = Path(__file__).parent / "data" / "format2"
EXPECTED = json.loads((DATA / "expected.json").read_text())
SYSTEM = "You are a careful agent."


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_a_format_2_cache_loads_and_resumes_as_it_did(tmp_path: Path, family: str) -> None:
    root = tmp_path / family
    shutil.copytree(DATA / family, root)
    manifest = json.loads((root / "agents" / "one" / "manifest.json").read_bytes())
    assert manifest["manifest"]["format_version"] == 2
    extra = {"head_dim": 64} if family == "llama" else {}
    model = functools.partial(make_tiny_model, 0, family, **extra)
    async with kvactor.open(model, cache_dir=root, attention="dequantized") as kv:
        agent = await kv.spawn_agent("one", system=SYSTEM)
        done = await agent.generate("and the global layers?", max_tokens=10)
    want = EXPECTED[family]
    assert done.path == Tier.WARM
    assert done.timings.reused_tokens == want["reused"]
    assert done.token_ids == want["second"]
