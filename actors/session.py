"""The public API: ``kvactor.open()`` → a Session that spawns agents on one engine."""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType
from typing import Any

import msgspec

from ..runtime import ActorRef, ReplyStream, Runtime
from ._tokenizer import Tokenizer
from .agent import AgentActor, GetHistory, Turn
from .engine import EngineActor, EngineConfig, ModelSpec
from .errors import UnknownAgent
from .protocol import (
    CacheInfo,
    CacheQuery,
    DropCache,
    EngineStats,
    Finished,
    GetModelInfo,
    ModelInfo,
    Sampling,
    StatsQuery,
    Timings,
    check_agent_id,
)

__all__ = ("Agent", "Completion", "Session", "TextStream", "open")


class Completion(msgspec.Struct, frozen=True):
    """One finished turn: the text, why it stopped (eos / stop / length), and its timings."""

    text: str
    finish_reason: str
    token_ids: list[int]
    timings: Timings


def _completion(finished: Finished) -> Completion:
    return Completion(finished.text, finished.reason, finished.token_ids, finished.timings)


class TextStream:
    """``async for piece in agent.stream(text)``: text pieces as they are generated.

    After the loop, ``completion`` holds the whole turn. Leaving the loop early or
    cancelling the reader cancels the generation and frees its batch slot; ``async with``
    makes that immediate.
    """

    def __init__(self, inner: ReplyStream) -> None:
        self._inner = inner
        self.completion: Completion | None = None

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> str:
        item = await self._inner.__anext__()
        if isinstance(item, Finished):
            self.completion = _completion(item)
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def aclose(self) -> None:
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
        """Stream the reply to ``text``. Raises TypeError / ValueError for bad options."""
        return TextStream(self.ref.stream(Turn(text, Sampling.from_options(sampling))))

    async def generate(self, text: str, **sampling: Any) -> Completion:
        """The whole reply to ``text``.

        Sampling options: max_tokens, temperature (0 = greedy), top_p, seed, stop.
        Raises TypeError for an unknown option, ValueError for an empty prompt or a bad
        value, ContextOverflow when the prompt does not fit the model.
        """
        async with self.stream(text, **sampling) as pieces:
            async for _ in pieces:
                pass
        assert pieces.completion is not None
        return pieces.completion

    async def history(self) -> list[dict[str, str]]:
        history: list[dict[str, str]] = await self.ref.ask(GetHistory())
        return history

    async def cache_info(self) -> CacheInfo:
        info: CacheInfo = await self._session.engine.ask(CacheQuery(self.name))
        return info


class Session:
    """A runtime with one engine actor and any number of agent actors.

    Use ``async with kvactor.open(...) as session`` or ``session = await kvactor.open(...)``
    then ``await session.aclose()``.
    """

    def __init__(self, model: ModelSpec, config: EngineConfig, mailbox_size: int) -> None:
        self._model = model
        self.config = config
        self.runtime = Runtime(mailbox_size=mailbox_size)
        self.engine: ActorRef[Any]
        self.model: ModelInfo
        self.tokenizer: Tokenizer
        self._agents: dict[str, Agent] = {}

    async def start(self) -> Session:
        """Start the runtime and load the model on the engine's thread."""
        await self.runtime.__aenter__()
        try:
            self.engine = await self.runtime.spawn(
                EngineActor, self._model, self.config, name="engine"
            )
            self.model, self.tokenizer = await self.engine.ask(GetModelInfo())
        except BaseException as exc:
            await self.runtime.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def aclose(self) -> None:
        """Stop every agent, then the engine."""
        await self.runtime.__aexit__(None, None, None)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.runtime.__aexit__(exc_type, exc, tb)

    async def spawn_agent(self, name: str, *, system: str | None = None) -> Agent:
        """A new agent called ``name`` (letters, digits, '.', '_', '-').

        Raises InvalidAgentId for an unsafe name, ValueError when it already exists.
        """
        check_agent_id(name)
        if name in self._agents:
            raise ValueError(f"agent {name!r} already exists")
        ref = await self.runtime.spawn(
            AgentActor, name, self.engine, self.tokenizer, system, name=f"agent:{name}"
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

    async def forget(self, name: str) -> None:
        """Stop the agent and drop every byte of its cache."""
        agent = self.agent(name)
        await agent.ref.stop()
        del self._agents[name]
        await self.engine.ask(DropCache(name))

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self.engine.ask(StatsQuery())
        return stats


class _Opening:
    """What ``open()`` returns: await it, or use it as ``async with``."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def __await__(self) -> Generator[Any, None, Session]:
        return self._session.start().__await__()

    async def __aenter__(self) -> Session:
        return await self._session.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._session.__aexit__(exc_type, exc, tb)


def open(
    model: ModelSpec = None,
    *,
    max_batch: int = 8,
    prefill_chunk: int = 256,
    weights: str = "auto",
    mailbox_size: int = 64,
) -> _Opening:
    """Open a session on ``model``: None for the default model (fetched once, verified), a
    ``.gguf`` file, a local MLX / Hugging Face model directory, or a callable returning a
    LoadedModel. ``max_batch`` agents decode together; prompts are prefilled
    ``prefill_chunk`` tokens at a time between decode steps."""
    config = EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk, weights=weights)
    return _Opening(Session(model, config, mailbox_size))
