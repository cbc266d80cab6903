"""The engine and agent actors on a tiny random-weight model (real MLX on the CPU)."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest
from lively import lively
from test_budget import MEMORY_LIMIT, mlx_base_peak, mlx_bound

import kvactor
from kvactor.actors.engine import Attention
from kvactor.actors.engine._batch import DecodeBatch
from kvactor.actors.enums import FinishReason
from kvactor.actors.errors import AgentBusy, ContextOverflow, InvalidAgentId, UnknownAgent
from kvactor.actors.messages import Generate
from kvactor.actors.models import make_tiny_model
from kvactor.actors.options import Sampling
from kvactor.actors.session import Session
from kvactor.runtime import ActorDeadError

PROMPTS = [
    "hello there",
    "the quick brown fox",
    "jumps over the lazy dog",
    "ünïcödé ✓ text",
    "1 2 3 4 5 6 7 8",
    "actors own their state",
    "a longer prompt that takes a few more tokens to prefill than the others do",
    "z",
]


# Both ways a turn can read its stored cache: over a float copy, or quantized as stored.
ATTENTION = pytest.mark.parametrize("attention", ["dequantized", "quantized"])


def tiny(**overrides: Any) -> Any:
    # head_dim 64 so that the default codec (groups of 64) applies, as on real models
    return functools.partial(make_tiny_model, 0, **{"head_dim": 64, **overrides})


@ATTENTION
async def test_multi_turn_prefills_only_the_new_text(attention: Attention) -> None:
    async with kvactor.open(tiny(), attention=attention) as session:
        agent = await session.spawn_agent("a", system="be brief")
        first = await agent.generate("hello", max_tokens=6)
        assert first.finish_reason is FinishReason.LENGTH and len(first.token_ids) == 6
        assert first.timings.reused_tokens == 0
        info = await agent.cache_info()
        # The last generated token is sampled but not yet fed: it is fed with the next turn.
        assert info.tokens == first.timings.prompt_tokens + 5
        second = await agent.generate("more please", max_tokens=4)
        assert second.timings.reused_tokens == info.tokens
        new_text = "<|im_end|>\n<|im_start|>user\nmore please<|im_end|>\n<|im_start|>assistant\n"
        assert second.timings.prefilled_tokens == 1 + len(session.tokenizer.encode(new_text))
        history = await agent.history()
        assert [m["role"] for m in history] == ["system", "user", "assistant"] * 1 + [
            "user",
            "assistant",
        ]
        assert history[2]["content"] == first.text


@ATTENTION
async def test_greedy_output_is_the_same_alone_and_in_a_batch_of_8(attention: Attention) -> None:
    # The mode that promises it (README: "Answers that do not depend on who else runs"),
    # on a model whose every token depends on its cache (tests/lively.py).
    async with kvactor.open(
        lively(), max_batch=8, attention=attention, deterministic=True
    ) as session:
        solo = []
        for i, prompt in enumerate(PROMPTS):
            agent = await session.spawn_agent(f"solo-{i}")
            solo.append((await agent.generate(prompt, max_tokens=12)).token_ids)
        agents = [await session.spawn_agent(f"batch-{i}") for i in range(len(PROMPTS))]
        batched: list[list[int]] = [[] for _ in PROMPTS]

        async def run(i: int) -> None:
            batched[i] = (await agents[i].generate(PROMPTS[i], max_tokens=12)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        assert batched == solo
        stats = await session.stats()
        assert stats.max_batch_seen >= 4  # they really decoded together


async def test_the_lively_model_answers_by_its_whole_context() -> None:
    """Why the batch tests run on tests/lively.py: the tiny model's greedy turn repeats one
    token whatever its cache holds; the lively one's tokens change at every step, and two
    prompts that differ only at their start (same last token) answer differently to the
    end."""
    prompts = ["a" * 32 + "x", "b" * 32 + "x"]

    async def answers(model: Any) -> list[list[int]]:
        async with kvactor.open(model) as session:
            agents = [await session.spawn_agent(f"a{i}") for i in range(2)]
            return [
                (await a.complete(p, max_tokens=12)).token_ids
                for a, p in zip(agents, prompts, strict=True)
            ]

    assert all(len(set(ids)) == 1 for ids in await answers(tiny()))
    first, second = await answers(lively())
    assert len(set(first)) >= 4 and len(set(second)) >= 4
    assert first[-4:] != second[-4:]


@ATTENTION
async def test_decode_goes_on_while_a_long_prompt_is_prefilled_in_chunks(
    attention: Attention,
) -> None:
    async with kvactor.open(tiny(), prefill_chunk=8, attention=attention) as session:
        talker = await session.spawn_agent("talker")
        reader = await session.spawn_agent("reader")
        events: list[str] = []
        talking = anyio.Event()

        async def talk() -> None:
            async for _ in talker.stream("go", max_tokens=60):
                events.append("talker")
                talking.set()

        async def read() -> None:
            events.append("reader-submitted")
            async for _ in reader.stream("word " * 60, max_tokens=1):
                events.append("reader-first")

        async with anyio.create_task_group() as tg:
            tg.start_soon(talk)
            await talking.wait()
            tg.start_soon(read)
        start, first = events.index("reader-submitted"), events.index("reader-first")
        # ~40 prefill chunks for the reader; the talker decoded between them.
        assert events[start:first].count("talker") >= 10


#: A context so long that a turn of ENDLESS tokens runs for minutes on the tiny model (it
#: is not cut to the context): a turn that stops within a test stopped because it was told.
ENDLESS = 100_000


def endless() -> Any:
    return tiny(max_position_embeddings=1 << 17)


async def _until(predicate: Any, within: float = 10.0) -> None:
    """Poll ``await predicate()`` until it holds (nothing signals the engine's noticing a
    cancel); fails past ``within`` s, over 10x what it takes."""
    with anyio.fail_after(within):
        while not await predicate():
            await anyio.sleep(0.01)


async def _idle(session: Session) -> bool:
    stats = await session.stats()
    return stats.decoding == 0 and stats.prefilling == 0


async def test_leaving_a_stream_cancels_the_generation_and_frees_the_slot() -> None:
    async with kvactor.open(endless()) as session:
        agent = await session.spawn_agent("a")
        pieces = 0
        async with agent.stream("tell me everything", max_tokens=ENDLESS) as stream:
            async for _ in stream:
                pieces += 1
                if pieces == 3:
                    break
        await _until(functools.partial(_idle, session))
        # Stopped near where it was left: a turn left running makes thousands of tokens.
        assert (await session.stats()).generated_tokens < 1000
        assert stream.completion is None
        info = await agent.cache_info()
        assert not info.busy and 0 < info.tokens < 1000  # the partial cache is kept
        again = await agent.generate("and now?", max_tokens=3)
        assert len(again.token_ids) == 3


async def test_cancelling_the_caller_cancels_the_generation() -> None:
    async with kvactor.open(endless()) as session:
        agent = await session.spawn_agent("a")
        scope = anyio.CancelScope()
        returned: list[kvactor.Completion] = []

        async def call() -> None:
            with scope:
                returned.append(await agent.generate("go on forever", max_tokens=ENDLESS))

        async def decoding() -> bool:
            return (await session.stats()).decoding == 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await _until(decoding)
            scope.cancel()
        assert scope.cancelled_caught and not returned
        await _until(functools.partial(_idle, session))
        assert (await session.stats()).generated_tokens < 1000
        info = await agent.cache_info()
        assert not info.busy and info.tokens < 1000
        assert len((await agent.generate("and now?", max_tokens=2)).token_ids) == 2


async def test_stop_strings_end_the_text_before_the_stop() -> None:
    async with kvactor.open(tiny()) as session:
        agent = await session.spawn_agent("probe")
        full = (await agent.generate("x", max_tokens=40)).text
        stop = full[10:13]
        assert len(stop) == 3
        other = await session.spawn_agent("stopper")
        pieces = []
        async with other.stream("x", max_tokens=40, stop=[stop]) as stream:
            async for piece in stream:
                pieces.append(piece)
        assert stream.completion is not None
        assert stream.completion.finish_reason == "stop"
        assert "".join(pieces) == stream.completion.text == full[: full.index(stop)]


async def test_seeded_sampling_repeats_and_differs_from_greedy() -> None:
    async with kvactor.open(tiny()) as session:
        outs = []
        for i, seed in enumerate([7, 7, 8]):
            agent = await session.spawn_agent(f"s{i}")
            options = {"temperature": 1.5, "top_p": 0.95, "seed": seed, "max_tokens": 16}
            outs.append((await agent.generate("sample", **options)).token_ids)
        greedy = await (await session.spawn_agent("g")).generate("sample", max_tokens=16)
        assert outs[0] == outs[1]
        assert outs[0] != outs[2]
        assert outs[0] != greedy.token_ids


async def test_many_agents_from_one_task_group() -> None:
    async with kvactor.open(tiny(), max_batch=4) as session:
        results: dict[str, str] = {}

        async def one(i: int) -> None:
            agent = await session.spawn_agent(f"agent-{i}")
            for turn in range(2):
                results[f"{i}.{turn}"] = (await agent.generate(f"turn {turn}", max_tokens=4)).text

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
        assert len(results) == 20
        assert (await session.stats()).agents_cached == 10


async def test_bad_input_gets_clear_errors_and_the_engine_keeps_serving() -> None:
    async with kvactor.open(tiny(max_position_embeddings=160)) as session:
        agent = await session.spawn_agent("a")
        with pytest.raises(TypeError, match=r"unknown sampling option.*temprature"):
            await agent.generate("hi", temprature=0.5)
        with pytest.raises(ValueError, match="temperature"):
            await agent.generate("hi", temperature=-1)
        with pytest.raises(ValueError, match="empty"):
            await agent.generate("   ")
        with pytest.raises(ContextOverflow, match="context of 160"):
            await agent.generate("x" * 300)
        for hostile in ["../x", "a/b", "", "a\\b", "..", "x" * 200, "nul\x00"]:
            with pytest.raises(InvalidAgentId):
                await session.spawn_agent(hostile)
        with pytest.raises(kvactor.AgentExists, match="already exists"):
            await session.spawn_agent("a")
        with pytest.raises(UnknownAgent):
            session.agent("nobody")
        # Near the context end, max_tokens is cut to what fits instead of overflowing.
        done = await agent.generate("y" * 20, max_tokens=1000)
        assert done.finish_reason in {FinishReason.LENGTH, FinishReason.EOS}
        assert done.timings.prompt_tokens + len(done.token_ids) <= 160
        with pytest.raises(ContextOverflow):  # the conversation has filled the context
            await agent.generate("still fine?", max_tokens=2)
        other = await session.spawn_agent("b")
        assert (await other.generate("still fine?", max_tokens=2)).token_ids


async def test_engine_refuses_a_second_generation_for_a_busy_agent() -> None:
    async with kvactor.open(tiny()) as session:
        engine = session.engine
        first = Generate("x", [1, 2, 3], Sampling(max_tokens=200), 0.0)
        async with engine.stream(first) as stream:
            await stream.__anext__()
            with pytest.raises(AgentBusy):
                async for _ in engine.stream(Generate("x", [1, 2], Sampling(), 0.0)):
                    pass
            with pytest.raises(ValueError, match="token ids"):
                async for _ in engine.stream(Generate("y", [10**9], Sampling(), 0.0)):
                    pass
            for cuts in ((0,), (3,), (2, 1), (1, 1)):  # cuts lie inside the prompt, increasing
                with pytest.raises(ValueError, match="cuts"):
                    async for _ in engine.stream(
                        Generate("y", [1, 2, 3], Sampling(), 0.0, cuts=cuts)
                    ):
                        pass
            # An answer begins inside the prompt, below a cut (where its decoded run ends).
            for answers in ((0,), (2,), (1, 1)):
                with pytest.raises(ValueError, match="answers"):
                    async for _ in engine.stream(
                        Generate("y", [1, 2, 3], Sampling(), 0.0, cuts=(2,), answers=answers)
                    ):
                        pass


async def test_forget_drops_the_cache() -> None:
    async with kvactor.open(tiny()) as session:
        agent = await session.spawn_agent("a")
        await agent.generate("remember me", max_tokens=2)
        await session.forget("a")
        with pytest.raises(UnknownAgent):
            session.agent("a")
        assert (await session.stats()).agents_cached == 0


async def test_open_can_be_awaited_and_closed() -> None:
    session: Session = await kvactor.open(tiny())
    try:
        agent = await session.spawn_agent("a")
        assert (await agent.generate("hi", max_tokens=2)).token_ids
    finally:
        await session.aclose()
    assert not session.engine.alive


async def test_a_model_that_fails_to_load_fails_open() -> None:
    with pytest.raises(kvactor.ModelLoadError):
        async with kvactor.open("/nonexistent/model.gguf"):
            pass


@ATTENTION
async def test_the_hot_budget_is_never_exceeded_and_caches_never_mix(attention: Attention) -> None:
    prompts = [f"agent number {i} says {'abc'[i % 3] * (i + 1)}" for i in range(12)]
    # Deterministic: batched answers equal solo ones only in that mode (README).
    options: dict[str, Any] = {"attention": attention, "deterministic": True, "max_batch": 8}
    async with kvactor.open(lively(), **options) as session:
        solo = []
        for i, prompt in enumerate(prompts):
            agent = await session.spawn_agent(f"solo-{i}")
            solo.append((await agent.generate(prompt, max_tokens=10)).token_ids)
    base = await mlx_base_peak(lively(), prompts[-1], 10, **options)
    # Two turns (a 1 MiB reserve each) and a few idle caches of ~20 kB: the rest must go.
    budget = 2 * 1024 * 1024 + 64 * 1024
    async with kvactor.open(
        lively(), budget_bytes=budget, memory_limit=MEMORY_LIMIT, **options
    ) as session:
        agents = [await session.spawn_agent(f"a-{i}") for i in range(len(prompts))]
        outs: list[list[int]] = [[] for _ in prompts]

        async def run(i: int) -> None:
            outs[i] = (await agents[i].generate(prompts[i], max_tokens=10)).token_ids

        async def again(i: int) -> None:
            await agents[i].generate("and again", max_tokens=4)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
        # Second turns of a few agents while the others idle: room must come from them.
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(again, i)
        stats = await session.stats()
        assert outs == solo  # nobody got another agent's cache
        assert stats.max_batch_seen > 1  # and some of them decoded together
        assert stats.peak_bytes <= budget
        assert stats.mlx_peak_bytes <= mlx_bound(base, budget)  # MLX's own memory too
        assert stats.demoted_cold > 0  # demotions really happened (no warm tier here)
        assert stats.cache_bytes <= budget


async def test_a_turn_larger_than_the_whole_budget_is_refused() -> None:
    async with kvactor.open(tiny(), budget_bytes=64 * 1024) as session:
        agent = await session.spawn_agent("big")
        with pytest.raises(kvactor.BudgetExceeded, match="hot budget"):
            await agent.generate("hello", max_tokens=100)


async def test_the_engine_lets_mlx_keep_freed_buffers_for_reuse() -> None:
    import mlx.core as mx

    from kvactor.kernels.memory import FREED_BUFFER_BYTES, keep_freed_buffers

    before = mx.set_cache_limit(32 << 20)  # MLX's own default on CPU
    try:
        async with kvactor.open(tiny()) as session:
            await (await session.spawn_agent("a")).generate("hi", max_tokens=2)
            # What the engine set at its start: up to 1 GiB, never above 1/8 of memory.
            in_force = mx.set_cache_limit(32 << 20)
            assert 32 << 20 < in_force <= FREED_BUFFER_BYTES
        mx.set_cache_limit(4 * FREED_BUFFER_BYTES)
        assert keep_freed_buffers() == 4 * FREED_BUFFER_BYTES  # a higher limit is kept
    finally:
        mx.set_cache_limit(before)


@ATTENTION
async def test_pipelined_decode_gives_the_tokens_and_caches_of_an_unpipelined_one(
    attention: Attention, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows leave a pipelined batch at different steps (token budgets, a stop string, EOS
    from sampling): each leaves its cache as an unpipelined run does, so the next turns
    EXTEND it alike and the ready copies are kept alike."""
    options: list[dict[str, Any]] = [{"max_tokens": 3 + 2 * i} for i in range(len(PROMPTS) - 2)] + [
        {"max_tokens": 12, "stop": ["e"]},
        {"max_tokens": 9, "temperature": 0.8, "seed": 7},
    ]

    async def run() -> tuple[list[list[int]], list[int], kvactor.EngineStats]:
        async with kvactor.open(
            tiny(), max_batch=8, attention=attention, deterministic=True
        ) as session:
            agents = [await session.spawn_agent(f"a{i}") for i in range(len(PROMPTS))]
            out: list[list[int]] = [[] for _ in range(2 * len(PROMPTS))]

            async def turns(i: int) -> None:
                for t, text in enumerate((PROMPTS[i], "and then?")):
                    done = await agents[i].generate(text, **options[i])
                    out[2 * i + t] = done.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(turns, i)
            cached = [(await a.cache_info()).tokens for a in agents]
            return out, cached, await session.stats()

    pipelined = await run()
    monkeypatch.setattr(DecodeBatch, "pipelined", False)
    plain = await run()
    assert pipelined[0] == plain[0] and pipelined[1] == plain[1]
    assert pipelined[2].max_batch_seen > 1  # rows really decoded together
    assert pipelined[2].ready_turns == plain[2].ready_turns
    assert pipelined[2].generated_tokens == plain[2].generated_tokens


