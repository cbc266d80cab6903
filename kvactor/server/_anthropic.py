"""Anthropic's API: ``POST /v1/messages``, whole or as Anthropic's server-sent events;
with tools, a reply's calls are ``tool_use`` blocks (streamed: a ``content_block_start``
of type ``tool_use``, then ``input_json_delta`` pieces) and its ``stop_reason`` is
``tool_use``."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors.enums import FinishReason
from ..actors.records import Completion
from ._conversation import anthropic_messages, anthropic_system
from ._errors import ApiError
from ._request import (
    check_fields,
    check_model,
    check_prompt_chars,
    parse_off_loop,
    read_body,
    sampling,
    stream_flag,
    string,
)
from ._routing import agent_id
from ._state import ServerState, server_state
from ._tools import anthropic_tools
from ._turn import Ask, Piece, StreamedTurn, admitted

_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "system", "stream", "temperature", "top_p", "top_k"}
    | {"stop_sequences", "metadata", "tools", "tool_choice"}
)


def _ask(state: ServerState, body: Mapping[str, Any], model: str | None) -> Ask:
    """The turn a messages body asks for (``system`` first) of ``model`` (None: the one
    served). Raises ApiError for what the conversation, sampling or tool checks refuse."""
    conversation = anthropic_messages(body["messages"], anthropic_system(body.get("system")))
    options = sampling(body, "max_tokens", "stop_sequences", state.vocab_size(model))
    return Ask(conversation, options, anthropic_tools(body), model=model)


def _user_id(body: Mapping[str, Any]) -> str | None:
    """``metadata.user_id`` (None when unset). Raises ApiError for other metadata, or a
    user_id that is not a string."""
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise ApiError(400, "metadata must be an object that holds only user_id", "metadata")
    try:
        return string(metadata, "user_id")
    except ApiError:
        raise ApiError(400, "'metadata.user_id' must be a string", param="metadata") from None


@dataclass(frozen=True)
class _Parsed:
    """A checked messages body: its turn, whether streamed, and its user id."""

    ask: Ask
    stream: bool
    user: str | None


def _parse(state: ServerState, body: Mapping[str, Any]) -> _Parsed:
    """Check a messages body. Raises ApiError naming the field at fault."""
    check_fields(body, _FIELDS, ("model", "messages", "max_tokens"))
    model = check_model(body, state.model_id, state.strict_model, state.models)
    ask = _ask(state, body, model)
    check_prompt_chars(ask.conversation, state.max_prompt_chars - ask.tools.chars, "messages")
    return _Parsed(ask, stream_flag(body), _user_id(body))


def _stop_reason(done: Completion, stops: list[str]) -> tuple[str, str | None]:
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if done.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if done.finish_reason == FinishReason.STOP:
        # Which string matched is not recorded: named when there is only one.
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


def _usage(done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "input_tokens": t.prompt_tokens - t.reused_tokens,
        "cache_read_input_tokens": t.reused_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": t.generated_tokens,
    }


def _content(done: Completion) -> list[dict[str, Any]]:
    """The reply's content blocks: its text (unless it made calls and said nothing
    else), then a ``tool_use`` block a call."""
    blocks: list[dict[str, Any]] = []
    if done.text or not done.tool_calls:
        blocks.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        )
    return blocks


def _message(ident: str, model: str, done: Completion, stops: list[str]) -> dict[str, Any]:
    reason, sequence = _stop_reason(done, stops)
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(done),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class _Blocks:
    """The content blocks of a streamed reply as Anthropic's events tell them: each
    opened (``content_block_start``) when its first piece comes, the open one closed
    when another begins or the reply ends; ``eager``: the text block opens at once (a
    turn without tools, as before tools existed)."""

    def __init__(self, eager: bool) -> None:
        self.count = 0  # blocks opened so far
        self._open: str | None = None  # "text", or the tool call's index as text
        self._eager = eager

    def _switch(self, key: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self._open = key
        events.append(_event("content_block_start", {"index": self.count, "content_block": block}))
        self.count += 1
        return events

    def open_text(self) -> list[str]:
        """The events that open a text block."""
        return self._switch("text", {"type": "text", "text": ""})

    def start(self) -> list[str]:
        """The events of the reply's start (its text block's, when ``eager``)."""
        return self.open_text() if self._eager else []

    def piece(self, piece: Piece) -> list[str]:
        """The events of one piece of the reply."""
        if isinstance(piece, str):
            events = [] if self._open == "text" else self.open_text()
            delta = {"type": "text_delta", "text": piece}
        else:
            events = []
            if piece.id is not None:
                block: dict[str, Any] = {"type": "tool_use", "id": piece.id}
                block.update(name=piece.name, input={})
                events = self._switch(str(piece.index), block)
            if not piece.arguments:
                return events
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
        return [*events, _event("content_block_delta", {"index": self.count - 1, "delta": delta})]

    def close(self) -> list[str]:
        """The events that close the open block (none when none is)."""
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self.count - 1})]


async def _events(
    ident: str, model: str, turn: StreamedTurn, stops: list[str], tools: bool
) -> AsyncIterator[str]:
    begin: dict[str, Any] = {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    yield _event("message_start", {"message": begin})
    blocks = _Blocks(eager=not tools)
    for event in blocks.start():
        yield event
    yield _event("ping", {})
    async for piece in turn.events():
        for event in blocks.piece(piece):
            yield event
    if turn.cut:
        message = "the server is shutting down: this turn was ended"
        yield _event("error", {"error": {"type": "overloaded_error", "message": message}})
        return
    done = turn.finished()
    if blocks.count == 0:  # nothing said: one empty text block, as Anthropic answers
        for event in blocks.open_text():
            yield event
    for event in blocks.close():
        yield event
    reason, sequence = _stop_reason(done, stops)
    end = {"stop_reason": reason, "stop_sequence": sequence}
    yield _event("message_delta", {"delta": end, "usage": _usage(done)})
    yield _event("message_stop", {})


async def messages_route(request: Request) -> Response:
    """``POST /v1/messages``."""
    async with admitted(request) as turn:
        state = server_state(request)
        raw = await read_body(request, state.max_body_bytes)
        parsed = await parse_off_loop(raw, partial(_parse, state), state.big_bodies)
        ask = parsed.ask
        who = agent_id(request, parsed.user)
        ident = f"msg_{secrets.token_hex(12)}"
        stops: list[str] = ask.options.get("stop", [])
        if not parsed.stream:
            _, done = await turn.whole(who, ask)
            return JSONResponse(_message(ident, ask.model or state.model_id, done, stops))
        tools = bool(ask.tools.options)
        return await turn.streamed(
            who, ask, lambda t: _events(ident, ask.model or state.model_id, t, stops, tools)
        )
