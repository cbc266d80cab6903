"""The workflow-aware policy and the application's hints: LRU order without hints, hinted
agents kept hot where LRU demotes them, done / priority / overdue hints, prefetches that
never displace a sooner agent, and on a real engine with a warm tier (tiny model): greedy
answers the same under LRU, right hints and wrong hints, the budget never exceeded."""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from hinting import FIRST, MAX_TOKENS, NEWCOMER, OPTIONS, SECOND, ask, room_for_one_idle_cache
from test_budget import one_turn_need
from test_pool import new_pool, turn

import kvactor
from kvactor.actors.engine import EngineConfig
from kvactor.actors.enums import Room, Tier
from kvactor.actors.hot import Candidate, LRUPolicy, WorkflowPolicy, make_hint
from kvactor.actors.hot._hints import HintBook
from kvactor.actors.messages import Hint
from kvactor.actors.models import LoadedModel, make_tiny_model
from kvactor.kernels.float_turn import FloatTurnCache

pytestmark = pytest.mark.one_backend  # the policy's choices, not the event loop


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    loaded = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(loaded.model)
    return loaded


def test_without_hints_the_order_is_lrus() -> None:
    rng = random.Random(3)
    for _ in range(50):
        candidates = [
            Candidate(
                agent=f"a{i}",
                nbytes=rng.randrange(1, 10_000),
                tokens=10,
                last_used=rng.random(),
                hits=0,
                clean=rng.random() < 0.7,
                demote_to=Tier.WARM,
                reload_s=rng.random(),
                next_use=rng.random() if rng.random() < 0.3 else None,  # prefetch marks
                waiting=rng.random() < 0.2,
            )
            for i in range(8)
        ]
        need = rng.randrange(1, 40_000)
        assert WorkflowPolicy().victims(candidates, need) == LRUPolicy().victims(candidates, need)


def test_hinted_next_agents_stay_hot_where_lru_demotes_them(lm: LoadedModel) -> None:
    kept = {}
    for policy in (LRUPolicy(), WorkflowPolicy()):
        pool = new_pool(lm, None, policy=policy)
        sizes = {a: turn(pool, lm, a, 30, persist=True) for a in ("next", "b", "c", "d")}
        pool.hint(Hint(next=("next",)))  # the oldest runs next
        pool.limit = sum(sizes.values())
        pool.ledger.reset_peak()  # counted under the limit (each turn's export held room before it)
        assert pool.make_room(sizes["next"])
        kept[type(policy).__name__] = "next" in pool
        assert pool.peak <= pool.limit
    assert kept == {"LRUPolicy": False, "WorkflowPolicy": True}


def test_furthest_first_then_done_priority_and_overdue_hints(lm: LoadedModel) -> None:
    pool = new_pool(lm, None, policy=WorkflowPolicy())
    sizes = {a: turn(pool, lm, a, 30, persist=True) for a in ("soon", "later", "free")}
    pool.hint(Hint(expect_in_s=(("soon", 1.0), ("later", 100.0))))
    order = [c.agent for c in WorkflowPolicy().order(pool.candidates())]
    assert order == ["free", "later", "soon"]  # unhinted (LRU), then furthest first
    pool.hint(Hint(done=("soon",), priority=(("free", 5),)))
    order = [c.agent for c in WorkflowPolicy().order(pool.candidates())]
    assert order == ["soon", "later", "free"]  # done first; priority last
    # A tool-waiting cache stays ahead of idle ones until its TTL, whatever the hints.
    pool.tool_wait("soon", 60.0)
    assert [c.agent for c in WorkflowPolicy().order(pool.candidates())][-1] == "soon"
    # A hint long overdue is forgotten: the agent ranks as unhinted again. A place in an
    # order is overdue by turns (twice the turns to it, and 4 more), a time by seconds.
    book = HintBook()
    book.apply(Hint(next=("x",), expect_in_s=(("y", 0.0),)), now=0.0)
    assert book.next_use("y", 5.0) == 0.0 and book.next_use("y", 60.0) is None
    assert book.next_use("x", 600.0) == 600.0 + book.turn_s  # the turn after the next
    for other in "abcdef":
        book.queued(other)
    assert book.next_use("x", 600.0) == 600.0  # no more turns than its grace: awaited
    book.queued("g")
    assert book.next_use("x", 600.0) is None
    assert sizes["soon"] > 0


def test_a_prefetch_never_displaces_an_agent_hinted_to_run_sooner(lm: LoadedModel) -> None:
    pool = new_pool(lm, None, policy=WorkflowPolicy())
    size = turn(pool, lm, "first", 30, persist=True)
    pool.limit = size + size // 2
    pool.hint(Hint(next=("first", "second")))
    assert pool.reserve("second", size, prefetch=True) is Room.NO_ROOM
    assert "first" in pool
    # Staged for a waiting turn (not a prefetch), the same room is made.
    assert pool.reserve("second", size) is Room.RESERVED and "first" not in pool


