"""Running a scenario on one session: the turns, the live tiers, the cold references."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ._scenario_format import (
    POLICIES,
    PhaseSpec,
    Scenario,
    resolve_model,
    scenario_cache_dir,
    turn_plan,
    turn_prompt,
)
from ._scenario_results import (
    AgentRow,
    ColdReference,
    Event,
    PhaseStarted,
    Results,
    RunStarted,
    TurnFinished,
    TurnRecord,
    TurnStarted,
    summarize,
)
from .actors import ModelInfo, Tier, Tokenizer, UnknownAgent
from .actors import open as open_session
from .actors.config import turn_reserve_bytes
from .actors.session import Agent, Session
from .actors.store import forget, list_agents, lock_cache_dir
from .kernels.agent_cache import cache_nbytes
from .kernels.qcodec import KVCodec
from .kernels.turn_cache import CacheGeometry

if sys.version_info < (3, 11):  # pragma: no cover - Python 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = ("estimate_budget", "estimate_context", "run_scenario")


# ---------------------------------------------------------------------- estimates
def _codec_bytes_per_token(info: ModelInfo) -> float:
    """Stored (quantized) bytes one token costs, all layers (sink tokens at higher precision
    are left out: the count starts past them)."""
    codec = KVCodec.from_description(info.codec)
    n = 1024
    return cache_nbytes(codec, _geometry(info), n, start=codec.sink_tokens) / n


def _geometry(info: ModelInfo) -> CacheGeometry:
    if info.geometry:
        return CacheGeometry.from_description(info.geometry)
    return CacheGeometry.uniform(info.n_layers, info.n_kv_heads, info.head_dim)


def estimate_context(s: Scenario, tokenizer: Tokenizer, start_tokens: Mapping[str, int]) -> int:
    """The most tokens (prompt + reply) any turn of the run may need: the conversations
    are rendered with every reply ``max_tokens`` long, on top of the ``start_tokens``
    that resumed agents already hold. A small margin covers quoted replies that tokenize
    into more tokens than were generated."""
    unit = " a"  # one token per repeat in BPE vocabularies; a byte tokenizer counts bytes
    per_unit = len(tokenizer.encode(unit * 64)) / 64

    def reply(max_tokens: int) -> str:
        return unit * max(1, int(max_tokens / per_unit))

    def count(messages: list[dict[str, str]], add_generation_prompt: bool) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return len(tokenizer.encode(text))

    head = {a.name: [{"role": "system", "content": a.system}] if a.system else [] for a in s.agents}
    conversations = {name: list(messages) for name, messages in head.items()}
    offset = {
        name: max(0, tokens - (count(head[name], False) if head[name] else 0))
        for name, tokens in start_tokens.items()
    }
    # A resumed run quotes what the agents said at the end of the previous one.
    said = {name: reply(s.sampling.max_tokens) for name in start_tokens}
    longest = 0
    for _, phase, names in turn_plan(s):
        max_tokens = phase.max_tokens or s.sampling.max_tokens
        snapshot = dict(said)
        for name in names:
            messages = conversations[name]
            messages.append({"role": "user", "content": turn_prompt(s, phase, name, snapshot)})
            need = offset.get(name, 0) + count(messages, True) + max_tokens
            longest = max(longest, need)
            said[name] = reply(max_tokens)
            messages.append({"role": "assistant", "content": said[name]})
    return int(longest * 1.02) + 8


def estimate_budget(
    s: Scenario, info: ModelInfo, tokenizer: Tokenizer, start_tokens: Mapping[str, int]
) -> tuple[int, str]:
    """The hot budget for ``s.hot_agents``: room for ``concurrency`` running turns at the
    longest context of the run (``estimate_context``; the engine reserves twice a float
    working copy of prompt + max_tokens, rounded up to 256 tokens, plus the stored
    cache) and for ``hot_agents`` idle agents' quantized caches of that length."""
    assert s.hot_agents is not None
    longest = estimate_context(s, tokenizer, start_tokens)
    reserve = turn_reserve_bytes(_geometry(info), longest)
    cached = longest * _codec_bytes_per_token(info)
    budget = int(s.concurrency * (reserve + cached) + s.hot_agents * cached)
    note = (
        f"hot_agents = {s.hot_agents:g}: {s.concurrency} running turn(s) of <= {longest} "
        f"tokens ({reserve / 1e6:.1f} MB working copy each) + {s.hot_agents:g} idle "
        f"cache(s) of <= {cached / 1e6:.1f} MB"
    )
    return budget, note


