"""Running a scenario on one session: the warm caches found, the turns, the live tiers;
the estimates before (``_scenario_estimate``) and the measures after (``_scenario_measure``)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ..actors.enums import Tier
from ..actors.errors import UnknownAgent
from ..actors.opening import open as open_session
from ..actors.session import Agent, Session
from ..actors.warm import disk_footprint, forget, list_agents, lock_cache_dir
from ._estimate import estimate_budget
from ._format import (
    CONTEXT_AGENT,
    POLICIES,
    PhaseSpec,
    Scenario,
    resolve_model,
    scenario_cache_dir,
    shared_text,
    turn_plan,
    turn_prompt,
)
from ._measure import cold_references, hot_footprint, make_context, reference_prompts
from ._models import agent_model, model_folders, session_models
from ._results import (
    AgentRow,
    Event,
    Footprint,
    PhaseStarted,
    Results,
    RunStarted,
    TurnFinished,
    TurnRecord,
    TurnStarted,
    summarize,
)

if sys.version_info < (3, 11):  # pragma: no cover - Python 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = ("run_scenario",)

#: How many of the next turns (in plan order) each turn's hint names.
HINT_AHEAD = 4


class _Outcome(msgspec.Struct, kw_only=True):
    found: list[str]
    tokens: dict[str, int]
    reset: str | None


def _warm_on_disk(s: Scenario, root: Path | None) -> _Outcome:
    """Which of the scenario's agents have warm caches; forget them (and the shared
    context's) when asked to (or when one is past ``resume_max_tokens``). Runs on a
    worker thread: it touches files."""
    if root is None:
        return _Outcome(found=[], tokens={}, reset=None)
    names = {a.name for a in s.agents}
    folders = model_folders(s, root)
    infos = [
        w
        for folder in folders
        for w in list_agents(folder)
        if w.agent in names and w.rejected is None
    ]
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
        for folder in folders:
            with lock_cache_dir(folder):  # CacheDirLocked while another session uses it
                for name in sorted(names | ({CONTEXT_AGENT} if s.shared_context else set())):
                    forget(folder, name)
        return _Outcome(found=found, tokens={}, reset=reset)
    return _Outcome(found=found, tokens={w.agent: w.tokens for w in infos}, reset=None)


def _disk_footprint(s: Scenario, root: Path | None, names: Sequence[str]) -> tuple[int, int, int]:
    """``disk_footprint`` over every model's folder of the scenario's warm tier."""
    if root is None:
        return 0, 0, 0
    parts = [disk_footprint(folder, names) for folder in model_folders(s, root)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)


# -------------------------------------------------------------------------------- run
async def _tier_rows(
    kv: Session, names: Sequence[str], last: Mapping[str, TurnRecord], turns: Mapping[str, int]
) -> list[AgentRow]:
    warm = {w.agent: w for w in await kv.warm_agents() if w.rejected is None}
    several = bool(kv.model_names)
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
                model=kv.model_of(name) if several and name in kv.agents else None,
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

    def __init__(
        self,
        s: Scenario,
        kv: Session,
        on_event: Callable[[Event], None] | None,
        context: str | None = None,
    ) -> None:
        self.s = s
        self.kv = kv
        self.on_event = on_event
        self.context = context  # the shared context's text, when it is shared
        self.names = [a.name for a in s.agents]
        self.specs = {a.name: a for a in s.agents}
        self.caches = [*self.names, *([CONTEXT_AGENT] if context is not None else [])]
        self.fresh: set[str] = set()  # no user message yet: its role opens its next turn
        self.forked: set[str] = set()  # forks before their first turn
        self.plan = turn_plan(s)
        self.total = sum(len(names) for *_, names in self.plan)
        # Every turn in plan order: what the hints say comes next (``hint_order``).
        self.order = [name for *_, names in self.plan for name in names]
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
        return await _tier_rows(self.kv, self.caches, self.last, self.turns)

    async def spawn(self, on_disk: Collection[str], text: str | None) -> tuple[list[str], int]:
        """Start every agent but the forks made later (those without a warm cache to
        resume); ``text``: the shared context, shared when ``self.context`` is set, else
        each agent's own system prompt. Returns the agents that resumed a warm cache, and
        their tokens."""
        resumed: list[str] = []
        tokens = 0
        for spec in self.s.agents:
            if spec.fork is not None and spec.name not in on_disk:
                continue  # forked at the start of the first phase it speaks in
            model = agent_model(self.s, spec.name)
            if spec.fork is not None:  # resumes its warm cache
                agent = await self.kv.spawn_agent(spec.name, model=model)
            elif self.context is not None:
                agent = await self.kv.spawn_agent(spec.name, context=CONTEXT_AGENT)
            else:
                system = text or spec.system
                agent = await self.kv.spawn_agent(spec.name, system=system, model=model)
            state = await agent.state()
            if not any(m["role"] == "user" for m in state.messages):
                self.fresh.add(spec.name)
            if state.restored:
                resumed.append(agent.name)
                tokens += state.tokens
                replies = [m["content"] for m in state.messages if m["role"] == "assistant"]
                if replies:  # {outputs} of the first phase: what they said last time
                    self.outputs[agent.name] = replies[-1].strip()
        return resumed, tokens

    async def fork(self, names: Sequence[str]) -> None:
        """Make the forks that speak first in this phase: each starts where its source is
        now, at the end of the previous phase."""
        for name in names:
            source = self.specs[name].fork
            if source is not None and name not in self.kv.agents:
                await self.kv.fork(source, name)
                self.forked.add(name)

    async def hint(self, name: str | None) -> None:
        if name is None or not self.s.prefetch or self.kv.cache_dir is None:
            return
        if name not in self.kv.agents:
            return  # a fork not made yet
        agent = self.kv.agent(name)
        if not await _is_hot(agent):
            self.hinted_cold.add(name)
        await self.kv.prefetch(name)

    async def hint_order(self, index: int, name: str, *, ended: bool = False) -> None:
        """Before turn ``index`` (of ``name``): hint the agents of the next turns in plan
        order; once it ``ended``, ``name`` done if it has no turn left. Staging stays
        ``hint``'s (the scenario's ``prefetch``)."""
        later = self.order[index + 1 :]
        if ended:
            if name not in later:
                await self.kv.hint(done=[name], prefetch=0)
            return
        upcoming = list(dict.fromkeys(a for a in later[:HINT_AHEAD] if a != name))
        await self.kv.hint(next=upcoming, prefetch=0)

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        for index, phase, names in self.plan:
            await self.fork(names)
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
        prompt = turn_prompt(s, phase, name, snapshot, first=name in self.fresh)
        self.fresh.discard(name)
        forked = name in self.forked
        self.forked.discard(name)
        sampling: dict[str, Any] = {
            "max_tokens": phase.max_tokens or s.sampling.max_tokens,
            "temperature": s.sampling.temperature,
            "top_p": s.sampling.top_p,
            "seed": s.sampling.seed,
            "stop": list(s.sampling.stop),
        }
        index = self.started
        self.started += 1
        await self.hint_order(index, name)
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
        await self.hint_order(index, name, ended=True)
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
            shared_tokens=t.shared_tokens,
            forked_tokens=t.reused_tokens - t.shared_tokens if forked else 0,
        )
        self.hinted_cold.discard(name)
        self.records.append(record)
        self.last[name] = record
        self.turns[name] = self.turns.get(name, 0) + 1
        self.outputs[name] = done.text.strip()
        self.emit(TurnFinished(record=record, total=self.total, agents=await self.rows()))


def _open(
    scenario: Scenario, spec: Any, models: dict[str, Any], budget: int | None, root: Path | None
) -> Any:
    """The run's session, not opened yet (several models: ``models`` names them)."""
    return open_session(
        None if "models" in models else spec,
        **models,
        max_batch=scenario.max_batch,
        prefill_chunk=scenario.prefill_chunk,
        attention=scenario.attention,
        budget_bytes=budget,
        policy=POLICIES[scenario.policy](),
        cache_dir=root,
        share_prefixes=scenario.share_prefixes,
        deterministic=scenario.deterministic,
    )


