"""The hot tier as an object: CachePool's budget, typed answers, demotion and what a policy
sees (real AgentKV caches of a tiny model, real MLX arrays)."""

from __future__ import annotations

import gc
import random
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence

import mlx.core as mx
import pytest

from kvactor.actors.enums import Room, Tier
from kvactor.actors.errors import AgentBusy, BudgetExceeded
from kvactor.actors.hot import (
    CachePool,
    Candidate,
    EvictionPolicy,
    HintBook,
    HotEntry,
    LRUPolicy,
    WorkflowPolicy,
    _hints,
    make_hint,
)
from kvactor.actors.messages import AskWith, WarmAgent, WarmVictims
from kvactor.actors.models import LoadedModel, make_tiny_model
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.qcodec import DEFAULT_CODEC


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    loaded = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(loaded.model)
    return loaded


def new_pool(
    lm: LoadedModel,
    limit: int | None,
    *,
    persistent: bool = True,
    policy: EvictionPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    ready_copies: bool = False,
) -> CachePool:
    return CachePool(
        limit,
        policy or LRUPolicy(),
        persistent=persistent,
        codec=DEFAULT_CODEC,
        geometry=lm.geometry,
        ready_copies=ready_copies,
        clock=clock,
        wall=wall,
    )


def turn(pool: CachePool, lm: LoadedModel, agent: str, n: int, *, persist: bool) -> int:
    """One turn of ``n`` new tokens for ``agent``; its stored bytes after it."""
    entry = pool.claim(agent)
    kv = entry.kv
    work = kv.activate()
    lm.model(mx.array([[7 + i % 50 for i in range(n)]]), cache=work.layers)
    kv.tokens.extend(7 + i % 50 for i in range(n))
    pool.end_turn(agent, entry, finished=True)  # the agent writes the new tokens next
    if persist:
        exported = pool.export(agent)
        pool.written(agent, exported.export_id, len(exported.tokens))
    return kv.stored_bytes


def test_room_answers_are_typed_and_count_in_the_budget(lm: LoadedModel) -> None:
    pool = new_pool(lm, 100_000)
    size = turn(pool, lm, "hot", 20, persist=False)
    held = 2 * size  # its stored cache, and the room its export (to come) will pin
    assert pool.reserve("hot", 10) is Room.HOT
    assert pool.reserve("big", 100_001) is Room.TOO_BIG
    assert pool.reserve("a", 50_000) is Room.RESERVED
    assert pool.reserve("a", 50_000) is Room.RESERVED  # held already
    assert pool.measure() == held + 50_000
    # "hot" is not on disk: it cannot be demoted, so there is no room for another staging.
    assert pool.reserve("b", 100_000 - held - 49_999) is Room.NO_ROOM
    pool.release("a")
    assert pool.measure() == held
    assert pool.reserve("b", 40_000) is Room.RESERVED
    installed = pool.warm.install("b", 0, lambda: AgentKV(DEFAULT_CODEC, lm.geometry), pin=True)
    assert installed and pool.warm.installs == 1 and "b" in pool
    with pytest.raises(BudgetExceeded):
        pool.warm.install("c", 200_000, lambda: AgentKV(DEFAULT_CODEC, lm.geometry), pin=False)


def test_a_finished_turns_export_holds_its_room_from_the_turns_end(lm: LoadedModel) -> None:
    # Between a turn's end and its agent's export, the bytes the export will pin count: a
    # staging granted in that gap would put the budget over once the export pins them.
    size = turn(new_pool(lm, None), lm, "x", 20, persist=False)
    pool = new_pool(lm, 2 * size + 10)
    assert turn(pool, lm, "a", 20, persist=False) == size  # ended; its write is due
    assert pool.measure() == 2 * size  # stored, and its export to come
    assert pool.reserve("b", size) is Room.NO_ROOM  # "a" cannot go: it is being written
    exported = pool.export("a")
    # The export's views are the resident cache's arrays: counted once while "a" stays.
    assert pool.measure() == size
    pool.written("a", exported.export_id, len(exported.tokens))
    assert pool.measure() == size
    assert pool.reserve("b", size) is Room.RESERVED


def test_demotion_is_least_recent_first_and_counted_by_tier(lm: LoadedModel) -> None:
    for persistent, tier in ((True, Tier.WARM), (False, Tier.COLD)):
        pool = new_pool(lm, None, persistent=persistent)
        sizes = {a: turn(pool, lm, a, 30, persist=True) for a in ("old", "mid", "new")}
        turn(pool, lm, "unsaved", 30, persist=False)
        pool.limit = pool.measure()  # full (with unsaved's export to come, when persistent)
        assert pool.make_room(sizes["old"])
        assert "old" not in pool and {"mid", "new", "unsaved"} <= {
            a for a in ("mid", "new", "unsaved") if a in pool
        }
        assert pool.demotions[tier] == 1 and pool.peak <= pool.limit
        # A request bigger than all that can be freed demotes nobody.
        assert not pool.make_room(pool.limit + 1)
        assert "mid" in pool and "new" in pool


