"""Tools and structured output as each API sends them: ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` (OpenAI), ``tools`` and ``tool_choice``
(Anthropic), checked field by field and made the tool options ``Agent.stream_chat``
takes (:func:`openai_tools`, :func:`anthropic_tools`).

The schemas a turn's grammar will hold (its tools' parameters when a call is required,
its response format's) are compiled here on the request's worker thread with llguidance,
without the tokenizer: an invalid, unsupported or too large schema is a 400 naming its
field before any agent or the engine sees it. What only the engine's compile finds (it
has the tokenizer) is a 400 too (``GRAMMAR_ERRORS``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..actors.options import MAX_GRAMMAR_CHARS
from ..actors.records import ToolRequest
from ..actors.tools import JSON_FORMAT, closed_objects, tool_request
from ._errors import ApiError
from ._request import shown

MAX_TOOLS = 128  # ``tool_request``'s bound
#: What the engine's ValueError for a grammar it could not compile says (a 400 then).
GRAMMAR_ERRORS = ("constraint", "JSON schema", "grammar")

_TIGHT = (",", ":")
_OPENAI_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_ANTHROPIC_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type"}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ToolAsk:
    """A request's tool options (``options``: ``Agent.stream_chat``'s keywords; empty:
    a plain turn), the field a grammar error belongs to (``param``), and the characters
    its tools add to the prompt."""

    options: dict[str, Any] = field(default_factory=dict)
    param: str | None = None
    chars: int = 0


def _name(raw: object, where: str, param: str) -> str:
    if not isinstance(raw, str) or not 1 <= len(raw) <= 128 or not raw.isprintable():
        raise _bad(f"{where}: a tool name is a string of 1 to 128 printable characters", param)
    return raw


def _schema(raw: object, where: str, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be a JSON schema object, got {shown(raw)}", param)
    return raw


def _description(spec: Mapping[str, Any], where: str, param: str) -> str:
    text = spec.get("description")
    if text is not None and not isinstance(text, str):
        raise _bad(f"{where}.description must be a string", param)
    return text or ""


def _definition(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def _openai_tool(i: int, tool: object) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _bad(f"{where}: only function tools are supported, not {shown(kind)}", "tools")
    if set(tool) - {"type", "function"} or not isinstance(tool.get("function"), dict):
        raise _bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    extra = sorted(shown(k) for k in set(fn) - _OPENAI_FUNCTION_KEYS)
    if extra:
        raise _bad(f"{where}.function: unsupported field(s) {extra[:5]}", "tools")
    if not isinstance(fn.get("strict", False), bool | None):
        raise _bad(f"{where}.function.strict must be a boolean", "tools")
    name = _name(fn.get("name"), f"{where}.function", "tools")
    params = _schema(fn.get("parameters", {"type": "object"}), f"{where}.parameters", "tools")
    return _definition(name, _description(fn, f"{where}.function", "tools"), params)


def _anthropic_tool(i: int, tool: object) -> dict[str, Any]:
    where = f"tools.{i}"
    if not isinstance(tool, dict):
        raise _bad(f"{where} must be an object", "tools")
    if tool.get("type", "custom") not in ("custom", None):
        raise _bad(f"{where}: only client tools are supported, not {shown(tool['type'])}", "tools")
    extra = sorted(shown(k) for k in set(tool) - _ANTHROPIC_TOOL_KEYS)
    if extra:
        raise _bad(f"{where}: unsupported field(s) {extra[:5]}", "tools")
    if not isinstance(tool.get("cache_control") or {}, dict):
        raise _bad(f"{where}.cache_control must be an object", "tools")
    name = _name(tool.get("name"), where, "tools")
    params = _schema(tool.get("input_schema"), f"{where}.input_schema", "tools")
    return _definition(name, _description(tool, where, "tools"), params)


def _tool_list(raw: object, api: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools")
    if len(raw) > MAX_TOOLS:
        raise _bad(f"'tools' takes at most {MAX_TOOLS} tools", "tools")
    one = _openai_tool if api == "openai" else _anthropic_tool
    return [one(i, t) for i, t in enumerate(raw)]


def _openai_choice(raw: object) -> object:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) == {"type", "function"}:
        fn = raw["function"]
        if isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str):
            return raw
    raise _bad(
        "'tool_choice' must be 'auto', 'none', 'required' or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, not {shown(raw)}",
        "tool_choice",
    )


def _anthropic_choice(raw: object) -> tuple[object, bool | None]:
    """Anthropic's ``tool_choice`` and, from ``disable_parallel_tool_use``, whether
    several calls may be made (None: unsaid)."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if raw["type"] == "tool" else set())
    if set(raw) - keys or (raw["type"] == "tool" and not isinstance(raw.get("name"), str)):
        raise _bad(
            "tool_choice is {'type', 'name' (for 'tool'), 'disable_parallel_tool_use'}",
            "tool_choice",
        )
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _bad("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    choice = {k: v for k, v in raw.items() if k != "disable_parallel_tool_use"}
    return choice, None if disable is None else not disable


def _response_format(raw: object) -> object:
    """OpenAI's ``response_format`` checked (a json_schema without a schema: any JSON
    object, as OpenAI reads it)."""
    param = "response_format"
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format.type must be 'text', 'json_object' or 'json_schema'", param)
    if raw["type"] != "json_schema":
        if set(raw) != {"type"}:
            raise _bad(f"response_format {{'type': {raw['type']!r}}} takes no other field", param)
        return raw
    inner = raw.get("json_schema")
    if set(raw) != {"type", "json_schema"} or not isinstance(inner, dict):
        raise _bad("response_format json_schema needs 'json_schema': {'name', 'schema'}", param)
    if set(inner) - {"name", "description", "schema", "strict"}:
        extra = sorted(shown(k) for k in set(inner) - {"name", "description", "schema", "strict"})
        raise _bad(f"response_format.json_schema: unsupported field(s) {extra[:5]}", param)
    if not isinstance(inner.get("name", ""), str) or not isinstance(
        inner.get("description", ""), str
    ):
        raise _bad("response_format.json_schema name and description must be strings", param)
    if not isinstance(inner.get("strict", False), bool | None):
        raise _bad("response_format.json_schema.strict must be a boolean", param)
    if "schema" not in inner:
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"schema": _schema(inner["schema"], param, param)},
    }


