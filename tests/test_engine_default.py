"""The engine on the real default model: the answer, and batch-invariant greedy decoding."""

from __future__ import annotations

import anyio
import pytest

import kvactor
from kvactor.actors.enums import FinishReason

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Who wrote Hamlet?",
    "What is 12 times 12?",
    "Name a color of the rainbow.",
    "Say hello in Spanish.",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # one backend is enough for the slow model tests; the kernel tests do both


async def test_paris_and_a_second_turn_that_reuses_the_cache() -> None:
    async with kvactor.open() as session:
        agent = await session.spawn_agent("geo")
        first = await agent.generate("What is the capital of France?", max_tokens=20)
        assert "Paris" in first.text
        assert first.finish_reason is FinishReason.EOS
        second = await agent.generate("And of Germany?", max_tokens=20)
        assert "Berlin" in second.text
        assert (
            second.timings.reused_tokens == first.timings.prompt_tokens + len(first.token_ids) - 1
        )


async def test_greedy_tokens_alone_equal_tokens_in_a_batch_of_8() -> None:
    # The mode that promises batch-independent answers (README).
    async with kvactor.open(max_batch=8, deterministic=True) as session:
        alone = []
        for i, prompt in enumerate(PROMPTS):
            agent = await session.spawn_agent(f"alone-{i}")
            alone.append((await agent.generate(prompt, max_tokens=16)).token_ids)
        agents = [await session.spawn_agent(f"batch-{i}") for i in range(len(PROMPTS))]
        batched: list[list[int]] = [[] for _ in PROMPTS]

        async def run(i: int) -> None:
            batched[i] = (await agents[i].generate(PROMPTS[i], max_tokens=16)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        assert batched == alone
        assert (await session.stats()).max_batch_seen >= 6