class _Outcome(msgspec.Struct, kw_only=True):
    found: list[str]
    tokens: dict[str, int]
    reset: str | None


def _warm_on_disk(s: Scenario, root: Path | None) -> _Outcome:
    """Which of the scenario's agents have warm caches; forget them when asked to (or
    when one is past ``resume_max_tokens``). Runs on a worker thread: it touches files."""
    if root is None:
        return _Outcome(found=[], tokens={}, reset=None)
    names = {a.name for a in s.agents}
    infos = [w for w in list_agents(root) if w.agent in names and w.rejected is None]
    found = sorted(w.agent for w in infos)
    reset = None
    if infos and not s.resume:
        reset = "asked to start fresh"
    elif s.resume_max_tokens is not None and infos:
        longest = max(w.tokens for w in infos)
        if longest > s.resume_max_tokens:
            reset = (
                f"the conversations reached {longest} tokens "
                f"(resume_max_tokens = {s.resume_max_tokens})"
            )
    if reset is not None:
        with lock_cache_dir(root):  # CacheDirLocked while another session uses it
            for name in sorted(names):
                forget(root, name)
        return _Outcome(found=found, tokens={}, reset=reset)
    return _Outcome(found=found, tokens={w.agent: w.tokens for w in infos}, reset=None)


# -------------------------------------------------------------------------------- run
async def _tier_rows(
    kv: Session, names: Sequence[str], last: Mapping[str, TurnRecord], turns: Mapping[str, int]
) -> list[AgentRow]:
    warm = {w.agent: w for w in await kv.warm_agents() if w.rejected is None}
    rows = []
    for name in names:
        try:
            info = await kv.agent(name).cache_info()
            tier, tokens, nbytes = Tier.HOT, info.tokens, info.nbytes
        except UnknownAgent:
            w = warm.get(name)
            tier, tokens, nbytes = (Tier.WARM, w.tokens, w.nbytes) if w else (Tier.COLD, 0, 0)
        record = last.get(name)
        rows.append(
            AgentRow(
                agent=name,
                tier=tier,
                tokens=tokens,
                nbytes=nbytes,
                turns=turns.get(name, 0),
                last_path=record.path if record else None,
                last_match=record.match if record else None,
                last_ttft_s=record.ttft_s if record else None,
            )
        )
    return rows


async def _is_hot(agent: Agent) -> bool:
    try:
        await agent.cache_info()
    except UnknownAgent:
        return False
    return True