async def test_a_prompt_too_long_for_any_tokenization_is_refused_before_it_is_tokenized() -> None:
    """A prompt of more characters than context x the longest token could spell is refused
    at once (ContextOverflow naming the limit), and the session keeps serving."""
    async with kvactor.open(tiny()) as session:
        agent = await session.spawn_agent("a")
        limit = session.max_prompt_chars
        with anyio.fail_after(5):  # tokenizing this many characters would take far longer
            with pytest.raises(ContextOverflow, match=str(limit)):
                await agent.generate("x" * (limit + 1), max_tokens=2)
            with pytest.raises(ContextOverflow, match=str(limit)):
                await agent.chat([{"role": "user", "content": "y" * (limit + 1)}], max_tokens=2)
        assert (await agent.generate("hello", max_tokens=2)).token_ids


async def test_a_turn_in_flight_when_the_engine_stops_fails_with_engine_stopped() -> None:
    """docs/embedding.md, Errors: a turn in flight when the engine stops fails with
    EngineStopped, and nothing hangs: a turn asked for after fails at once (the engine
    actor is dead), and the session still closes."""
    with anyio.fail_after(60):  # a turn that is never answered would run into this
        async with kvactor.open(endless()) as session:
            agent = await session.spawn_agent("a")
            failed: list[BaseException] = []

            async def call() -> None:
                try:
                    await agent.generate("go on forever", max_tokens=ENDLESS)
                except kvactor.EngineStopped as exc:
                    failed.append(exc)

            async def decoding() -> bool:
                return (await session.stats()).decoding == 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await _until(decoding)
                await session.engine.stop()
            assert len(failed) == 1 and "engine stopped" in str(failed[0])
            with pytest.raises(ActorDeadError, match="engine"):
                await agent.generate("and now?", max_tokens=2)
