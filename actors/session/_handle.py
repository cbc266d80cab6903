"""An agent actor as its caller in this process holds it: :class:`Agent` (the agent API,
``kvactor.actors.api``) and the :class:`TextStream` of a turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ...runtime import ActorRef, ReplyStream
from ..agent import check_history
from ..errors import StoreWriteError
from ..messages import AgentMessage, CacheQuery, GetState, Turn
from ..options import Sampling
from ..records import AgentState, CacheInfo, Completion, ToolCallDelta, ToolRequest
from ..warm import PortableInfo
from ._api import AgentTurns, TurnKind

if TYPE_CHECKING:
    from ._session import Session

__all__ = ("Agent", "TextStream")


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
        while True:
            item = await self._next()
            if isinstance(item, str):
                return item

    async def events(self) -> AsyncIterator[str | ToolCallDelta]:
        """The turn's text pieces and its tool calls' pieces as they form (then
        ``completion`` is set)."""
        while True:
            try:
                yield await self._next()
            except StopAsyncIteration:
                return

    async def _next(self) -> str | ToolCallDelta:
        if self.completion is not None:
            raise StopAsyncIteration
        item = await self._inner.__anext__()
        if isinstance(item, Completion):
            self.completion = item
            if self._raise and item.save_error is not None:
                error = StoreWriteError(
                    f"the turn completed but its cache was not saved: {item.save_error}"
                )
                error.completion = item
                raise error
            raise StopAsyncIteration
        assert isinstance(item, str | ToolCallDelta)
        return item

    async def aclose(self) -> None:
        if self.completion is None:
            await self._inner.aclose()

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Agent(AgentTurns):
    """A handle on one agent actor: multi-turn generation with a cache kept between turns
    (the turn methods: :class:`~kvactor.actors.api.AgentTurns`)."""

    def __init__(self, session: Session, name: str, ref: ActorRef[AgentMessage]) -> None:
        self._session = session
        self.name = name
        self.ref = ref

    def __repr__(self) -> str:
        return f"<Agent {self.name!r}>"

    def _turn_stream(
        self,
        kind: TurnKind,
        payload: Any,
        sampling: dict[str, Any],
        *,
        pieces: bool,
        tools: ToolRequest | None = None,
    ) -> TextStream:
        options = Sampling.from_options(sampling)
        if kind == "chat":
            turn = Turn("", options, history=check_history(payload), tools=tools)
        else:
            turn = Turn(payload, options, raw=kind == "raw", tools=tools)
        return self.send_turn(turn)

    def send_turn(self, turn: Turn) -> TextStream:
        """Stream a ``Turn`` message as it is, unchecked (the session's own turns: priming
        a shared context)."""
        raising = self._session.on_save_error == "raise"
        return TextStream(self.ref.stream(turn), raise_on_save_error=raising)

    async def state(self) -> AgentState:
        state: AgentState = await self.ref.ask(GetState())
        return state

    async def history(self) -> list[dict[str, Any]]:
        return (await self.state()).messages

    async def hint(self, *, expect_in_s: float | None = None, priority: int | None = None) -> None:
        """Advice about this agent (``Session.hint``): its next turn comes in about
        ``expect_in_s`` seconds; ``priority``: higher stays hot longer (0: the default).
        Raises TypeError / ValueError as ``Session.hint``."""
        await self._session.hint(
            expect_in_s=None if expect_in_s is None else {self.name: expect_in_s},
            priority=None if priority is None else {self.name: priority},
        )

    async def done(self) -> None:
        """Advice: this agent is done for now, so its cache is demoted before others'."""
        await self._session.hint(done=[self.name])

    async def export(self, dest: Any) -> PortableInfo:
        """Write this agent's cache as one portable file to ``dest`` (a path or a binary
        file): ``Session.export_agent``."""
        return await self._session.export_agent(self.name, dest)

    async def cache_info(self) -> CacheInfo:
        info: CacheInfo = await self._session.engine_for(self.name).ask(CacheQuery(self.name))
        return info