class _Runner:
    """The state of one run: the session, each agent's latest output, the records."""

    def __init__(self, s: Scenario, kv: Session, on_event: Callable[[Event], None] | None) -> None:
        self.s = s
        self.kv = kv
        self.on_event = on_event
        self.names = [a.name for a in s.agents]
        self.plan = turn_plan(s)
        self.total = sum(len(names) for *_, names in self.plan)
        self.outputs: dict[str, str] = {}
        self.records: list[TurnRecord] = []
        self.last: dict[str, TurnRecord] = {}
        self.turns: dict[str, int] = {}
        self.hinted_cold: set[str] = set()  # hinted while not hot: a hot turn was staged
        self.started = 0
        self.t0 = time.perf_counter()

    def emit(self, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(event)

    async def rows(self) -> list[AgentRow]:
        if self.on_event is None:
            return []
        return await _tier_rows(self.kv, self.names, self.last, self.turns)

    async def hint(self, name: str | None) -> None:
        if name is None or not self.s.prefetch or self.kv.cache_dir is None:
            return
        agent = self.kv.agent(name)
        if not await _is_hot(agent):
            self.hinted_cold.add(name)
        await self.kv.prefetch(name)

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        for index, phase, names in self.plan:
            self.emit(PhaseStarted(index=index, name=phase.name, agents=list(names)))
            following = self.plan[index + 1][2][0] if index + 1 < len(self.plan) else None
            # Every turn of a phase quotes what the others said before the phase began,
            # so the prompts do not depend on how the turns interleave.
            snapshot = dict(self.outputs)
            pending = deque(names)
            workers = min(self.s.concurrency, len(names))
            if workers == 1:  # no task group: errors reach the caller unwrapped
                await self.worker(index, phase, pending, snapshot, following)
                continue
            try:
                async with anyio.create_task_group() as tg:
                    for _ in range(workers):
                        tg.start_soon(self.worker, index, phase, pending, snapshot, following)
            except BaseExceptionGroup as group:
                errors = group.exceptions
                if len(errors) == 1 and isinstance(errors[0], Exception):
                    raise errors[0] from None  # one failed turn: its own error, not a group
                raise

    async def worker(
        self,
        index: int,
        phase: PhaseSpec,
        pending: deque[str],
        snapshot: Mapping[str, str],
        following: str | None,
    ) -> None:
        """Take the phase's next agent until none is left; hint the one after it."""
        while pending:
            name = pending.popleft()
            await self.turn(index, phase, name, snapshot, pending[0] if pending else following)

    async def turn(
        self,
        phase_index: int,
        phase: PhaseSpec,
        name: str,
        snapshot: Mapping[str, str],
        after: str | None,
    ) -> None:
        s = self.s
        prompt = turn_prompt(s, phase, name, snapshot)
        sampling: dict[str, Any] = {
            "max_tokens": phase.max_tokens or s.sampling.max_tokens,
            "temperature": s.sampling.temperature,
            "top_p": s.sampling.top_p,
            "seed": s.sampling.seed,
            "stop": list(s.sampling.stop),
        }
        index = self.started
        self.started += 1
        self.emit(TurnStarted(phase_index=phase_index, agent=name, index=index, total=self.total))
        agent = self.kv.agent(name)
        started = time.perf_counter()
        hinted = False
        async with agent.stream(prompt, **sampling) as pieces:
            async for _ in pieces:
                if not hinted:  # the turn is past its prefill: stage the next agent now
                    hinted = True
                    await self.hint(after)
        if not hinted:
            await self.hint(after)
        done = pieces.completion
        assert done is not None
        wall = time.perf_counter() - started
        try:
            info = await agent.cache_info()
            cache_tokens, cache_bytes = info.tokens, info.nbytes
        except UnknownAgent:  # demoted already, by a concurrent turn
            cache_tokens, cache_bytes = len(done.token_ids), 0
        t = done.timings
        record = TurnRecord(
            index=index,
            phase=phase.name,
            phase_index=phase_index,
            agent=name,
            path=done.path,
            match=done.match,
            prefetched=done.path is Tier.HOT and name in self.hinted_cold,
            ttft_s=t.ttft_s,
            queue_s=t.queue_s,
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            prompt_tokens=t.prompt_tokens,
            reused_tokens=t.reused_tokens,
            prefilled_tokens=t.prefilled_tokens,
            generated_tokens=t.generated_tokens,
            decode_tok_s=t.decode_tok_s,
            finish_reason=done.finish_reason,
            cache_tokens=cache_tokens,
            cache_bytes=cache_bytes,
            start_s=started - self.t0,
            wall_s=wall,
            text=done.text,
        )
        self.hinted_cold.discard(name)
        self.records.append(record)
        self.last[name] = record
        self.turns[name] = self.turns.get(name, 0) + 1
        self.outputs[name] = done.text.strip()
        self.emit(TurnFinished(record=record, total=self.total, agents=await self.rows()))


async def _cold_references(kv: Session, records: Sequence[TurnRecord]) -> list[ColdReference]:
    """Prefill again, from scratch, the prompt of the longest turn and (when the run had
    no cold turn to compare with) of the shortest, in a throwaway agent."""
    targets = [max(records, key=lambda r: (r.prompt_tokens, r.index))]
    if all(r.path is not Tier.COLD for r in records):
        shortest = min(records, key=lambda r: (r.prompt_tokens, r.index))
        if shortest.prompt_tokens <= 0.75 * targets[0].prompt_tokens:
            targets.append(shortest)
    name = "cold-reference"
    while name in kv.agents:
        name += "-"
    out = []
    for record in targets:
        # The record's prompt is the agent's history up to that turn's user message.
        history = await kv.agent(record.agent).history()
        later = sum(1 for r in records if r.agent == record.agent and r.index > record.index)
        messages = history[: len(history) - 2 * later - 1]
        if not messages or messages[-1]["role"] != "user":
            continue
        prompt = kv.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        scratch = await kv.spawn_agent(name)
        try:
            done = await scratch.complete(prompt, max_tokens=1)
        finally:
            await kv.forget(name)
        out.append(
            ColdReference(
                index=record.index,
                agent=record.agent,
                prompt_tokens=done.timings.prompt_tokens,
                ttft_s=done.timings.ttft_s,
                turn_ttft_s=record.ttft_s,
                turn_path=f"{record.path}/{record.match}",
            )
        )
    return out


async def run_scenario(
    scenario: Scenario, *, on_event: Callable[[Event], None] | None = None
) -> Results:
    """Run every phase of ``scenario`` on one session and measure every turn.

    ``on_event`` (a plain function) sees RunStarted, PhaseStarted, TurnStarted and
    TurnFinished as they happen. Raises ScenarioError for a model path that does not
    exist, ModelLoadError for a model that cannot be loaded, and what a turn raises
    (BudgetExceeded when ``budget_mb`` cannot hold one turn's working cache).
    """
    started_at = time.time()
    t0 = time.perf_counter()
    spec = resolve_model(scenario.model)
    root = scenario_cache_dir(scenario)
    disk = await anyio.to_thread.run_sync(_warm_on_disk, scenario, root)
    budget: int | None = None
    note = "no budget: every cache stays hot"
    if scenario.budget_mb is not None:
        budget = int(scenario.budget_mb * 1e6)
        note = f"budget_mb = {scenario.budget_mb:g}"
    elif scenario.hot_agents is not None:
        # The estimate needs the model's shape and tokenizer before the budget is set.
        async with open_session(spec, max_batch=1) as probe:
            budget, note = estimate_budget(scenario, probe.model, probe.tokenizer, disk.tokens)
    async with open_session(
        spec,
        max_batch=scenario.max_batch,
        prefill_chunk=scenario.prefill_chunk,
        attention=scenario.attention,
        budget_bytes=budget,
        policy=POLICIES[scenario.policy](),
        cache_dir=root,
    ) as kv:
        runner = _Runner(scenario, kv, on_event)
        resumed: list[str] = []
        resumed_tokens = 0
        for spec_agent in scenario.agents:
            agent = await kv.spawn_agent(spec_agent.name, system=spec_agent.system)
            state = await agent.state()
            if state.restored:
                resumed.append(agent.name)
                resumed_tokens += state.tokens
                replies = [m["content"] for m in state.messages if m["role"] == "assistant"]
                if replies:  # {outputs} of the first phase: what they said last time
                    runner.outputs[agent.name] = replies[-1].strip()
        runner.emit(
            RunStarted(
                scenario=scenario,
                model=kv.model,
                cache_dir=str(root) if root is not None else None,
                budget_bytes=budget,
                budget_note=note,
                found_warm=disk.found,
                resumed=resumed,
                resumed_tokens=resumed_tokens,
                reset=disk.reset,
                total_turns=runner.total,
                agents=await runner.rows(),
            )
        )
        await runner.run()
        stats = await kv.stats()  # before the reference prefill, which demotes caches
        records = sorted(runner.records, key=lambda r: r.index)
        references = []
        if scenario.cold_reference and records:
            references = await _cold_references(kv, records)
        model = kv.model
    return Results(
        scenario=scenario,
        model=model,
        cache_dir=str(root) if root is not None else None,
        budget_bytes=budget,
        budget_note=note,
        resumed=resumed,
        reset=disk.reset,
        turns=records,
        summary=summarize(records, references),
        stats=stats,
        wall_s=time.perf_counter() - t0,
        started_at=started_at,
    )
