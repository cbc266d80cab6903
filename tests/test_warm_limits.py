"""The warm tier's disk limit (``open(disk_limit=)``): what the directory holds stays under
it (counted as stored: a file linked by several agents once), held at rest and across a
restart under a lower limit; agents go cold (their conversation kept, their cache
prefilled again) in the eviction policy's order, never half, and never a staged or busy
one (real tiny models, real files, real kill -9)."""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import anyio
import mlx.core as mx
import msgspec
import numpy as np
import pytest
from lively import lively
from mounts import tmpfs
from test_budget import one_turn_need

import kvactor
from kvactor.actors.enums import Tier
from kvactor.actors.hot import HintBook, Rates, WorkflowPolicy, cold_candidates
from kvactor.actors.messages import Hint, WarmAgent
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import (
    DiskUsage,
    StoreActor,
    collect,
    disk_footprint,
    list_agents,
    read_manifest,
)
from kvactor.actors.warm._manifest import held_answers, held_state
from kvactor.kernels.qcodec import KVCodec

model = functools.partial(make_tiny_model, 0, head_dim=64)
SYSTEM = "You help."
ASK = "hello there " * 5


def on_disk(root: Path) -> int:
    """The bytes the directory's agents hold, each file once (as the limit counts them)."""
    names = [w.agent for w in list_agents(root)]
    return disk_footprint(root, names)[1]


async def _one_agent_bytes(tmp_path: Path) -> int:
    async with kvactor.open(model, cache_dir=tmp_path / "probe", disk_limit=None) as kv:
        agent = await kv.spawn_agent("a", system=SYSTEM)
        await agent.generate(ASK, max_tokens=8)
        return on_disk(tmp_path / "probe")


async def test_the_limit_holds_and_the_least_recently_used_go_cold(tmp_path: Path) -> None:
    one = await _one_agent_bytes(tmp_path)
    limit = int(one * 2.9)  # two agents and the headroom (DiskUsage.headroom)
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=limit, budget_bytes=None) as kv:
        for i in range(6):
            agent = await kv.spawn_agent(f"a{i}", system=SYSTEM)
            done = await agent.generate(ASK, max_tokens=8)
            assert done.saved, done.save_error
            assert on_disk(root) <= limit  # the directory itself, listed
        stats = await kv.warm_stats()
        assert stats.disk_limit_bytes == limit
        assert stats.disk_peak_bytes <= limit and stats.disk_bytes == on_disk(root)
        assert stats.demoted_cold >= 3
        # Each agent made cold is a move of the warm tier's log, with the bytes it freed.
        (moves,) = (await kv.warm_moves()).values()
        assert [(m.kind, m.tier, m.source) for m in moves.moves] == [
            ("demoted", "cold", "warm")
        ] * stats.demoted_cold
        assert moves.moves[0].agent == "a0" and all(m.nbytes > 0 for m in moves.moves)
        assert (await kv.warm_moves({kv.model.name: moves.last}))[kv.model.name].moves == []
        tokens = {w.agent: w.tokens for w in list_agents(root)}
        assert tokens["a5"] > 0 and tokens["a4"] > 0  # the newest stay warm
        assert tokens["a0"] == 0  # the oldest went cold first
    # Cold: its conversation is kept, its cache prefilled again, and the conversation
    # goes on (its answer is the warm resume's: the test below).
    async with kvactor.open(model, cache_dir=root, disk_limit=limit, share_prefixes=False) as kv:
        cold = await kv.spawn_agent("a0", system=SYSTEM)
        assert len(await cold.history()) == 3
        again = await cold.generate("and now?", max_tokens=6)
        assert again.path is Tier.COLD and again.timings.reused_tokens == 0
        assert again.text and len(await cold.history()) == 5