def test_a_policy_sees_what_it_needs_to_beat_lru(lm: LoadedModel) -> None:
    seen: list[Candidate] = []

    class Record:
        def victims(self, candidates: Sequence[Candidate], need: int) -> list[str]:
            seen.extend(candidates)
            return LRUPolicy().victims(candidates, need)

    pool = new_pool(lm, None, policy=Record())
    turn(pool, lm, "a", 40, persist=True)
    turn(pool, lm, "a", 8, persist=True)  # a second turn that found it hot
    turn(pool, lm, "b", 16, persist=True)
    turn(pool, lm, "dirty", 16, persist=False)  # being written: not a candidate yet
    assert pool.reserve("b", 1) is Room.HOT  # a prefetch hint for a hot agent
    pool.limit = pool.measure()
    assert pool.make_room(1)
    by_agent = {c.agent: c for c in seen}
    assert set(by_agent) == {"a", "b"}
    a, b = by_agent["a"], by_agent["b"]
    assert (a.tokens, a.hits, b.hits) == (48, 1, 0)
    assert a.nbytes > b.nbytes > 0
    assert a.tier is Tier.HOT and a.demote_to is Tier.WARM and a.clean
    assert a.reload_s > 0 and a.next_use is None and b.next_use is not None
    assert a.last_used < b.last_used


def test_turn_reserves_count_until_the_turn_ends_and_stuck_says_when_nothing_frees(
    lm: LoadedModel,
) -> None:
    pool = new_pool(lm, 1_000_000)
    entry = pool.claim("x")
    assert pool.start_turn(entry, 900_000)
    assert pool.committed() == 900_000
    assert not pool.start_turn(pool.claim("y"), 200_000)  # must wait for x
    assert not pool.stuck()  # x's turn will end
    entry.kv.activate()
    entry.kv.deactivate()
    pool.end_turn("x", entry)
    assert pool.committed() == 0
    pool.drop("x")
    assert not pool.start_turn(pool.claim("z"), 2_000_000)
    assert pool.stuck()  # nothing running, staged or being written: y's cache is empty


def test_a_queued_turn_never_holds_room_the_turn_ahead_of_it_needs(lm: LoadedModel) -> None:
    pool = new_pool(lm, None)
    sizes = {a: turn(pool, lm, a, 40, persist=True) for a in ("head", "queued")}
    head, queued = pool.claim("head"), pool.claim("queued")  # both turns queued, in order
    pool.limit = sum(sizes.values()) + 1000
    # The head's turn fits alone: the queued turn's cache goes warm to make room for it.
    assert pool.start_turn(head, 1000 + sizes["queued"])
    assert "queued" not in pool and pool.demotions[Tier.WARM] == 1
    assert pool.committed() <= pool.limit
    with pytest.raises(AgentBusy):  # its turn is still queued, though its cache is gone
        pool.claim("queued")
    head.kv.activate()
    head.kv.deactivate()
    pool.end_turn("head", head)
    again = pool.adopt("queued")  # what its turn starts from now: an empty cache
    assert again is not queued and pool.busy("queued") and len(again.kv.tokens) == 0


def test_a_cache_no_write_will_save_may_go_cold_but_one_being_written_waits(
    lm: LoadedModel,
) -> None:
    pool = new_pool(lm, None)
    size = turn(pool, lm, "a", 40, persist=False)  # its write is due
    pool.limit = size + 100
    entry = pool.claim("b")
    assert not pool.start_turn(entry, 1000)
    assert not pool.stuck(entry)  # a's write will end: then a can go warm
    exported = pool.export("a")
    assert not pool.stuck(entry)
    pool.written("a", exported.export_id, exported.persisted, failed=True)
    cache = pool.get("a")
    assert cache is not None and cache.persisted == 0 and not cache.clean
    assert (pool.warm.writes, pool.warm.write_failures) == (0, 1)
    # A next write would start where the disk copy ends.
    again = pool.export("a")
    assert again.persisted == 0 and again.ranges[0][0] == 0
    pool.written("a", again.export_id, again.persisted, failed=True)
    # Nothing will save it now: it may go cold (its older warm copy, if any, stays), so
    # the waiting turn neither hangs nor fails.
    assert pool.start_turn(entry, 1000)
    assert "a" not in pool and pool.demotions[Tier.COLD] == 1


