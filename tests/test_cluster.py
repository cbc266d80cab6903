"""More than one engine: hosts (``kvactor.actors.host``) in process, and as Ray actors on a
local cluster (127.0.0.1, two hosts, tiny random models): placement, affinity, migration
with the cache (greedy identity, hostile files refused), a host killed mid-turn. The Ray
tests are marked ``ray`` (``-m "not ray"`` leaves them out) and run on asyncio only: each
starts and stops its own local cluster (~10 s)."""

from __future__ import annotations

import functools
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from clustering import local_cluster, tiny
from hinting import FIRST, MAX_TOKENS, NEWCOMER, OPTIONS, SECOND, ask, room_for_one_idle_cache

import kvactor
from kvactor.actors.cluster import EngineHost
from kvactor.actors.engine import default_memory_limit
from kvactor.actors.hot import make_hint
from kvactor.actors.messages import SpawnAgent
from kvactor.actors.models import make_tiny_model
from kvactor.cli._inspect import format_table, inspect_rows

other = functools.partial(make_tiny_model, 1, head_dim=64)  # other weights: another model
GREEDY = {"max_tokens": 6}


async def _talk(host: EngineHost, name: str, text: str) -> kvactor.Completion:
    return await host.generate(name, "text", text, GREEDY)


# ----------------------------------------------------------------------- hosts, in process
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # a host runs on asyncio, as Ray's async actors do


async def test_an_agent_moves_between_hosts_with_its_cache(tmp_path: Path) -> None:
    a = EngineHost("a", tiny, tmp_path / "a")
    b = EngineHost("b", tiny, tmp_path / "b")
    stay = EngineHost("stay", tiny, tmp_path / "stay")
    try:
        for host in (a, stay):
            await host.spawn(SpawnAgent(name="x", system="You help."))
            await _talk(host, "x", "first question")
        files = await a.export("x")  # one portable file, as Agent.export writes it
        assert files.startswith(b"kvactor-agent\n")
        assert await b.adopt("x", files) == len(files)
        moved = await _talk(b, "x", "second question")
        kept = await _talk(stay, "x", "second question")
        # Greedy identity: the moved agent resumes its warm cache (nothing re-prefilled
        # but the new message) and answers as the agent that stayed hot.
        assert moved.path == kvactor.Tier.WARM and kept.path == kvactor.Tier.HOT
        assert moved.token_ids == kept.token_ids
        assert moved.timings.reused_tokens == kept.timings.reused_tokens > 0
        assert await b.history("x") == await stay.history("x")
        # The source still has its files until it is told to forget them.
        assert (tmp_path / "a" / "agents" / "x" / "manifest.json").is_file()
        await a.forget("x")
        assert not (tmp_path / "a" / "agents" / "x").exists()
        info = await b.info()
        assert info.agents == ["x"] and info.migrations_in == 1
    finally:
        for host in (a, b, stay):
            await host.close()