def _compile_check(schema: object, where: str, param: str) -> None:
    """Compile ``schema`` as the engine will (closed objects, its JSON spelling), without
    the tokenizer. Raises ApiError naming ``param`` when llguidance refuses it."""
    import llguidance

    try:
        text = json.dumps(closed_objects(schema))
    except (RecursionError, ValueError) as exc:
        raise _bad(f"{where}: the schema cannot be used: {exc}", param) from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _bad(f"{where}: the schema has more than {MAX_GRAMMAR_CHARS} characters", param)
    defaults: Any = JSON_FORMAT
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        failed, messages = True, [str(exc)]
    if failed:
        error = messages[0] if messages else "refused"
        raise _bad(f"{where}: the schema is not one the grammar engine takes: {error[:300]}", param)


def _grammar_tools(request: ToolRequest) -> list[tuple[int, dict[str, Any]]]:
    """The tools (with their places) whose schemas the turn's grammar holds: all of them
    (or the named one) when a call is required, all when calls or a JSON answer may come."""
    forced = request.choice in ("required", "function")
    if not forced and (request.response is None or request.choice == "none"):
        return []
    return [
        (i, t)
        for i, t in enumerate(request.tools)
        if request.choice != "function" or t["function"]["name"] == request.name
    ]


def _ask(options: dict[str, Any], api: str) -> ToolAsk:
    """The checked options made one request (its errors a 400 naming the field), its
    constrained schemas compiled."""
    try:
        request = tool_request(**options)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        named = next((k for k in options if text.startswith(k)), None) or "tools"
        raise _bad(text, "tool_choice" if "tool_choice" in text else named) from None
    if request is None:
        return ToolAsk()
    grammar_tools = _grammar_tools(request)
    total = sum(len(json.dumps(t["function"]["parameters"])) for _, t in grammar_tools)
    if total > MAX_GRAMMAR_CHARS:
        raise _bad(f"the tools' schemas have more than {MAX_GRAMMAR_CHARS} characters", "tools")
    for i, tool in grammar_tools:
        where = f"tools.{i}" if api == "anthropic" else f"tools[{i}]"
        _compile_check(tool["function"]["parameters"], where, "tools")
    if request.response is not None and request.response.kind == "json_schema":
        _compile_check(json.loads(request.response.source), "response_format", "response_format")
    param: str | None = None  # where an error of the turn's grammar comes from
    if grammar_tools:
        param = "tools"
    elif request.response is not None:
        param = "response_format"
    chars = sum(
        len(t["function"]["name"]) + len(json.dumps(t["function"]["parameters"], separators=_TIGHT))
        for t in request.tools
    )
    return ToolAsk({k: v for k, v in options.items() if v is not None}, param, chars)


def openai_tools(body: Mapping[str, Any]) -> ToolAsk:
    """A chat body's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``response_format``. Raises ApiError naming the field at fault."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools = body.get("tools")
    options = {
        "tools": None if tools is None else _tool_list(tools, "openai"),
        "tool_choice": _openai_choice(body.get("tool_choice")),
        "response_format": _response_format(body.get("response_format")),
        "parallel_tool_calls": parallel,
    }
    if options["response_format"] == {"type": "text"}:
        options["response_format"] = None
    return _ask(options, "openai")


def anthropic_tools(body: Mapping[str, Any]) -> ToolAsk:
    """A messages body's ``tools`` and ``tool_choice`` (its
    ``disable_parallel_tool_use``: ``parallel_tool_calls``). Raises ApiError naming the
    field at fault."""
    tools = body.get("tools")
    choice, parallel = _anthropic_choice(body.get("tool_choice"))
    options = {
        "tools": None if tools is None else _tool_list(tools, "anthropic"),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    return _ask(options, "anthropic")
