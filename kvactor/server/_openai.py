"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. Replies carry a ``kvactor`` field (the agent, the tier its cache came
from, the reused tokens) besides OpenAI's own."""

from __future__ import annotations

import json
import secrets
import time
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
    flag,
    include_usage,
    integer,
    messages,
    number,
    parse_off_loop,
    read_body,
    sampling,
    stream_flag,
    string,
)
from ._routing import agent_id
from ._state import ServerState, server_state
from ._turn import Ask, StreamedTurn, admitted

_FIELDS = frozenset(
    {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed"}
    | {"stop", "user", "n", "logprobs"}
)
_CHAT_FIELDS = _FIELDS | {
    "messages",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
}
_COMPLETION_FIELDS = _FIELDS | {"prompt", "echo"}


def _usage(done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.generated_tokens,
        "total_tokens": t.prompt_tokens + t.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": t.reused_tokens},
    }


def _finish_reason(done: Completion) -> str:
    return "length" if done.finish_reason == FinishReason.LENGTH else "stop"


def _kvactor_info(agent: str, done: Completion) -> dict[str, Any]:
    """What a reply says of kvactor's side of the turn: ``agent`` as the client knows it."""
    t = done.timings
    return {
        "agent": agent,
        "path": str(done.path),
        "match": str(done.match),
        "ttft_s": t.ttft_s,
        "reused_tokens": t.reused_tokens,
        "saved": done.saved,
    }


def _sse(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


_DONE = "data: [DONE]\n\n"
# What a stream ended by the server's drain says last (OpenAI's shape of an error event).
_ENDED = _sse(
    {
        "error": {
            "message": "the server is shutting down: this turn was ended",
            "type": "server_error",
            "param": None,
            "code": "shutting_down",
        }
    }
)


@dataclass(frozen=True)
class _Reply:
    """What every object of one reply repeats: its id, creation time and model."""

    ident: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, model: str) -> _Reply:
        return cls(f"{prefix}-{secrets.token_hex(12)}", model, int(time.time()))

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model}


@dataclass(frozen=True)
class _Parsed:
    """A checked body: the turn it asks for, whether streamed (with usage at the end),
    and its ``user`` field."""

    ask: Ask
    stream: bool
    usage: bool
    user: str | None


def _common(body: Mapping[str, Any], state: ServerState, ask: Ask, param: str) -> _Parsed:
    """What both routes check alike. Raises ApiError."""
    if integer(body, "n", 1) not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    check_prompt_chars(ask.conversation, state.max_prompt_chars, param)
    return _Parsed(ask, stream_flag(body), include_usage(body), string(body, "user"))


# -- chat completions ----------------------------------------------------------------------
def _chat_parse(state: ServerState, body: Mapping[str, Any]) -> _Parsed:
    """The turn a chat body asks for. Raises ApiError for a field of the wrong type or
    what the server does not do."""
    check_fields(body, _CHAT_FIELDS, ("model", "messages"))
    check_model(body, state.model_id)
    for name in ("presence_penalty", "frequency_penalty"):
        if number(body, name, -2.0, 2.0) not in (None, 0.0):
            raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
    if flag(body, "logprobs"):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(
            400, "only response_format {'type': 'text'} is supported", param="response_format"
        )
    ask = Ask(messages(body["messages"]), sampling(body, "max_tokens", "stop"))
    return _common(body, state, ask, "messages")


def _chat_reply(reply: _Reply, agent: str, done: Completion) -> dict[str, Any]:
    return {
        **reply.head("chat.completion"),
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": _finish_reason(done),
            }
        ],
        "usage": _usage(done),
        "kvactor": _kvactor_info(agent, done),
    }


def _chunk(
    reply: _Reply,
    delta: dict[str, Any],
    finish: str | None = None,
    info: dict[str, Any] | None = None,
) -> str:
    data: dict[str, Any] = {
        **reply.head("chat.completion.chunk"),
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if info is not None:
        data["kvactor"] = info
    return _sse(data)


async def _chat_events(reply: _Reply, turn: StreamedTurn, usage: bool) -> AsyncIterator[str]:
    yield _chunk(reply, {"role": "assistant", "content": ""})
    async for piece in turn.texts():
        yield _chunk(reply, {"content": piece})
    if turn.cut:
        yield _ENDED
        return
    done = turn.finished()
    yield _chunk(reply, {}, _finish_reason(done), _kvactor_info(turn.shown, done))
    if usage:
        yield _sse({**reply.head("chat.completion.chunk"), "choices": [], "usage": _usage(done)})
    yield _DONE


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    async with admitted(request) as turn:
        state = server_state(request)
        raw = await read_body(request, state.max_body_bytes)
        chat = await parse_off_loop(raw, partial(_chat_parse, state), state.big_bodies)
        reply = _Reply.new("chatcmpl", state.model_id)
        who = agent_id(request, chat.user)
        if not chat.stream:
            agent, done = await turn.whole(who, chat.ask)
            return JSONResponse(_chat_reply(reply, turn.local_id(agent), done))
        return await turn.streamed(who, chat.ask, lambda t: _chat_events(reply, t, chat.usage))


# -- completions ---------------------------------------------------------------------------
def _completion_parse(state: ServerState, body: Mapping[str, Any]) -> _Parsed:
    """The turn a completions body asks for. Raises ApiError for a field of the wrong
    type, what the server does not do (n > 1, echo, logprobs) or a prompt that is not
    one non-empty string."""
    check_fields(body, _COMPLETION_FIELDS, ("model", "prompt"))
    check_model(body, state.model_id)
    if flag(body, "echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if integer(body, "logprobs", 0):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return _common(body, state, Ask(prompt, sampling(body, "max_tokens", "stop")), "prompt")


def _text_reply(
    reply: _Reply, text: str, finish: str | None, done: Completion | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        **reply.head("text_completion"),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if done is not None:
        out["usage"] = _usage(done)
    return out


async def _completion_events(reply: _Reply, turn: StreamedTurn) -> AsyncIterator[str]:
    async for piece in turn.texts():
        yield _sse(_text_reply(reply, piece, None, None))
    if turn.cut:
        yield _ENDED
        return
    done = turn.finished()
    yield _sse(_text_reply(reply, "", _finish_reason(done), done))
    yield _DONE


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: a raw prompt, no chat template."""
    async with admitted(request) as turn:
        state = server_state(request)
        raw = await read_body(request, state.max_body_bytes)
        parsed = await parse_off_loop(
            raw, lambda body: _completion_parse(state, body), state.big_bodies
        )
        reply = _Reply.new("cmpl", state.model_id)
        who = agent_id(request, parsed.user)
        if not parsed.stream:
            _, done = await turn.whole(who, parsed.ask)
            return JSONResponse(_text_reply(reply, done.text, _finish_reason(done), done))
        return await turn.streamed(who, parsed.ask, lambda t: _completion_events(reply, t))


# -- models --------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    """``GET /v1/models``: the one model served."""
    state = server_state(request)
    model = {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "kvactor",
    }
    return JSONResponse({"object": "list", "data": [model]})