async def test_asking_about_the_least_recently_written_first_makes_the_same_agents_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With more agents on disk than the shortlist (4 here, 64 by default), a write at the
    # limit asks the engine about the 4 least recently written first (LRU answers from
    # them), and the agents that go cold, in order, are those of a run that asks about
    # every agent. The first five agents are used again before the limit bites: the least
    # recently written are then a5, a6, a7, not the first ones written.
    from kvactor.actors.warm import _store

    one = await _one_agent_bytes(tmp_path)
    limit = int(one * 10.5)

    async def cold_order(shortlist: int, root: Path) -> list[str]:
        monkeypatch.setattr(_store, "SHORTLIST", shortlist)
        options: dict[str, Any] = {"disk_limit": limit, "policy": kvactor.LRUPolicy()}
        async with kvactor.open(model, cache_dir=root, **options) as kv:
            agents = [await kv.spawn_agent(f"a{i}", system=SYSTEM) for i in range(18)]
            for agent in agents[:8]:
                assert (await agent.generate(ASK, max_tokens=4)).saved
            for agent in agents[:5]:
                assert (await agent.generate("more", max_tokens=2)).saved
            (moves,) = (await kv.warm_moves()).values()
            assert moves.moves == []  # nothing cold yet
            for agent in agents[8:12]:
                assert (await agent.generate(ASK, max_tokens=4)).saved
            for agent in (agents[8], agents[1], agents[9]):  # used again, at the limit now
                assert (await agent.generate("more", max_tokens=2)).saved
            for agent in agents[12:]:
                assert (await agent.generate(ASK, max_tokens=4)).saved
            (moves,) = (await kv.warm_moves()).values()
            assert (await kv.warm_stats()).disk_peak_bytes <= limit
            return [m.agent for m in moves.moves]

    shortlisted = await cold_order(4, tmp_path / "short")
    everyone = await cold_order(10_000, tmp_path / "all")
    assert everyone[:3] == ["a5", "a6", "a7"] and shortlisted == everyone
    assert "a8" not in everyone[: everyone.index("a10")]  # used again: it went later


async def test_an_imported_agent_is_asked_about_by_the_age_of_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An import keeps the time its cache was written where it was exported: the oldest
    # here, though written last. Among the least recently written it stands by that time,
    # so that asking about the first ones (2 here) still gives LRU's answer: it goes cold
    # first, as it does when every agent is asked.
    from kvactor.actors.warm import _store

    one = await _one_agent_bytes(tmp_path)
    limit = int(one * 6.5)

    async def cold_order(shortlist: int, root: Path) -> list[str]:
        monkeypatch.setattr(_store, "SHORTLIST", shortlist)
        options: dict[str, Any] = {
            "disk_limit": limit,
            "policy": kvactor.LRUPolicy(),
            "budget_bytes": one_turn_need(False),  # the idle agents leave the hot tier
        }
        carried = root.parent / f"{root.name}.kva"
        async with kvactor.open(model, cache_dir=root, **options) as kv:
            old = await kv.spawn_agent("old", system=SYSTEM)
            assert (await old.generate(ASK, max_tokens=4)).saved
            await kv.export_agent("old", carried)
            await kv.forget("old")
            agents = [await kv.spawn_agent(f"a{i}", system=SYSTEM) for i in range(12)]
            for agent in agents[:8]:  # the limit bites: the store lists its agents
                assert (await agent.generate(ASK, max_tokens=4)).saved
            await kv.import_agent(carried, "old")
            for agent in agents[8:]:
                assert (await agent.generate(ASK, max_tokens=4)).saved
            (moves,) = (await kv.warm_moves()).values()
            return [m.agent for m in moves.moves]

    shortlisted = await cold_order(4, tmp_path / "short")
    everyone = await cold_order(10_000, tmp_path / "all")
    assert "old" in everyone and shortlisted == everyone, (shortlisted, everyone)


