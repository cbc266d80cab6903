"""The public API: ``kvactor.open()`` → a Session that spawns agents on one engine."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, overload

import anyio
import msgspec

from ..kernels.agent_cache import segment_layout
from ..kernels.geometry import CacheGeometry
from ..kernels.qcodec import DEFAULT_CODEC, KVCodec
from ..runtime import ActorRef, ReplyStream, Runtime
from ._dirlock import CacheDirLock, lock_cache_dir
from ._tokenizer import Tokenizer
from .agent import AgentActor, AgentState, GetState, Snapshot, Turn, TurnDone, check_history
from .config import Attention, EngineConfig, ModelSpec
from .engine import EngineActor
from .enums import FinishReason, Match, Tier
from .errors import CacheRejected, StoreWriteError, UnknownAgent, UnsafeCachePath
from .policy import EvictionPolicy, LRUPolicy
from .prefetch import Prefetch, PrefetchActor, Stage, StageResult
from .protocol import (
    CacheInfo,
    CacheQuery,
    DropCache,
    EngineStats,
    Fork,
    GetModelInfo,
    ModelInfo,
    Sampling,
    StatsQuery,
    Timings,
    check_agent_id,
)
from .store import (
    Append,
    CacheIdentity,
    ExpectFn,
    Forget,
    Forgotten,
    ForkCache,
    ListAgents,
    Manifest,
    ShareCache,
    StoreActor,
    StoreStats,
    StoreStatsQuery,
    WarmInfo,
    collect,
)

if TYPE_CHECKING:
    from .cluster import ClusterSession

__all__ = ("Agent", "Completion", "Session", "TextStream", "WarmTier", "open")

log = logging.getLogger("kvactor.session")

OnSaveError = Literal["report", "raise"]
_ON_SAVE_ERROR = ("report", "raise")


class Completion(msgspec.Struct, frozen=True):
    """One finished turn: the text, why it stopped, its timings, and how the cache was
    found: ``path`` the tier it came from (cold: nothing reused), ``match`` how the prompt
    compared with what it held.

    ``saved``: the turn's cache is in the warm tier (always False without ``cache_dir``);
    ``save_error``: why it is not, when writing it failed (disk full, I/O error). The
    conversation goes on either way, and the next write that succeeds saves what this one
    missed."""

    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    timings: Timings
    path: Tier
    match: Match
    saved: bool = False
    save_error: str | None = None


def _completion(done: TurnDone) -> Completion:
    return Completion(
        done.text,
        done.reason,
        done.token_ids,
        done.timings,
        done.path,
        done.match,
        saved=done.saved,
        save_error=done.save_error,
    )


class TextStream:
    """``async for piece in agent.stream(text)``: text pieces as they are generated.

    After the loop, ``completion`` holds the whole turn. Leaving the loop early or
    cancelling the reader cancels the generation and frees its batch slot; ``async with``
    makes that immediate. With ``on_save_error="raise"`` the loop ends with
    StoreWriteError when the turn's cache could not be written (``completion`` is set,
    and is the error's ``completion`` too).
    """

    def __init__(self, inner: ReplyStream, *, raise_on_save_error: bool = False) -> None:
        self._inner = inner
        self._raise = raise_on_save_error
        self.completion: Completion | None = None

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> str:
        if self.completion is not None:
            raise StopAsyncIteration
        item = await self._inner.__anext__()
        if isinstance(item, TurnDone):
            self.completion = _completion(item)
            if self._raise and item.save_error is not None:
                error = StoreWriteError(
                    f"the turn completed but its cache was not saved: {item.save_error}"
                )
                error.completion = self.completion
                raise error
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def aclose(self) -> None:
        if self.completion is None:
            await self._inner.aclose()

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Agent:
    """A handle on one agent actor: multi-turn generation with a cache kept between turns."""

    def __init__(self, session: Session, name: str, ref: ActorRef[Any]) -> None:
        self._session = session
        self.name = name
        self.ref = ref

    def __repr__(self) -> str:
        return f"<Agent {self.name!r}>"

    def stream(self, text: str, **sampling: Any) -> TextStream:
        """Stream the reply to the user message ``text``. Raises TypeError / ValueError for
        a prompt that is not a str or bad options."""
        return self._stream(Turn(prompt_text(text), Sampling.from_options(sampling)))

    def stream_raw(self, prompt: str, **sampling: Any) -> TextStream:
        """Stream a completion of the whole raw ``prompt`` (no chat template, no history).

        A prompt that extends the previous one (plus what was generated) reuses the cache."""
        return self._stream(Turn(prompt_text(prompt), Sampling.from_options(sampling), raw=True))

    def stream_chat(self, messages: list[dict[str, str]], **sampling: Any) -> TextStream:
        """Stream the reply to a whole conversation kept by the caller (``[{"role",
        "content"}, ...]``, ending with the user's message), as an HTTP client resends it
        every turn: it replaces the agent's history, and whatever of it the cache already
        spells is reused (prefix matching: a resent history plus a new message is an
        EXTEND). Raises ValueError / TypeError for a malformed conversation or options."""
        history = check_history(messages)
        return self._stream(Turn("", Sampling.from_options(sampling), history=history))

    async def chat(self, messages: list[dict[str, str]], **sampling: Any) -> Completion:
        """The whole reply to a conversation kept by the caller; see ``stream_chat``."""
        return await drain(self.stream_chat(messages, **sampling))

    def _stream(self, turn: Turn) -> TextStream:
        raising = self._session.on_save_error == "raise"
        return TextStream(self.ref.stream(turn), raise_on_save_error=raising)

    async def complete(self, prompt: str, **sampling: Any) -> Completion:
        """The completion of the raw ``prompt``; see ``stream_raw`` and ``generate``."""
        return await drain(self.stream_raw(prompt, **sampling))

    async def generate(self, text: str, **sampling: Any) -> Completion:
        """The whole reply to ``text``.

        Sampling options: max_tokens, temperature (0 = greedy), top_p, seed, stop.
        Raises TypeError for an unknown option, ValueError for an empty prompt or a bad
        value, ContextOverflow when the prompt does not fit the model; with
        ``on_save_error="raise"``, StoreWriteError (holding the ``completion``) when the
        turn's cache could not be written to the warm tier.
        """
        return await drain(self.stream(text, **sampling))

    async def state(self) -> AgentState:
        state: AgentState = await self.ref.ask(GetState())
        return state

    async def history(self) -> list[dict[str, str]]:
        return (await self.state()).messages

    async def cache_info(self) -> CacheInfo:
        info: CacheInfo = await self._session.engine.ask(CacheQuery(self.name))
        return info


def prompt_text(text: object) -> str:
    """``text``, checked to be a str (a prompt or a message)."""
    if not isinstance(text, str):
        raise TypeError(f"the prompt must be a str, not {type(text).__name__}")
    return text


class Streamed(Protocol):
    """A turn's stream (``TextStream``, a cluster's ``ClusterTextStream``)."""

    completion: Completion | None

    def __aiter__(self) -> AsyncIterator[str]: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc_info: object) -> None: ...


async def drain(stream: Streamed) -> Completion:
    """The Completion of a turn's stream, its pieces read and dropped."""
    async with stream:
        async for _ in stream:
            pass
    assert stream.completion is not None
    return stream.completion