def test_the_prefix_index_finds_the_longest_boundary_and_checks_every_hit() -> None:
    from kvactor.actors.hot._prefix_index import PrefixIndex

    index = PrefixIndex()
    caches = {"a": [1, 2, 3, 4, 5, 6], "b": [1, 2, 3, 9, 9]}
    index.update("a", caches["a"], [2, 4, 6], 0)
    index.update("b", caches["b"], [3, 5], 1)

    def holds(agent: str, stop: int, count: int) -> bool:
        return caches[agent][:stop] == prompt[:stop]

    prompt = [1, 2, 3, 4, 5, 7, 8]
    assert index.longest(prompt, len(prompt) - 1, "me", holds) == (4, "a", 2)
    assert index.longest(prompt, 3, "me", holds) == (3, "b", 1)  # the limit
    assert index.longest(prompt, 6, "a", holds) == (3, "b", 1)  # not its own
    # A trim keeps the boundaries below it; a hit that the cache does not hold is refused.
    caches["a"] = [1, 2, 7]
    index.update("a", caches["a"], [2], 0)
    assert index.longest(prompt, 6, "me", holds) == (3, "b", 1)
    assert index.longest(prompt, 6, "me", lambda *_: False) is None
    # Among agents ending at one boundary the lowest rank wins, whichever came in first.
    caches["c"] = caches["b"][:3]
    index.update("c", caches["c"], [3], -1)
    assert index.longest(prompt, 6, "me", holds) == (3, "c", 1)
    assert index.longest(prompt, 6, "c", holds) == (3, "b", 1)
    index.remove("c")
    index.check()
    index.remove("b")
    assert index.longest(prompt, 6, "me", holds) == (2, "a", 1)
    index.remove("a")
    assert index.longest(prompt, 6, "me", holds) is None
    # nothing left behind
    assert not index._stops and not index._at and not index._of and not index._rank


def test_the_prefix_index_agrees_with_a_search_of_every_boundary() -> None:
    # Random caches forking from shared prefixes at random boundaries, prompts that
    # branch off them anywhere: the index (prompt hashed once, every prefix in one pass)
    # finds what comparing the prompt with every boundary of every cache finds.
    from kvactor.actors.hot._prefix_index import PrefixIndex, prefix_hashes

    rng = random.Random(7)
    roots = [[rng.randrange(50) for _ in range(rng.randrange(100, 5000))] for _ in range(3)]
    caches: dict[str, list[int]] = {}
    bounds: dict[str, list[int]] = {}
    index = PrefixIndex()
    # Ranks in no relation to the order of updating (the lowest wins a tied boundary), and
    # agents updated again later: the holders of a boundary stay in rank order.
    ranks = rng.sample(range(1000), 40)
    for step in range(80):
        i = step if step < 40 else rng.randrange(40)
        if step >= 40 and rng.random() < 0.5:  # a turn extends its cache by a range
            tokens = caches[f"a{i}"] + [rng.randrange(50) for _ in range(rng.randrange(1, 99))]
            stops = [*bounds[f"a{i}"], len(tokens)]
        else:  # a cache of its own (again: the agent left and came back)
            index.remove(f"a{i}")
            root = rng.choice(roots)
            keep = rng.randrange(1, len(root))
            tokens = root[:keep] + [rng.randrange(50) for _ in range(rng.randrange(0, 300))]
            stops = sorted(rng.sample(range(1, len(tokens) + 1), min(4, len(tokens))))
        caches[f"a{i}"], bounds[f"a{i}"] = tokens, stops
        index.update(f"a{i}", tokens, stops, ranks[i])
    index.check()

    def order(agent: str) -> int:
        return ranks[int(agent[1:])]

    def holds(agent: str, stop: int, count: int) -> bool:
        return bounds[agent][count - 1] == stop and caches[agent][:stop] == prompt[:stop]

    def searched(limit: int, exclude: str) -> tuple[int, str, int] | None:
        hits = [
            (stop, agent, count)
            for agent, stops in bounds.items()
            for count, stop in enumerate(stops, start=1)
            if agent != exclude and stop <= limit and caches[agent][:stop] == prompt[:stop]
        ]
        return min(hits, key=lambda h: (-h[0], order(h[1])), default=None)

    for _ in range(60):
        root = rng.choice([*roots, *caches.values()])
        prompt = [*root[: rng.randrange(1, len(root) + 1)], rng.randrange(50)]
        limit = rng.choice([len(prompt) - 1, rng.randrange(len(prompt))])
        exclude = rng.choice(sorted(caches))
        assert index.longest(prompt, limit, exclude, holds) == searched(limit, exclude)
    tokens = roots[0]
    hashes = prefix_hashes(tokens, len(tokens))
    assert len(hashes) == len(tokens) + 1 and len(set(hashes.tolist())) == len(hashes)
    assert (prefix_hashes([*tokens[:100], 1, 2], 100) == hashes[:101]).all()
    assert len(prefix_hashes([-1, 2**40], 2)) == 3  # any id a list holds hashes


