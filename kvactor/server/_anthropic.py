"""Anthropic's API: ``POST /v1/messages``, whole or as Anthropic's server-sent events."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors import Completion, FinishReason
from ._errors import ApiError
from ._request import (
    check_fields,
    check_model,
    check_prompt_chars,
    messages,
    parse_off_loop,
    read_body,
    sampling,
    stream_flag,
    string,
    text_content,
)
from ._routing import agent_id
from ._state import ServerState, server_state
from ._turn import Ask, StreamedTurn, admitted

_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "system", "stream", "temperature", "top_p"}
    | {"stop_sequences", "metadata"}
)


def _ask(body: Mapping[str, Any]) -> Ask:
    """The turn a messages body asks for (``system`` first). Raises ApiError for a role
    other than user / assistant in ``messages``, or what ``messages`` refuses."""
    system = body.get("system")
    if system is not None:
        system = text_content(system, "system", "system")
    for i, m in enumerate(body["messages"] if isinstance(body["messages"], list) else []):
        if isinstance(m, dict) and m.get("role") not in ("user", "assistant"):
            raise ApiError(
                400, f"messages.{i}.role: must be 'user' or 'assistant'", param="messages"
            )
    return Ask(messages(body["messages"], system), sampling(body, "max_tokens", "stop_sequences"))


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
    check_model(body, state.model_id)
    ask = _ask(body)
    check_prompt_chars(ask.conversation, state.max_prompt_chars, "messages")
    return _Parsed(ask, stream_flag(body), _user_id(body))


def _stop_reason(done: Completion, stops: list[str]) -> tuple[str, str | None]:
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


def _message(ident: str, model: str, done: Completion, stops: list[str]) -> dict[str, Any]:
    reason, sequence = _stop_reason(done, stops)
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": done.text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(
    ident: str, model: str, turn: StreamedTurn, stops: list[str]
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
    block = {"type": "text", "text": ""}
    yield _event("content_block_start", {"index": 0, "content_block": block})
    yield _event("ping", {})
    async for piece in turn.texts():
        delta = {"type": "text_delta", "text": piece}
        yield _event("content_block_delta", {"index": 0, "delta": delta})
    if turn.cut:
        message = "the server is shutting down: this turn was ended"
        yield _event("error", {"error": {"type": "overloaded_error", "message": message}})
        return
    done = turn.finished()
    reason, sequence = _stop_reason(done, stops)
    yield _event("content_block_stop", {"index": 0})
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
            return JSONResponse(_message(ident, state.model_id, done, stops))
        return await turn.streamed(who, ask, lambda t: _events(ident, state.model_id, t, stops))
