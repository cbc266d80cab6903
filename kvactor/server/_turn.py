"""Answering a turn request: admitted (:func:`admitted` holds its admission slot), then run
on its agent and answered whole (:meth:`TurnRequest.whole`) or as server-sent events
(:meth:`TurnRequest.streamed`). A streamed turn keeps what it holds (its slot, its agent,
its text stream) until its events end or its client leaves.

A client that leaves cancels its turn, whenever it leaves: while its agent is found,
while its turn waits or runs (whole or before the first piece: the connection is watched
meanwhile), or mid-stream (Starlette watches then). The engine drops a cancelled turn at
its next step, which frees its batch slot; ``kvactor_turns_cancelled_total`` counts them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..actors.enums import FinishReason
from ..actors.errors import ContextOverflow
from ..actors.records import Completion, ToolCallDelta
from ..actors.session import TurnStream
from ._errors import ApiError, ClientGone, ended
from ._hints import header_hints
from ._routing import Conversation
from ._served import ServedAgent
from ._state import server_state, tenant_of
from ._tools import GRAMMAR_ERRORS, ToolAsk

T = TypeVar("T")


@dataclass(frozen=True)
class Ask:
    """What a request asks of its agent: a conversation (a chat) or a raw prompt, the
    sampling options, and its tool options (``tools``)."""

    conversation: Conversation
    options: dict[str, Any]
    tools: ToolAsk = field(default_factory=ToolAsk)
    model: str | None = None  # the model it runs on (None: the session's one model)

    def start(self, agent: ServedAgent) -> TurnStream:
        """The turn's stream on ``agent`` (not started). Raises TypeError / ValueError
        for bad options."""
        if isinstance(self.conversation, str):
            return agent.stream_raw(self.conversation, **self.options)
        return agent.stream_chat(self.conversation, **self.options, **self.tools.options)

    def after(self, done: Completion) -> Conversation:
        """The conversation once the turn is done (for the anonymous routing), as its
        client will send it again: the reply with its tool calls."""
        if isinstance(self.conversation, str):
            return self.conversation + done.text
        reply: dict[str, Any] = {"role": "assistant", "content": done.text}
        if done.tool_calls:
            reply["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in done.tool_calls
            ]
        return [*self.conversation, reply]

    def error(self, exc: Exception) -> Exception:
        """What ``exc``, raised by the turn, tells the client: the engine's refusal of a
        grammar is a 400 naming the field it came from."""
        if (
            self.tools.param is not None
            and isinstance(exc, ValueError)
            and not isinstance(exc, ContextOverflow)
            and any(word in str(exc) for word in GRAMMAR_ERRORS)
        ):
            return ApiError(400, str(exc), param=self.tools.param)
        return exc


Piece = str | ToolCallDelta  # what a turn's stream gives: text, or a piece of a tool call


class StreamedTurn:
    """A streamed turn, as its events see it: its agent (``shown``: the id its client
    knows it by), its pieces (text and tool calls' pieces), and its Completion once the
    pieces ran out (``finished``)."""

    def __init__(
        self,
        agent: ServedAgent,
        stream: TurnStream,
        pieces: AsyncIterator[Piece],
        first: Piece | None,
        on_done: Callable[[], None],
        shown: str,
        drainable: Callable[[], contextlib.AbstractContextManager[anyio.CancelScope]],
    ) -> None:
        self.agent = agent
        self.shown = shown
        self.cut = False  # the server's drain ended it before its last piece
        self._drainable = drainable
        self._stream = stream
        self._pieces = pieces
        self._first = first
        self._on_done = on_done
        self._done: Completion | None = None

    async def events(self) -> AsyncIterator[Piece]:
        """The reply's pieces (the first one already read): text, and with tools the
        calls' pieces as they form; they stop early, with ``cut`` set, when the server's
        drain ends the turn."""
        if self._first:
            yield self._first
        while True:
            with self._drainable() as scope:  # around the wait only: never a yield
                piece = await anext(self._pieces, None)
            if scope.cancelled_caught:
                self.cut = True
                return
            if piece is None:
                # Ended by the drain at a decode step: saved, counted, answered as ended.
                self.cut = self.finished().finish_reason == FinishReason.ENDED
                return
            yield piece

    async def texts(self) -> AsyncIterator[str]:
        """The reply's text pieces alone (see :meth:`events`)."""
        async for piece in self.events():
            if isinstance(piece, str):
                yield piece

    def finished(self) -> Completion:
        """The Completion (after ``texts`` ran out); the turn is counted once."""
        if self._done is None:
            self._done = self._stream.completion
            assert self._done is not None
            self._on_done()
        return self._done


Events = Callable[[StreamedTurn], AsyncIterator[str]]  # a streamed turn as SSE text


async def unless_gone(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """What ``work`` returns, watching the connection meanwhile (the request's body has
    been read: the next ASGI message is its end). Raises ClientGone, ``work`` cancelled,
    as soon as the client disconnects; what ``work`` raises."""
    gone = False
    result: list[T] = []
    error: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # its own; a cancellation goes through
            error.append(exc)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    if not result:
        assert gone
        raise ClientGone()
    return result[0]


class _TurnResponse(StreamingResponse):
    """Server-sent events of a turn. What the turn holds (``held``) is let go when the
    events end, else when the response ends however it does (a client that leaves
    before the first event included); ``on_cancel`` is called when the client left
    before the events ended."""

    def __init__(
        self,
        events: AsyncIterator[str],
        held: contextlib.AsyncExitStack,
        on_cancel: Callable[[], None],
    ) -> None:
        self._held = held
        self._on_cancel = on_cancel
        self._complete = False
        super().__init__(
            self._body(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _body(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
            self._complete = True
        finally:
            await self._let_go()

    async def _let_go(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._held.aclose()  # a second call does nothing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
            if not self._complete:  # Starlette saw the client leave and stopped the events
                self._on_cancel()
        finally:
            await self._let_go()


class TurnRequest:
    """A turn request holding its admission slot (see :func:`admitted`)."""

    def __init__(self, request: Request, held: contextlib.AsyncExitStack) -> None:
        self._state = server_state(request)
        self._tenant = tenant_of(request)
        self._receive = request.receive
        self._held = held

    def local_id(self, agent: ServedAgent) -> str:
        """The id the client knows ``agent`` by (within its tenant)."""
        return self._tenant.local_id(agent.name)

    async def _unless_gone(self, work: Callable[[], Awaitable[T]], reply: str) -> T:
        try:
            return await unless_gone(self._receive, work)
        except ClientGone:
            self._state.metrics.cancelled.labels(reply).inc()
            raise

    async def whole(self, agent_id: str | None, ask: Ask) -> tuple[ServedAgent, Completion]:
        """Run the turn to its end: its agent and its Completion (remembered, counted).
        Raises ClientGone when the client left meanwhile (the turn cancelled), what the
        turn raises (ContextOverflow, TypeError / ValueError, ...)."""
        state = self._state

        async def run() -> tuple[ServedAgent, Completion]:
            held = state.agents.agent(self._tenant, agent_id, ask.conversation, ask.model)
            async with held as agent:
                async with ask.start(agent) as pieces:
                    async for _ in pieces:
                        pass
                done = pieces.completion
                assert done is not None
                state.finished(agent, done, ask.after(done))
            return agent, done

        with state.drainable(starting=True):
            try:
                agent, done = await self._unless_gone(run, "whole")
            except (TypeError, ValueError) as exc:
                raise ask.error(exc) from None
            if done.finish_reason != FinishReason.ENDED:
                return agent, done
        raise ended()  # by the drain: at a decode step (saved), or cancelled

    async def streamed(self, agent_id: str | None, ask: Ask, events: Events) -> StreamingResponse:
        """The turn as server-sent ``events``, once its first piece is there: an error
        before it raises here (and is answered with a status, not a broken 200), as
        does ClientGone when the client left meanwhile."""
        state, held = self._state, self._held
        router = state.agents

        async def begin() -> tuple[ServedAgent, TurnStream, AsyncIterator[Piece], Piece | None]:
            agent = await held.enter_async_context(
                router.agent(self._tenant, agent_id, ask.conversation, ask.model)
            )
            stream = await held.enter_async_context(ask.start(agent))
            pieces = stream.events()
            return agent, stream, pieces, await anext(pieces, None)

        with state.drainable(starting=True) as scope:
            try:
                agent, stream, pieces, first = await self._unless_gone(begin, "stream")
            except (TypeError, ValueError) as exc:
                raise ask.error(exc) from None
        if scope.cancelled_caught:
            raise ended()

        def on_done() -> None:
            done = stream.completion
            assert done is not None
            state.finished(agent, done, ask.after(done))

        def on_cancel() -> None:
            state.metrics.cancelled.labels("stream").inc()

        shown = self.local_id(agent)
        turn = StreamedTurn(agent, stream, pieces, first, on_done, shown, state.drainable)
        return _TurnResponse(events(turn), held.pop_all(), on_cancel)


@contextlib.asynccontextmanager
async def admitted(request: Request) -> AsyncIterator[TurnRequest]:
    """A turn request for the block, holding one admission slot (a streamed reply takes
    it along), its hint headers given (``_hints``). Raises ApiError (429) when
    ``max_pending`` requests are in flight, a 400 for a malformed hint header."""
    state = server_state(request)
    await header_hints(request)
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(state.admission.slot())
        yield TurnRequest(request, held)