def test_the_least_recently_written_alone_give_lru_s_answer_or_none(lm: LoadedModel) -> None:
    # A write at the disk limit asks about the first agents in write order only
    # (WarmVictims.beyond); the answer, when there is one, is the answer for all of them.
    # Hot agents rank by their last turn, not their write: written long ago but used at
    # t=1000 (then they may be among those asked yet rank after ones left out), or written
    # last (then left out, yet ranking before some of those asked).
    now = [1000.0]
    offset = 1e9  # the wall clock, ahead of the monotonic one
    pool = new_pool(lm, None, clock=lambda: now[0], wall=lambda: now[0] + offset)
    hot = ("h0", "h1", "h2")
    for name in hot:
        turn(pool, lm, name, 10, persist=True)
    now[0] = 2000.0
    rng = random.Random(3)
    answered = refused = 0
    for round_ in range(400):
        written = (0, 10) if round_ % 2 else (1900, 1999)
        agents = [
            WarmAgent(f"w{i:03d}", rng.randrange(1, 100), 10, offset + rng.uniform(10, 1500))
            for i in range(60)
        ] + [WarmAgent(h, rng.randrange(1, 100), 10, offset + rng.uniform(*written)) for h in hot]
        agents.sort(key=lambda a: a.updated)
        k = rng.randrange(1, len(agents))
        need = rng.randrange(1, 4000)
        full = pool.demotion.choose_cold(WarmVictims(agents, need))
        part = pool.demotion.choose_cold(WarmVictims(agents[:k], need, agents[k].updated))
        if part is None:
            refused += 1
        else:
            answered += 1
            assert part == full, (round_, k, need)
    assert answered > 100 and refused > 100  # both ways, often

    class Custom(LRUPolicy):  # any other policy: its order is not known, never early
        pass

    pool.demotion.policy = Custom()
    assert pool.demotion.choose_cold(WarmVictims(agents[:1], 1, agents[1].updated)) is None


def test_the_least_recently_written_alone_give_workflow_s_answer_or_none(
    lm: LoadedModel,
) -> None:
    # The same with the hints: agents, some of them left out, marked done, given a
    # priority (lower or higher) or expected soon or late; the answer from the first in
    # write order, when there is one, is the answer for all of them.
    now = [1000.0]
    offset = 1e9
    pool = new_pool(lm, None, clock=lambda: now[0], wall=lambda: now[0] + offset)
    pool.demotion.policy = WorkflowPolicy(clock=lambda: now[0])
    for name in ("h0", "h1"):
        turn(pool, lm, name, 10, persist=True)
    now[0] = 2000.0
    rng = random.Random(5)
    answered = refused = asked_with = held_back = 0
    for round_ in range(400):
        agents = [
            WarmAgent(f"w{i:03d}", rng.randrange(1, 100), 10, offset + rng.uniform(10, 1500))
            for i in range(60)
        ] + [
            WarmAgent(h, rng.randrange(1, 100), 10, offset + rng.uniform(0, 1999))
            for h in ("h0", "h1")
        ]
        agents.sort(key=lambda a: a.updated)
        names = [a.agent for a in agents]
        for name in names:
            pool.hints.forget(name)
        some = rng.sample(names, rng.randrange(0, 6))
        pool.hints.apply(
            make_hint(
                done=some[:2],
                expect_in_s={a: rng.uniform(0, 500) for a in some[2:4]},
                priority={a: rng.choice((-2, -1, 1, 3)) for a in some[3:]},
            ),
            now[0],
        )
        k = rng.randrange(1, len(agents))
        need = rng.randrange(1, 3000)
        full = pool.demotion.choose_cold(WarmVictims(agents, need))
        part = pool.demotion.choose_cold(WarmVictims(agents[:k], need, agents[k].updated))
        if isinstance(part, AskWith):  # asked again with the agents it named
            assert part.agents and not set(part.agents) & set(names[:k])
            more = [a for a in agents[k:] if a.agent in part.agents]
            # The least recently written of them, the rest held back (some of it hot).
            j = rng.randrange(0, len(more) + 1)
            again = WarmVictims(
                agents[:k] + more[:j],
                need,
                agents[k].updated,
                checked=part.agents,
                held_back=tuple(a.agent for a in more[j:]),
                held_beyond=more[j].updated if j < len(more) else 0.0,
            )
            part = pool.demotion.choose_cold(again)
            assert not isinstance(part, AskWith)
            asked_with += 1
            held_back += j < len(more)
        if part is None:
            refused += 1
        else:
            answered += 1
            assert part == full, (round_, k, need, some)
    assert answered > 100 and refused > 100 and asked_with > 20 and held_back > 10, (
        answered,
        refused,
        asked_with,
        held_back,
    )  # each way, often