class WarmTier:
    """The warm tier as an agent sees it: restore its conversation, stage its cache into the
    engine, append the new tokens of a turn. Backed by the store and prefetch actors."""

    def __init__(self, store: ActorRef[Any], prefetch: ActorRef[Any]) -> None:
        self.store = store
        self.prefetch = prefetch

    async def restore(self, agent: str) -> tuple[list[int], str, list[dict[str, str]]] | None:
        try:
            manifest = await self.store.ask(Manifest(agent))
        except CacheRejected as exc:
            log.warning("agent %r starts cold: %s", agent, exc)
            return None
        if manifest is None:
            return None
        return list(manifest.token_ids), manifest.text, [dict(m) for m in manifest.messages]

    async def stage(self, agent: str) -> bool:
        result: StageResult = await self.prefetch.ask(Stage(agent), timeout=None)
        if not result.staged:
            why = f"{result.outcome}: {result.detail}" if result.detail else result.outcome
            log.warning("agent %r: warm cache not staged (%s): starting cold", agent, why)
        return result.staged

    async def append(
        self,
        agent: str,
        start: int,
        tensors: dict[str, Any],
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, str]],
    ) -> None:
        await self.store.ask(Append(agent, start, tensors, tokens, text, messages), timeout=120)

    async def share(
        self,
        agent: str,
        source: str,
        *,
        tokens: list[int],
        text: str,
        messages: list[dict[str, str]],
    ) -> bool:
        """Give ``agent`` (nothing on disk yet) a warm cache of ``tokens`` linked from
        ``source``'s segments; False when that cannot be done (write them instead)."""
        info = await self.store.ask(ShareCache(source, agent, tokens, text, messages), timeout=120)
        return info is not None

    async def hot(self, agent: str) -> None:
        """Stage ``agent``'s warm cache into the hot tier if it is not hot and there is
        room (a shared context an agent is about to reuse); never waits for room."""
        await self.prefetch.ask(Prefetch(agent), timeout=None)


