"""A session in this process: one engine actor, the warm tier's actors, and agent actors;
``kvactor.open()`` (``actors/opening.py``) makes one."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import anyio

from ...runtime import ActorRef, Runtime
from ..agent import AgentActor, AgentEnv
from ..engine import EngineConfig, ModelRef, ModelSpec
from ..errors import UnknownAgent
from ..hot import make_hint, split_hint
from ..ids import check_agent_id
from ..messages import CacheQuery, DropCache, EngineMessage, Fork, Hint, Snapshot, StatsQuery, Turn
from ..models import Tokenizer
from ..options import Sampling
from ..records import AgentSnapshot, CacheInfo, EngineStats, ModelInfo
from ..warm import (
    ActorWarmTier,
    CacheDirLock,
    CacheIdentity,
    ExpectFn,
    Forget,
    Forgotten,
    ForkCache,
    ListAgents,
    Prefetch,
    PrefetchMessage,
    StoreMessage,
    StoreStats,
    StoreStatsQuery,
    WarmInfo,
    lock_cache_dir,
)
from ._api import drain
from ._handle import Agent
from ._model_part import ModelPart
from ._models import Models, SessionModels

__all__ = ("OnSaveError", "Session")

log = logging.getLogger("kvactor.session")

OnSaveError = Literal["report", "raise"]
_ON_SAVE_ERROR = ("report", "raise")


def _scope(scope: object) -> str:
    """``scope``, checked: a str of at most 256 characters. Raises TypeError / ValueError."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, not {type(scope).__name__}")
    if len(scope) > 256:
        raise ValueError("scope must have at most 256 characters")
    return scope