@pytest.mark.parametrize("folders", [1, 1000])
async def test_the_warm_list_made_beside_the_collector_gives_the_same_cold_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folders: int
) -> None:
    # After open, the store lists its warm agents during the collector's pass, a few
    # folders between its messages, instead of reading every manifest at the first write
    # at the limit. With one folder a step and the pass held after five, that write comes
    # mid-pass (the rest is listed then); with a thousand, after it. Writes during the
    # pass reach the list either way. The agents made cold are those of a store that
    # lists them all at that write.
    from kvactor.actors.warm import _store

    one = await _one_agent_bytes(tmp_path)
    made = tmp_path / "made"
    async with kvactor.open(model, cache_dir=made, disk_limit=None) as kv:
        agents = [await kv.spawn_agent(f"a{i}", system=SYSTEM) for i in range(40)]
        for agent in agents:
            assert (await agent.generate(ASK, max_tokens=4)).saved
        for agent in (agents[16], agents[0], agents[3]):  # the order of writes is not by name
            assert (await agent.generate("more", max_tokens=2)).saved
    shutil.copytree(made, tmp_path / "copied")  # as the copies hold it: no file linked
    # Under it at open, with its headroom and room for a1's short turn (its folder among
    # the first listed): n0's write makes room, mid-pass with one folder a step.
    room = on_disk(tmp_path / "copied") + one // 2
    limit = room
    while limit < room + DiskUsage.headroom(limit):
        limit = room + DiskUsage.headroom(limit)
    listed: list[int] = []  # the folders each list_some call read
    real_list_some = _store.list_some

    def counted(root: Any, names: Any, identity: Any = None) -> Any:
        names = list(names)
        listed.append(len(names))
        return real_list_some(root, names, identity)

    async def cold_order(root: Path) -> list[str]:
        shutil.copytree(made, root)
        hot = one_turn_need(False)  # the idle agents leave the hot tier: asked by write time
        async with kvactor.open(model, cache_dir=root, disk_limit=limit, budget_bytes=hot) as kv:
            for name in ("a1", "n0", "a8", "a2", "a16", "n1", "n2", "n3"):
                agent = await kv.spawn_agent(name, system=SYSTEM)
                assert (await agent.generate("again", max_tokens=2)).saved

            (moves,) = (await kv.warm_moves()).values()
            assert (await kv.warm_stats()).disk_peak_bytes <= limit
            return [m.agent for m in moves.moves]

    monkeypatch.setattr(StoreActor, "sweep_folders", folders)
    if folders == 1:  # the pass stops after 5 folders: the write at the limit comes mid-pass
        steps = iter(range(4))
        go_on = StoreActor._queue_sweep
        monkeypatch.setattr(
            StoreActor, "_queue_sweep", lambda store: next(steps, None) is not None and go_on(store)
        )
    monkeypatch.setattr(_store, "SHORTLIST", 4)  # the list's order asked of, not only its set
    monkeypatch.setattr(_store, "list_some", counted)
    at_once = 0
    real_list_agents = _store.list_agents

    def all_at_once(root: Any, identity: Any = None) -> Any:
        nonlocal at_once
        at_once += 1
        return real_list_agents(root, identity)

    monkeypatch.setattr(_store, "list_agents", all_at_once)
    beside = await cold_order(tmp_path / "beside")
    assert at_once == 0 and sum(listed) >= 40 and 0 not in listed, listed  # once each
    if folders == 1:  # the first write at the limit came mid-pass: it listed the rest
        assert max(listed) > 1, listed
    monkeypatch.setattr(_store.WarmList, "begin", lambda self, folders: None)  # no pass
    everyone = await cold_order(tmp_path / "at-once")
    assert at_once == 1
    assert len(everyone) >= 3 and beside == everyone, (beside, everyone)


@pytest.mark.parametrize("limit", [None, 1 << 30])
async def test_the_bytes_written_are_the_new_files_with_a_limit_or_without(
    tmp_path: Path, limit: int | None
) -> None:
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=limit) as kv:
        agent = await kv.spawn_agent("a", system=SYSTEM)
        assert (await agent.generate(ASK, max_tokens=8)).saved
        first = (await kv.stats()).warm_written_bytes
        assert first >= on_disk(root) > 0  # every file is new (and manifests replaced)
        assert (await agent.generate("and more", max_tokens=8)).saved
        more = (await kv.stats()).warm_written_bytes - first
        assert 0 < more < on_disk(root)  # the new segment and manifest, not the folder


@pytest.mark.parametrize(
    ("turns", "max_tokens", "share", "codec"),
    [
        (3, 12, False, None),
        (4, 20, True, None),
        # Finer steps show a last bit that differs: the answers fed max_batch at a time
        # (stepwise attention), and one a step (a basis that has no stepwise attention).
        (4, 40, False, KVCodec(bits=8, rotate=True)),
        (4, 40, False, KVCodec(bits=8)),
    ],
)
async def test_a_cold_agent_answers_as_it_would_have_warm(
    tmp_path: Path, turns: int, max_tokens: int, share: bool, codec: KVCodec | None
) -> None:
    """A cold manifest keeps the token ids the cache held and where its stored ranges
    ended: the re-prefill is cut there, each range computed from the stored form of the
    ones before, as the cache was made, so the answer is the warm resume's (the lively
    model: its answers depend on every cached value; without the cuts they differ). When
    the next prompt leaves the cache inside its last range (the second shape: the prompt
    renders the last answer's end anew), the warm resume keeps that range's stored form up
    to there, and the re-prefill cuts there too."""
    options: dict[str, Any] = {"deterministic": True, "share_prefixes": share}
    if codec is not None:
        options["codec"] = codec
    asks = [
        "Tell me about the sea " * 8,
        "and the mountains? " * 6,
        "what of rivers " * 7,
        "and lakes " * 5,
    ][:turns]
    await cold_as_warm(tmp_path, lively(), asks, max_tokens, options)