class Session:
    """A runtime with one engine actor and any number of agent actors.

    Use ``async with kvactor.open(...) as session`` or ``session = await kvactor.open(...)``
    then ``await session.aclose()``.
    """

    def __init__(
        self,
        model: ModelSpec,
        config: EngineConfig,
        mailbox_size: int,
        cache_dir: str | os.PathLike[str] | None,
        delete_rejected: bool,
        on_save_error: OnSaveError = "report",
    ) -> None:
        if on_save_error not in _ON_SAVE_ERROR:
            raise ValueError(f"on_save_error must be 'report' or 'raise', not {on_save_error!r}")
        self._model = model
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._delete_rejected = delete_rejected
        self.on_save_error = on_save_error
        self._lock: CacheDirLock | None = None
        self.runtime = Runtime(mailbox_size=mailbox_size)
        self.engine: ActorRef[Any]
        self.store: ActorRef[Any] | None = None
        self.prefetcher: ActorRef[Any] | None = None
        self.warm: WarmTier | None = None
        self.model: ModelInfo
        self.tokenizer: Tokenizer
        self._agents: dict[str, Agent] = {}
        self._contexts: dict[str, str] = {}  # shared contexts made here: name -> text
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
            self.engine = await self.runtime.spawn(
                EngineActor, self._model, self.config, name="engine"
            )
            self.model, self.tokenizer = await self.engine.ask(GetModelInfo())
            if self.cache_dir is not None:
                await self._start_warm_tier(self.cache_dir)
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
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    async def _start_warm_tier(self, root: Path) -> None:
        info = self.model
        codec = self.config.codec or DEFAULT_CODEC
        identity = CacheIdentity(
            model_fingerprint=info.fingerprint,
            codec=codec.describe(),
            n_layers=info.n_layers,
            n_kv_heads=info.n_kv_heads,
            head_dim=info.head_dim,
            vocab_size=info.vocab_size,  # a cache of other ids would fail every turn
            geometry=info.geometry,
        )
        geometry = CacheGeometry.from_description(identity.layer_geometry())
        expect = segment_layout(codec, geometry)
        self.identity, self.layout = identity, expect
        # Files a killed process left unnamed (mid-write, mid-fork): we hold the lock.
        try:
            collected = await anyio.to_thread.run_sync(collect, root)
            if collected.removed:
                log.info("removed %d unreferenced cache files", len(collected.removed))
        except (StoreWriteError, UnsafeCachePath) as exc:
            log.warning("unreferenced cache files not collected: %s", exc)
        self.store = await self.runtime.spawn(
            StoreActor, identity, expect, root, delete_rejected=self._delete_rejected, name="store"
        )
        self.prefetcher = await self.runtime.spawn(
            PrefetchActor, self.engine, self.store, name="prefetch"
        )
        self.warm = WarmTier(self.store, self.prefetcher)

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
    ) -> Agent:
        """A new agent called ``name`` (letters, digits, '.', '_', '-'); ``fork_of``: one
        that starts where that agent is (``fork``); ``context``: one whose system prompt
        is that shared context's text (see ``context``), so that its first turn reuses
        the context's cache instead of prefilling it. Give at most one of ``system``,
        ``fork_of`` and ``context``.

        Raises InvalidAgentId for an unsafe name, ValueError when it already exists or
        for more than one of those, TypeError when ``system`` is not a str, UnknownAgent
        for a ``context`` this session has not made; with ``fork_of``, what ``fork``
        raises.
        """
        if sum(x is not None for x in (system, fork_of, context)) > 1:
            raise ValueError("give at most one of system, fork_of and context")
        if fork_of is not None:
            return await self.fork(fork_of, name)
        check_agent_id(name)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, not {type(system).__name__}")
        if context is not None:
            system = self._context_text(context)
        if name in self._agents:
            raise ValueError(f"agent {name!r} already exists")
        return await self._start_agent(name, system, context=context)

    async def context(self, name: str, text: str) -> Agent:
        """A shared context called ``name``: an agent whose cache holds ``text`` as a
        system prompt (as the chat template renders it) and nothing else, prefilled once
        now (resumed from the warm tier when it is there). Agents spawned with
        ``context=name`` start from its cache: their first turn shares its stored arrays
        (one copy in the hot budget) instead of prefilling the text, and their first
        write links its segment files (one copy on disk). Any agent whose prompt begins
        with the same tokens shares them too (``share_prefixes``). Forget it like an
        agent: the agents that share it keep what they use.

        Calling it again with the same text returns the context (its cache made hot
        again if it was demoted). Raises InvalidAgentId for an unsafe name, ValueError
        for an empty text or a name that is an agent with another system prompt, TypeError
        when ``text`` is not a str.
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
            agent = await self._start_agent(name, text)
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

    async def fork(self, source: str, name: str) -> Agent:
        """A new agent ``name`` that starts where agent ``source`` is now: its conversation
        and its cache, without copying it. In memory the stored arrays are shared (the hot
        budget counts them once); on disk ``name``'s folder gets hard links
        to ``source``'s segment files (one copy of the bytes) and a manifest of its own.
        From then on each goes its own way: neither ever sees the other's later tokens,
        and forgetting one leaves the other whole.

        The source is asked between its turns (a turn it is taking finishes first). Raises
        InvalidAgentId for unsafe names, ValueError when ``name`` exists (running or on
        disk), UnknownAgent when ``source`` is neither running nor on disk.
        """
        check_agent_id(source)
        check_agent_id(name)
        if name in self._agents:
            raise ValueError(f"agent {name!r} already exists")
        running = self._agents.get(source)
        if running is not None:
            start = await running.ref.ask(Snapshot())
        elif self.warm is not None:
            start = await self.warm.restore(source)
        else:
            start = None
        if start is None:
            raise UnknownAgent(f"no agent named {source!r}, running or on disk")
        on_disk = None
        store, warm = self.store, self.warm
        if store is not None and warm is not None:
            forked = await store.ask(ForkCache(source, name))
            on_disk = None if forked is None else await warm.restore(name)  # what it resumes
        # Hot too when the source is, with exactly those tokens (else it stages from disk).
        await self.engine.ask(Fork(source, name, list((on_disk or start)[0])))
        return await self._start_agent(name, None, None if on_disk else start)

    async def _start_agent(
        self,
        name: str,
        system: str | None,
        start: tuple[list[int], str, list[dict[str, str]]] | None = None,
        *,
        context: str | None = None,
    ) -> Agent:
        ref = await self.runtime.spawn(
            AgentActor,
            name,
            self.engine,
            self.tokenizer,
            system,
            self.warm,
            start,
            context,
            name=f"agent:{name}",
        )
        agent = Agent(self, name, ref)
        self._agents[name] = agent
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

        Raises InvalidAgentId for an unsafe name."""
        check_agent_id(name)
        agent = self._agents.pop(name, None)
        self._contexts.pop(name, None)
        if agent is not None:
            await agent.ref.stop()
        await self.engine.ask(DropCache(name))
        if self.store is None:
            return Forgotten(agent=name)
        done: Forgotten = await self.store.ask(Forget(name))
        return done

    async def release(self, name: str) -> None:
        """Stop agent ``name``'s actor (it saves its last turn first) and drop its hot cache;
        its warm cache stays, and ``spawn_agent(name)`` resumes it from there, here or in
        another session (an engine host hands agents over this way). Raises
        InvalidAgentId for an unsafe name, UnknownAgent when it is not running."""
        check_agent_id(name)
        agent = self.agent(name)
        del self._agents[name]
        self._contexts.pop(name, None)
        await agent.ref.stop()
        await self.engine.ask(DropCache(name))

    async def prefetch(self, name: str) -> None:
        """Hint that agent ``name`` runs next: its warm cache is staged into the hot tier in
        the background, if there is room, so that its next turn starts hot."""
        check_agent_id(name)
        if self.prefetcher is not None:
            await self.prefetcher.tell(Prefetch(name))

    async def warm_agents(self) -> list[WarmInfo]:
        """Every agent with a warm cache under ``cache_dir`` (refused ones say why)."""
        if self.store is None:
            return []
        infos: list[WarmInfo] = await self.store.ask(ListAgents())
        return infos

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self.engine.ask(StatsQuery())
        return stats

    async def cache_info(self, name: str) -> CacheInfo:
        """Agent ``name``'s hot cache (tokens, bytes, busy, persisted), whether or not an
        agent actor runs for it (a prefetch stages caches ahead of their agents). Raises
        UnknownAgent when it has no hot cache, InvalidAgentId for an unsafe name."""
        info: CacheInfo = await self.engine.ask(CacheQuery(check_agent_id(name)))
        return info

    async def warm_stats(self) -> StoreStats:
        """The warm tier's reads and writes so far (all zero without a warm tier)."""
        if self.store is None:
            return StoreStats()
        stats: StoreStats = await self.store.ask(StoreStatsQuery())
        return stats