class Session(SessionModels):
    """A runtime with one engine actor and any number of agent actors.

    Use ``async with kvactor.open(...) as session`` or ``session = await kvactor.open(...)``
    then ``await session.aclose()``. With several models (``models``: a name per model),
    the one engine holds them all under ``memory_limit`` bytes (``ModelsEngine``: its
    ``pins`` are never unloaded; ``model_ttl_s``), each agent runs one of them, and the
    session's ``engine``, ``model``, ``tokenizer`` and warm tier are the first model's.
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
    ) -> None:
        if on_save_error not in _ON_SAVE_ERROR:
            raise ValueError(f"on_save_error must be 'report' or 'raise', not {on_save_error!r}")
        self._model = model
        self.memory_limit = memory_limit
        self._pins, self._model_ttl_s = pins, model_ttl_s
        if memory_limit is not None and not isinstance(model, dict):
            model = {"default": model}  # one model under a memory limit: the same engine
            self._flat = True
        else:
            self._flat = False
        if isinstance(model, dict):
            if not model:
                raise ValueError("models must name at least one model")
            for name in model:
                check_agent_id(name)  # a model's name names its warm tier's folder
            if memory_limit is None or memory_limit < 1:
                raise ValueError("several models need a positive memory_limit")
            unknown = sorted(pins - set(model))
            if unknown:
                raise ValueError(f"pinned models {unknown} are not among {sorted(model)}")
        self._model = model
        self._parts: dict[str, ModelPart] = {}  # each model's (set at start)
        self._agent_models: dict[str, str] = {}  # running agents' models
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._delete_rejected = delete_rejected
        self.on_save_error = on_save_error
        self._lock: CacheDirLock | None = None
        self._model_locks: list[CacheDirLock] = []  # each model's folder's (several models)
        self.runtime = Runtime(mailbox_size=mailbox_size)
        self.engine: ActorRef[EngineMessage]
        self.store: ActorRef[StoreMessage] | None = None
        self.prefetcher: ActorRef[PrefetchMessage] | None = None
        self.warm: ActorWarmTier | None = None
        self.model: ModelInfo
        self.tokenizer: Tokenizer
        self._env: AgentEnv  # what every agent actor shares (set at start)
        self._agents: dict[str, Agent] = {}
        self._contexts: dict[str, str] = {}  # shared contexts made here: name -> text
        self._scopes: dict[str, str] = {}  # running agents' sharing scopes (spawn_agent)
        self._closed = False
        # With a warm tier: what its caches must match, and their segments' layout.
        self.identity: CacheIdentity | None = None
        self.layout: ExpectFn | None = None

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
            await self._start_models()
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
            await self.runtime.__aexit__(exc_type, exc, tb)
        finally:
            self._unlock()

    def _unlock(self) -> None:
        locks, self._model_locks = self._model_locks, []
        lock, self._lock = self._lock, None
        for held in [*locks, lock]:
            if held is not None:
                held.release()

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

    async def spawn_agent(
        self,
        name: str,
        *,
        system: str | None = None,
        fork_of: str | None = None,
        context: str | None = None,
        scope: str | None = None,
        tool_wait_s: float | None = None,
        model: str | None = None,
    ) -> Agent:
        """A new agent called ``name`` (letters, digits, '.', '_', '-'); ``fork_of``: one
        that starts where that agent is (``fork``); ``context``: one whose system prompt
        is that shared context's text (see ``context``), so that its first turn reuses
        the context's cache instead of prefilling it. Give at most one of ``system``,
        ``fork_of`` and ``context``.

        ``scope``: the agents whose cached prefixes it shares (``share_prefixes``): only
        those of the same scope, so that what one scope (a tenant) caches never shows in
        another's turns. Default: its context's or fork source's scope, else ``""``.
        ``tool_wait_s``: how long its turns that end in tool calls keep its cache hot
        (default: the session's ``tool_wait_s``). ``model``: the model it runs (a name of
        ``models``; default: the first, or its fork source's or context's): forks and
        shared contexts stay within a model.

        Raises InvalidAgentId for an unsafe name, ValueError when it already exists, for
        more than one of those, or for a scope other than its context's or source's,
        TypeError when ``system`` or ``scope`` is not a str, UnknownAgent for a
        ``context`` this session has not made, ValueError for an unknown model or one
        other than the context's; with ``fork_of``, what ``fork`` raises.
        """
        if sum(x is not None for x in (system, fork_of, context)) > 1:
            raise ValueError("give at most one of system, fork_of and context")
        if fork_of is not None:
            return await self.fork(fork_of, name, scope=scope, model=model)
        part = self._part(model)
        check_agent_id(name)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, not {type(system).__name__}")
        if context is not None:
            system = self._context_text(context)
            scope = self._same_scope(context, scope)
            part = self._same_model(context, model)
        if name in self._agents:
            raise ValueError(f"agent {name!r} already exists")
        scope = _scope("" if scope is None else scope)
        if tool_wait_s is not None and not 0 <= tool_wait_s <= 86_400:
            raise ValueError(f"tool_wait_s must be in [0, 86400], got {tool_wait_s}")
        return await self._start_agent(
            part, name, system, context=context, scope=scope, tool_wait_s=tool_wait_s
        )

    def _same_scope(self, source: str, scope: str | None) -> str:
        """The scope of an agent made from ``source``: ``source``'s. Raises ValueError
        for another one."""
        known = self._scopes.get(source, "")
        if scope is not None and _scope(scope) != known:
            raise ValueError(f"{source!r} is of scope {known!r}, not {scope!r}")
        return known

    async def context(
        self, name: str, text: str, *, scope: str = "", model: str | None = None
    ) -> Agent:
        """A shared context called ``name``: an agent whose cache holds ``text`` as a
        system prompt (as the chat template renders it) and nothing else, prefilled once
        now (resumed from the warm tier when it is there). Agents spawned with
        ``context=name`` start from its cache: their first turn shares its stored arrays
        (one copy in the hot budget) instead of prefilling the text, and their first
        write links its segment files (one copy on disk). Any agent whose prompt begins
        with the same tokens shares them too (``share_prefixes``). Forget it like an
        agent: the agents that share it keep what they use.

        Calling it again with the same text returns the context (its cache made hot
        again if it was demoted). Only agents of its ``scope`` and ``model`` (default: the
        first) share it (``spawn_agent``).
        Raises InvalidAgentId for an unsafe name, ValueError for an empty text or a name
        that is an agent with another system prompt or scope, TypeError when ``text`` is
        not a str.
        """
        check_agent_id(name)
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        if not text.strip():
            raise ValueError("a shared context needs some text")
        known = self._contexts.get(name)
        if known is not None and known != text:
            raise ValueError(f"shared context {name!r} exists with another text")
        agent = self._agents.get(name)
        if agent is None:
            agent = await self._start_agent(self._part(model), name, text, scope=_scope(scope))
        elif model is not None and self._agent_models[name] != self._part(model).name:
            raise ValueError(f"agent {name!r} exists and runs another model")
        elif self._scopes.get(name, "") != _scope(scope):
            raise ValueError(f"agent {name!r} exists in another scope")
        messages = await agent.history()
        if messages[:1] != [{"role": "system", "content": text}] or len(messages) > 1:
            raise ValueError(f"agent {name!r} exists and is not a shared context of this text")
        self._contexts[name] = text
        await drain(agent._stream(Turn("", Sampling(max_tokens=1), prime=True)))
        return agent

    def _context_text(self, name: str) -> str:
        try:
            return self._contexts[name]
        except KeyError:
            raise UnknownAgent(f"no shared context {name!r}: make it with context()") from None

    async def fork(
        self, source: str, name: str, *, scope: str | None = None, model: str | None = None
    ) -> Agent:
        """A new agent ``name`` that starts where agent ``source`` is now: its conversation
        and its cache, without copying it. In memory the stored arrays are shared (the hot
        budget counts them once); on disk ``name``'s folder gets hard links
        to ``source``'s segment files (one copy of the bytes) and a manifest of its own.
        From then on each goes its own way: neither ever sees the other's later tokens,
        and forgetting one leaves the other whole. It is of ``source``'s scope (a source
        on disk only: ``scope``, default ``""``) and runs ``source``'s model (a source on
        disk only: ``model``, default the first): ValueError for another model.

        The source is asked between its turns (a turn it is taking finishes first). Raises
        InvalidAgentId for unsafe names, ValueError when ``name`` exists (running or on
        disk), UnknownAgent when ``source`` is neither running nor on disk.
        """
        check_agent_id(source)
        check_agent_id(name)
        if name in self._agents:
            raise ValueError(f"agent {name!r} already exists")
        running = self._agents.get(source)
        scope = self._same_scope(source, scope) if running is not None else _scope(scope or "")
        part = self._same_model(source, model) if running is not None else self._part(model)
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
        return await self._start_agent(part, name, None, None if on_disk else start, scope=scope)

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
        self._agent_models[name] = part.name
        return agent

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
        agent = self._agents.pop(name, None)
        self._scopes.pop(name, None)
        self._contexts.pop(name, None)
        model = self._agent_models.pop(name, None)
        if agent is not None:
            await agent.ref.stop()
        parts = list(self._parts.values()) if model is None else [self._parts[model]]
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
        agent = self.agent(name)
        engine = self.engine_for(name)
        del self._agents[name]
        self._scopes.pop(name, None)
        self._contexts.pop(name, None)
        self._agent_models.pop(name, None)
        await agent.ref.stop()
        await engine.ask(DropCache(name))

    async def prefetch(self, name: str) -> None:
        """Hint that agent ``name`` runs next: its warm cache is staged into the hot tier in
        the background, if there is room, so that its next turn starts hot (an agent that
        is not running: the first model's)."""
        check_agent_id(name)
        prefetcher = self._part(self._agent_models.get(name)).prefetcher
        if prefetcher is not None:
            await prefetcher.tell(Prefetch(name))

    async def hint(
        self,
        next: Sequence[str] = (),
        *,
        expect_in_s: Mapping[str, float] | None = None,
        priority: Mapping[str, int] | None = None,
        done: Sequence[str] = (),
        prefetch: int = 2,
    ) -> None:
        """Advice for the hot tier (docs: memory-policy): ``next``, the agents that run
        next, soonest first; ``expect_in_s``, seconds until an agent's next turn;
        ``priority``, higher stays hot longer; ``done``, agents done for now (demoted
        first). The first ``prefetch`` agents of ``next`` are staged from the warm tier.
        Wrong or missing hints cost time, never change an answer. Raises what
        :func:`~kvactor.actors.hints.make_hint` raises."""
        hint = make_hint(next, expect_in_s=expect_in_s, priority=priority, done=done)
        if len(self._parts) == 1:
            await send_hint(self.engine, self.prefetcher, hint, prefetch)
            return
        # Several models: each model's engine part and warm tier hear of their own agents
        # (an agent not running: the first model's, as prefetch has it).
        first = self._part(None).name
        for model, part_hint in split_hint(hint, self._agent_models, first).items():
            part = self._part(model)
            await send_hint(part.engine, part.prefetcher, part_hint, prefetch)

    async def warm_agents(self) -> list[WarmInfo]:
        """Every agent with a warm cache under ``cache_dir`` (refused ones say why), of
        every model."""
        infos: list[WarmInfo] = []
        for part in self._parts.values():
            if part.store is not None:
                infos += await part.store.ask(ListAgents())
        return infos

    async def stats(self) -> EngineStats:
        """The engine's figures (several models: summed, with the memory limit's)."""
        ref = self._multi_ref() if isinstance(self.engine, ModelRef) else self.engine
        stats: EngineStats = await ref.ask(StatsQuery())
        return stats

    async def cache_info(self, name: str) -> CacheInfo:
        """Agent ``name``'s hot cache (tokens, bytes, busy, persisted), whether or not an
        agent actor runs for it (a prefetch stages caches ahead of their agents). Raises
        UnknownAgent when it has no hot cache, InvalidAgentId for an unsafe name."""
        engine = self.engine_for(check_agent_id(name))
        info: CacheInfo = await engine.ask(CacheQuery(name))
        return info

    async def warm_stats(self) -> StoreStats:
        """The warm tier's reads and writes so far (all zero without a warm tier)."""
        if self.store is None:
            return StoreStats()
        stats: StoreStats = await self.store.ask(StoreStatsQuery())
        return stats


async def send_hint(
    engine: ActorRef[EngineMessage],
    prefetcher: ActorRef[PrefetchMessage] | None,
    hint: Hint,
    prefetch: int,
) -> None:
    """Give ``hint`` to the engine (the hot tier's owner), then ask the warm tier, if any,
    to stage the first ``prefetch`` agents of ``hint.next`` that are not hot (in room that
    is free or held by agents expected later: a prefetch never displaces a sooner one)."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    await engine.ask(hint)
    if prefetcher is not None:
        for agent in hint.next[:prefetch]:
            await prefetcher.tell(Prefetch(agent))
