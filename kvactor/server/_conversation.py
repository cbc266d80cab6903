"""A conversation as each API sends it, checked and put in the form ``Agent.stream_chat``
takes (``kvactor.actors.agent``'s conversation): system, user, assistant (with its ``tool_calls``:
``{"id", "type": "function", "function": {"name", "arguments": dict}}``) and tool
messages (``tool_call_id``). Every check raises :class:`ApiError` (a 400 naming the
field: ``messages``, or ``system``).

OpenAI: roles ``system`` / ``developer`` (read as system), ``user``, ``assistant`` (its
content may be null beside its ``tool_calls``; a ``refusal`` is its text), ``tool``;
content a string or a list of text parts; an assistant's ``audio``, ``function_call``
and ``annotations`` (a reply's fields, sent back as it came) only when null.

Anthropic: ``system`` a string or text blocks; user content blocks ``text`` and
``tool_result`` (each a tool message, in order), assistant blocks ``text`` and
``tool_use`` (its calls); ``cache_control`` is taken and ignored (every prefix is cached
anyway)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._errors import ApiError
from ._request import shown

Message = dict[str, Any]

_OPENAI_KEYS = {
    "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "audio"}
    | {"function_call", "annotations"},
    "tool": {"role", "content", "tool_call_id"},
}
_TEXT_KEYS = {
    "openai": {"type", "text"},
    "anthropic": {"type", "text", "cache_control", "citations"},
}
# Fields of a reply's blocks sent back as they came: taken when they say nothing.
_UNSET: tuple[object, ...] = (None, [], {"type": "direct"})


def _bad(message: str, param: str = "messages") -> ApiError:
    return ApiError(400, message, param=param)


def _unknown(m: Mapping[str, Any], known: set[str], where: str, param: str = "messages") -> None:
    extra = sorted(shown(k) for k in set(m) - known)
    if extra:
        raise _bad(f"{where}: unsupported field(s) {extra[:5]}", param)


def _cache_control(block: Mapping[str, Any], where: str, param: str) -> None:
    """Checks ``cache_control`` (an object, or null) and the reply's own fields a block
    may carry back (``citations``, ``caller``, ``toolset_name``: only when unset)."""
    if not isinstance(block.get("cache_control") or {}, dict):
        raise _bad(f"{where}.cache_control must be an object", param)
    for key in ("citations", "caller", "toolset_name"):
        if block.get(key) not in _UNSET:
            raise _bad(f"{where}.{key} is not supported", param)


def _text_part(part: object, where: str, param: str, api: str) -> str:
    """A text part's text (OpenAI ``{"type": "text", "text"}``, Anthropic's text block)."""
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else None
        raise _bad(f"{where}: only text content is supported, not {shown(kind)}", param)
    if not isinstance(part.get("text"), str):
        raise _bad(f"{where}: a text part is {{'type': 'text', 'text': string}}", param)
    _unknown(part, _TEXT_KEYS[api], where, param)
    _cache_control(part, where, param)
    return str(part["text"])


def text_content(content: Any, where: str, param: str, api: str = "openai") -> str:
    """A message content: a string, or a list of text parts (in ``api``'s shape). Raises
    ApiError (naming ``where``; ``param``: its top-level field) for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            _text_part(part, f"{where}[{i}]", param, api) for i, part in enumerate(content)
        )
    raise _bad(f"{where}: content must be a string or a list of text parts", param)