@pytest.mark.slow  # the default model: seconds a turn
async def test_on_the_default_model_a_cold_agent_stores_the_bits_it_stored_warm(
    tmp_path: Path,
) -> None:
    """Where the lively model cannot tell (its attention gives a position the same bits
    alone as in a causal chunk), the default model can: its re-prefill matches the stored
    bits only with each answer's positions attending as their decode steps did (measured:
    with one causal chunk instead, the ranges from the second turn on differ)."""
    rng = random.Random(0)
    words = [
        "river",
        "stone",
        "light",
        "storm",
        "harbor",
        "engine",
        "ledger",
        "signal",
        "market",
        "garden",
    ]
    asks = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(3)]
    await cold_as_warm(tmp_path, None, asks, 16, {"deterministic": True})


async def cold_as_warm(
    tmp_path: Path, model: Any, asks: list[str], max_tokens: int, options: dict[str, Any]
) -> None:
    """An agent's turns on ``asks``, made cold on disk by another agent under a disk limit,
    then one more turn, cold and from a copy kept warm: the same answer, the same bits in
    the ranges both store, and where each answer began kept in both manifests."""
    root, copy = tmp_path / "cache", tmp_path / "warm-copy"
    async with kvactor.open(model, cache_dir=root, disk_limit=None, **options) as kv:
        agent = await kv.spawn_agent("a", system=SYSTEM)
        for text in asks:
            await agent.generate(text, max_tokens=max_tokens)
    shutil.copytree(root, copy)
    limit = int(on_disk(root) * 1.3)  # room for "a" and a little: "b" pushes it out
    async with kvactor.open(model, cache_dir=root, disk_limit=limit, **options) as kv:
        other = await kv.spawn_agent("b", system=SYSTEM)
        for text in asks:
            assert (await other.generate(text, max_tokens=max_tokens)).saved
        identity = kv.identity
        assert identity is not None
    assert {w.agent: w.tokens for w in list_agents(root)}["a"] == 0  # cold on disk
    cold, warm = (read_manifest(where, identity, "a") for where in (root, copy))
    assert cold is not None and warm is not None
    # Where each turn's answer began is kept warm, and cold (with the token ids it held).
    assert len(held_answers(warm, warm.n_tokens)) == len(asks)
    assert held_answers(cold, len(held_state(cold)[0])) == held_answers(warm, warm.n_tokens)
    for bad in ("7", [3, 2], [True], [1.5]):  # hand-edited: none (the cuts still hold)
        assert held_answers(msgspec.structs.replace(warm, extra={"answers": bad}), 99) == []
    answers = []
    for where, path in ((root, Tier.COLD), (copy, Tier.WARM)):
        async with kvactor.open(model, cache_dir=where, disk_limit=None, **options) as kv:
            done = await (await kv.spawn_agent("a", system=SYSTEM)).generate(
                "and now?", max_tokens=12
            )
            assert done.path is path
            answers.append(done.token_ids)
    assert answers[0] == answers[1]
    # Not only the answer: the re-prefilled ranges hold the bytes the turns stored, the
    # answers' tokens fed as they were decoded (Generate.answers). (A prompt that leaves
    # the cache inside its last range keeps that range whole on disk when warm, and only
    # up to there when re-prefilled: the tokens both hold compared.)
    again, kept = stored_ranges(root, "a"), stored_ranges(copy, "a")
    assert len(kept) == len(again) == len(asks) + 2  # the system prompt, the turns, the last
    for (start, stop), (start2, stop2) in zip(sorted(kept), sorted(again), strict=True):
        assert start == start2
        both = min(stop, stop2) - start
        tensors, made = kept[start, stop], again[start2, stop2]
        assert tensors.keys() == made.keys()
        for name, array in tensors.items():
            assert np.array_equal(array[:, :, :both], made[name][:, :, :both]), (start, name)


