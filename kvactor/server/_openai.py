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

from ..actors.enums import FinishReason
from ..actors.records import Completion, Timings, ToolCall, ToolCallDelta
from ._conversation import openai_messages
from ._errors import ApiError
from ._request import (
    check_fields,
    check_model,
    check_prompt_chars,
    flag,
    include_usage,
    integer,
    parse_off_loop,
    read_body,
    sampling,
    stream_flag,
    string,
)
from ._routing import agent_id
from ._state import ServerState, server_state
from ._tools import openai_tools
from ._turn import Ask, StreamedTurn, admitted

_FIELDS = frozenset(
    {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed"}
    | {"stop", "user", "n", "logprobs"}
)
# The sampling filters local clients send besides OpenAI's own (llama.cpp's, vLLM's names).
_FILTER_FIELDS = {"top_k", "min_p", "repetition_penalty", "repetition_context_size"}
_CHAT_FIELDS = (
    _FIELDS
    | _FILTER_FIELDS
    | {"messages", "max_completion_tokens", "presence_penalty", "frequency_penalty"}
    | {"logit_bias", "top_logprobs", "store", "metadata"}
    | {"tools", "tool_choice", "parallel_tool_calls", "response_format"}
)
_COMPLETION_FIELDS = (
    _FIELDS
    | _FILTER_FIELDS
    | {"prompt", "echo", "presence_penalty", "frequency_penalty", "logit_bias"}
)


def _usage(done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.generated_tokens,
        "total_tokens": t.prompt_tokens + t.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": t.reused_tokens},
    }


def _finish_reason(done: Completion) -> str:
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_calls"
    return "length" if done.finish_reason == FinishReason.LENGTH else "stop"


def _kvactor_info(agent: str, done: Completion, reply: _Reply) -> dict[str, Any]:
    """What a reply says of kvactor's side of the turn: ``agent`` as the client knows it,
    and where the turn's time went (``timings``)."""
    t = done.timings
    return {
        "agent": agent,
        "path": str(done.path),
        "match": str(done.match),
        "ttft_s": t.ttft_s,
        "reused_tokens": t.reused_tokens,
        "saved": done.saved,
        "timings": _parts(t, reply),
    }


def _parts(t: Timings, reply: _Reply) -> dict[str, float]:
    """A turn's time over HTTP, in the order its parts ran: reading and checking the
    request body (``parse_s``); rendering the conversation, tokenizing it and matching it
    against the cache (``prompt_s``); waiting for the engine, a warm load included
    (``queue_s``, ``load_s`` of it); the prefill, the working copy included
    (``prefill_s``, ``dequantize_s`` of it); the decode (``decode_s``); storing and
    writing the new tokens (``save_s``); and from the request's arrival to this reply
    (``server_s``; the rest of it is routing, actor hops and the reply's own making)."""
    return {
        "parse_s": reply.parse_s,
        "prompt_s": t.prompt_s,
        "queue_s": t.queue_s,
        "load_s": t.load_s,
        "prefill_s": t.prefill_s,
        "dequantize_s": t.dequantize_s,
        "decode_s": t.decode_s,
        "save_s": t.save_s,
        "server_s": time.perf_counter() - reply.arrived,
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
    arrived: float = 0.0  # time.perf_counter() when the request came
    parse_s: float = 0.0  # reading and checking its body

    @classmethod
    def new(
        cls, prefix: str, model: str, arrived: float | None = None, parsing: float | None = None
    ) -> _Reply:
        """``arrived``: when the request came; ``parsing``: when its body began to be read
        (both ``time.perf_counter()``; None: now)."""
        now = time.perf_counter()
        return cls(
            f"{prefix}-{secrets.token_hex(12)}",
            model,
            int(time.time()),
            now if arrived is None else arrived,
            0.0 if parsing is None else now - parsing,
        )

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
    check_prompt_chars(ask.conversation, state.max_prompt_chars - ask.tools.chars, param)
    return _Parsed(ask, stream_flag(body), include_usage(body), string(body, "user"))


# -- chat completions ----------------------------------------------------------------------
def _chat_parse(state: ServerState, body: Mapping[str, Any]) -> _Parsed:
    """The turn a chat body asks for. Raises ApiError for a field of the wrong type or
    what the server does not do."""
    check_fields(body, _CHAT_FIELDS, ("model", "messages"))
    model = check_model(body, state.model_id, state.strict_model, state.models)
    if flag(body, "logprobs"):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    if integer(body, "top_logprobs", 0):
        raise ApiError(400, "'top_logprobs' is not supported", param="top_logprobs")
    flag(body, "store")  # OpenAI's keeping of completions: nothing is kept here but caches
    _metadata(body)
    conversation = openai_messages(body["messages"])
    options = sampling(body, "max_tokens", "stop", state.vocab_size(model))
    ask = Ask(conversation, options, openai_tools(body), model=model)
    return _common(body, state, ask, "messages")


def _metadata(body: Mapping[str, Any]) -> None:
    """OpenAI's ``metadata`` (stored completions' tags): at most 16 string pairs, taken
    and unused. Raises ApiError otherwise."""
    tags = body.get("metadata")
    if tags is None:
        return
    if (
        not isinstance(tags, dict)
        or len(tags) > 16
        or not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in tags.items())
    ):
        raise ApiError(400, "'metadata' must hold at most 16 string pairs", param="metadata")


def _call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments_json}
    return {"id": call.id, "type": "function", "function": function}


