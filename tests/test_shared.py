"""Shared prefixes: agents whose prompts begin with what another hot cache holds (a shared
context) reuse its stored ranges instead of prefilling them, one copy in the hot budget
and on disk (hard links), with answers equal to independent agents'. Forget reports what
stays for others; the collector removes what no manifest names; kill -9 at any point
leaves every agent loadable. Real engine, files, actors, processes."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.numpy
from multimodels import hot_pool

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import collect, demote_cold, list_agents

pytestmark = pytest.mark.one_backend  # shared prefixes on disk and hot, not the event loop

tiny = functools.partial(make_tiny_model, 0, head_dim=64)
DOC = " ".join(f"Clause {i}: the service keeps record {i} for {i % 7} days." for i in range(40))
MODES: list[kvactor.Attention] = ["dequantized", "quantized"]


def _pool(kv: Any) -> Any:
    return hot_pool(kv)


async def _run(
    share: bool, attention: kvactor.Attention, cache_dir: Path | None = None
) -> list[Any]:
    """Three agents over DOC, two turns each: with a shared context, or independent."""
    async with kvactor.open(
        tiny, cache_dir=cache_dir, share_prefixes=share, attention=attention, ready_copies=False
    ) as kv:
        if share:
            await kv.context("doc", DOC)
        out = []
        for i in range(3):
            if share:
                agent = await kv.spawn_agent(f"a{i}", context="doc")
            else:
                agent = await kv.spawn_agent(f"a{i}", system=DOC)
            first = await agent.generate(f"Which clause is about record {i}?", max_tokens=5)
            second = await agent.generate("And the next one?", max_tokens=5)
            out.append((first, second))
        return out


@pytest.mark.parametrize("attention", MODES)
async def test_agents_over_a_shared_context_reuse_it_and_answer_as_independent_ones(
    attention: kvactor.Attention,
) -> None:
    shared = await _run(True, attention)
    alone = await _run(False, attention)
    for (a1, a2), (b1, b2) in zip(shared, alone, strict=True):
        assert a1.token_ids == b1.token_ids and a2.token_ids == b2.token_ids
        assert a1.timings.shared_tokens > 100 and b1.timings.shared_tokens == 0
        assert a1.timings.prefilled_tokens + a1.timings.shared_tokens == b1.timings.prefilled_tokens
        assert a1.path == Tier.HOT and b1.path == Tier.COLD
        assert a2.timings.shared_tokens == 0  # later turns reuse the agent's own cache


async def _stored(
    share: bool, attention: kvactor.Attention, cache_dir: Path
) -> dict[str, list[Any]]:
    """The stored ranges (segment files, written byte for byte from the hot form) of a
    context and of an agent over it (sharing it, or given its text as its system prompt)."""
    async with kvactor.open(
        tiny, cache_dir=cache_dir, share_prefixes=share, attention=attention
    ) as kv:
        await kv.context("doc", DOC)
        if share:
            agent = await kv.spawn_agent("a", context="doc")
        else:
            agent = await kv.spawn_agent("a", system=DOC)
        await agent.generate("Which clause is about record 3?", max_tokens=5)
        await agent.generate("And the next one?", max_tokens=5)
    folder = cache_dir / "agents"
    return {
        name: [
            safetensors.numpy.load_file(str(folder / name / f"seg-{i}.safetensors"))
            for i in range(1, len(list((folder / name).glob("seg-*.safetensors"))) + 1)
        ]
        for name in ("doc", "a")
    }


@pytest.mark.parametrize("attention", MODES)
async def test_a_system_prompt_is_stored_on_its_own_and_computed_as_if_shared(
    attention: kvactor.Attention, tmp_path: Path
) -> None:
    # An agent that prefills the document as its system prompt stores it as a range of its
    # own (a cut at its end), byte for byte the context's, and computes its own tokens from
    # those stored values: byte for byte what an agent sharing the context stores.
    shared = await _stored(True, attention, tmp_path / "shared")
    alone = await _stored(False, attention, tmp_path / "alone")
    doc = shared["doc"][0]
    assert len(shared["doc"]) == 1 and len(alone["a"]) == len(shared["a"]) == 3
    for ranges in (shared["a"], alone["a"], alone["doc"]):
        assert ranges[0].keys() == doc.keys()
        for name in doc:
            assert ranges[0][name].tobytes() == doc[name].tobytes(), name
    for mine, theirs in zip(alone["a"][1:], shared["a"][1:], strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].tobytes() == theirs[name].tobytes(), name


async def test_shared_arrays_are_the_contexts_own_and_count_once() -> None:
    async with kvactor.open(tiny, ready_copies=False) as kv:
        await kv.context("doc", DOC)
        alone = (await kv.stats()).cache_bytes
        for i in range(4):
            agent = await kv.spawn_agent(f"a{i}", context="doc")
            await agent.generate(f"note {i}", max_tokens=3)
        pool = _pool(kv)
        doc = pool.get("doc").kv
        for i in range(4):
            mine = pool.get(f"a{i}").kv
            assert mine.ranges[0].layers[0][0]["q"] is doc.ranges[0].layers[0][0]["q"]
        stats = await kv.stats()
        own = sum(pool.get(f"a{i}").kv.ranges[-1].nbytes for i in range(4))
        assert stats.cache_bytes == alone + own  # the context's bytes once
        assert stats.shared_turns == 4 and stats.shared_tokens == 4 * len(doc.tokens)
    async with kvactor.open(tiny, ready_copies=False, share_prefixes=False) as kv:
        for i in range(4):
            agent = await kv.spawn_agent(f"a{i}", system=DOC)
            await agent.generate(f"note {i}", max_tokens=3)
        assert (await kv.stats()).cache_bytes > 4 * alone  # four copies


async def test_a_cut_inside_a_shared_range_copies_and_leaves_the_source_whole() -> None:
    async with kvactor.open(tiny, ready_copies=False) as kv:
        await kv.context("doc", DOC)
        a = await kv.spawn_agent("a", context="doc")
        first = await a.generate("Summarise clause 3.", max_tokens=4)
        doc = _pool(kv).get("doc").kv
        held = list(doc.tokens)
        arrays = [id(x) for x in doc.stored_arrays()]
        # A conversation whose system prompt is cut short: a DIVERGE inside the shared range.
        short = [
            {"role": "system", "content": DOC[: len(DOC) // 2]},
            {"role": "user", "content": "Hi"},
        ]
        await a.chat(short, max_tokens=4)
        mine = _pool(kv).get("a").kv
        assert mine.stored_tokens > 0 and mine.tokens[: len(held)] != held
        assert mine.ranges[0].layers[0][0]["q"] is not doc.ranges[0].layers[0][0]["q"]
        # The context never sees it: same tokens, same arrays, and a new agent still shares
        # it and answers as the first one did.
        assert doc.tokens == held and [id(x) for x in doc.stored_arrays()] == arrays
        b = await kv.spawn_agent("b", context="doc")
        again = await b.generate("Summarise clause 3.", max_tokens=4)
        assert again.token_ids == first.token_ids and again.timings.shared_tokens == len(held)


@pytest.mark.slow  # another process: the whole suite's
async def test_on_disk_shared_segments_are_one_file_and_load_in_another_process(
    tmp_path: Path,
) -> None:
    hot = await _run(True, "dequantized", tmp_path)
    agents = tmp_path / "agents"
    doc_seg = next(agents.glob("doc/seg-*.safetensors"))
    for i in range(3):
        mine = agents / f"a{i}" / doc_seg.name
        assert os.stat(mine).st_ino == os.stat(doc_seg).st_ino
        manifest = json.loads((agents / f"a{i}" / "manifest.json").read_bytes())["manifest"]
        assert manifest["segments"][0]["owner"] == "doc"
    assert os.stat(doc_seg).st_nlink == 4
    # Another process: each agent resumes from its warm cache (the linked segment and its
    # own) and its third turn is what the same agent kept hot answers.
    script = textwrap.dedent(
        f"""
        import anyio, functools, json, kvactor
        from kvactor.actors.models import make_tiny_model
        model = functools.partial(make_tiny_model, 0, head_dim=64)
        async def main():
            out = []
            async with kvactor.open(model, cache_dir={str(tmp_path)!r}) as kv:
                for i in range(3):
                    a = await kv.spawn_agent(f"a{{i}}", system={DOC!r})
                    c = await a.generate("One more?", max_tokens=5)
                    out.append([c.token_ids, c.path.value])
            print(json.dumps(out))
        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    reloaded = json.loads(done.stdout.strip().splitlines()[-1])
    async with kvactor.open(tiny, share_prefixes=False, ready_copies=False) as kv:
        for i in range(3):
            agent = await kv.spawn_agent(f"a{i}", system=DOC)
            await agent.generate(f"Which clause is about record {i}?", max_tokens=5)
            await agent.generate("And the next one?", max_tokens=5)
            third = await agent.generate("One more?", max_tokens=5)
            assert reloaded[i] == [third.token_ids, Tier.WARM.value]
    assert hot  # the first session's answers were produced