def test_a_done_agent_left_out_is_asked_about_and_once_cold_left_out(
    lm: LoadedModel,
) -> None:
    # A done agent left out of those asked goes first, so the first ones alone cannot
    # answer: the engine names it, and asked again with it, answers as if asked of all.
    # Once it went cold, the first ones alone answer again.
    offset, now = 1e9, 2000.0
    pool = new_pool(lm, None, clock=lambda: now, wall=lambda: now + offset)
    pool.demotion.policy = WorkflowPolicy(clock=lambda: now)
    agents = [WarmAgent(f"w{i:03d}", 10, 10, offset + i) for i in range(100)]
    pool.hints.apply(make_hint(done=["w090"]), now)
    beyond = agents[50].updated
    assert pool.cold_victims(WarmVictims(agents[:50], 15, beyond)) == AskWith(("w090",))
    asked = WarmVictims([*agents[:50], agents[90]], 15, beyond)
    assert pool.demotion.choose_cold(asked) == ["w090", "w000"]
    assert pool.cold_victims(WarmVictims(agents, 15)) == ["w090", "w000"]
    left = [a for a in agents if a.agent not in ("w090", "w000")]
    assert pool.cold_victims(WarmVictims(left[:50], 15, left[50].updated)) == ["w001", "w002"]


def test_named_agents_held_back_bound_the_answer_by_their_last_use(lm: LoadedModel) -> None:
    # Of the done agents an AskWith names, the store sends the least recently written and
    # holds back the rest, written later. A hot one held back may have been used before
    # its write: its last turn bounds the answer, and the engine refuses (the store then
    # asks all) where the full answer puts it first.
    offset, now = 1e9, [5.0]
    pool = new_pool(lm, None, clock=lambda: now[0], wall=lambda: now[0] + offset)
    pool.demotion.policy = WorkflowPolicy(clock=lambda: now[0])
    turn(pool, lm, "h", 10, persist=True)  # its last turn at 5
    now[0] = 2000.0
    agents = [WarmAgent(f"w{i:03d}", 10, 10, offset + i) for i in range(100)]
    hot = WarmAgent("h", 10, 10, offset + 95)  # its warm copy dated later than its turn
    pool.hints.apply(make_hint(done=["w090", "h"]), now[0])
    beyond = agents[50].updated
    asked = pool.demotion.choose_cold(WarmVictims(agents[:50], 10, beyond))
    assert isinstance(asked, AskWith) and set(asked.agents) == {"w090", "h"}
    full = pool.demotion.choose_cold(WarmVictims([*agents, hot], 10))
    assert full == ["h"]  # used at 5, before w090's write at 90
    sent = [*agents[:50], agents[90]]
    again = WarmVictims(sent, 10, beyond, asked.agents, held_back=("h",), held_beyond=hot.updated)
    assert pool.demotion.choose_cold(again) is None
    # Were h no candidate (not warm any more: not held back), w090 would be the answer.
    assert pool.demotion.choose_cold(WarmVictims(sent, 10, beyond, asked.agents)) == ["w090"]


def test_a_hint_book_counts_its_ranks_as_hints_come_and_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # lowest_rank is kept by counting, not by a pass over the agents: it must agree with
    # one over the agents in a tier (not made cold since their last turn) after every
    # change, the book's limit (here 12 agents) included.
    monkeypatch.setattr(_hints, "BOOK_LIMIT", 12)
    book, rng = HintBook(), random.Random(7)
    names = [f"a{i}" for i in range(40)]
    cold: dict[str, None] = {}  # the last 12 made cold, as the book keeps them
    for step in range(1500):
        pick = rng.sample(names, 3)
        match rng.randrange(6):
            case 0:
                book.apply(make_hint(done=pick), float(step))
            case 1:
                book.apply(make_hint(priority={a: rng.randint(-3, 3) for a in pick}), float(step))
            case 2:
                book.apply(make_hint(next=pick), float(step))
            case 3:
                book.queued(pick[0])
                cold.pop(pick[0], None)
            case 4:
                book.went_cold(pick[0])
                cold.pop(pick[0], None)
                cold[pick[0]] = None
                if len(cold) > 12:
                    del cold[next(iter(cold))]
                assert not book.done(pick[0])
            case _:
                book.forget(pick[0])
                cold.pop(pick[0], None)
        left_out = set(rng.sample(names, rng.randrange(0, 10)))
        ranks = [book.rank(a) for a in names if a not in left_out and a not in cold]
        assert book.lowest_rank(left_out) == min([(0, 1), *ranks]), step