_T = TypeVar("_T")


class Opening(Generic[_T]):
    """What ``open()`` returns: await it (the started session), or use it as ``async
    with`` (closed on the way out). ``start`` starts the session; ``close`` is its
    ``__aexit__``."""

    def __init__(
        self,
        start: Callable[[], Coroutine[Any, Any, _T]],
        close: Callable[
            [type[BaseException] | None, BaseException | None, TracebackType | None],
            Awaitable[object],
        ],
    ) -> None:
        self._start = start
        self._close = close

    def __await__(self) -> Generator[Any, None, _T]:
        return self._start().__await__()

    async def __aenter__(self) -> _T:
        return await self._start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close(exc_type, exc, tb)


@overload
def open(
    model: ModelSpec = None,
    *,
    max_batch: int = 8,
    prefill_chunk: int = 256,
    weights: str = "auto",
    mailbox_size: int = 64,
    budget_bytes: int | None = None,
    codec: KVCodec | None = None,
    policy: EvictionPolicy | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    delete_rejected: bool = False,
    attention: Attention = "auto",
    on_save_error: OnSaveError = "report",
    ready_copies: bool = True,
    share_prefixes: bool = True,
    cluster: None = None,
) -> Opening[Session]: ...


@overload
def open(model: ModelSpec = None, *, cluster: str, **options: Any) -> Opening[ClusterSession]: ...