def test_make_hint_checks_what_it_is_given() -> None:
    hint = make_hint(["a", "b"], expect_in_s={"c": 2}, priority={"d": -3}, done=["e"])
    assert hint == Hint(("a", "b"), (("c", 2.0),), (("d", -3),), ("e",))
    with pytest.raises(TypeError):
        make_hint("ab")
    with pytest.raises(ValueError):
        make_hint(expect_in_s={"a": -1.0})
    with pytest.raises(ValueError):
        make_hint(priority={"a": 5000})
    with pytest.raises(TypeError):
        make_hint(priority={"a": 1.5})  # type: ignore[dict-item]
    with pytest.raises(kvactor.InvalidAgentId):
        make_hint(["../etc"])


AGENTS = 6
ROUNDS = 3


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


async def round_robin(root: Path, policy: Any, hints: str, budget: int) -> tuple[Any, ...]:
    """Every agent in turn, ROUNDS times, one turn at a time; before each, the hint
    ``hints`` says (``right``: the next two in order, ``wrong``: two random others,
    ``none``). Returns (answers, hot turns, peak bytes, peak seen between turns)."""
    rng = random.Random(7)
    order = [f"a{i}" for r in range(ROUNDS) for i in range(AGENTS)]
    answers: list[list[int]] = []
    hot = 0
    async with kvactor.open(
        tiny(), cache_dir=root, budget_bytes=budget, policy=policy, attention="dequantized"
    ) as kv:
        agents = {f"a{i}": await kv.spawn_agent(f"a{i}") for i in range(AGENTS)}
        for step, name in enumerate(order):
            if hints == "right":
                await kv.hint(next=order[step + 1 : step + 3])
            elif hints == "wrong":
                await kv.hint(next=rng.sample(sorted(agents), 2))
            with anyio.fail_after(60):
                done = await agents[name].generate(
                    f"step {step} says {'xy' * (step % 4)}", max_tokens=6
                )
            answers.append(done.token_ids)
            hot += done.path is Tier.HOT
            stats = await kv.stats()
            assert stats.cache_bytes <= budget and stats.peak_bytes <= budget
        return answers, hot, (await kv.stats()).peak_bytes


async def test_answers_are_the_same_under_lru_right_and_wrong_hints_within_budget(
    tmp_path: Path,
) -> None:
    # Room for one turn and about two idle caches besides: a round robin of six thrashes.
    stored = 40_000
    budget = one_turn_need(False) + 2 * stored
    runs = {}
    for n, (policy, hints) in enumerate(
        [(LRUPolicy(), "none"), (WorkflowPolicy(), "right"), (WorkflowPolicy(), "wrong")]
    ):
        runs[hints] = await round_robin(tmp_path / f"r{n}", policy, hints, budget)
        assert runs[hints][2] <= budget
    assert runs["right"][0] == runs["none"][0] == runs["wrong"][0]
    assert runs["right"][1] > runs["none"][1]  # the hinted next agent was found hot


def test_the_hint_book_turns_an_order_into_times() -> None:
    book = HintBook()
    book.turn_s = 2.0
    now = time.monotonic()
    book.apply(Hint(next=("a", "b", "c")), now)
    # A hint comes before a turn of its own, which counts: the first agent's comes after it.
    assert [book.next_use(a, now) for a in "abc"] == [now + 2.0, now + 4.0, now + 6.0]
    assert book.soonest(now, 2) == ["a", "b"]
    book.queued("a")
    assert book.next_use("a", now) is None and book.soonest(now, 5) == ["b", "c"]


def test_an_order_given_once_ranks_by_the_turns_still_to_come() -> None:
    # An application that says the whole order once, then runs it: each place comes a turn
    # nearer as turns are queued, however long they take. As a time (place x the average
    # turn), the order expired within a few turns slower than the average.
    book = HintBook()
    book.turn_s = 0.5
    order = [f"a{i}" for i in range(40)]
    book.apply(Hint(next=tuple(order)), 0.0)
    now = 0.0
    for i, agent in enumerate(order[:30]):
        now += 60.0  # each turn far slower than the average the order was given at
        book.queued(agent)
        ahead = [book.next_use(a, now) for a in order[i + 1 :]]
        times = [t for t in ahead if t is not None]
        assert times == ahead and times == sorted(times), i
        assert book.soonest(now, 2) == order[i + 1 : i + 3]
    assert book.next_use("a35", now) == now + 6 * book.turn_s