def _arguments(raw: object, where: str) -> dict[str, Any]:
    """A call's arguments: JSON text of an object (OpenAI's), or the object itself."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise _bad(f"{where}: arguments must be JSON text of an object") from None
    if not isinstance(raw, dict):
        raise _bad(f"{where}: arguments must be a JSON object")
    return raw


def _call(call_id: object, name: object, arguments: dict[str, Any], where: str) -> Message:
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}: a tool call needs an id (a string)")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}: a tool call needs a function name (a string)")
    function = {"name": name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def _openai_calls(raw: object, where: str) -> list[Message]:
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise _bad(f"{at} must be a function call {{'id', 'type', 'function'}}")
        _unknown(call, {"id", "type", "function"}, at)
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function must be an object {{'name', 'arguments'}}")
        _unknown(fn, {"name", "arguments"}, f"{at}.function")
        args = _arguments(fn.get("arguments", "{}"), f"{at}.function")
        calls.append(_call(call.get("id"), fn.get("name"), args, at))
    return calls


def _openai_message(i: int, m: object) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or "role" not in m:
        raise _bad(f"{where} must be an object with a role")
    role = "system" if m["role"] == "developer" else m["role"]
    if not isinstance(role, str) or role not in _OPENAI_KEYS:
        raise _bad(f"{where}: role {shown(role)} is not supported")
    _unknown(m, _OPENAI_KEYS[role], where)
    if not isinstance(m.get("name", ""), str):
        raise _bad(f"{where}.name must be a string")
    content = m.get("content")
    if role == "assistant":
        for key in ("audio", "function_call", "annotations"):  # a reply's own fields, unset
            if m.get(key) not in (None, []):
                raise _bad(f"{where}.{key} is not supported")
        refusal = m.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise _bad(f"{where}.refusal must be a string")
        text = "" if content is None else text_content(content, f"{where}.content", "messages")
        out: Message = {"role": role, "content": text or refusal or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = _openai_calls(m["tool_calls"], where)
        return out
    out = {"role": role, "content": text_content(content, f"{where}.content", "messages")}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"{where}: a tool message needs the tool_call_id (a string) it answers")
        out["tool_call_id"] = call_id
    return out


def _last_is_the_users(out: list[Message]) -> None:
    if out[-1]["role"] not in ("user", "tool"):
        raise _bad("messages: the last one must be the user's (or a tool's result)")


def openai_messages(raw: Any) -> list[Message]:
    """OpenAI's ``messages`` as a conversation. Raises ApiError for an empty list, a
    malformed message, an unsupported role or content part, or a last message that is
    neither the user's nor a tool's result."""
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list")
    out = [_openai_message(i, m) for i, m in enumerate(raw)]
    _last_is_the_users(out)
    return out


# -- Anthropic -------------------------------------------------------------------------
def anthropic_system(raw: Any) -> str | None:
    """Anthropic's ``system``: a string or a list of text blocks (None when unset)."""
    if raw is None:
        return None
    return text_content(raw, "system", "system", api="anthropic")


def _tool_result(block: dict[str, Any], where: str) -> Message:
    _unknown(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    _cache_control(block, where, "messages")
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}: a tool_result needs the tool_use_id (a string) it answers")
    content = block.get("content", "")
    text = text_content(content, f"{where}.content", "messages", api="anthropic")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{where}.is_error must be a boolean")
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _tool_use(block: dict[str, Any], where: str) -> Message:
    _unknown(
        block, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}, where
    )
    _cache_control(block, where, "messages")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{where}.input must be an object")
    return _call(block.get("id"), block.get("name"), block["input"], where)


def _blocks(role: str, content: list[Any], where: str) -> list[Message]:
    """A message's content blocks as messages: a user's text runs and tool results (a
    tool message each, in order), an assistant's text and calls (one message)."""
    out: list[Message] = []
    calls: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and role == "user":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append(_tool_result(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        else:
            texts.append(_text_part(block, at, "messages", "anthropic"))
    if role == "assistant":
        message: Message = {"role": "assistant", "content": "".join(texts)}
        return [{**message, "tool_calls": calls} if calls else message]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def anthropic_messages(raw: Any, system: str | None) -> list[Message]:
    """Anthropic's ``messages`` (``system`` first when given) as a conversation. Raises
    ApiError for an empty list, a role other than user / assistant, a malformed or
    unsupported block, or a last message that is the assistant's (a prefill)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list")
    out: list[Message] = [{"role": "system", "content": system}] if system is not None else []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be 'user' or 'assistant'")
        _unknown(m, {"role", "content"}, where)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(m["role"], content, where)
        else:
            raise _bad(f"{where}.content must be a string or a list of content blocks")
    _last_is_the_users(out)
    return out