async def run_scenario(
    scenario: Scenario,
    *,
    on_event: Callable[[Event], None] | None = None,
    watch: Callable[[Session], AbstractAsyncContextManager[object]] | None = None,
) -> Results:
    """Run every phase of ``scenario`` on one session and measure every turn.

    ``on_event`` (a plain function) sees RunStarted, PhaseStarted, TurnStarted and
    TurnFinished as they happen; ``watch(session)`` is entered once the session is open
    and left before it closes (a dashboard: its last look at the session). Raises
    ScenarioError for a model path that does not exist or a shared context file that
    cannot be read, ModelLoadError for a model that cannot be loaded, and what a turn
    raises (BudgetExceeded when ``budget_mb`` cannot hold one turn's working cache).
    """
    started_at = time.time()
    t0 = time.perf_counter()
    models = session_models(scenario)
    first = next(iter(scenario.models.values()), scenario.model)
    spec = resolve_model(first)  # several models: the cold reference runs on the first
    text = shared_text(scenario)
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
    opened = _open(scenario, spec, models, budget, root)
    async with opened as kv, watch(kv) if watch is not None else contextlib.nullcontext():
        # Without share_prefixes no shared context is made: the text is each agent's own.
        shared = text if scenario.share_prefixes else None
        runner = _Runner(scenario, kv, on_event, shared)
        context = None if shared is None else await make_context(kv, shared)
        resumed, resumed_tokens = await runner.spawn(disk.tokens, text)
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
                context=context,
            )
        )
        await runner.run()
        stats = await kv.stats()
        hot = await hot_footprint(kv, runner.caches)
        records = sorted(runner.records, key=lambda r: r.index)
        targets: list[tuple[TurnRecord, str]] = []
        if scenario.cold_reference and records:
            targets = await reference_prompts(kv, records)
        model = kv.model
    # Closed: every agent's last write is done.
    files = await anyio.to_thread.run_sync(_disk_footprint, scenario, root, runner.caches)
    references = await cold_references(spec, scenario, targets) if targets else []
    footprint = Footprint(
        hot_caches=hot[0],
        hot_bytes=hot[1],
        hot_bytes_each=hot[2],
        disk_files=files[0],
        disk_bytes=files[1],
        disk_bytes_each=files[2],
    )
    return Results(
        scenario=scenario,
        model=model,
        cache_dir=str(root) if root is not None else None,
        budget_bytes=budget,
        budget_note=note,
        resumed=resumed,
        reset=disk.reset,
        turns=records,
        summary=summarize(records, references, context),
        stats=stats,
        wall_s=time.perf_counter() - t0,
        started_at=started_at,
        context=context,
        footprint=footprint,
    )