def stored_ranges(root: Path, agent: str) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Each stored range of ``agent`` in ``root``: its tensors as they are on disk."""
    folder = root / "agents" / agent
    manifest = json.loads((folder / "manifest.json").read_bytes())["manifest"]
    out = {}
    for seg in manifest["segments"]:
        tensors = cast(dict[str, mx.array], mx.load(str(folder / seg["file"])))
        out[seg["start"], seg["stop"]] = {name: np.array(a) for name, a in tensors.items()}
    return out


async def test_a_restart_under_a_lower_limit_brings_the_directory_under_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=None) as kv:
        for i in range(4):
            agent = await kv.spawn_agent(f"a{i}", system=SYSTEM)
            await agent.generate(ASK, max_tokens=8)
    full = on_disk(root)
    lower = full // 2
    async with kvactor.open(model, cache_dir=root, disk_limit=lower) as kv:
        stats = await kv.warm_stats()
        assert stats.disk_bytes == on_disk(root) <= lower  # at open, before any turn
        assert stats.demoted_cold >= 1
        # Whoever went cold resumes its conversation and answers.
        cold = [w.agent for w in list_agents(root) if w.tokens == 0]
        assert cold
        agent = await kv.spawn_agent(cold[0], system=SYSTEM)
        assert len(await agent.history()) == 3
        assert (await agent.generate("go on", max_tokens=3)).text is not None


async def test_a_hot_idle_agent_whose_copy_goes_cold_stays_hot_and_writes_whole(
    tmp_path: Path,
) -> None:
    one = await _one_agent_bytes(tmp_path)
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=int(one * 1.9)) as kv:
        first = await kv.spawn_agent("first", system=SYSTEM)
        await first.generate(ASK, max_tokens=8)
        second = await kv.spawn_agent("second", system="You write poems.")
        await second.generate(ASK, max_tokens=8)  # room for it: "first" goes cold on disk
        info = await kv.cache_info("first")
        assert info.persisted == 0  # still hot, and it knows nothing of it is on disk
        assert {w.agent: w.tokens for w in list_agents(root)}["first"] == 0
        again = await first.generate("more", max_tokens=4)
        assert again.path is Tier.HOT and again.saved
        assert (await kv.cache_info("first")).persisted == len(info_tokens(root, "first"))


def info_tokens(root: Path, agent: str) -> list[int]:
    raw = json.loads((root / "agents" / agent / "manifest.json").read_bytes())
    return list(raw["manifest"]["token_ids"])


def test_done_agents_go_cold_first_and_agents_hinted_soon_last() -> None:
    now = time.time()
    agents = [WarmAgent(name, 1000, 100, now - 60 * i) for i, name in enumerate("abcd")]
    book = HintBook()
    book.apply(Hint(next=("d",), done=("a",)), time.monotonic())  # d: oldest, runs next
    order = WorkflowPolicy().victims(cold_candidates(agents, book, Rates()), 4000)
    assert order[0] == "a" and order[-1] == "d"
    # Without hints: least recently written first.
    plain = WorkflowPolicy().victims(cold_candidates(agents, None, Rates()), 4000)
    assert plain == ["d", "c", "b", "a"]


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1GB", True])
def test_a_bad_disk_limit_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="disk_limit"):
        kvactor.open(model, disk_limit=bad)  # type: ignore[call-overload]


async def test_the_default_limit_is_a_share_of_the_disk_at_most_30_gib(tmp_path: Path) -> None:
    from kvactor.actors.warm import default_disk_limit

    async with kvactor.open(model, cache_dir=tmp_path) as kv:
        stats = await kv.warm_stats()
    # The free space moves a little between the two looks (other files come and go).
    expected = default_disk_limit(tmp_path, stats.disk_bytes)
    assert stats.disk_limit_bytes is not None
    assert abs(stats.disk_limit_bytes - expected) <= expected // 100
    assert 0 < stats.disk_limit_bytes <= 30 << 30


# ------------------------------------------------------------------------------ quotas
def held_by(root: Path, namespace: str) -> int:
    names = [w.agent for w in list_agents(root) if w.agent.startswith(namespace + ".")]
    return disk_footprint(root, names)[1]


async def test_a_tenant_that_floods_agents_makes_only_its_own_cold(tmp_path: Path) -> None:
    one = await _one_agent_bytes(tmp_path)
    quota = int(one * 2.5)
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=None, disk_quota=quota) as kv:
        for name in ("calm.x", "calm.y", "solo"):  # a tenant within its quota, and no tenant
            await (await kv.spawn_agent(name, system=SYSTEM)).generate(ASK, max_tokens=8)
        calm = {w.agent: w.tokens for w in list_agents(root) if w.agent.startswith("calm.")}
        for i in range(7):
            agent = await kv.spawn_agent(f"flood.a{i}", system=SYSTEM)
            done = await agent.generate(ASK, max_tokens=8)
            assert done.saved, done.save_error
            assert held_by(root, "flood") <= quota
        tokens = {w.agent: w.tokens for w in list_agents(root)}
        assert {a: tokens[a] for a in calm} == calm and tokens["solo"] > 0  # untouched
        assert tokens["flood.a6"] > 0 and tokens["flood.a0"] == 0  # its oldest went cold
        assert (await kv.warm_stats()).demoted_cold >= 4
    # A lower quota at a restart: every tenant brought under it at open, by its own agents.
    async with kvactor.open(model, cache_dir=root, disk_limit=None, disk_quota=one + 1):
        assert held_by(root, "calm") <= one + 1 and held_by(root, "flood") <= one + 1
        assert {w.agent: w.tokens for w in list_agents(root)}["solo"] > 0


async def test_an_agent_alone_over_its_quota_keeps_its_conversation(tmp_path: Path) -> None:
    one = await _one_agent_bytes(tmp_path)
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_quota=one // 2) as kv:
        agent = await kv.spawn_agent("t.big", system=SYSTEM)
        done = await agent.generate(ASK, max_tokens=8)
        assert not done.saved and "quota" in str(done.save_error)
        assert len(await agent.history()) == 3
        again = await agent.generate("more", max_tokens=4)  # it goes on, hot
        assert again.path is Tier.HOT


def test_each_namespace_is_counted_as_its_agents_folders_change() -> None:
    """What a namespace holds is kept as folders change (a write under a quota does not sum
    every agent's files): the distinct files its agents list, in every root, after each of
    a seeded run of changes with files linked across agents and namespaces (forks, shared
    prefixes) and a file that grows."""
    rng = random.Random(3)
    usage = DiskUsage(None, quota=1)
    roots = (Path("/m1"), Path("/m2"))
    agents = [f"{ns}.a{i}" for ns in ("t1", "t2", "t3") for i in range(4)] + ["solo"]
    sizes = {(1, i): 100 + i for i in range(30)}
    held: dict[tuple[Path, str], dict[tuple[int, int], int]] = {}
    for step in range(400):
        if step % 50 == 49:  # a file grows, wherever it is listed
            grown = rng.choice(list(sizes))
            sizes[grown] += 7
        root, agent = rng.choice(roots), rng.choice(agents)
        files = {i: sizes[i] for i in rng.sample(list(sizes), rng.randint(0, 4))}
        held[(root, agent)] = files
        usage.update(root, agent, files)
        for r, a in held:  # the grown file's new size as each folder is listed again
            held[(r, a)] = {i: sizes[i] for i in held[(r, a)]}
            usage.update(r, a, held[(r, a)])
        for ns in ("t1", "t2", "t3", "t4"):
            listed = {
                i: n for (_, a), f in held.items() if a.startswith(ns + ".") for i, n in f.items()
            }
            assert usage.used_by(ns) == sum(listed.values()), (step, ns)
        assert usage.namespaces() == {
            a.split(".")[0] for (_, a), f in held.items() if f and "." in a
        }
        everything = {i: n for f in held.values() for i, n in f.items()}
        assert usage.used == sum(everything.values())


@pytest.mark.parametrize(
    ("key", "bad"),
    [("disk_quota", 0), ("disk_quota", 2.5), ("warm_ttl_s", -1), ("warm_ttl_s", "1h")],
)
def test_a_bad_quota_or_ttl_is_refused(tmp_path: Path, key: str, bad: object) -> None:
    options: dict[str, Any] = {key: bad}
    with pytest.raises(ValueError, match=key):
        kvactor.open(model, cache_dir=tmp_path, **options)
    with pytest.raises(ValueError, match="cache_dir"):
        kvactor.open(model, **{**options, key: 100})


# ------------------------------------------------------------------------------ ENOSPC
async def test_a_disk_that_fills_before_the_limit_lowers_it_and_loses_only_cache(
    tmp_path: Path,
) -> None:
    one = await _one_agent_bytes(tmp_path)
    with tmpfs(tmp_path / "small", int(one * 3.5)) as root:
        names = [f"a{i}" for i in range(8)]
        async with kvactor.open(model, cache_dir=root, disk_limit=1 << 30) as kv:
            for name in names:
                agent = await kv.spawn_agent(name, system=SYSTEM)
                done = await agent.generate(ASK, max_tokens=8)
                # The full disk lowered the limit, others went cold, the write went again.
                assert done.saved, done.save_error
            stats = await kv.warm_stats()
            assert stats.disk_limit_bytes is not None and stats.disk_limit_bytes < one * 3.5
            assert stats.demoted_cold >= 1 and stats.disk_bytes == on_disk(root)
            for name in names:  # nothing lost but cache: every conversation is there
                assert len(await kv.agent(name).history()) == 3
            tokens = {w.agent: w.tokens for w in list_agents(root)}
            assert tokens["a7"] > 0 and tokens["a0"] == 0
            again = await kv.agent("a0").generate("and then?", max_tokens=4)
            assert again.saved and again.text is not None


# ------------------------------------------------------------------------------ the TTL
async def test_agents_unused_past_the_ttl_go_cold_and_fresh_ones_stay(tmp_path: Path) -> None:
    root, ttl = tmp_path / "cache", 1.0
    async with kvactor.open(model, cache_dir=root, warm_ttl_s=ttl) as kv:
        for name in ("old1", "old2"):
            await (await kv.spawn_agent(name, system=SYSTEM)).generate(ASK, max_tokens=4)
        written = max(w.updated for w in list_agents(root))
        while time.time() <= written + ttl:  # the TTL is a wall-clock age: let it pass
            await anyio.sleep(written + ttl - time.time() + 0.01)
        fresh = await kv.spawn_agent("fresh", system=SYSTEM)
        assert (await fresh.generate(ASK, max_tokens=4)).saved  # its write looks at ages
        tokens = {w.agent: w.tokens for w in list_agents(root)}
        assert tokens["old1"] == tokens["old2"] == 0 and tokens["fresh"] > 0
        stats = await kv.warm_stats()
        assert stats.expired == 2 and stats.demoted_cold == 2
        assert len(await kv.agent("old1").history()) == 3  # cold, not forgotten
    # At open, whatever is older than the TTL goes cold before any turn.
    written = max(w.updated for w in list_agents(root))
    while time.time() <= written + ttl:
        await anyio.sleep(written + ttl - time.time() + 0.01)
    # (without a disk limit too: nothing is counted, the TTL holds all the same)
    async with kvactor.open(model, cache_dir=root, warm_ttl_s=ttl, disk_limit=None) as kv:
        assert all(w.tokens == 0 for w in list_agents(root))


# ------------------------------------------------------------------- the collector, later
def _leftovers(root: Path) -> list[str]:
    """What a killed writer left under ``root``: files no manifest names, a folder without."""
    agents = root / "agents"
    found = [str(p.relative_to(agents)) for p in agents.glob("*/seg-90.safetensors")]
    found += [str(p.relative_to(agents)) for p in agents.glob("*/.*.tmp")]
    return found + [name for name in ("ghost", "not an id") if (agents / name).exists()]


async def test_what_a_killed_writer_left_goes_after_open_and_leaves_the_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    async with kvactor.open(model, cache_dir=root, disk_limit=None) as kv:
        for i in range(5):
            agent = await kv.spawn_agent(f"a{i}", system=SYSTEM)
            await agent.generate(ASK, max_tokens=4)
    agents = root / "agents"
    for i in range(5):  # a segment and a manifest that were never committed
        (agents / f"a{i}" / "seg-90.safetensors").write_bytes(b"x" * 4096)
        (agents / f"a{i}" / ".manifest.json.1-abcd.tmp").write_bytes(b"{")
    for name in ("ghost", "not an id"):  # a first write that never got its manifest
        (agents / name).mkdir()
        (agents / name / "seg-0.safetensors").write_bytes(b"x" * 4096)
    assert len(_leftovers(root)) == 12
    # Open reads no manifest: the store collects a few folders between its messages.
    monkeypatch.setattr(StoreActor, "sweep_folders", 2)
    async with kvactor.open(model, cache_dir=root, disk_limit=1 << 30) as kv:
        for _ in range(8):  # each message to the store lets the Sweep queued before it go
            if not _leftovers(root):
                break
            await kv.warm_stats()
        assert _leftovers(root) == []
        assert (await kv.stats()).warm_bytes == on_disk(root)  # counted again, without
        agent = await kv.spawn_agent("a3", system=SYSTEM)
        assert (await agent.generate(ASK, max_tokens=2)).path == Tier.WARM


# ------------------------------------------------------------------------------ kill -9
_CHURN = textwrap.dedent(
    """
    import anyio, functools, sys, kvactor
    from kvactor.actors.models import make_tiny_model
    model = functools.partial(make_tiny_model, 0, head_dim=64)
    async def main():
        async with kvactor.open(model, cache_dir=sys.argv[1], disk_limit=int(sys.argv[2])) as kv:
            for i in range(10_000):
                a = await kv.spawn_agent(f"a{i}", system=f"You help with {i % 7}.")
                await a.generate("hello there " * 5, max_tokens=4)
                print(i, flush=True)
    anyio.run(main)
    """
)


@pytest.mark.slow  # thirty processes killed at random points: the whole suite's
async def test_kill_9_during_cold_demotions_leaves_each_agent_warm_or_cold(
    tmp_path: Path,
) -> None:
    one = await _one_agent_bytes(tmp_path)
    root = tmp_path / "cache"
    rng = random.Random(7)
    for point in range(30):
        child = subprocess.Popen(
            [sys.executable, "-c", _CHURN, str(root), str(int(one * 3))],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert child.stdout is not None
            for _ in range(3 if point == 0 else 1):  # past the first demotions
                child.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.4))  # the moment under test
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=60)
            if child.stdout is not None:
                child.stdout.close()
        for w in list_agents(root):  # warm (every file its manifest names) or cold
            if w.rejected and "no manifest" not in w.rejected:
                pytest.fail(f"{w.agent}: {w.rejected}")
            if not w.rejected:
                raw = json.loads((root / "agents" / w.agent / "manifest.json").read_bytes())
                listed = raw["manifest"]["segments"]
                assert (w.tokens == 0) == (listed == [])
                for s in listed:
                    assert os.path.isfile(root / "agents" / w.agent / s["file"])
    collect(root)
    async with kvactor.open(model, cache_dir=root, disk_limit=int(one * 3)) as kv:
        assert (await kv.warm_stats()).disk_bytes <= one * 3


# --------------------------------------------------------------------------------- shown
async def test_the_limit_is_shown_in_stats_metrics_and_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvactor.cli import main as cli
    from kvactor.server._metrics import Metrics

    one = await _one_agent_bytes(tmp_path)
    root = tmp_path / "cache"
    limit = int(one * 2.5)
    async with kvactor.open(model, cache_dir=root, disk_limit=limit) as kv:
        for i in range(4):
            agent = await kv.spawn_agent(f"a{i}", system=SYSTEM)
            await agent.generate(ASK, max_tokens=8)
        stats = await kv.stats()
        assert stats.warm_limit_bytes == limit
        assert 0 < stats.warm_bytes == on_disk(root) <= limit
        assert stats.demoted_warm_to_cold >= 1
        # Exactly what the appends put on disk: at least the segments and manifests there.
        assert stats.warm_written_bytes >= stats.warm_bytes
        metrics = Metrics()
        text = (await metrics.render(kv)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kvactor_warm_bytes"].samples[0].value == stats.warm_bytes
    assert families["kvactor_warm_limit_bytes"].samples[0].value == limit
    written = families["kvactor_warm_written_bytes_total"].samples[0].value
    assert written == stats.warm_written_bytes
    cold = {s.labels["to"]: s.value for s in families["kvactor_demotions_total"].samples}
    assert cold["cold"] >= stats.demoted_warm_to_cold >= 1
    capsys.readouterr()
    assert cli(["inspect", str(root), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["disk_limit_bytes"] == limit
    assert shown["written_today_bytes"] == stats.warm_written_bytes  # recorded at close
    # A second session the same day adds to it.
    async with kvactor.open(model, cache_dir=root, disk_limit=limit) as kv:
        await (await kv.spawn_agent("more", system=SYSTEM)).generate(ASK, max_tokens=8)
        more = (await kv.stats()).warm_written_bytes
    today = stats.warm_written_bytes + more
    assert cli(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["written_today_bytes"] == today


def test_serve_and_scenarios_take_a_disk_limit(tmp_path: Path) -> None:
    from kvactor.cli._main import build_parser
    from kvactor.scenario import parse_scenario
    from kvactor.scenario._models import session_models
    from kvactor.server._cli import _options as session_options

    parser = build_parser()
    args = parser.parse_args(["serve", "--disk-limit", "2G"])
    assert session_options(args)["disk_limit"] == 2 << 30
    args = parser.parse_args(["serve", "--disk-limit", "none"])
    assert session_options(args)["disk_limit"] is None
    args = parser.parse_args(["serve", "--tenant-disk-quota", "512M", "--agent-ttl", "12h"])
    options = session_options(args)
    assert options["disk_quota"] == 512 << 20 and options["warm_ttl_s"] == 12 * 3600
    for bad in (["--agent-ttl", "soon"], ["--agent-ttl", "0"], ["--tenant-disk-quota", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    scenario = parse_scenario(
        'name = "s"\ndisk_limit_mb = 50\n[[agents]]\nname = "a"\nsystem = "x"\n'
        '[[phases]]\nname = "p"\nprompt = "hi"\n'
    )
    assert session_models(scenario)["disk_limit"] == 50_000_000
    from kvactor.cli._demo import _overrides

    args = parser.parse_args(["run", "demo", "--disk-limit", "20M"])
    assert session_models(_overrides(scenario, args))["disk_limit"] == 20 << 20