def open(
    model: ModelSpec = None,
    *,
    max_batch: int = 8,
    prefill_chunk: int = 256,
    weights: str = "auto",
    mailbox_size: int = 64,
    budget_bytes: int | None = None,
    codec: KVCodec | None = None,
    policy: EvictionPolicy | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    delete_rejected: bool = False,
    attention: Attention = "auto",
    on_save_error: OnSaveError = "report",
    ready_copies: bool = True,
    share_prefixes: bool = True,
    cluster: str | None = None,
    **cluster_options: Any,
) -> Opening[Session] | Opening[ClusterSession]:
    """Open a session on ``model``: None for the default model (fetched once, verified), a
    ``.gguf`` file, a local MLX / Hugging Face model directory, or a callable returning a
    LoadedModel. ``max_batch`` agents decode together; prompts are prefilled
    ``prefill_chunk`` tokens at a time between decode steps.

    ``cache_dir`` turns on the warm tier there (``kvactor.default_cache_dir()`` is the
    usual place): every turn's new tokens are written to disk, demoted agents reload from
    there, and agents of a new session resume from it. The session holds the directory's
    lock: ``open`` raises CacheDirLocked when another session (of any process) has it.
    A turn whose write fails says so in its Completion (``saved``, ``save_error``); with
    ``on_save_error="raise"`` it raises StoreWriteError instead, holding the Completion.
    ``budget_bytes`` bounds the hot
    tier; ``codec`` picks how caches are stored (default ``DEFAULT_CODEC``: keys 5-bit, values
    3-bit in groups of 64, Hadamard-rotated, 4 sink tokens at 8 bits);
    ``policy`` picks whom to demote (default LRU). ``delete_rejected`` deletes warm caches
    that are refused (another model, corrupt) instead of setting them aside.
    ``attention``: ``"quantized"`` runs attention and batches over the stored quantized
    caches, ``"dequantized"`` over a float copy made at each turn's start; ``"auto"``
    (default) picks quantized on a GPU and dequantized on the CPU (see EngineConfig).
    ``ready_copies`` (dequantized attention): hot agents keep their float copy between
    turns while the budget has room, so their next turn starts at once (dropped first when
    room is needed; answers are the same either way). ``share_prefixes``: a turn that
    reuses nothing of its own cache reuses the stored ranges of another hot cache its
    prompt begins with (a shared context: ``Session.context``), shared, not prefilled
    (the sharing agent attends over the stored values, as a warm resume does: see
    EngineConfig).
    ``cluster``: the session's engines run as Ray actors over a cluster ("auto", "local",
    an address or ``ray://host:port``), one engine host per node; the keywords then go to
    ``kvactor.actors.cluster.open_cluster`` (``cache_dir`` required; ``hosts_per_node``,
    ``placement``, ``ray_options``) and every host's own session. Without it Ray is never
    imported.
    Raises ValueError for an ``on_save_error`` other than "report" or "raise"."""
    if cluster is not None:
        from .cluster import open_cluster

        given: dict[str, Any] = {
            "max_batch": max_batch,
            "prefill_chunk": prefill_chunk,
            "weights": weights,
            "mailbox_size": mailbox_size,
            "budget_bytes": budget_bytes,
            "codec": codec,
            "policy": policy,
            "delete_rejected": delete_rejected,
            "attention": attention,
            "on_save_error": on_save_error,
            "ready_copies": ready_copies,
            "share_prefixes": share_prefixes,
        }
        if cache_dir is None:
            raise ValueError("a cluster keeps each host's warm tier under cache_dir: give one")
        return open_cluster(model, cluster=cluster, cache_dir=cache_dir, **given, **cluster_options)
    if cluster_options:
        raise TypeError(f"unexpected keywords {sorted(cluster_options)} (cluster options?)")
    config = EngineConfig(
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        weights=weights,
        codec=codec,
        budget_bytes=budget_bytes,
        persistent=cache_dir is not None,
        policy=policy or LRUPolicy(),
        attention=attention,
        ready_copies=ready_copies,
        share_prefixes=share_prefixes,
    )
    session = Session(model, config, mailbox_size, cache_dir, delete_rejected, on_save_error)
    return Opening(session.start, session.__aexit__)
