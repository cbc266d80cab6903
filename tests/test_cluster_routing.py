"""Cache-aware placement on a cluster (``kvactor.CacheAware``, the default): hosts say what
they hold as chained block hashes of token prefixes, sent with each turn's result; a new
agent goes to the host that holds the longest prefix of its prompt unless that host is past
its share. Hosts in process (real sessions, tiny random models), and on a local Ray
cluster (marked ``ray``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from clustering import local_cluster, tiny

import kvactor
from kvactor.actors.cluster import (
    BLOCK,
    CacheAware,
    EngineHost,
    HeldPrefixes,
    MostFreeBudget,
    RoundRobin,
    TurnEnd,
    prefix_blocks,
)
from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.messages import SpawnAgent

GREEDY = {"max_tokens": 4}
# Two teams' system prompts, each several blocks long, that differ from their first words.
TEAMS = {
    "red": "You are the red team's analyst. " + "Check every figure twice. " * 40,
    "blue": "You are the blue team's writer. " + "Keep sentences short. " * 40,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # a host runs on asyncio, as Ray's async actors do


def test_block_hashes_chain_a_prefix_and_leave_the_last_part_block_out() -> None:
    tokens = list(range(1000, 1000 + 3 * BLOCK + 10))
    blocks = prefix_blocks(tokens)
    assert len(blocks) == 3 and len(set(blocks)) == 3  # the 10 tokens past them: no block
    assert prefix_blocks(tokens[: 2 * BLOCK]) == blocks[:2]  # a prefix: the same hashes
    changed = [*tokens[:BLOCK], 7, *tokens[BLOCK + 1 :]]
    other = prefix_blocks(changed)
    # A token changed in block 1: block 0 still matches, every later hash differs (chained),
    # even block 2 whose own tokens are the same.
    assert other[0] == blocks[0] and other[1] != blocks[1] and other[2] != blocks[2]
    assert prefix_blocks(tokens[: BLOCK - 1]) == []
    assert all(0 <= b < 1 << 64 for b in blocks)


def test_the_index_counts_whole_prefixes_per_host_and_follows_moves() -> None:
    red, blue = prefix_blocks(list(range(4 * BLOCK))), prefix_blocks(list(range(9, 9 + BLOCK)))
    held = HeldPrefixes()
    held.update("h0", "a", red)
    held.update("h0", "b", red[:2])
    held.update("h1", "c", blue)
    assert held.overlap("h0", red) == 4 * BLOCK and held.overlap("h1", red) == 0
    assert held.overlap("h0", [*red[:3], 12345]) == 3 * BLOCK  # the prompt goes on elsewhere
    held.drop("a")
    assert held.overlap("h0", red) == 2 * BLOCK  # b still holds the first two blocks
    held.move("b", "h1")
    assert held.overlap("h0", red) == 0 and held.overlap("h1", red) == 2 * BLOCK
    assert held.hashes("h0") == 0 and held.hashes("h1") == 3
    assert held.prompts("h0") == 0 and held.prompts("h1") == 2 and held.prompts("h9") == 0
    held.drop("nobody")  # nothing to drop: nothing changes
    assert held.blocks_of("c") == blue and held.blocks_of("nobody") == []
    held.went_cold("h0", ["b", "c"])  # neither is on h0 now: both kept
    assert held.blocks_of("b") == red[:2] and held.blocks_of("c") == blue
    held.went_cold("h1", ["b", "nobody"])
    assert held.blocks_of("b") == [] and held.overlap("h1", red) == 0


async def test_a_host_sends_what_its_agents_hold_with_each_turn_and_at_start(
    tmp_path: Path,
) -> None:
    host = EngineHost("h", tiny, tmp_path / "h")
    try:
        want = await host.prompt_blocks(TEAMS["red"])
        assert len(want) >= 3  # the system prompt is several blocks long
        await host.spawn(SpawnAgent(name="a", system=TEAMS["red"]))
        items = [i async for i in host.turn("a", "text", "first question", GREEDY, False)]
        end = items[-1]
        assert isinstance(end, TurnEnd) and end.completion.token_ids
        # The agent's cache holds its system prompt as the new agent's prompt renders it.
        assert end.blocks[: len(want)] == want and len(end.blocks) >= len(want)
        done = await host.generate("a", "text", "second question", GREEDY)
        assert isinstance(done, kvactor.Completion)
    finally:
        await host.close()
    again = EngineHost("h", tiny, tmp_path / "h")  # the host restarted: its warm caches
    try:
        held = await again.held_blocks()
        assert list(held) == ["a"] and held["a"][: len(want)] == want
        # What placement reads of it (no manifest read) names the same agents.
        assert (await again.load_info()).warm_agents == (await again.info()).warm_agents
        assert (await again.load_info()).warm_agents == ["a"]
    finally:
        await again.close()


async def test_a_host_says_which_agents_went_cold_and_the_front_forgets_them(
    tmp_path: Path,
) -> None:
    # Under a disk limit of about two agents and a hot budget of one turn, the older
    # agents go cold on the host's disk: the next TurnEnd names them, and the front's index
    # (fed as a ClusterTextStream feeds it) stops placing by what they held.
    options: dict[str, object] = {"share_prefixes": False}
    probe = EngineHost("p", tiny, tmp_path / "p", options)
    try:
        await probe.spawn(SpawnAgent(name="a", system=TEAMS["red"]))
        await probe.generate("a", "text", "first question", GREEDY)
        one = (await probe.warm_stats()).disk_bytes
        info = await probe.cache_info("a")
    finally:
        await probe.close()
    room = turn_reserve_bytes(tiny().geometry, info.tokens) + one // 2
    options |= {"disk_limit": int(one * 2.9), "budget_bytes": room}
    host = EngineHost("h", tiny, tmp_path / "h", options)
    held = HeldPrefixes()
    reported: list[str] = []
    try:
        for i in range(5):
            await host.spawn(SpawnAgent(name=f"a{i}", system=TEAMS["red"]))
            items = [x async for x in host.turn(f"a{i}", "text", "first question", GREEDY, False)]
            end = items[-1]
            assert isinstance(end, TurnEnd)
            held.went_cold("h", end.cold)
            held.update("h", f"a{i}", end.blocks)
            reported += end.cold
        (moves,) = (await host.warm_moves({})).values()
        made_cold = {m.agent for m in moves.moves if m.tier == "cold"}
        hot = {c.agent for caches in (await host.board({})).hot.values() for c in caches}
        assert made_cold and set(reported) == made_cold - hot  # each told once it happened
        assert len(reported) == len(set(reported))
        assert "a0" in reported and held.blocks_of("a0") == []
        assert held.blocks_of("a4")  # the newest still holds its prompt there
    finally:
        await host.close()


async def test_cache_aware_goes_where_the_prefix_is_unless_that_host_is_full(
    tmp_path: Path,
) -> None:
    hosts = [EngineHost(f"h{i}", tiny, tmp_path / f"h{i}") for i in range(3)]
    try:
        red = await hosts[0].prompt_blocks(TEAMS["red"])
        blue = await hosts[0].prompt_blocks(TEAMS["blue"])
        for name in ("r0", "r1"):
            await hosts[2].spawn(SpawnAgent(name=name, system=TEAMS["red"]))
        infos = [await h.info() for h in hosts]
        held = HeldPrefixes()
        held.update("h2", "r0", red)
        policy = CacheAware()
        assert policy.choose_prefix("r2", infos, red, held) == "h2"  # the prefix is there
        # No host holds blue: MostFreeBudget's choice (the fewest agents, then by name).
        assert policy.choose_prefix("b0", infos, blue, held) == "h0"
        assert policy.choose("b0", infos) == MostFreeBudget().choose("b0", infos) == "h0"
        # Past its share: h2 holds 4 of 4 agents; a fifth would be past 1.3 times an even
        # share (5/3) and more than ``allowance`` past the least loaded host (0), so the
        # prefix loses to the load.
        for name in ("r2", "r3"):
            await hosts[2].spawn(SpawnAgent(name=name, system=TEAMS["red"]))
        infos = [await h.info() for h in hosts]
        assert CacheAware(allowance=4).choose_prefix("r4", infos, red, held) == "h0"
        assert CacheAware(allowance=5).choose_prefix("r4", infos, red, held) == "h2"
        assert CacheAware(slack=10, allowance=0).choose_prefix("r4", infos, red, held) == "h2"
        # Busy: h2 has 20 turns under way, the others none; past ``queue_allowance`` (16)
        # the prefix loses to the queue, within it the prefix wins.
        busy = msgspec.structs.replace(infos[2].stats, waiting=17, decoding=3)
        queued = [*infos[:2], msgspec.structs.replace(infos[2], stats=busy)]
        assert CacheAware(allowance=5).choose_prefix("r4", queued, red, held) == "h0"
        assert (
            CacheAware(allowance=5, queue_allowance=20).choose_prefix("r4", queued, red, held)
            == "h2"
        )
        # A new prompt goes where the fewest distinct prompts are: h0 holds one (blue's),
        # h1 none, so a third team starts on h1 though both hold no agent.
        held.update("h0", "b0", blue)
        green = await hosts[0].prompt_blocks("You are green. " + "Be brief. " * 60)
        assert policy.choose_prefix("g0", infos, green, held) == "h1"
        assert policy.choose_prefix("short", infos, [], held) == "h0"  # under a block
        robin = RoundRobin()
        assert [robin.choose(n, infos) for n in "abcd"] == ["h0", "h1", "h2", "h0"]
        with pytest.raises(ValueError, match="slack"):
            CacheAware(slack=-1)
        with pytest.raises(ValueError, match="allowance"):
            CacheAware(allowance=-1)
        with pytest.raises(ValueError, match="queue_allowance"):
            CacheAware(queue_allowance=-1)
    finally:
        for h in hosts:
            await h.close()


# ------------------------------------------------------------------- on a local Ray cluster
@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_team_lands_where_its_system_prompt_is(tmp_path: Path) -> None:
    """Two teams arriving interleaved: under the default (cache-aware) placement each
    team's agents go to one host, and every agent after a team's first reuses the team's
    system prompt from another agent's cache; round robin and the most free budget (the
    fewest agents here) split them."""
    order = [("red", 0), ("red", 1), ("blue", 0), ("blue", 1), ("red", 2), ("blue", 2)]
    async with local_cluster(tmp_path / "aware") as kv:
        assert isinstance(kv.placement, CacheAware)
        where: dict[str, set[str]] = {team: set() for team in TEAMS}
        shared = []
        for team, i in order:
            agent = await kv.spawn_agent(f"{team}{i}", system=TEAMS[team])
            where[team].add(agent.host)
            done = await agent.generate("first question", **GREEDY)
            shared.append(done.timings.shared_tokens)
        assert all(len(hosts) == 1 for hosts in where.values())
        assert where["red"] != where["blue"]  # the second team on the other host
        firsts = [k for k, (_, i) in enumerate(order) if i == 0]
        assert [k for k, s in enumerate(shared) if s == 0] == firsts
        # What the front learned came with the turns: a restart of the front learns it
        # from the hosts' disks, and a newcomer of the red team joins its host.
    async with local_cluster(tmp_path / "aware") as kv:
        newcomer = await kv.spawn_agent("red9", system=TEAMS["red"])
        assert {newcomer.host} == where["red"]
    for policy in (RoundRobin(), MostFreeBudget()):
        async with local_cluster(tmp_path / type(policy).__name__, placement=policy) as kv:
            hosts: dict[str, set[str]] = {team: set() for team in TEAMS}
            for team, i in order:
                hosts[team].add((await kv.spawn_agent(f"{team}{i}", system=TEAMS[team])).host)
            assert all(len(h) == 2 for h in hosts.values())
