"""The hot budget under load: many agents, budgets from one turn's need to plenty, random
cancellations. Every turn completes (or was cancelled) within a deadline, no turn that fits
alone is refused, the budget is never exceeded (by the pool's count and by MLX's own
memory), and with a warm tier every turn that ran the same way as in an unbounded run gave
the same greedy tokens (real engine, real files, tiny model, ``deterministic=True``: the
mode that promises answers independent of the batch). Without a warm tier a demoted cache
is prefilled again from its text, which is not bit-identical to the quantized cache it
replaces, so only completion is checked there.

:func:`mlx_bound` is the check against MLX's memory that other tests use too."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest

import kvactor
from kvactor.actors.engine import Attention, turn_reserve_bytes
from kvactor.actors.models import make_tiny_model
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.qcodec import DEFAULT_CODEC

pytestmark = pytest.mark.one_backend  # the budget's arithmetic, not the event loop

AGENTS = 10
ROUNDS = 3
MAX_TOKENS = 6
#: Prompts, replies and the template of one agent stay below this many tokens (the tiny
#: tokenizer spends about one per character), so every turn reserves the same room.
MAX_CONTEXT = 256
TURN_DEADLINE_S = 60


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


@functools.cache
def one_turn_need(quantized: bool, context: int = MAX_CONTEXT) -> int:
    """The most a turn of up to ``context`` tokens (prompt and reply) of the tiny model
    needs alone: its stored cache and the room its working cache reserves (CachePool's
    accounting)."""
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    kv = AgentKV(DEFAULT_CODEC, lm.geometry)
    work = kv.activate()
    ids = [7 + i % 50 for i in range(context)]
    lm.model(mx.array([ids]), cache=work.layers)
    kv.tokens.extend(ids)
    kv.deactivate()
    stored = kv.stored_bytes
    reserve = turn_reserve_bytes(lm.geometry, context, stored_bytes=stored if quantized else None)
    return stored + reserve


#: Sessions whose MLX memory is checked run under this memory limit: the freed buffers MLX
#: may keep are a sixteenth of it (docs/multimodel.md), small beside the hot tier.
MEMORY_LIMIT = 64 << 20


async def mlx_base_peak(
    model: Any,
    prompt: str | list[str],
    max_tokens: int,
    *,
    memory_limit: int = MEMORY_LIMIT,
    **options: Any,
) -> int:
    """MLX's peak (``EngineStats.mlx_peak_bytes``, sampled by the engine) in a session of
    ``options`` (under MEMORY_LIMIT, no budget) where one agent runs a turn of ``prompt``
    (a list: a turn of each, in order) alone: the weights, a forward's activations, one
    turn's caches (and what the agent kept of its turns before)."""
    async with kvactor.open(model, memory_limit=memory_limit, **options) as kv:
        agent = await kv.spawn_agent("base")
        for text in [prompt] if isinstance(prompt, str) else prompt:
            await agent.generate(text, max_tokens=max_tokens)
        return (await kv.stats()).mlx_peak_bytes


def mlx_bound(base: int, budget: int, memory_limit: int = MEMORY_LIMIT) -> int:
    """The most MLX may hold (its peak plus its kept buffers, as the engine samples them:
    ``mlx_peak_bytes``) in a session under ``memory_limit`` whose hot tier stays within
    ``budget``: ``base`` (:func:`mlx_base_peak` of its longest turn: weights, activations,
    one turn), the budget, and the buffers MLX may keep (a sixteenth of the limit)."""
    return base + budget + memory_limit // 16


# (agent, round) -> the greedy tokens, or None when the turn was cancelled.
Outcomes = dict[tuple[int, int], list[int] | None]


async def workload(seed: int, attention: Attention, **options: Any) -> tuple[Outcomes, Any]:
    rng = random.Random(seed)
    plan = {
        (i, r): (
            f"{'abcdefgh'[rng.randrange(8)] * rng.randrange(1, 12)} {i}.{r}",
            rng.random() < 0.3,  # cancelled
            rng.uniform(0, 0.02),  # after this long
            rng.uniform(0, 0.01),  # sent after this long
        )
        for i in range(AGENTS)
        for r in range(ROUNDS)
    }
    outcomes: Outcomes = {}
    async with kvactor.open(
        tiny(),
        max_batch=4,
        attention=attention,
        deterministic=True,
        memory_limit=MEMORY_LIMIT,
        **options,
    ) as kv:
        agents = [await kv.spawn_agent(f"a{i}") for i in range(AGENTS)]

        async def run(i: int) -> None:
            for r in range(ROUNDS):
                text, cancel, after, delay = plan[i, r]
                await anyio.sleep(delay)  # the load under test: turns sent at random moments
                outcomes[i, r] = None
                with anyio.fail_after(TURN_DEADLINE_S):  # a hang fails the test
                    with anyio.move_on_after(after if cancel else TURN_DEADLINE_S + 1):
                        done = await agents[i].generate(text, max_tokens=MAX_TOKENS)
                        outcomes[i, r] = done.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(AGENTS):
                tg.start_soon(run, i)
        return outcomes, await kv.stats()