def test_a_clusters_hint_is_split_by_the_host_of_each_agent() -> None:
    from kvactor.actors.hot import split_hint

    hint = make_hint(["a", "b", "c", "x"], expect_in_s={"b": 1.0}, priority={"c": 2}, done=["a"])
    parts = split_hint(hint, {"a": "h1", "b": "h2", "c": "h1"})
    assert parts == {
        "h1": Hint(("a", "c"), (), (("c", 2),), ("a",)),
        "h2": Hint(("b",), (("b", 1.0),), (), ()),
    }
    # With a default, agents held nowhere go to it (a session's first model).
    parts = split_hint(hint, {"b": "h2"}, "h1")
    assert parts == {
        "h1": Hint(("a", "c", "x"), (), (("c", 2),), ("a",)),
        "h2": Hint(("b",), (("b", 1.0),), (), ()),
    }


async def _keeps_hot(kv: Any, agents: dict[str, Any]) -> None:
    await kv.hint(next=[FIRST])


async def _second_done(kv: Any, agents: dict[str, Any]) -> None:
    await agents[SECOND].done()


async def _first_matters(kv: Any, agents: dict[str, Any]) -> None:
    await agents[FIRST].hint(priority=5)


async def _first_soon(kv: Any, agents: dict[str, Any]) -> None:
    await agents[FIRST].hint(expect_in_s=1.0)


async def _strangers(kv: Any, agents: dict[str, Any]) -> None:
    await kv.hint(next=["ghost"], expect_in_s={"nobody": 5.0}, done=["other"])


@pytest.mark.parametrize(
    ("hint", "first_stays"),
    [
        (None, False),
        (_strangers, False),
        (_keeps_hot, True),
        (_second_done, True),
        (_first_matters, True),
        (_first_soon, True),
    ],
    ids=["none", "strangers", "next", "done", "priority", "expect_in_s"],
)
async def test_each_hint_changes_which_cache_stays_hot_and_strangers_change_nothing(
    tmp_path: Path, hint: Any, first_stays: bool
) -> None:
    """Room for a newcomer's turn and one idle cache (tests/hinting.py): without a hint
    the least recently used agent goes warm; ``Session.hint(next=)``, ``Agent.done()`` on
    the other, ``Agent.hint(priority=)`` or ``Agent.hint(expect_in_s=)`` keep it hot
    instead; hints about agents that do not exist change nothing."""
    budget = await room_for_one_idle_cache(tiny())
    async with kvactor.open(tiny(), cache_dir=tmp_path, budget_bytes=budget, **OPTIONS) as kv:
        agents = {n: await kv.spawn_agent(n) for n in (FIRST, SECOND, NEWCOMER)}
        for name in (FIRST, SECOND):
            await agents[name].generate(ask(name), max_tokens=MAX_TOKENS)
        if hint is not None:
            await hint(kv, agents)
        await agents[NEWCOMER].generate(ask(NEWCOMER), max_tokens=MAX_TOKENS)
        again = await agents[FIRST].generate("hello again", max_tokens=MAX_TOKENS)
        assert again.path is (Tier.HOT if first_stays else Tier.WARM)
        assert (await kv.stats()).peak_bytes <= budget
        with pytest.raises(ValueError):
            await kv.hint(next=[FIRST], prefetch=-1)


def test_the_hint_book_stays_bounded_whatever_it_is_told() -> None:
    from kvactor.actors.hot._hints import BOOK_LIMIT

    book = HintBook()
    names = tuple(f"n{i}" for i in range(BOOK_LIMIT + 50))
    book.apply(Hint(next=names, priority=tuple((n, 1) for n in names), done=names), 0.0)
    book.apply(Hint(expect_in_s=tuple((n, 5.0) for n in names)), 0.0)
    assert max(len(book._at), len(book._priority), len(book._done)) == BOOK_LIMIT
    assert book.next_use(names[-1], 0.0) == 5.0 and book.next_use(names[0], 0.0) is None


