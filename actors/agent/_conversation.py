"""A conversation as the caller gives it, checked and put in one form: system, user,
assistant (with its tool calls) and tool (a call's result) messages."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ("ROLES", "check_history", "text_of")

ROLES = frozenset({"system", "user", "assistant", "tool"})
_KEYS = {
    "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


def text_of(content: object, where: str) -> str:
    """A message's content as text: a str, or a list of text parts (``{"type": "text",
    "text": ...}``, as OpenAI clients send them) joined. Raises TypeError for another type,
    ValueError for a part that is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: content part {j} of type {kind!r} is not supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise TypeError(f"{where}: content part {j} must hold its text as a str")
            texts.append(text)
        return "".join(texts)
    raise TypeError(f"{where}: content must be a str or a list of text parts")


def _tool_calls(raw: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as ``{"id", "type": "function", "function":
    {"name", "arguments": dict}}`` (arguments given as JSON text are parsed)."""
    if not isinstance(raw, list):
        raise TypeError(f"{where}: tool_calls must be a list")
    out = []
    for j, call in enumerate(raw):
        at = f"{where}: tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise TypeError(f"{at} must be an object")
        function = call.get("function", call)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{at} needs a function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"{at}: arguments are not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}: arguments must be a JSON object")
        call_id = call.get("id") or f"call_{j}"
        if not isinstance(call_id, str):
            raise TypeError(f"{at}: id must be a str")
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _message(i: int, m: object) -> dict[str, Any]:
    where = f"message {i}"
    if not isinstance(m, Mapping) or "role" not in m:
        raise ValueError(f"{where} must be an object with a role")
    role = m["role"]
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {sorted(ROLES)}, not {role!r}")
    extra = sorted(set(m) - _KEYS[role])
    if extra:
        raise ValueError(f"{where}: unsupported key(s) {extra} for role {role!r}")
    calls = _tool_calls(m["tool_calls"], where) if m.get("tool_calls") else []
    content = m.get("content")
    if content is None and role == "assistant" and "content" in m:
        content = ""  # an assistant message of tool calls alone
    elif "content" not in m:
        raise ValueError(f"{where} must have a content")
    out: dict[str, Any] = {"role": role, "content": text_of(content, where)}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{where}: a tool message needs the tool_call_id it answers")
        out["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def check_history(history: object) -> list[dict[str, Any]]:
    """A conversation as a list of messages, copied into one form: ``{"role", "content"}``
    (roles system, user, assistant, tool; contents str or lists of text parts, joined),
    assistant messages with ``tool_calls`` (content may be None; arguments JSON text or
    objects, kept as objects), tool messages with the ``tool_call_id`` they answer.

    Raises ValueError (TypeError for wrong types) for anything else, an empty list, or
    one whose last message is neither the user's nor a tool's result."""
    if not isinstance(history, list) or not history:
        raise ValueError("the conversation must be a non-empty list of messages")
    out = [_message(i, m) for i, m in enumerate(history)]
    if out[-1]["role"] not in ("user", "tool"):
        raise ValueError("the last message must be the user's (or a tool's result)")
    return out