def _chat_message(done: Completion) -> dict[str, Any]:
    """The reply's message: its text (null when it made calls and said nothing else),
    its tool calls."""
    if not done.tool_calls:
        return {"role": "assistant", "content": done.text}
    calls = [_call(c) for c in done.tool_calls]
    return {"role": "assistant", "content": done.text or None, "tool_calls": calls}


def _chat_reply(reply: _Reply, agent: str, done: Completion) -> dict[str, Any]:
    return {
        **reply.head("chat.completion"),
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": _chat_message(done),
                "logprobs": None,
                "finish_reason": _finish_reason(done),
            }
        ],
        "usage": _usage(done),
        "kvactor": _kvactor_info(agent, done, reply),
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


def _call_delta(piece: ToolCallDelta) -> dict[str, Any]:
    """A piece of a tool call as OpenAI streams it: the first with its id, type and name
    (and arguments ""), the next ones with pieces of its arguments."""
    if piece.id is not None:
        function = {"name": piece.name, "arguments": piece.arguments}
        call = {"index": piece.index, "id": piece.id, "type": "function", "function": function}
    else:
        call = {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"tool_calls": [call]}


async def _chat_events(reply: _Reply, turn: StreamedTurn, usage: bool) -> AsyncIterator[str]:
    yield _chunk(reply, {"role": "assistant", "content": ""})
    async for piece in turn.events():
        if isinstance(piece, str):
            yield _chunk(reply, {"content": piece})
        else:
            yield _chunk(reply, _call_delta(piece))
    if turn.cut:
        yield _ENDED
        return
    done = turn.finished()
    yield _chunk(reply, {}, _finish_reason(done), _kvactor_info(turn.shown, done, reply))
    if usage:
        yield _sse({**reply.head("chat.completion.chunk"), "choices": [], "usage": _usage(done)})
    yield _DONE


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    arrived = time.perf_counter()
    async with admitted(request) as turn:
        state = server_state(request)
        parsing = time.perf_counter()
        raw = await read_body(request, state.max_body_bytes)
        chat = await parse_off_loop(raw, partial(_chat_parse, state), state.big_bodies)
        reply = _Reply.new("chatcmpl", chat.ask.model or state.model_id, arrived, parsing)
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
    model = check_model(body, state.model_id, state.strict_model, state.models)
    if flag(body, "echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if integer(body, "logprobs", 0):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    options = sampling(body, "max_tokens", "stop", state.vocab_size(model))
    return _common(body, state, Ask(prompt, options, model=model), "prompt")


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
        reply = _Reply.new("cmpl", parsed.ask.model or state.model_id)
        who = agent_id(request, parsed.user)
        if not parsed.stream:
            _, done = await turn.whole(who, parsed.ask)
            return JSONResponse(_text_reply(reply, done.text, _finish_reason(done), done))
        return await turn.streamed(who, parsed.ask, lambda t: _completion_events(reply, t))


# -- models --------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    """``GET /v1/models``: the models served, each with ``loaded`` (in memory now; a
    session of several models loads one when a request needs it)."""
    state = server_state(request)
    if state.models:
        loaded = {s.name: s.loaded for s in await state.session.model_states()}
        served = [(name, loaded[name]) for name in state.models]
    else:
        served = [(state.model_id, True)]
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvactor",
            "loaded": is_loaded,
        }
        for name, is_loaded in served
    ]
    return JSONResponse({"object": "list", "data": data})