def test_room_comes_first_from_ready_copies_still_being_built(lm: LoadedModel) -> None:
    from kvactor.actors.hot import CachePool
    from kvactor.kernels.qcodec import DEFAULT_CODEC

    pool = CachePool(
        None, WorkflowPolicy(), persistent=True, codec=DEFAULT_CODEC, geometry=lm.geometry
    )
    for agent in ("a", "b"):
        turn(pool, lm, agent, 30, persist=True)
        entry = pool.get(agent)
        assert entry is not None
        pool.ready.drop(entry.kv)  # kept at the turn's end: dropped, to be built again
    pool.hint(Hint(next=("a",)))  # builds a's ready copy ahead, one layer a step
    building = pool.ready.reserved
    assert building > 0 and pool.ready.building
    pool.limit = pool.committed()
    assert pool.make_room(building // 2)
    assert "a" in pool and "b" in pool and pool.demotions[Tier.WARM] == 0
    assert not pool.ready.building


async def concurrent_load(root: Path | None, budget: int | None, hints: bool) -> dict[Any, Any]:
    """Six agents, three turns each, all at once (max_batch 4); with ``hints``, random
    advice (next, expect_in_s, priority, done: mostly wrong) sent all the while."""
    rng = random.Random(11)
    outcomes: dict[Any, Any] = {}
    options: dict[str, Any] = {"budget_bytes": budget, "cache_dir": root}
    options["deterministic"] = True  # a row's answer never depends on its batch
    async with kvactor.open(tiny(), max_batch=4, attention="dequantized", **options) as kv:
        names = [f"c{i}" for i in range(6)]
        agents = [await kv.spawn_agent(n) for n in names]
        finished = anyio.Event()

        async def advise() -> None:
            while not finished.is_set():
                await kv.hint(
                    next=rng.sample(names, 3),
                    expect_in_s={rng.choice(names): rng.uniform(0, 3)},
                    priority={rng.choice(names): rng.randint(-2, 2)},
                    done=rng.sample(names, 1),
                )
                await anyio.sleep(0.002)  # the load under test: advice at random moments

        async def run(i: int) -> None:
            for r in range(3):
                with anyio.fail_after(60):
                    done = await agents[i].generate(
                        f"{'ab'[i % 2] * (i + 3)} {i}.{r}", max_tokens=5
                    )
                outcomes[i, r] = done.token_ids

        async with anyio.create_task_group() as tg:
            if hints:
                tg.start_soon(advise)
            async with anyio.create_task_group() as turns:
                for i in range(6):
                    turns.start_soon(run, i)
            finished.set()
        assert budget is None or (await kv.stats()).peak_bytes <= budget
    return outcomes


async def test_random_advice_under_a_tight_budget_changes_no_answer(tmp_path: Path) -> None:
    reference = await concurrent_load(tmp_path / "ref", None, hints=False)
    need = one_turn_need(False)
    for n, budget in enumerate((need, 2 * need)):
        got = await concurrent_load(tmp_path / f"b{n}", budget, hints=True)
        assert got == reference, budget


def test_a_prefetch_gives_up_no_ready_copy_of_an_agent_hinted_sooner(lm: LoadedModel) -> None:
    from kvactor.actors.hot import CachePool
    from kvactor.kernels.qcodec import DEFAULT_CODEC

    pool = CachePool(
        None, WorkflowPolicy(), persistent=True, codec=DEFAULT_CODEC, geometry=lm.geometry
    )
    turn(pool, lm, "a", 30, persist=True)
    entry = pool.get("a")
    assert entry is not None
    pool.ready.drop(entry.kv)
    pool.hint(Hint(next=("a", "later")))  # builds a's ready copy ahead
    assert pool.ready.building
    pool.limit = pool.committed()
    assert pool.reserve("later", 1000, prefetch=True) is Room.NO_ROOM
    assert pool.ready.building and "a" in pool  # a runs first: its copy stays
    assert pool.reserve("later", 1000) is Room.RESERVED  # for a waiting turn: it may go
    assert not pool.ready.building


def test_a_policy_is_named_or_refused_when_the_config_is_made() -> None:
    assert isinstance(EngineConfig(policy="lru").policy, LRUPolicy)  # type: ignore[arg-type]
    assert isinstance(EngineConfig(policy="workflow").policy, WorkflowPolicy)  # type: ignore[arg-type]
    mine = LRUPolicy()
    assert EngineConfig(policy=mine).policy is mine
    with pytest.raises(ValueError, match="unknown policy 'fifo'; known: lru, workflow"):
        EngineConfig(policy="fifo")  # type: ignore[arg-type]
    for bad in (LRUPolicy, 42, object()):  # the class itself: a common slip
        with pytest.raises(TypeError, match="policy must be an EvictionPolicy"):
            EngineConfig(policy=bad)  # type: ignore[arg-type]


async def test_open_takes_a_policy_by_name_and_refuses_a_bad_one_before_any_turn(
    tmp_path: Path,
) -> None:
    # Before, a name was taken as the policy itself and the engine died at its first
    # demotion ("'str' object has no attribute 'victims'").
    for bad, error in (("fifo", ValueError), (LRUPolicy, TypeError)):
        with pytest.raises(error):
            await kvactor.open(tiny(), policy=bad)  # type: ignore[arg-type]
    budget = one_turn_need(False) + 2 * 40_000  # a turn's room and about two idle caches
    async with kvactor.open(
        tiny(), cache_dir=tmp_path, budget_bytes=budget, policy="lru", attention="dequantized"
    ) as kv:
        agents = [await kv.spawn_agent(f"a{i}") for i in range(AGENTS)]
        for step, agent in enumerate(agents + agents):
            with anyio.fail_after(60):
                await agent.generate(f"step {step} says {'xy' * (step % 4)}", max_tokens=6)
        stats = await kv.stats()
    assert stats.demoted_warm > 0  # the named policy chose whom to demote
    assert stats.peak_bytes <= budget
