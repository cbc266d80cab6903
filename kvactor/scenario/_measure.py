"""After a scenario's turns: the cold references (prompts prefilled again from scratch),
the shared context's record and the hot tier's footprint (see ``kvactor.scenario``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..actors.engine import ModelSpec
from ..actors.enums import Tier
from ..actors.errors import UnknownAgent
from ..actors.opening import open as open_session
from ..actors.session import Session
from ._format import CONTEXT_AGENT, Scenario
from ._results import ColdReference, ContextRecord, TurnRecord

__all__ = ("cold_references", "hot_footprint", "make_context", "reference_prompts")


async def reference_prompts(
    kv: Session, records: Sequence[TurnRecord]
) -> list[tuple[TurnRecord, str]]:
    """The turns to prefill again from scratch: the longest and (when the run had no cold
    turn to compare with) the shortest, each with its whole prompt."""
    targets = [max(records, key=lambda r: (r.prompt_tokens, r.index))]
    if all(r.path is not Tier.COLD for r in records):
        shortest = min(records, key=lambda r: (r.prompt_tokens, r.index))
        if shortest.prompt_tokens <= 0.75 * targets[0].prompt_tokens:
            targets.append(shortest)
    out = []
    for record in targets:
        # The record's prompt is the agent's history up to that turn's user message.
        history = await kv.agent(record.agent).history()
        later = sum(1 for r in records if r.agent == record.agent and r.index > record.index)
        messages = history[: len(history) - 2 * later - 1]
        if messages and messages[-1]["role"] == "user":
            prompt = kv.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            out.append((record, prompt))
    return out


async def cold_references(
    spec: ModelSpec, s: Scenario, targets: Sequence[tuple[TurnRecord, str]]
) -> list[ColdReference]:
    """Prefill each prompt from scratch in a session of its own: there no other cache
    holds a prefix to share, so each is a true cold prefill."""
    out = []
    async with open_session(
        spec, max_batch=1, prefill_chunk=s.prefill_chunk, attention=s.attention
    ) as kv:
        scratch = await kv.spawn_agent("cold-reference")
        await scratch.complete("Hello", max_tokens=1)  # the first turn of a session warms up
        for record, prompt in targets:
            await kv.forget(scratch.name)
            scratch = await kv.spawn_agent(scratch.name)
            done = await scratch.complete(prompt, max_tokens=1)
            out.append(
                ColdReference(
                    index=record.index,
                    agent=record.agent,
                    prompt_tokens=done.timings.prompt_tokens,
                    ttft_s=done.timings.ttft_s,
                    turn_ttft_s=record.ttft_s,
                    turn_path=f"{record.path}/{record.match}",
                    reused_tokens=done.timings.reused_tokens,
                )
            )
    return out


async def make_context(kv: Session, text: str) -> ContextRecord:
    started = time.perf_counter()
    agent = await kv.context(CONTEXT_AGENT, text)
    seconds = time.perf_counter() - started
    state = await agent.state()
    path = Tier.WARM if state.restored else Tier.COLD
    return ContextRecord(tokens=state.tokens, path=path, seconds=seconds)


async def hot_footprint(kv: Session, names: Sequence[str]) -> tuple[int, int, int]:
    """(hot caches, their stored bytes with shared arrays once, each counted whole)."""
    stats = await kv.stats()
    each = 0
    caches = 0
    for name in names:
        try:
            each += (await kv.cache_info(name)).nbytes
        except UnknownAgent:
            continue
        caches += 1
    # Between turns a hot cache is its stored ranges plus its ready (float) copy, if
    # kept; the copies come off both counts (a shared prefix's copy is in no cache's).
    once = stats.cache_bytes - stats.ready_bytes
    own_copies = stats.ready_bytes - stats.shared_ready_bytes
    return caches, once, max(once, each - own_copies)