def same_history(a: Outcomes, b: Outcomes, agent: int, upto: int) -> bool:
    """Whether ``agent``'s turns before ``upto`` all completed in both runs. (A cancelled
    turn leaves the conversation as it was, but the tokens it prefilled before it stopped,
    a timing-dependent number, stay in the cache; numbers computed in other chunk shapes
    may round differently, so later turns are only comparable without one.)"""
    return all(a[agent, r] is not None and b[agent, r] is not None for r in range(upto))


@pytest.mark.parametrize("attention", ["dequantized", "quantized"])
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])  # fast loop: one
async def test_random_load_under_every_budget_completes_in_order_and_within_budget(
    tmp_path: Path, attention: Attention, seed: int
) -> None:
    need = one_turn_need(attention == "quantized")
    reference, _ = await workload(seed, attention)
    longest = "h" * 11 + f" {AGENTS - 1}.{ROUNDS - 1}"  # the longest prompt of the plan
    base = await mlx_base_peak(
        tiny(), longest, MAX_TOKENS, attention=attention, deterministic=True, max_batch=4
    )
    budgets = [need, need + need // 4, 2 * need, 4 * need]
    for n, budget in enumerate(budgets):
        for persistent in (True, False) if n == 0 else (True,):
            options: dict[str, Any] = {"budget_bytes": budget}
            if persistent:
                options["cache_dir"] = tmp_path / f"b{n}"
            outcomes, stats = await workload(seed, attention, **options)
            where = f"budget {budget} ({n}), persistent={persistent}"
            assert stats.peak_bytes <= budget, where
            assert 0 < stats.mlx_peak_bytes <= mlx_bound(base, budget), where
            finished = [k for k, v in outcomes.items() if v is not None]
            assert len(finished) >= AGENTS, where  # most turns were not cancelled
            if not persistent:
                continue  # demoted caches are prefilled again: not bit-identical
            for (i, r), tokens in outcomes.items():
                if same_history(outcomes, reference, i, r + 1):
                    assert tokens == reference[i, r], f"{where}: agent {i} turn {r}"


async def test_a_turn_that_cannot_fit_alone_fails_at_once_with_a_clear_error() -> None:
    need = one_turn_need(False)
    async with kvactor.open(tiny(), attention="dequantized", budget_bytes=need // 2) as kv:
        agent = await kv.spawn_agent("big")
        with anyio.fail_after(TURN_DEADLINE_S), pytest.raises(kvactor.BudgetExceeded) as caught:
            await agent.generate("hello there", max_tokens=MAX_TOKENS)
        assert "hot budget" in str(caught.value)
        # The agent is not left busy: its next call gets the same answer, not AgentBusy.
        with anyio.fail_after(TURN_DEADLINE_S), pytest.raises(kvactor.BudgetExceeded):
            await agent.generate("hello again", max_tokens=MAX_TOKENS)
        assert (await kv.stats()).peak_bytes <= need // 2


async def test_mlx_memory_stays_within_the_budget_where_unbounded_it_does_not() -> None:
    """The budget holds in MLX's own memory, not only in the pool's count: sixteen agents of
    ~400-token prompts, one turn at a time (their idle caches and ready copies ~14 MB
    unbounded), under budgets of 2 and 4 MiB stay within :func:`mlx_bound`, and the same
    turns without a budget go past the larger bound (the check can fail)."""
    prompts = [f"agent {i}: " + "abcdefgh"[i % 8] * 400 for i in range(16)]

    async def load(budget: int | None) -> kvactor.EngineStats:
        async with kvactor.open(tiny(), budget_bytes=budget, memory_limit=MEMORY_LIMIT) as kv:
            for i, prompt in enumerate(prompts):
                agent = await kv.spawn_agent(f"a{i}")
                await agent.generate(prompt, max_tokens=MAX_TOKENS)
            return await kv.stats()

    base = await mlx_base_peak(tiny(), prompts[-1], MAX_TOKENS)
    for budget in (2 << 20, 4 << 20):
        stats = await load(budget)
        assert stats.peak_bytes <= budget
        assert stats.mlx_peak_bytes <= mlx_bound(base, budget), (budget, stats)
        assert stats.demoted_cold + stats.dropped_ready > 0  # the budget made room
    unbounded = await load(None)
    assert unbounded.mlx_peak_bytes > mlx_bound(base, 4 << 20), unbounded