async def test_a_cold_agent_s_next_write_links_the_prefix_it_shared(tmp_path: Path) -> None:
    # An agent made cold keeps its manifest (no tokens). Its next turn re-prefills over the
    # hot context's ranges, and its write links the context's segment file as a new
    # agent's does, instead of writing those tokens again (one copy on disk); in a new
    # session it resumes warm and answers as an agent kept hot throughout.
    asks = ("Which clause is about record 3?", "And the next one?", "One more?")
    root = tmp_path / "cache"
    async with kvactor.open(tiny, cache_dir=root, ready_copies=False) as kv:
        await kv.context("doc", DOC)
        agent = await kv.spawn_agent("a0", context="doc")
        await agent.generate(asks[0], max_tokens=5)
        identity = kv.identity
    assert identity is not None and demote_cold(root, identity, "a0")
    agents = root / "agents"
    assert not list(agents.glob("a0/seg-*.safetensors"))
    async with kvactor.open(tiny, cache_dir=root, ready_copies=False) as kv:
        await kv.context("doc", DOC)
        agent = await kv.spawn_agent("a0", context="doc")
        again = await agent.generate(asks[1], max_tokens=5)
        assert again.path != Tier.WARM and again.saved  # re-prefilled over the context
        assert (await kv.stats()).shared_turns == 1
    manifest = json.loads((agents / "a0" / "manifest.json").read_bytes())["manifest"]
    first = manifest["segments"][0]
    assert first["owner"] == "doc"
    doc_seg = agents / "doc" / first["file"]
    assert os.stat(agents / "a0" / first["file"]).st_ino == os.stat(doc_seg).st_ino
    async with kvactor.open(tiny, cache_dir=root, ready_copies=False) as kv:
        await kv.context("doc", DOC)
        warm = await (await kv.spawn_agent("a0", context="doc")).generate(asks[2], max_tokens=5)
        assert warm.path == Tier.WARM
    async with kvactor.open(tiny, cache_dir=tmp_path / "hot", ready_copies=False) as kv:
        await kv.context("doc", DOC)
        agent = await kv.spawn_agent("a0", context="doc")
        for ask in asks:
            kept = await agent.generate(ask, max_tokens=5)
    assert warm.token_ids == kept.token_ids


