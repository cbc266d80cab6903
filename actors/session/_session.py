"""A session in this process: one engine actor, the warm tier's actors, and agent actors;
``kvactor.open()`` (``actors/opening.py``) makes one."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio
import msgspec

from ...runtime import ActorRef, Runtime
from ..agent import AgentActor
from ..engine import EngineConfig, ModelSpec
from ..errors import AgentExists, UnknownAgent
from ..hot import split_hint
from ..ids import check_agent_id
from ..messages import (
    CacheQuery,
    DropCache,
    EngineMessage,
    Flush,
    Fork,
    Hint,
    HotQuery,
    MakeContext,
    Snapshot,
    SpawnAgent,
    TierEvents,
    Turn,
)
from ..models import Tokenizer
from ..options import Sampling
from ..records import (
    AgentSnapshot,
    CacheInfo,
    EngineBoard,
    EngineStats,
    ModelInfo,
    ModelState,
    TierMoves,
)
from ..warm import (
    MAX_IMPORT_BYTES,
    ActorWarmTier,
    Adopt,
    AgentNames,
    CacheDirLock,
    CacheIdentity,
    ExpectFn,
    Forget,
    Forgotten,
    ForkCache,
    ListAgents,
    PortableInfo,
    Prefetch,
    PrefetchMessage,
    StoreMessage,
    StoreStats,
    StoreStatsQuery,
    WarmInfo,
    WarmMoves,
    lock_cache_dir,
)
from ._api import SessionAPI, drain, scope_name
from ._carry import (
    ExportStream,
    ImportSource,
    behind,
    export_to,
    folder_taken,
    open_export,
    stage_import,
)
from ._handle import Agent
from ._model_part import ModelPart
from ._models import DEFAULT, Default, Models, SessionModels

__all__ = ("OnSaveError", "Session")

log = logging.getLogger("kvactor.session")

OnSaveError = Literal["report", "raise"]
_ON_SAVE_ERROR = ("report", "raise")


class Session(SessionAPI[Agent]):
    """A runtime with one engine actor and any number of agent actors.

    Use ``async with kvactor.open(...) as session`` or ``session = await kvactor.open(...)``
    then ``await session.aclose()``. With several models (``models``: a name per model),
    the one engine holds them all under ``memory_limit`` bytes (its ``pins`` are never
    unloaded; ``model_ttl_s``), each agent runs one of them, and the session's ``engine``,
    ``model``, ``tokenizer`` and warm tier are the first model's. One model is the same
    engine with one model (``memory_limit`` None: no limit, only the hot budget).
    """

    def __init__(
        self,
        model: ModelSpec | Models,
        config: EngineConfig,
        mailbox_size: int,
        cache_dir: str | os.PathLike[str] | None,
        delete_rejected: bool,
        on_save_error: OnSaveError = "report",
        *,
        memory_limit: int | None = None,
        pins: frozenset[str] = frozenset(),
        model_ttl_s: float | None = None,
        disk_limit: int | Default | None = DEFAULT,
        disk_quota: int | None = None,
        warm_ttl_s: float | None = None,
    ) -> None:
        if on_save_error not in _ON_SAVE_ERROR:
            raise ValueError(f"on_save_error must be 'report' or 'raise', not {on_save_error!r}")
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.on_save_error = on_save_error
        self.memory_limit = memory_limit
        self._models = SessionModels(
            model,
            config,
            self.cache_dir,
            delete_rejected=delete_rejected,
            memory_limit=memory_limit,
            pins=pins,
            model_ttl_s=model_ttl_s,
            disk_limit=disk_limit,
            disk_quota=disk_quota,
            warm_ttl_s=warm_ttl_s,
            agent_ref=self._agent_ref,
        )
        self._lock: CacheDirLock | None = None
        self.runtime = Runtime(mailbox_size=mailbox_size)
        self._agents: dict[str, Agent] = {}
        self._contexts: dict[str, str] = {}  # shared contexts made here: name -> text
        self._scopes: dict[str, str] = {}  # running agents' sharing scopes (spawn_agent)
        self._closed = False

    # -- the first model's, as the session's own --------------------------------------
    @property
    def engine(self) -> ActorRef[EngineMessage]:
        """The engine as the first model's agents see it."""
        return self._models.first.engine

    @property
    def model(self) -> ModelInfo:
        return self._models.first.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._models.first.tokenizer

    @property
    def store(self) -> ActorRef[StoreMessage] | None:
        return self._models.first.store

    @property
    def prefetcher(self) -> ActorRef[PrefetchMessage] | None:
        return self._models.first.prefetcher

    @property
    def warm(self) -> ActorWarmTier | None:
        return self._models.first.warm

    @property
    def identity(self) -> CacheIdentity | None:
        """With a warm tier: what its caches must match."""
        return self._models.first.identity

    @property
    def layout(self) -> ExpectFn | None:
        """With a warm tier: its segments' layout."""
        return self._models.first.layout

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which no prompt fits any model's context."""
        return self._models.max_prompt_chars

    # -- start and close --------------------------------------------------------------
    async def start(self) -> Session:
        """Lock ``cache_dir``, start the runtime and load the model on the engine's thread.

        Raises CacheDirLocked (before loading the model) when another session, in this
        process or another one, uses ``cache_dir``."""
        if self.cache_dir is not None:
            self._lock = await anyio.to_thread.run_sync(lock_cache_dir, self.cache_dir)
        try:
            await self.runtime.__aenter__()
        except BaseException:
            self._unlock()
            raise
        try:
            await self._models.start(self.runtime)
        except BaseException as exc:
            self._closed = True
            await self._close(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The lock goes last: stopping agents may still write their caches.
        try:
            if exc_type is None:
                await self._leave_by_recency()
            await self.runtime.__aexit__(exc_type, exc, tb)
        finally:
            self._unlock()

    async def _leave_by_recency(self) -> None:
        """Under write-back with a disk limit: stop the agents with hot caches first, the
        most recently used first. Each writes its cache as it stops, and the limit keeps
        the first written at close (``Append.leaving``): those most likely used next.
        Not when the session ends in an error (the runtime's exit stops every agent)."""
        if not self.config.write_back or self._models.usage is None:
            return
        try:
            hot = sorted(await self.hot_caches(), key=lambda info: -info.last_used)
        except Exception as exc:  # an engine that died: close as usual
            log.warning("closing without ordering the agents' last writes: %s", exc)
            return
        for info in hot:
            agent, _ = self._forget_running(info.agent)
            if agent is not None:
                await agent.ref.stop()

    def _unlock(self) -> None:
        self._models.release_locks()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    async def aclose(self) -> None:
        """Stop every agent (each first saves its last turn), then the engine. Closing a
        closed session does nothing."""
        if not self._closed:
            self._closed = True
            await self._close(None, None, None)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._closed:
            self._closed = True
            await self._close(exc_type, exc, tb)

    # -- agents: spawn, fork, contexts (declared in SessionAPI) -----------------------
    async def _spawn(self, spawn: SpawnAgent) -> Agent:
        if spawn.host is not None:
            raise ValueError("host= is for a cluster session; this one runs in this process")
        if spawn.fork_of is not None:
            return await self._fork(spawn)
        part = self._models.part(spawn.model)
        system, scope = spawn.system, spawn.scope
        if spawn.context is not None:
            system = self._context_text(spawn.context)
            scope = self._same_scope(spawn.context, scope)
            part = self._models.same_model(spawn.context, spawn.model)
        if spawn.name in self._agents:
            raise AgentExists(f"agent {spawn.name!r} already exists")
        return await self._start_agent(
            part,
            spawn.name,
            system,
            context=spawn.context,
            scope="" if scope is None else scope,
            tool_wait_s=spawn.tool_wait_s,
        )

    def _same_scope(self, source: str, scope: str | None) -> str:
        """The scope of an agent made from ``source``: ``source``'s. Raises ValueError
        for another one."""
        known = self._scopes.get(source, "")
        if scope is not None and scope_name(scope) != known:
            raise ValueError(f"{source!r} is of scope {known!r}, not {scope!r}")
        return known

    async def _context(self, made: MakeContext) -> Agent:
        name, text = made.name, made.text
        known = self._contexts.get(name)
        if known is not None and known != text:
            raise ValueError(f"shared context {name!r} exists with another text")
        agent = self._agents.get(name)
        if agent is None:
            part = self._models.part(made.model)
            agent = await self._start_agent(part, name, text, scope=made.scope)
        elif made.model is not None and self._models.model_of(name) != made.model:
            self._models.part(made.model)  # an unknown model says so
            raise ValueError(f"agent {name!r} exists and runs another model")
        elif self._scopes.get(name, "") != made.scope:
            raise ValueError(f"agent {name!r} exists in another scope")
        messages = await agent.history()
        if messages[:1] != [{"role": "system", "content": text}] or len(messages) > 1:
            raise ValueError(f"agent {name!r} exists and is not a shared context of this text")
        self._contexts[name] = text
        await drain(agent.send_turn(Turn("", Sampling(max_tokens=1), prime=True)))
        return agent

    def _context_text(self, name: str) -> str:
        try:
            return self._contexts[name]
        except KeyError:
            raise UnknownAgent(f"no shared context {name!r}: make it with context()") from None

    async def _fork(self, spawn: SpawnAgent) -> Agent:
        source, name, scope, model = spawn.fork_of, spawn.name, spawn.scope, spawn.model
        assert source is not None
        if name in self._agents:
            raise AgentExists(f"agent {name!r} already exists")
        running = self._agents.get(source)
        if running is not None:
            scope = self._same_scope(source, scope)
            part = self._models.same_model(source, model)
        else:
            scope = scope or ""
            part = self._models.part(model)
        start: AgentSnapshot | None
        if running is not None:
            start = await running.ref.ask(Snapshot())
        elif part.warm is not None:
            start = await part.warm.restore(source)
        else:
            start = None
        if start is None:
            raise UnknownAgent(f"no agent named {source!r}, running or on disk")
        on_disk = None
        store, warm = part.store, part.warm
        if store is not None and warm is not None:
            forked = await store.ask(ForkCache(source, name))
            on_disk = None if forked is None else await warm.restore(name)  # what it resumes
        # Hot too when the source is, with exactly those tokens (else it stages from disk).
        await part.engine.ask(Fork(source, name, list((on_disk or start).tokens)))
        return await self._start_agent(
            part,
            name,
            None,
            None if on_disk else start,
            scope=scope,
            tool_wait_s=spawn.tool_wait_s,
        )

    async def _start_agent(
        self,
        part: ModelPart,
        name: str,
        system: str | None,
        start: AgentSnapshot | None = None,
        *,
        context: str | None = None,
        scope: str = "",
        tool_wait_s: float | None = None,
    ) -> Agent:
        ref = await self.runtime.spawn(
            AgentActor,
            name,
            part.env,
            system,
            start,
            context,
            scope,
            tool_wait_s,
            name=f"agent:{name}",
        )
        agent = Agent(self, name, ref)
        self._agents[name] = agent
        self._scopes[name] = scope
        self._models.assign(name, part)
        return agent

    def _forget_running(self, name: str) -> tuple[Agent | None, ModelPart | None]:
        """Take running agent ``name`` out of the session's books: its handle and model."""
        agent = self._agents.pop(name, None)
        self._scopes.pop(name, None)
        self._contexts.pop(name, None)
        return agent, self._models.unassign(name)

    def _agent_ref(self, name: str) -> ActorRef[Any] | None:
        agent = self._agents.get(name)
        return agent.ref if agent is not None else None

    async def _flush(self, agent: Agent) -> None:
        """Under a write budget: write what the warm tier lacks of ``agent``'s cache now,
        whatever the budget says (it is about to be exported or handed over)."""
        if self.config.write_back:
            await agent.ref.ask(Flush(), timeout=None)

    def agent(self, name: str) -> Agent:
        """The agent called ``name``; raises UnknownAgent."""
        try:
            return self._agents[name]
        except KeyError:
            raise UnknownAgent(f"no agent named {name!r}") from None

    @property
    def agents(self) -> dict[str, Agent]:
        return dict(self._agents)

    async def forget(self, name: str) -> Forgotten:
        """Stop the agent (if running) and delete every byte of its cache that is its own:
        hot and warm. Its stored arrays and segment files that other agents use (forks,
        agents that shared its prefix, the context or agent it started from) stay for
        them: the answer lists those files and their users (``kept``), and the bytes it
        deleted from disk (``freed``). Forgetting the last user of a file deletes it.

        An agent that is not running is forgotten in every model's tiers.
        Raises InvalidAgentId for an unsafe name."""
        check_agent_id(name)
        agent, running = self._forget_running(name)
        if agent is not None:
            await agent.ref.stop()
        parts = self._models.parts() if running is None else [running]
        done = Forgotten(agent=name)
        for part in parts:
            await part.engine.ask(DropCache(name))
            if part.store is not None:
                forgotten: Forgotten = await part.store.ask(Forget(name))
                if forgotten.freed or forgotten.kept or part is parts[0]:
                    done = forgotten
        return done

    async def release(self, name: str) -> None:
        """Stop agent ``name``'s actor (it saves its last turn first) and drop its hot cache;
        its warm cache stays, and ``spawn_agent(name)`` resumes it from there, here or in
        another session (an engine host hands agents over this way). Raises
        InvalidAgentId for an unsafe name, UnknownAgent when it is not running."""
        check_agent_id(name)
        await self._flush(self.agent(name))  # UnknownAgent when it is not running
        agent, part = self._forget_running(name)
        assert agent is not None and part is not None
        await agent.ref.stop()
        await part.engine.ask(DropCache(name))

    # -- carrying agents (declared in SessionAPI) -------------------------------------
    async def export_agent(self, name: str, dest: Any) -> PortableInfo:
        part, check = await self._exporting(name)
        return await export_to(part, name, dest, check)

    async def export_stream(self, name: str) -> ExportStream:
        """Agent ``name``'s export as a stream of bytes (``async for``; its ``header``
        first): what ``export_agent`` writes. Raises as that does, before the first byte."""
        part, check = await self._exporting(name)
        return await open_export(part, name, check)

    async def _exporting(self, name: str) -> tuple[ModelPart, Any]:
        """The model part of agent ``name``, and (running) the check that its warm cache
        holds all its turns: asked between its turns, so a turn under way finishes first."""
        check_agent_id(name)
        part = self._models.part_of(name)
        agent = self._agents.get(name)
        if agent is None:
            return part, None
        await self._flush(agent)
        messages = len((await agent.state()).messages)
        return part, functools.partial(behind, messages)

    async def import_agent(
        self,
        src: ImportSource,
        name: str | None = None,
        *,
        replace: bool = False,
        model: str | None = None,
        scope: str | None = None,
        max_bytes: int = MAX_IMPORT_BYTES,
    ) -> Agent:
        part = self._models.part(model)
        if part.store is None:
            raise ValueError("importing an agent needs a warm tier: open with a cache_dir")

        def taken(target: str) -> bool:
            return not replace and (target in self._agents or folder_taken(part.root, target))

        staged = await stage_import(
            part,
            src,
            name,
            taken=taken,
            usage=self._models.usage,
            budget=self._models.budget_bytes,
            max_bytes=max_bytes,
        )
        target = staged.name
        try:
            if target in self._agents:
                if not replace:
                    raise AgentExists(f"agent {target!r} already exists")
                await self.release(target)
            adopt = Adopt(
                str(staged.staging),
                target,
                staged.header.nbytes,
                replace=replace,
                manifest=staged.manifest,
            )
            await part.store.ask(adopt)
        finally:
            staged.discard()
        await part.engine.ask(DropCache(target))  # a hot copy staged before is stale
        return await self.spawn_agent(target, model=model, scope=scope)

    async def prefetch(self, name: str) -> None:
        """Hint that agent ``name`` runs next: its warm cache is staged into the hot tier in
        the background, if there is room, so that its next turn starts hot (an agent that
        is not running: the first model's)."""
        check_agent_id(name)
        prefetcher = self._models.part_of(name).prefetcher
        if prefetcher is not None:
            await prefetcher.tell(Prefetch(name))

    async def _hint(self, hint: Hint, prefetch: int) -> None:
        # Each model's engine part and warm tier hear of their own agents (an agent not
        # running: the first model's, as prefetch has it).
        first = self._models.first.name
        for model, part_hint in split_hint(hint, self._models.agents_by_model(), first).items():
            part = self._models.part(model)
            await part.engine.ask(part_hint)  # the hot tier's owner first
            if part.prefetcher is not None:  # then stage the soonest that are not hot
                for agent in part_hint.next[:prefetch]:
                    await part.prefetcher.tell(Prefetch(agent))

    async def warm_agents(self) -> list[WarmInfo]:
        """Every agent with a warm cache under ``cache_dir`` (refused ones say why), of
        every model."""
        infos: list[WarmInfo] = []
        for part in self._models.parts():
            if part.store is not None:
                infos += await part.store.ask(ListAgents())
        return infos

    async def warm_names(self) -> list[str]:
        """The name of every agent folder under ``cache_dir``, of every model, sorted:
        one directory listing, no manifest read (:meth:`warm_agents` reads each one)."""
        names: set[str] = set()
        for part in self._models.parts():
            if part.store is not None:
                names.update(await part.store.ask(AgentNames()))
        return sorted(names)

    async def stats(self) -> EngineStats:
        """The engine's figures (several models: summed, with the memory limit's), and the
        warm tier's on disk (its bytes against its limit, what it wrote, who went cold)."""
        return await self._with_warm(await self._models.stats())

    async def board(self, since: Mapping[str, int] | None = None) -> EngineBoard:
        """What :meth:`stats`, :meth:`hot_caches`, :meth:`tier_moves` (after ``since``)
        and :meth:`model_states` answer, at one moment of the engine and in one question
        to it (a dashboard's sample: it waits for one decode step, not four). Its ``hot``,
        ``moves`` and ``states`` are by model name."""
        board = await self._models.board(since or {})
        return msgspec.structs.replace(board, stats=await self._with_warm(board.stats))

    async def _with_warm(self, stats: EngineStats) -> EngineStats:
        written = cold = 0
        for part in self._models.parts():
            if part.store is not None:
                io: StoreStats = await part.store.ask(StoreStatsQuery())
                written += io.bytes_written
                cold += io.demoted_cold
        usage = self._models.usage
        return msgspec.structs.replace(
            stats,
            warm_bytes=0 if usage is None else usage.used,
            warm_limit_bytes=None if usage is None else usage.limit,
            warm_written_bytes=written,
            warm_written_today_bytes=0 if usage is None else usage.written_today(),
            demoted_warm_to_cold=cold,
        )

    async def cache_info(self, name: str) -> CacheInfo:
        """Agent ``name``'s hot cache (tokens, bytes, busy, persisted), whether or not an
        agent actor runs for it (a prefetch stages caches ahead of their agents). Raises
        UnknownAgent when it has no hot cache, InvalidAgentId for an unsafe name."""
        engine = self._models.engine_for(check_agent_id(name))
        info: CacheInfo = await engine.ask(CacheQuery(name))
        return info

    async def hot_caches(self) -> list[CacheInfo]:
        """Every hot cache of every model (as :meth:`cache_info` tells one), one question
        per model however many agents are hot."""
        infos: list[CacheInfo] = []
        for part in self._models.parts():
            infos += await part.engine.ask(HotQuery())
        return infos

    async def tier_moves(self, since: Mapping[str, int] | None = None) -> dict[str, TierMoves]:
        """Each model's hot-tier moves (demotions, installs from the warm tier; see
        :class:`~kvactor.actors.records.TierMove`) after the seq ``since`` names for it
        (none named: from its first), by model name; one question per model."""
        since = since or {}
        moves: dict[str, TierMoves] = {}
        for part in self._models.parts():
            moves[part.name] = await part.engine.ask(TierEvents(since.get(part.name, 0)))
        return moves

    async def warm_moves(self, since: Mapping[str, int] | None = None) -> dict[str, TierMoves]:
        """Each model's warm-tier moves (agents made cold: for room under the disk limit
        or a quota, or past the TTL; ``kind`` demoted, ``tier`` cold, ``source`` warm)
        after the seq ``since`` names for it, by model name; none without a warm tier."""
        since = since or {}
        moves: dict[str, TierMoves] = {}
        for part in self._models.parts():
            if part.store is not None:
                moves[part.name] = await part.store.ask(WarmMoves(since.get(part.name, 0)))
        return moves

    async def warm_stats(self) -> StoreStats:
        """The warm tier's reads and writes so far (all zero without a warm tier)."""
        if self.store is None:
            return StoreStats()
        stats: StoreStats = await self.store.ask(StoreStatsQuery())
        return stats

    # -- the models -------------------------------------------------------------------
    @property
    def models(self) -> dict[str, ModelInfo]:
        """The session's models by name (one model: under its own name)."""
        return self._models.infos

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests choose a model by: several models' (as ``models=`` named
        them), else none (one model serves any name)."""
        return self._models.names

    def model_of(self, name: str) -> str:
        """The model running agent ``name`` runs. Raises UnknownAgent."""
        self.agent(name)
        return self._models.model_of(name)

    def engine_for(self, name: str) -> ActorRef[EngineMessage]:
        """The engine as running agent ``name``'s model sees it (the session's ``engine``
        when it is not running)."""
        return self._models.engine_for(name)

    async def model_states(self) -> list[ModelState]:
        """Each model: loaded or not, pinned, weights, loads (one model: always loaded)."""
        return await self._models.states()

    async def end_turns(self) -> int:
        """End every turn, for a close to come (a server stopping): a decoding turn ends
        at its next step with finish_reason ``"ended"`` and is saved as any turn; a turn
        not decoding yet, and any asked for later, fails with TurnEnded. Returns how many
        turns it ended."""
        return await self._models.end_turns()
