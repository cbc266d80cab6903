"""Forks: a new agent that starts where another is, sharing its cache (arrays in memory,
hard-linked segment files on disk), then goes its own way. Real engine, files, actors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from lively import lively
from mounts import tmpfs
from multimodels import hot_pool

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.models import make_tiny_model

pytestmark = pytest.mark.one_backend  # forks of caches, not the event loop

tiny = functools.partial(make_tiny_model, 0, head_dim=64)
SYSTEM = "You are agent seven."


async def test_a_fork_resumes_from_the_source_cache_and_then_goes_its_own_way() -> None:
    async with kvactor.open(tiny) as kv:
        source = await kv.spawn_agent("src", system=SYSTEM)
        await source.generate("read this long shared document please", max_tokens=6)
        held = (await source.state()).tokens
        engine_before = (await kv.stats()).installs
        fork = await kv.fork("src", "copy")
        # Hot at once, no copy: the fork's stored arrays are the source's own objects.
        pool = hot_pool(kv)  # looking inside: the engine actor's hot tier
        src_kv, fork_kv = pool.get("src").kv, pool.get("copy").kv
        assert fork_kv.tokens == src_kv.tokens and fork_kv is not src_kv
        assert fork_kv.ranges[0].layers[0][0]["q"] is src_kv.ranges[0].layers[0][0]["q"]
        assert (await kv.stats()).installs == engine_before  # nothing read from disk
        assert await fork.history() == await source.history()
        # The same next prompt from the same cache: the same greedy answer, all reused.
        a = await fork.generate("what next?", max_tokens=6)
        b = await source.generate("what next?", max_tokens=6)
        assert a.path == b.path == Tier.HOT
        assert a.timings.reused_tokens == b.timings.reused_tokens > held // 2
        assert a.token_ids == b.token_ids
        # Then they diverge: neither sees the other's turns.
        await fork.generate("only the fork hears this", max_tokens=4)
        await source.generate("only the source hears that", max_tokens=4)
        fork_text = " ".join(m["content"] for m in await fork.history())
        source_text = " ".join(m["content"] for m in await source.history())
        assert "only the fork" in fork_text and "only the source" not in fork_text
        assert "only the source" in source_text and "only the fork" not in source_text
        # Their caches hold their own tokens only.
        assert src_kv.tokens != fork_kv.tokens


async def test_fork_errors() -> None:
    async with kvactor.open(tiny) as kv:
        await (await kv.spawn_agent("a")).generate("hi", max_tokens=2)
        await kv.spawn_agent("b")
        with pytest.raises(kvactor.AgentExists, match="already exists"):
            await kv.fork("a", "b")
        with pytest.raises(kvactor.UnknownAgent):
            await kv.fork("nobody", "c")
        with pytest.raises(kvactor.InvalidAgentId):
            await kv.fork("a", "../c")
        with pytest.raises(ValueError, match="at most one"):
            await kv.spawn_agent("d", system="other", fork_of="a")
        d = await kv.spawn_agent("d", fork_of="a")
        assert await d.history() == await kv.agent("a").history()


async def test_on_disk_a_fork_links_the_source_files_and_outlives_it(tmp_path: Path) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path) as kv:
        source = await kv.spawn_agent("src", system=SYSTEM)
        await source.generate("read this long shared document please", max_tokens=6)
        await kv.fork("src", "copy")
        hot = await kv.agent("copy").generate("what next?", max_tokens=6)
    agents = tmp_path / "agents"
    # The system prompt is a segment of its own (a cut), then the first turn's.
    src_files = sorted(agents.glob("src/seg-*.safetensors"))
    assert len(src_files) == 2
    linked = [agents / "copy" / f.name for f in src_files]
    # One copy of the bytes: the fork's first segments are the source's files, linked.
    for mine, theirs in zip(linked, src_files, strict=True):
        assert os.stat(mine).st_ino == os.stat(theirs).st_ino
        assert os.stat(mine).st_nlink == 2
    manifest = json.loads((agents / "copy" / "manifest.json").read_bytes())["manifest"]
    assert manifest["agent"] == "copy" and manifest["segments"][0]["owner"] == "src"
    assert "owner" not in manifest["segments"][-1] or not manifest["segments"][-1]["owner"]
    # Forget the source: the fork still loads (in another process) and answers the same.
    shared = sum(f.stat().st_size for f in linked)
    async with kvactor.open(tiny, cache_dir=tmp_path) as kv:
        owned = sum(p.stat().st_size for p in (agents / "src").iterdir()) - shared
        done = await kv.forget("src")
        assert done.freed == owned  # the linked segments stay: not freed
        assert [(k.file, k.users) for k in done.kept] == [(f.name, ["copy"]) for f in linked]
    assert not (agents / "src").exists()
    assert all(os.stat(f).st_nlink == 1 for f in linked)
    script = textwrap.dedent(
        f"""
        import anyio, functools, json, kvactor
        from kvactor.actors.models import make_tiny_model
        model = functools.partial(make_tiny_model, 0, head_dim=64)
        async def main():
            async with kvactor.open(model, cache_dir={str(tmp_path)!r}) as kv:
                fork = await kv.spawn_agent("copy")
                history = await fork.history()
                done = await fork.generate("and then?", max_tokens=6)
                print(json.dumps([len(history), done.path, done.timings.reused_tokens]))
        anyio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"},
    )
    n_messages, path, reused = json.loads(out.stdout.strip().splitlines()[-1])
    assert n_messages == 5 and path == "warm" and reused > 0
    # And the hot fork's turn matched what a fork resumed from disk gives.
    async with kvactor.open(tiny, cache_dir=tmp_path / "again") as kv:
        source = await kv.spawn_agent("src", system=SYSTEM)
        await source.generate("read this long shared document please", max_tokens=6)
    async with kvactor.open(tiny, cache_dir=tmp_path / "again") as kv:
        fork = await kv.fork("src", "copy")  # the source is on disk only: linked, then staged
        again = await fork.generate("what next?", max_tokens=6)
        assert again.path == Tier.WARM
        assert again.token_ids == hot.token_ids


