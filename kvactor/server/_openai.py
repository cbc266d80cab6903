"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. Replies carry a ``kvactor`` field (the agent, the tier its cache came
from, the reused tokens) besides OpenAI's own."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors import Agent, Completion, FinishReason
from ._errors import ApiError
from ._request import check_fields, check_model, messages, read_body, sampling, stream_flag
from ._routing import agent_id
from ._state import server_state
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


def _kvactor_info(agent: Agent, done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "agent": agent.name,
        "path": str(done.path),
        "match": str(done.match),
        "ttft_s": t.ttft_s,
        "reused_tokens": t.reused_tokens,
        "saved": done.saved,
    }


def _sse(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


_DONE = "data: [DONE]\n\n"


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


# -- chat completions ----------------------------------------------------------------------
def _chat_ask(body: Mapping[str, Any]) -> Ask:
    """The turn a chat body asks for. Raises ApiError for what the server does not do."""
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) not in (0, 0.0, None):
            raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
    if body.get("logprobs"):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(
            400, "only response_format {'type': 'text'} is supported", param="response_format"
        )
    return Ask(messages(body["messages"]), sampling(body, "max_tokens", "stop"))


def _chat_reply(reply: _Reply, agent: Agent, done: Completion) -> dict[str, Any]:
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
    done = turn.finished()
    yield _chunk(reply, {}, _finish_reason(done), _kvactor_info(turn.agent, done))
    if usage:
        yield _sse({**reply.head("chat.completion.chunk"), "choices": [], "usage": _usage(done)})
    yield _DONE


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    async with admitted(request) as turn:
        state = server_state(request)
        body = await read_body(request, state.max_body_bytes)
        check_fields(body, _CHAT_FIELDS, ("model", "messages"))
        check_model(body, state.model_id)
        ask = _chat_ask(body)
        stream = stream_flag(body)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        reply = _Reply.new("chatcmpl", state.model_id)
        who = agent_id(request, body.get("user"))
        if not stream:
            agent, done = await turn.whole(who, ask)
            return JSONResponse(_chat_reply(reply, agent, done))
        return await turn.streamed(who, ask, lambda t: _chat_events(reply, t, usage))


# -- completions ---------------------------------------------------------------------------
def _completion_ask(body: Mapping[str, Any]) -> Ask:
    """The turn a completions body asks for. Raises ApiError for what the server does not
    do (n > 1, echo, logprobs) or a prompt that is not one non-empty string."""
    if body.get("n", 1) != 1 or body.get("echo") or body.get("logprobs"):
        raise ApiError(400, "n > 1, echo and logprobs are not supported")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return Ask(prompt, sampling(body, "max_tokens", "stop"))


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
    done = turn.finished()
    yield _sse(_text_reply(reply, "", _finish_reason(done), done))
    yield _DONE


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: a raw prompt, no chat template."""
    async with admitted(request) as turn:
        state = server_state(request)
        body = await read_body(request, state.max_body_bytes)
        check_fields(body, _COMPLETION_FIELDS, ("model", "prompt"))
        check_model(body, state.model_id)
        ask = _completion_ask(body)
        reply = _Reply.new("cmpl", state.model_id)
        who = agent_id(request, body.get("user"))
        if not body.get("stream", False):
            _, done = await turn.whole(who, ask)
            return JSONResponse(_text_reply(reply, done.text, _finish_reason(done), done))
        return await turn.streamed(who, ask, lambda t: _completion_events(reply, t))


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