def test_the_hot_agents_a_hint_names_are_kept_by_change(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Demotion asks about the hot agents a hint names apart; it keeps them by change (the
    # residents' and the book's feeds), not by a pass over every agent named. After every
    # change below (hints of each kind, turns queued, agents made cold, forgotten, dropped,
    # demoted, hints long overdue, the book's limit) the set must be exactly the residents
    # the book names. It fails when any of the book's writers forgets to say so.
    monkeypatch.setattr(_hints, "BOOK_LIMIT", 12)
    now = [0.0]
    pool = new_pool(lm, None, clock=lambda: now[0], policy=WorkflowPolicy(lambda: now[0]))
    rng = random.Random(11)
    names = [f"a{i:02d}" for i in range(30)]
    book, named_hot = pool.hints, pool.demotion._named
    seen = 0
    for step in range(2000):
        pick = rng.sample(names, 3)
        match rng.randrange(12):
            case 0:
                pool.hint(make_hint(done=pick), ahead=0)
            case 1:
                pool.hint(make_hint(priority={a: rng.randint(-2, 2) for a in pick}), ahead=0)
            case 2:
                pool.hint(make_hint(next=pick), ahead=0)
            case 3:
                pool.hint(make_hint(expect_in_s={a: rng.uniform(0, 5) for a in pick}), ahead=0)
            case 4:
                turn(pool, lm, pick[0], 2, persist=rng.random() < 0.8)  # queued, then hot
            case 5:
                book.went_cold(pick[0])
            case 6:
                book.forget(pick[0])
                if rng.random() < 0.5:
                    pool.drop(pick[0])
            case 7:
                now[0] += rng.choice((1.0, 30.0))  # some expected turns long overdue now
                for agent in names:
                    book.next_use(agent, now[0])
            case 8:
                now[0] += rng.choice((1.0, 30.0))
                book.soonest(now[0], 4)
            case 9:
                book.queued(pick[0])  # a turn queued (the hot entry unchanged yet)
            case 10:
                book.turn_took(rng.uniform(0.1, 10.0))
            case _:
                pool.limit = max(pool.used - rng.randrange(1, 4_000), 0)
                pool.make_room(0)
                pool.limit = None
        want = {a for a in names if a in pool.residents and book.is_named(a)}
        assert want == {a for a in book.named() if a in pool.residents}, step
        assert named_hot.agents() == want, step
        seen += len(want)
    assert seen > 2000  # the set was not empty all along
    # A place long overdue, found by next_use alone (no hint between to sweep the book).
    hot = next(a for a in names if a in pool.residents)
    book.forget(hot)
    book.apply(make_hint(next=[hot]), now[0])
    assert named_hot.agents() == {a for a in book.named() if a in pool.residents}
    assert hot in named_hot.agents()
    for _ in range(7):  # place 0 is awaited for 2 + GRACE_TURNS turns after its own
        book.queued("other")
    assert book.next_use(hot, now[0]) is None
    assert hot not in named_hot.agents()


def test_ready_copies_go_in_one_order_read_a_page_at_a_time(lm: LoadedModel) -> None:
    # Room takes ready copies idle before waiting, a lower priority first, then agents
    # without an expected turn least recently used first, then those expected, furthest
    # first. The pool reads the order a page at a time from the hot agents' ready order and
    # merges in the agents hints name: what it drops for ``need`` bytes must be exactly
    # the first copies of that order sorted over every hot cache (ties of last use,
    # priorities, expected turns and tool waits among them), and more than a page deep.
    now = [100.0]
    pool = new_pool(lm, None, clock=lambda: now[0], ready_copies=True)
    rng = random.Random(5)
    names = [f"a{i:03d}" for i in range(200)]
    for name in names:
        now[0] += rng.choice((0.0, 1.0))  # some turns end at the same time
        turn(pool, lm, name, 4, persist=True)
    hints, demotion = pool.hints, pool.demotion

    def key(agent: str, entry: HotEntry) -> tuple[bool, int, bool, float]:
        at = hints.next_use(agent, now[0])
        rank = entry.last_used if at is None else -at
        return demotion.waiting(agent, entry), hints.priority(agent), at is not None, rank

    deep = 0
    for round_ in range(25):
        for name in rng.sample(names, 12):  # another turn: a later use, a ready copy again
            now[0] += rng.choice((0.0, 0.5))
            turn(pool, lm, name, 2, persist=True)
        expect = {a: rng.uniform(0, 60) for a in rng.sample(names, 6)}
        pool.hint(
            make_hint(
                expect_in_s=expect, priority={a: rng.randint(-2, 2) for a in rng.sample(names, 6)}
            ),
            ahead=0,
        )
        for name in rng.sample(names, 4):
            pool.tool_wait(name, rng.choice((0.0, 30.0)))
        ready = {a: e for a, e in pool.residents.items() if e.kv.ready is not None}
        order = [a for _, a in sorted((key(a, e), a) for a, e in ready.items() if not key(a, e)[0])]
        need = rng.randrange(1, sum(ready[a].kv.ready_bytes for a in order))
        want, held = [], 0
        for agent in order:
            if held >= need:
                break
            want.append(agent)
            held += ready[agent].kv.ready_bytes
        deep = max(deep, len(want))
        assert pool.demotion.drop_ready(need) == held, round_
        dropped = {a for a, e in ready.items() if e.kv.ready is None}
        assert dropped == set(want), round_
        pool.check()
    assert deep > 64  # past the first page


def hint_at_random(
    pool: CachePool, rng: random.Random, pick: list[str], *, expected: int, ranked: int
) -> None:
    """Hints about ``pick``: its first ``expected`` agents expected within a minute, the next
    ``ranked`` of a priority from -2 to 2, the rest done."""
    ranks = expected + ranked
    pool.hint(
        make_hint(
            expect_in_s={a: rng.uniform(0, 60) for a in pick[:expected]},
            priority={a: rng.randint(-2, 2) for a in pick[expected:ranks]},
            done=pick[ranks:],
        ),
        ahead=0,
    )


@pytest.mark.parametrize("workflow", [False, True], ids=["lru", "workflow"])
def test_the_least_recently_used_alone_give_the_policy_s_answer_for_all(
    lm: LoadedModel, workflow: bool
) -> None:
    # With more hot caches than the shortlist, room is made by asking the policy about the
    # 64 least recently used and the agents hints name first: its answer must be the one
    # it gives about every cache (hints, done marks, priorities, tool waits, unwritten
    # caches and tied last uses among them), and both ways must be taken often.
    now = [100.0]
    policy = WorkflowPolicy(clock=lambda: now[0]) if workflow else LRUPolicy()
    pool = new_pool(lm, None, policy=policy, clock=lambda: now[0])
    rng = random.Random(11)
    made = 0

    def add(count: int) -> None:
        nonlocal made
        for _ in range(count):
            now[0] += rng.choice((0.0, 1.0))  # some turns end at the same time
            turn(pool, lm, f"a{made:04d}", rng.randrange(2, 9), persist=rng.random() < 0.7)
            made += 1

    add(200)
    for round_ in range(60):
        names = list(pool.residents)
        if workflow:
            hint_at_random(pool, rng, rng.sample(names, 6), expected=2, ranked=2)
        for name in rng.sample(names, 3):
            pool.tool_wait(name, rng.choice((0.0, 30.0)))
        pool.limit = pool.committed()
        candidates = [c for c in pool.candidates() if not c.waiting]
        need = rng.randrange(1, sum(c.nbytes for c in candidates) // rng.choice((3, 12)))
        want = set(policy.victims(candidates, need))
        before = set(pool.residents)
        assert pool.make_room(need), round_
        assert before - set(pool.residents) == want, round_
        pool.limit = None
        add(len(want))
        now[0] += 1.0
    asked = pool.demotion.asked
    assert asked["shortlist"] > 5 and asked["all"] > 5, asked


def test_a_prefetch_spares_whom_asking_every_hot_agent_would(lm: LoadedModel) -> None:
    # A prefetch of a hinted agent never displaces one hinted to run no later or of a
    # higher priority (Demotion._sooner). It reads the agents the hints name (every hot one
    # only below priority 0): the same set as asking every hot agent, under random hints
    # that name agents not hot too.
    now = [100.0]
    pool = new_pool(lm, None, policy=WorkflowPolicy(clock=lambda: now[0]), clock=lambda: now[0])
    rng = random.Random(5)
    for i in range(40):
        turn(pool, lm, f"a{i:02d}", rng.randrange(2, 6), persist=True)
    book, names = pool.hints, [*pool.residents, "gone1", "gone2", "gone3"]

    def every(agent: str) -> set[str]:
        at = book.next_use(agent, now[0])
        if at is None:
            return set()
        mine = book.priority(agent)
        return {
            other
            for other in pool.residents
            if ((t := book.next_use(other, now[0])) is not None and t <= at)
            or book.priority(other) > mine
        }

    seen = Counter[str]()
    for _ in range(30):
        hint_at_random(pool, rng, rng.sample(names, 12), expected=5, ranked=4)
        for agent in names:
            kept = pool.demotion._sooner(agent)
            assert kept == every(agent), agent
            if kept:
                seen["below 0" if book.priority(agent) < 0 else "0 or more"] += 1
        now[0] += 5.0
    assert seen["below 0"] > 5 and seen["0 or more"] > 5, seen


def test_the_stats_kept_by_change_equal_a_count_of_every_hot_agent(lm: LoadedModel) -> None:
    # The stats' ready copies' bytes and tool waits, and the idle bytes a second model's
    # turn weighs, are kept by change or read a page at a time: after random turns, drops,
    # demotions, tool waits that end by their time or by a turn, each equals a count over
    # every hot agent (``idle_bytes(enough)`` may stop early, never short of ``enough``).
    now = [100.0]
    pool = new_pool(lm, None, clock=lambda: now[0], ready_copies=True)
    rng = random.Random(23)
    names = [f"a{i:03d}" for i in range(150)]
    for agent in names:
        turn(pool, lm, agent, rng.randrange(1, 6), persist=True)
    seen = Counter[str]()
    for step in range(120):
        op = rng.randrange(5)
        if op <= 1 or not pool.residents:
            agent = rng.choice(names)
            if rng.random() < 0.5:
                now[0] += 1.0  # a turn ends later than the last one
            turn(pool, lm, agent, rng.randrange(1, 6), persist=True)
        elif op == 2:
            for agent in rng.sample(list(pool.residents), min(5, len(pool.residents))):
                pool.tool_wait(agent, rng.choice((0.0, 2.0, 30.0)))
        elif op == 3:
            pool.demotion.drop_ready(rng.randrange(1, 200_000))
        else:
            pool.limit = pool.committed()
            pool.make_room(rng.randrange(1, 20_000))
            pool.limit = None
        now[0] += rng.choice((0.0, 0.5, 3.0))
        residents = list(pool.residents.values())
        ready = sum(e.kv.ready_bytes_now() for e in residents) + pool.ready.shared.nbytes
        assert pool.ready_bytes == ready, step
        waits = sum(e.tool_waiting(now[0]) for e in residents)
        assert pool.tool_waits == waits, step
        seen["waiting"] += waits > 0
        every = pool.idle_bytes()
        assert every == sum(c.nbytes for c in pool.demotion.candidates() if not c.waiting), step
        enough = rng.randrange(1, every + 2)
        got = pool.idle_bytes(enough)
        assert got >= enough or got == every, step
        seen["early"] += got < every
    assert seen["waiting"] > 10 and seen["early"] > 10 and len(pool.residents) > 64, seen


def test_a_tool_wait_does_not_keep_a_cache_that_left_alive(lm: LoadedModel) -> None:
    # The pool counts tool waits from the agents it told to wait: by name, so that a cache
    # that leaves the hot tier while it waits (dropped here, as a forget does) is freed,
    # its arrays with it, not held by the count until the stats next ask.
    pool = new_pool(lm, None)
    turn(pool, lm, "tools", 6, persist=True)
    pool.tool_wait("tools", 60.0)
    assert pool.tool_waits == 1
    kv = weakref.ref(pool.residents["tools"].kv)
    assert pool.drop("tools")
    gc.collect()
    assert kv() is None
    assert pool.tool_waits == 0


def test_what_each_cache_alone_holds_is_kept_as_caches_share_and_go(lm: LoadedModel) -> None:
    # StoredCounts.own keeps a shared cache's own bytes until some array's sole holder
    # changes: after every fork, turn and drop it equals a count from scratch, by ids.
    pool = new_pool(lm, None)
    rng = random.Random(11)
    names: list[str] = []
    for step in range(60):
        op = rng.randrange(4) if names else 1
        if op == 0:  # a fork of a hot, idle cache shares all its arrays
            source, new = rng.choice(names), f"f{step}"
            assert pool.fork(source, new, list(pool.residents[source].kv.tokens))
            names.append(new)
        elif op == 1:  # a turn, of a new agent or of one hot
            agent = rng.choice([*names, f"a{step}"])
            turn(pool, lm, agent, rng.randrange(1, 9), persist=True)
            names += [] if agent in names else [agent]
        elif op == 2:
            agent = rng.choice(names)
            pool.drop(agent)
            names.remove(agent)
        else:
            pool.measure()
        stored = pool.ledger.stored()
        arrays = {n: {id(a): a.nbytes for a in pool.residents[n].kv.stored_arrays()} for n in names}
        holders = Counter(i for held in arrays.values() for i in held)
        for n, held in arrays.items():
            assert stored.own(n) == sum(b for i, b in held.items() if holders[i] == 1), (step, n)
    assert any(pool.residents[n].kv.shared for n in names)  # it did share


def test_a_staging_whose_cache_outgrows_its_reservation_trips_the_budget_assert(
    lm: LoadedModel,
) -> None:
    # The invariant "the budget is never exceeded" is checked where bytes change (every
    # measure), not only by tests reading the peak afterwards: a reservation that lied
    # about its bytes is caught at the install that would go over.
    source = new_pool(lm, None)
    size = turn(source, lm, "big", 40, persist=True)
    staged = source.get("big")
    assert staged is not None
    pool = new_pool(lm, size // 2)
    assert pool.reserve("big", 1) is Room.RESERVED  # one byte reserved for it
    with pytest.raises(AssertionError, match="over its budget"):
        pool.warm.install("big", 1, lambda: staged.kv.fork(pool.new_kv()), pin=False)


def test_the_debug_check_finds_an_index_out_of_date(lm: LoadedModel) -> None:
    # Residents index each cache's stored ranges; a range stored behind the pool's back
    # (not through store_so_far / end_turn) leaves the index stale: check() says so.
    pool = new_pool(lm, None)
    turn(pool, lm, "a", 20, persist=True)
    pool.check()  # consistent
    entry = pool.get("a")
    assert entry is not None
    entry.kv.trim(10)  # behind the pool's back
    with pytest.raises(AssertionError, match="index out of date"):
        pool.check()