def _corrupt(files: bytes) -> bytes:
    data = bytearray(files)
    data[len(data) // 2] ^= 0xFF  # in a segment's bytes
    return bytes(data)


def _corrupt_files(files: dict[str, bytes]) -> dict[str, bytes]:
    seg = sorted(f for f in files if f.startswith("seg-"))[-1]
    data = bytearray(files[seg])
    data[len(data) // 2] ^= 0xFF
    return {**files, seg: bytes(data)}


async def test_a_host_takes_hints_about_its_agents(tmp_path: Path) -> None:
    """Under a budget with room for a newcomer's turn and one idle cache
    (tests/hinting.py), the least recently used agent goes warm, unless the host is told
    it runs next (strangers named beside it are left out)."""
    budget = await room_for_one_idle_cache(tiny)
    paths = {}
    for hinted in (False, True):
        host = EngineHost("a", tiny, tmp_path / str(hinted), {"budget_bytes": budget, **OPTIONS})
        try:
            for name in (FIRST, SECOND, NEWCOMER):
                await host.spawn(SpawnAgent(name=name))
            for name in (FIRST, SECOND):
                await host.generate(name, "text", ask(name), {"max_tokens": MAX_TOKENS})
            if hinted:
                await host.hint(
                    make_hint(
                        [FIRST, "ghost"], expect_in_s={FIRST: 1.0}, priority={FIRST: 2}, done=["y"]
                    ),
                    1,
                )
            await host.generate(NEWCOMER, "text", ask(NEWCOMER), {"max_tokens": MAX_TOKENS})
            again = await host.generate(FIRST, "text", "again", {"max_tokens": MAX_TOKENS})
            paths[hinted] = again.path
        finally:
            await host.close()
    assert paths == {False: kvactor.Tier.WARM, True: kvactor.Tier.HOT}


async def test_a_host_ends_its_turns(tmp_path: Path) -> None:
    host = EngineHost("a", tiny, tmp_path / "a")
    try:
        assert await host.end_turns() == 0  # not open yet: nothing to end
        await host.spawn(SpawnAgent(name="x", system="You help."))
        await _talk(host, "x", "first question")
        assert await host.end_turns() == 0  # open, nothing running
        with pytest.raises(kvactor.TurnEnded):
            await _talk(host, "x", "second question")
    finally:
        await host.close()


async def test_a_hosts_memory_limit_is_its_share_of_its_nodes(tmp_path: Path) -> None:
    shared = EngineHost("a", tiny, tmp_path / "a", hosts_on_node=2)
    given = EngineHost("b", tiny, tmp_path / "b", {"memory_limit": 1 << 30}, hosts_on_node=2)
    try:
        assert (await shared.info()).stats.memory_limit_bytes == default_memory_limit() // 2
        assert (await given.info()).stats.memory_limit_bytes == 1 << 30
    finally:
        await shared.close()
        await given.close()


async def test_hostile_or_corrupted_files_in_transit_are_refused(tmp_path: Path) -> None:
    a = EngineHost("a", tiny, tmp_path / "a")
    b = EngineHost("b", tiny, tmp_path / "b")
    foreign = EngineHost("f", other, tmp_path / "f")
    try:
        await a.spawn(SpawnAgent(name="x"))
        await _talk(a, "x", "hello")
        files = await a.export("x")
        await foreign.spawn(SpawnAgent(name="x"))
        await _talk(foreign, "x", "hello")
        cases: list[tuple[bytes, str]] = [
            (_corrupt(files), "checksum"),
            (files[: len(files) // 2], "truncated"),
            (files + b"x", "after the end"),
            (b"PK\x03\x04" + files[4:], "not a kvactor agent file"),
            (await foreign.export("x"), "model"),  # another model's cache
        ]
        for bad, reason in cases:
            with pytest.raises(kvactor.CacheRejected, match=reason):
                await b.adopt("x", bad)
            # Nothing of it stays: no agent, no staging folder.
            assert not (tmp_path / "b" / "agents" / "x").exists()
            assert not any((tmp_path / "b" / "incoming").iterdir())
        with pytest.raises(kvactor.InvalidAgentId):
            await b.adopt("../x", files)
        # The good files still move, and the agent's name is then taken there.
        await b.adopt("x", files)
        with pytest.raises(ValueError, match="already exists"):
            await b.adopt("x", files)
        with pytest.raises(kvactor.UnknownAgent):
            await a.export("nobody")
    finally:
        for host in (a, b, foreign):
            await host.close()


async def test_a_replica_takes_the_new_files_verified_and_resumes_as_its_source(
    tmp_path: Path,
) -> None:
    a = EngineHost("a", tiny, tmp_path / "a")
    b = EngineHost("b", tiny, tmp_path / "b")
    source = tmp_path / "a" / "agents" / "x"
    replica = tmp_path / "b" / "replicas" / "agents" / "x"
    try:
        await a.spawn(SpawnAgent(name="x", system="You help."))
        await _talk(a, "x", "first question")
        assert await b.replica_files("x") == []
        await b.keep_replica("x", await a.files("x", []))
        await _talk(a, "x", "second question")
        have = await b.replica_files("x")
        sent, kept, scope = await a.files("x", have)
        # Only the manifest and the new segment travel; the others stay where they are.
        assert kept and "manifest.json" in sent and not set(sent) & set(kept)
        with pytest.raises(kvactor.CacheRejected, match="checksum"):
            await b.keep_replica("x", (_corrupt_files(sent), kept, scope))
        assert await b.replica_files("x") == have  # the replica so far stays whole
        await b.keep_replica("x", (sent, kept, scope))
        files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
        assert {p.name: p.read_bytes() for p in replica.iterdir()} == files
        assert (await b.info()).replicas == ["x"]
        # Its host gone, the replica becomes an agent of b: verified, then resumed warm,
        # answering as the source does.
        await b.promote("x")
        assert (await b.info()).replicas == [] and (await b.info()).warm_agents == ["x"]
        moved = await _talk(b, "x", "third question")
        kept_turn = await _talk(a, "x", "third question")
        assert moved.path == kvactor.Tier.WARM and moved.token_ids == kept_turn.token_ids
        with pytest.raises(kvactor.UnknownAgent):
            await b.promote("nobody")
    finally:
        for host in (a, b):
            await host.close()


SCOPED = "You are the red team's analyst. " + "Check every figure twice. " * 40


async def _shares(host: EngineHost, name: str, scope: str | None) -> int:
    """The tokens a new agent of ``scope`` with the SCOPED system prompt shares on ``host``."""
    await host.spawn(SpawnAgent(name=name, system=SCOPED, scope=scope))
    return (await _talk(host, name, "first question")).timings.shared_tokens


async def test_an_agents_scope_survives_a_restart_a_migration_and_a_promotion(
    tmp_path: Path,
) -> None:
    """A tenant's agent stays in its scope wherever the host resumes it: after the host
    restarts (it resumes from disk), on the host it migrated to, and on the host that
    promoted its replica; an agent of another scope never shares its cache (before scopes
    were kept, a resumed agent was of scope "" and shared its cache with every such
    agent)."""
    a, b, c = (EngineHost(n, tiny, tmp_path / n) for n in "abc")
    try:
        await a.spawn(SpawnAgent(name="s", system=SCOPED, scope="t1"))
        await _talk(a, "s", "first question")
        fork = SpawnAgent(name="f", fork_of="s")  # a fork is of its source's scope
        await a.spawn(fork)
        await c.keep_replica("s", await a.files("s", []))
        await a.close()
        a = EngineHost("a", tiny, tmp_path / "a")  # restarted: "s" resumes from disk
        await _talk(a, "s", "second question")
        assert await a.scope_of("s") == "t1" and await a.scope_of("f") == "t1"
        assert await _shares(a, "stranger", None) == 0
        assert await _shares(a, "mate", "t1") > 0
        # Migrated to b with its scope.
        assert await b.adopt("s", await a.export("s"), await a.scope_of("s")) > 0
        await _talk(b, "s", "third question")
        assert await _shares(b, "stranger", "") == 0
        assert await _shares(b, "mate", "t1") > 0
        # Promoted on c from its replica, with its scope.
        await c.promote("s")
        await _talk(c, "s", "third question")
        assert await c.scope_of("s") == "t1" and await _shares(c, "stranger", None) == 0
        await a.forget("f")
        assert await a.scope_of("f") == ""
    finally:
        for host in (a, b, c):
            await host.close()


async def test_inspect_lists_each_hosts_warm_caches(tmp_path: Path) -> None:
    # A cluster's cache directory: each host's warm tier under hosts/<host>.
    hosts = [EngineHost(n, tiny, tmp_path / "hosts" / n) for n in ("h0", "h1")]
    try:
        for i, host in enumerate(hosts):
            await host.spawn(SpawnAgent(name=f"agent{i}"))
            await _talk(host, f"agent{i}", "hello")
    finally:
        for host in hosts:
            await host.close()
    rows = inspect_rows(tmp_path)
    assert [(r["host"], r["agent"], r["status"]) for r in rows] == [
        ("h0", "agent0", "ok"),
        ("h1", "agent1", "ok"),
    ]
    table = format_table(rows).splitlines()
    assert table[0].split()[:2] == ["HOST", "AGENT"] and table[1].split()[:2] == ["h0", "agent0"]
    assert "HOST" not in format_table(inspect_rows(tmp_path / "hosts" / "h0"))
    # A symlinked hosts/ could lead anywhere: refused, with the reason.
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "linked"
    link.mkdir()
    (link / "hosts").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(kvactor.UnsafeCachePath, match="symlink"):
        inspect_rows(link)


def test_an_application_without_a_cluster_never_imports_ray() -> None:
    code = (
        "import sys, anyio, kvactor\n"
        "from kvactor.actors.models import make_tiny_model\n"
        "async def main():\n"
        "    async with kvactor.open(lambda: make_tiny_model(0, head_dim=64)) as kv:\n"
        "        await (await kv.spawn_agent('a')).generate('hi', max_tokens=2)\n"
        "anyio.run(main)\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -------------------------------------------------------------------------- Ray cluster
@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_placement_affinity_and_migration_on_a_locallocal_cluster(tmp_path: Path) -> None:
    async with local_cluster(tmp_path) as kv:
        hosts = await kv.hosts()
        assert [h.name for h in hosts] == ["h0", "h1"] and hosts[0].pid != hosts[1].pid
        # Placement: the host with the most free budget (none here), then the fewest agents.
        agents = [await kv.spawn_agent(f"a{i}", system="You help.") for i in range(4)]
        assert sorted(a.host for a in agents) == ["h0", "h0", "h1", "h1"]
        pinned = await kv.spawn_agent("pinned", host="h1")
        fork = await kv.spawn_agent("fork", fork_of="a0")  # with its source (affinity)
        assert pinned.host == "h1" and fork.host == agents[0].host
        with pytest.raises(ValueError, match="already exists"):
            await kv.spawn_agent("a1")
        with pytest.raises(ValueError, match="no host"):
            await kv.spawn_agent("z", host="h9")
        with pytest.raises(kvactor.UnknownAgent):
            kv.agent("nobody")
        # Migration keeps greedy identity: a0 moves after its first turn, twin stays.
        home = agents[0].host
        twin = await kv.spawn_agent("twin", system="You help.", host=home)
        for agent in (agents[0], twin):
            first = await agent.generate("first question", **GREEDY)
            assert first.path == kvactor.Tier.COLD or first.timings.shared_tokens > 0
        target = "h1" if home == "h0" else "h0"
        moved = await kv.place("a0", target)
        assert moved is not None and moved.nbytes > 0 and kv.agent("a0").host == target
        assert await kv.place("a0", target) is None
        after = await agents[0].generate("second question", **GREEDY)
        stayed = await twin.generate("second question", **GREEDY)
        assert after.path == kvactor.Tier.WARM and stayed.path == kvactor.Tier.HOT
        assert after.token_ids == stayed.token_ids
        # Carried out of the cluster as one portable file, and in again on the other host.
        out = io.BytesIO()
        info = await agents[0].export(out)
        assert info.agent == "a0" and info.nbytes == len(out.getvalue())
        copy = await kv.import_agent(out.getvalue(), "a0copy", host=home)
        assert copy.host == home
        with pytest.raises(ValueError, match="already exists"):
            await kv.import_agent(out.getvalue(), "a0copy")
        ahead = await copy.generate("what next?", **GREEDY)
        twin_next = await twin.generate("what next?", **GREEDY)
        assert ahead.path == kvactor.Tier.WARM and ahead.token_ids == twin_next.token_ids
        # Streaming through a host, and stats that show hosts and migrations.
        async with agents[1].stream("stream this", **GREEDY) as pieces:
            text = "".join([p async for p in pieces])
        assert pieces.completion is not None and text == pieces.completion.text
        stats = await kv.stats()
        assert [m.agent for m in stats.migrations] == ["a0"]
        where = {a: h.name for h in stats.hosts for a in h.agents}
        assert where["a0"] == target and where["twin"] == home
        # Hints reach the host of each agent they name (strangers are left out).
        await kv.hint(next=["a1", "a0", "ghost"], expect_in_s={"twin": 5.0}, done=["fork"])
        await agents[1].hint(priority=3)
        await agents[1].done()
        again = await agents[1].generate("after the hints", **GREEDY)
        assert again.path == kvactor.Tier.HOT
    # Affinity across sessions: a new session finds each agent on the host whose disk has it.
    async with local_cluster(tmp_path) as kv:
        assert kv.agent("a0").host == target
        again = await kv.agent("a0").generate("third question", **GREEDY)
        assert again.path == kvactor.Tier.WARM and again.timings.reused_tokens > 0
        # Ending the turns (a close to come) reaches every host: nothing starts after it.
        ends = [await kv.spawn_agent(f"end{i}", host=f"h{i}") for i in range(2)]
        assert await kv.end_turns() == 0  # none was running
        for agent in ends:
            with pytest.raises(kvactor.TurnEnded):
                await agent.generate("one more", **GREEDY)


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_host_killed_mid_turn_fails_its_turn_and_comes_back(tmp_path: Path) -> None:
    async with local_cluster(tmp_path) as kv:
        victim = await kv.spawn_agent("victim", host="h0")
        bystander = await kv.spawn_agent("bystander", host="h1")
        await victim.generate("remember this", **GREEDY)
        before = await bystander.generate("hello", **GREEDY)
        pid = {h.name: h.pid for h in await kv.hosts()}["h0"]
        began = time.monotonic()
        with pytest.raises(kvactor.HostLost, match="h0"):
            async with victim.stream("a long answer please", max_tokens=100_000) as pieces:
                async for _ in pieces:
                    os.kill(pid, signal.SIGKILL)  # mid-turn: its first piece has come
        assert time.monotonic() - began < 30  # at once, not after a timeout
        # The other host's agent never noticed; the victim resumes from its warm cache.
        assert (await bystander.generate("hello again", **GREEDY)).path == kvactor.Tier.HOT
        assert before.text
        back = await victim.generate("still there?", **GREEDY)
        assert back.path == kvactor.Tier.WARM and back.timings.reused_tokens > 0
        hosts = {h.name: h.pid for h in await kv.hosts()}
        assert hosts["h0"] != pid  # Ray restarted the host process
        assert (await kv.stats()).lost_hosts == []  # a restarted host is not gone


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_replicas_hand_the_agents_of_a_host_gone_for_good_to_another(
    tmp_path: Path,
) -> None:
    import ray

    async with local_cluster(tmp_path, replicas=2) as kv:
        a = await kv.spawn_agent("a", system="You help.", host="h0")
        gone = await kv.spawn_agent("gone", host="h0")
        twin = await kv.spawn_agent("twin", system="You help.", host="h1")
        b = await kv.spawn_agent("b", host="h1")
        for question in ("first question", "second question"):  # replicas: new files only
            for agent in (a, twin):
                await agent.generate(question, **GREEDY)
        await gone.generate("hello", **GREEDY)
        await b.generate("hello", **GREEDY)
        infos = {h.name: h for h in await kv.hosts()}
        assert infos["h1"].replicas == ["a", "gone"] and infos["h0"].replicas == ["b", "twin"]
        await kv.forget("gone")  # its replica goes too
        assert {h.name: h for h in await kv.hosts()}["h1"].replicas == ["a"]
        history = await a.history()
        # h0's node is lost: Ray does not bring the host back. The next call finds it gone
        # (a clear error, saying where its agents went), and a is h1's agent from then on.
        ray.kill(kv.engine_hosts.any("h0").handle, no_restart=True)
        with pytest.raises(kvactor.HostLost, match=r"gone for good.*a -> h1"):
            await a.generate("third question", **GREEDY)
        stats = await kv.stats()
        assert stats.lost_hosts == ["h0"] and [h.name for h in stats.hosts] == ["h1"]
        assert stats.replication_failures == 0
        assert a.host == "h1" and await a.history() == history
        after = await a.generate("third question", **GREEDY)
        kept = await twin.generate("third question", **GREEDY)
        # Greedy identity: the replica resumes warm, exactly as the twin answers hot.
        assert after.path == kvactor.Tier.WARM and after.timings.reused_tokens > 0
        assert after.token_ids == kept.token_ids
        assert (await b.generate("hello again", **GREEDY)).path == kvactor.Tier.HOT
        with pytest.raises(ValueError, match="gone"):
            await kv.spawn_agent("late", host="h0")


def test_replicas_are_one_or_two(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas"):
        kvactor.open(tiny, cluster="local", cache_dir=tmp_path, replicas=3)


class _LastHost:
    """A placement of one's own: every agent on the host last by name."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def choose(self, agent: str, hosts: Any) -> str:
        self.asked.append(agent)
        return max(h.name for h in hosts)


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_custom_placement_and_rebalance_on_an_autolocal_cluster(tmp_path: Path) -> None:
    """docs/cluster.md: ``cluster="auto"`` starts a local cluster when none runs,
    ``placement=`` takes any object with ``choose(agent, hosts)``, and ``kv.rebalance()``
    evens out the agents per host, each moved with its cache (its next turn WARM on its
    new host, answering as an agent that never moved)."""
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():
        pytest.skip("a Ray cluster runs on this machine: cluster='auto' would join it")
    placement = _LastHost()
    names = [f"a{i}" for i in range(4)]
    async with kvactor.open(
        tiny,
        cluster="auto",
        cache_dir=tmp_path / "cluster",
        hosts_per_node=2,
        ray_options={"num_cpus": 2},
        placement=placement,
    ) as kv:
        agents = [await kv.spawn_agent(n, system="You help.") for n in names]
        assert placement.asked == names and {a.host for a in agents} == {"h1"}
        firsts = [await a.generate("first question", **GREEDY) for a in agents]
        moves = await kv.rebalance()
        assert sorted(m.agent for m in moves) == ["a2", "a3"]  # the last by name moved
        where = {a: h.name for h in (await kv.stats()).hosts for a in h.agents}
        assert sorted(where.values()) == ["h0", "h0", "h1", "h1"]
        assert await kv.rebalance() == []  # even already
        seconds = {n: await kv.agent(n).generate("second question", **GREEDY) for n in names}
    assert {n: d.path for n, d in seconds.items()} == {
        n: kvactor.Tier.WARM if where[n] == "h0" else kvactor.Tier.HOT for n in names
    }
    # A moved agent answers as one that stayed (the same conversation in one session).
    async with kvactor.open(tiny, cache_dir=tmp_path / "alone") as alone:
        stay = await alone.spawn_agent("a3", system="You help.")
        assert (await stay.generate("first question", **GREEDY)).token_ids == firsts[3].token_ids
        again = await stay.generate("second question", **GREEDY)
    assert again.token_ids == seconds["a3"].token_ids