async def test_forget_reports_what_stays_for_others_and_the_last_user_frees_it(
    tmp_path: Path,
) -> None:
    await _run(True, "dequantized", tmp_path)
    agents = tmp_path / "agents"
    doc_seg = next(agents.glob("doc/seg-*.safetensors"))
    size = doc_seg.stat().st_size
    async with kvactor.open(tiny, cache_dir=tmp_path) as kv:
        done = await kv.forget("doc")
        assert [(k.file, k.users) for k in done.kept] == [(doc_seg.name, ["a0", "a1", "a2"])]
        assert 0 < done.freed < size  # its manifest: the segment stays for the agents
        first = await kv.forget("a0")
        assert [k.users for k in first.kept] == [["a1", "a2"]]
        await kv.forget("a1")
        last = await kv.forget("a2")
        assert last.kept == [] and last.freed > size  # the shared file goes with its last user
    assert not any(agents.iterdir())


async def test_context_errors_and_a_second_call_returns_it() -> None:
    async with kvactor.open(tiny) as kv:
        with pytest.raises(ValueError, match="needs some text"):
            await kv.context("doc", "   ")
        with pytest.raises(TypeError):
            await kv.context("doc", 3)  # type: ignore[arg-type]
        with pytest.raises(kvactor.InvalidAgentId):
            await kv.context("../doc", DOC)
        with pytest.raises(kvactor.UnknownAgent, match="make it with context"):
            await kv.spawn_agent("a", context="doc")
        await kv.context("doc", DOC)
        again = await kv.context("doc", DOC)
        assert again is kv.agent("doc")
        with pytest.raises(ValueError, match="another text"):
            await kv.context("doc", DOC + " more")
        busy = await kv.spawn_agent("busy", system="other")
        await busy.generate("hello", max_tokens=2)
        with pytest.raises(ValueError, match="not a shared context"):
            await kv.context("busy", "other")
        with pytest.raises(ValueError, match="at most one"):
            await kv.spawn_agent("b", context="doc", system="x")


# ------------------------------------------------------------------------ kill -9, gc
_CHURN = textwrap.dedent(
    """
    import anyio, functools, sys, kvactor
    from kvactor.actors.models import make_tiny_model
    model = functools.partial(make_tiny_model, 0, head_dim=64)
    DOC = sys.argv[2]
    async def main():
        async with kvactor.open(model, cache_dir=sys.argv[1]) as kv:
            await kv.context("doc", DOC)
            for i in range(1000):
                a = await kv.spawn_agent(f"s{i}", context="doc")
                await a.generate(f"note {i}", max_tokens=2)
                await kv.fork(f"s{i}", f"f{i}")
                print(i, flush=True)
    anyio.run(main)
    """
)