async def test_forks_count_once_in_the_hot_budget() -> None:
    async with kvactor.open(tiny, attention="quantized") as kv:
        source = await kv.spawn_agent("src", system=SYSTEM)
        await source.generate("a long shared document " * 20, max_tokens=4)
        alone = (await kv.stats()).cache_bytes
        for i in range(3):
            await kv.fork("src", f"f{i}")
        stats = await kv.stats()
        assert stats.agents_cached == 4
        assert stats.cache_bytes == alone  # the forks hold the source's arrays: no new bytes
        # A fork's own tokens are its own bytes (a cut into a shared range makes its own
        # slices too); the source's still count once.
        await kv.agent("f0").generate("mine", max_tokens=2)
        assert (await kv.stats()).cache_bytes > alone


@pytest.fixture
def fork_folder_elsewhere(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/agents/copy`` as another file system (a tmpfs mounted there): a hard link
    into it fails (EXDEV). Skipped where this process may not mount (not root)."""
    with tmpfs(tmp_path / "agents" / "copy", 64 << 20) as folder:
        yield folder


async def test_a_fork_on_another_file_system_gets_copies_and_resumes_as_its_source(
    tmp_path: Path, fork_folder_elsewhere: Path
) -> None:
    """docs/sharing.md: a fork on disk holds hard links to the source's segment files, a
    copy where links fail: here the fork's folder is another file system. Its files are
    copies (other inodes, the same bytes), and a new session resumes it warm, answering as
    the source does from the same cache."""
    model = lively()  # its tokens depend on its cache (tests/lively.py)
    async with kvactor.open(model, cache_dir=tmp_path) as kv:
        source = await kv.spawn_agent("src", system=SYSTEM)
        await source.generate("read this long shared document please", max_tokens=6)
        await kv.fork("src", "copy")
    src_files = sorted((tmp_path / "agents" / "src").glob("seg-*.safetensors"))
    assert src_files
    for theirs in src_files:
        mine = fork_folder_elsewhere / theirs.name
        assert os.stat(mine).st_dev != os.stat(theirs).st_dev
        assert os.stat(theirs).st_nlink == os.stat(mine).st_nlink == 1
        assert mine.read_bytes() == theirs.read_bytes()
    async with kvactor.open(model, cache_dir=tmp_path) as kv:
        answers = []
        for name in ("copy", "src"):
            agent = await kv.spawn_agent(name, system=SYSTEM)
            answers.append(await agent.generate("what next?", max_tokens=6))
    assert [a.path for a in answers] == [Tier.WARM, Tier.WARM]
    assert answers[0].token_ids == answers[1].token_ids
    assert answers[0].timings.reused_tokens == answers[1].timings.reused_tokens > 0
