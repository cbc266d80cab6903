"""Reading and checking a request body, shared by the OpenAI and Anthropic routes: each
check raises :class:`ApiError` (a 400 unless it says otherwise) naming the field at fault."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from ._errors import ApiError

DEFAULT_MAX_TOKENS = 512


async def read_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object. Raises ApiError: 413 past ``max_bytes`` (declared or
    read), 400 for a body that is not JSON or not an object; ClientDisconnect when the
    client leaves mid-body."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def check_fields(body: Mapping[str, Any], known: frozenset[str], required: tuple[str, ...]) -> None:
    """Raises ApiError for a field outside ``known`` or a ``required`` one missing."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    for name in required:
        if name not in body:
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name)


def check_model(body: Mapping[str, Any], model_id: str) -> None:
    """Raises ApiError (404) unless the body names ``model_id`` or ``"default"``."""
    model = body.get("model")
    if model not in (model_id, "default"):
        raise ApiError(
            404,
            f"The model {model!r} does not exist: this server serves "
            f"{model_id!r} (or say 'default')",
            code="model_not_found",
            param="model",
        )


def stream_flag(body: Mapping[str, Any]) -> bool:
    """The body's ``stream`` (default False). Raises ApiError unless it is a boolean."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    return stream


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be a number in [{low}, {high}], got {value!r}", param=name
        )
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"'{name}' must be an integer >= {low}, got {value!r}", param=name)
    return value


def _stops(body: Mapping[str, Any], name: str) -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'{name}' must be a string or a list of non-empty strings", param=name)
    return stop


def sampling(body: Mapping[str, Any], max_name: str, stop_name: str) -> dict[str, Any]:
    """Our sampling options from an API body (OpenAI's or Anthropic's names: the token
    limit in ``max_name`` or ``max_completion_tokens``, the stop strings in
    ``stop_name``). Raises ApiError for a value out of range or of the wrong type."""
    options: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name in (max_name, "max_completion_tokens"):
        value = _integer(body, name, 1)
        if value is not None:
            options["max_tokens"] = value
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        options["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise ApiError(400, "'top_p' must be > 0", param="top_p")
        options["top_p"] = top_p
    seed = _integer(body, "seed", 0)
    if seed is not None:
        options["seed"] = seed
    stop = _stops(body, stop_name)
    if stop:
        options["stop"] = stop
    return options


def text_content(content: Any, where: str) -> str:
    """A message content: a string, or a list of text parts (both APIs' shapes). Raises
    ApiError for anything else (images, tool calls)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(400, f"{where}: only text content is supported", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def messages(raw: Any, system: str | None = None) -> list[dict[str, str]]:
    """A conversation as ``Agent.stream_chat`` takes it (``system`` first when given;
    ``developer`` read as ``system``). Raises ApiError for an empty list, a malformed
    message, a role other than system / user / assistant, or a last message that is not
    the user's."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = [{"role": "system", "content": system}] if system is not None else []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m:
            raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(
                400, f"messages[{i}]: unsupported field(s) {sorted(extra)}", param="messages"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role {role!r} is not supported", param="messages")
        out.append({"role": role, "content": text_content(m.get("content"), f"messages[{i}]")})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    return out