def _check_loadable(root: Path) -> int:
    """Every agent under ``root`` with a manifest loads; returns how many there are."""
    infos = list_agents(root)
    broken = [
        (w.agent, w.rejected) for w in infos if w.rejected and "no manifest" not in w.rejected
    ]
    assert not broken
    for w in infos:
        if not w.rejected:
            manifest = json.loads((root / "agents" / w.agent / "manifest.json").read_bytes())
            for s in manifest["manifest"]["segments"]:
                assert (root / "agents" / w.agent / s["file"]).is_file()
    return sum(not w.rejected for w in infos)


@pytest.mark.slow  # a subprocess or a long load: the whole suite's
@pytest.mark.parametrize("delay", [0.7, 2.0])
def test_kill_9_during_shares_and_forks_leaves_every_agent_loadable(
    tmp_path: Path, delay: float
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHURN, str(tmp_path), DOC],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # one agent and one fork done: the churn is on
        time.sleep(delay)  # the moment under test: kill -9 at two points of the churn
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()
    loadable = _check_loadable(tmp_path)
    assert loadable >= 3
    collect(tmp_path)
    assert collect(tmp_path).removed == []  # idempotent
    assert _check_loadable(tmp_path) == loadable
    # Every cache still answers: a new session resumes one of them warm.
    script = textwrap.dedent(
        f"""
        import anyio, functools, kvactor
        from kvactor.actors.models import make_tiny_model
        model = functools.partial(make_tiny_model, 0, head_dim=64)
        async def main():
            async with kvactor.open(model, cache_dir={str(tmp_path)!r}) as kv:
                a = await kv.spawn_agent("f0", system={DOC!r})
                c = await a.generate("again", max_tokens=2)
                assert c.path.value == "warm", c.path
        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # processes killed: the whole suite's
def test_the_collector_removes_only_what_no_manifest_names_and_survives_kill_9(
    tmp_path: Path,
) -> None:
    import anyio

    anyio.run(_run, True, "dequantized", tmp_path)
    agents = tmp_path / "agents"
    doc_seg = next(agents.glob("doc/seg-*.safetensors"))
    # What killed writers leave: linked and temporary files no manifest names, and a
    # folder that never got its manifest.
    for i in range(300):
        os.link(doc_seg, agents / "a0" / f".seg-9{i}.safetensors.ab{i}.tmp")
        (agents / "a1" / f"seg-{900 + i}.safetensors").write_bytes(b"x" * 64)
    (agents / "half").mkdir()
    os.link(doc_seg, agents / "half" / doc_seg.name)
    before = _check_loadable(tmp_path)
    killer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kvactor.actors.warm import collect; print(1, flush=True); "
            "collect(sys.argv[1])",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert killer.stdout is not None
    killer.stdout.readline()
    killer.send_signal(signal.SIGKILL)
    killer.wait(timeout=60)
    killer.stdout.close()
    assert _check_loadable(tmp_path) == before
    done = collect(tmp_path)
    assert collect(tmp_path).removed == []
    assert not (agents / "half").exists()
    assert not list(agents.glob("a0/.*.tmp")) and not list(agents.glob("a1/seg-9*"))
    assert _check_loadable(tmp_path) == before == 4
    assert os.stat(doc_seg).st_nlink == 4  # doc and the three agents: no one lost it
    assert done.freed >= 0
    # The CLI does the same, under the directory's lock.
    cli = subprocess.run(
        [sys.executable, "-m", "kvactor", "gc", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and "0 unreferenced files removed" in cli.stdout


async def test_agents_share_prefixes_only_within_their_scope() -> None:
    """Two scopes (tenants) with the same system prompt: each scope's second agent shares
    its first one's stored system prompt; no agent ever shares another scope's, so what
    it reuses (and so its timings) says nothing about what another scope cached."""
    async with kvactor.open(tiny, ready_copies=False) as kv:
        reused = {}
        for name, scope in (("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B"), ("n1", "")):
            agent = await kv.spawn_agent(name, system=DOC, scope=scope)
            done = await agent.generate("Which clause is about record 3?", max_tokens=3)
            reused[name] = done.timings.shared_tokens
        assert reused["a1"] == reused["b1"] == reused["n1"] == 0  # first of their scopes
        assert reused["a2"] > 0 and reused["b2"] == reused["a2"]
        with pytest.raises(ValueError, match="scope"):
            await kv.spawn_agent("b3", fork_of="a1", scope="B")
        forked = await kv.spawn_agent("a3", fork_of="a1")
        again = await forked.generate("And record 4?", max_tokens=2)
        assert again.timings.reused_tokens > 0
        with pytest.raises(TypeError):
            await kv.spawn_agent("x", scope=3)  # type: ignore[arg-type]
