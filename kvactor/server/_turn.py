"""Answering a turn request: admitted (:func:`admitted` holds its admission slot), then run
on its agent and answered whole (:meth:`TurnRequest.whole`) or as server-sent events
(:meth:`TurnRequest.streamed`). A streamed turn keeps what it holds (its slot, its agent,
its text stream) until its events end or its client leaves; leaving cancels the turn,
which frees its batch slot."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..actors import Agent, Completion
from ..actors.api import TurnStream
from ._routing import Conversation
from ._state import ServerState, server_state


@dataclass(frozen=True)
class Ask:
    """What a request asks of its agent: a conversation (a chat) or a raw prompt, and
    the sampling options."""

    conversation: Conversation
    options: dict[str, Any]

    def start(self, agent: Agent) -> TurnStream:
        """The turn's text stream on ``agent`` (not started). Raises TypeError /
        ValueError for bad options."""
        if isinstance(self.conversation, str):
            return agent.stream_raw(self.conversation, **self.options)
        return agent.stream_chat(self.conversation, **self.options)

    def after(self, done: Completion) -> Conversation:
        """The conversation once the turn is done (for the anonymous routing)."""
        if isinstance(self.conversation, str):
            return self.conversation + done.text
        return [*self.conversation, {"role": "assistant", "content": done.text}]


class StreamedTurn:
    """A streamed turn, as its events see it: its agent, its text pieces, and its
    Completion once the pieces ran out (``finished``)."""

    def __init__(
        self, agent: Agent, stream: TurnStream, first: str | None, on_done: Callable[[], None]
    ) -> None:
        self.agent = agent
        self._stream = stream
        self._first = first
        self._on_done = on_done
        self._done: Completion | None = None

    async def texts(self) -> AsyncIterator[str]:
        """The reply's text pieces (the first one already read)."""
        if self._first:
            yield self._first
        async for piece in self._stream:
            yield piece

    def finished(self) -> Completion:
        """The Completion (after ``texts`` ran out); the turn is counted once."""
        if self._done is None:
            self._done = self._stream.completion
            assert self._done is not None
            self._on_done()
        return self._done


Events = Callable[[StreamedTurn], AsyncIterator[str]]  # a streamed turn as SSE text


class _TurnResponse(StreamingResponse):
    """Server-sent events of a turn. What the turn holds (``held``) is let go when the
    events end, else when the response ends however it does (a client that leaves
    before the first event included)."""

    def __init__(self, events: AsyncIterator[str], held: contextlib.AsyncExitStack) -> None:
        self._held = held
        super().__init__(
            self._body(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _body(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            await self._let_go()

    async def _let_go(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._held.aclose()  # a second call does nothing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._let_go()


class TurnRequest:
    """A turn request holding its admission slot (see :func:`admitted`)."""

    def __init__(self, state: ServerState, held: contextlib.AsyncExitStack) -> None:
        self._state = state
        self._held = held

    async def whole(self, agent_id: str | None, ask: Ask) -> tuple[Agent, Completion]:
        """Run the turn to its end: its agent and its Completion (remembered, counted).
        Raises what the turn raises (ContextOverflow, TypeError / ValueError, ...)."""
        async with self._state.agents.agent(agent_id, ask.conversation) as agent:
            async with ask.start(agent) as pieces:
                async for _ in pieces:
                    pass
            done = pieces.completion
            assert done is not None
            self._state.finished(agent, done, ask.after(done))
        return agent, done

    async def streamed(self, agent_id: str | None, ask: Ask, events: Events) -> StreamingResponse:
        """The turn as server-sent ``events``, once its first piece is there: an error
        before it raises here (and is answered with a status, not a broken 200)."""
        state, held = self._state, self._held
        agent = await held.enter_async_context(state.agents.agent(agent_id, ask.conversation))
        pieces = await held.enter_async_context(ask.start(agent))
        first = await anext(pieces, None)

        def on_done() -> None:
            done = pieces.completion
            assert done is not None
            state.finished(agent, done, ask.after(done))

        turn = StreamedTurn(agent, pieces, first, on_done)
        return _TurnResponse(events(turn), held.pop_all())


@contextlib.asynccontextmanager
async def admitted(request: Request) -> AsyncIterator[TurnRequest]:
    """A turn request for the block, holding one admission slot (a streamed reply takes
    it along). Raises ApiError (429) when ``max_pending`` requests are in flight."""
    state = server_state(request)
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(state.admission.slot())
        yield TurnRequest(state, held)
