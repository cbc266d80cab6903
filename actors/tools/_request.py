"""Tools and structured output as callers give them, in one form: tool definitions
(OpenAI's or Anthropic's shapes, plain Python functions with type hints, pydantic
models), ``tool_choice`` (OpenAI's and Anthropic's), ``response_format`` (OpenAI's, a
JSON schema, a pydantic model) and ``parallel_tool_calls``, made into a
:class:`~kvactor.actors.protocol.ToolRequest` (plain data: it crosses to a cluster's
hosts as it is)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..options import Constraint
from ..records import ToolCall, ToolCallDelta, ToolRequest

__all__ = (
    "TOOL_OPTIONS",
    "ToolCall",
    "ToolCallDelta",
    "ToolRequest",
    "response_constraint",
    "tool_definition",
    "tool_options",
    "tool_request",
)

#: The turn options that are about tools (the rest are sampling options).
TOOL_OPTIONS = ("tools", "tool_choice", "response_format", "parallel_tool_calls")


def _pydantic_model(obj: object) -> bool:
    return isinstance(obj, type) and hasattr(obj, "model_json_schema")


def _function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s parameters, from its type hints (pydantic builds it).
    Raises TypeError for ``*args`` / ``**kwargs`` or hints pydantic cannot describe."""
    import pydantic

    fields: dict[str, Any] = {}
    hints = inspect.get_annotations(fn, eval_str=True)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args and **kwargs cannot be described")
        hint = hints.get(name, Any)
        fields[name] = (hint, ... if p.default is p.empty else p.default)
    model = pydantic.create_model(f"{fn.__name__}_arguments", **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    return schema


def tool_definition(tool: object) -> dict[str, Any]:
    """``tool`` as OpenAI's function tool definition ``{"type": "function", "function":
    {"name", "description", "parameters"}}``. Takes that shape, a flat ``{"name",
    "description", "parameters"}`` (Anthropic's ``input_schema`` too), a pydantic model
    class (its name, docstring and schema) or a Python function (its name, docstring and
    type hints). Raises TypeError / ValueError for anything else."""
    if _pydantic_model(tool):
        cls: Any = tool
        name, doc, params = cls.__name__, inspect.getdoc(cls) or "", cls.model_json_schema()
    elif callable(tool) and not isinstance(tool, Mapping):
        fn: Any = tool
        name, doc, params = fn.__name__, inspect.getdoc(fn) or "", _function_schema(fn)
    elif isinstance(tool, Mapping):
        spec = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
        if tool.get("type") not in (None, "function", "custom") and "input_schema" not in tool:
            raise ValueError(f"tool type {tool.get('type')!r} is not supported (only functions)")
        if not isinstance(spec, Mapping):
            raise TypeError("a function tool's 'function' must be an object")
        name = spec.get("name")
        doc = spec.get("description") or ""
        params = spec.get("parameters", spec.get("input_schema", {"type": "object"}))
    else:
        raise TypeError(
            f"a tool must be a definition, a function or a pydantic model, not {tool!r}"
        )
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ValueError(f"a tool needs a name of 1 to 128 characters, got {name!r}")
    if not isinstance(params, Mapping) or not isinstance(doc, str):
        raise ValueError(f"tool {name}: parameters must be a JSON schema object")
    return {
        "type": "function",
        "function": {"name": name, "description": doc, "parameters": dict(params)},
    }


def response_constraint(response_format: object) -> Constraint | None:
    """What ``response_format`` asks the answer to be: None (free text: None or
    ``{"type": "text"}``), any JSON object (``{"type": "json_object"}``), JSON valid
    against a schema (``{"type": "json_schema", "json_schema": {"schema": ...}}``, a JSON
    schema itself, or a pydantic model class), or a :class:`Constraint` as it is. Raises
    TypeError / ValueError for anything else."""
    if response_format is None or isinstance(response_format, Constraint):
        return response_format.check() if response_format is not None else None
    if _pydantic_model(response_format):
        return Constraint.json_schema(response_format.model_json_schema())  # type: ignore[attr-defined]
    if not isinstance(response_format, Mapping):
        raise TypeError(
            "response_format must be a dict, a pydantic model or a Constraint, "
            f"not {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind == "text" and len(response_format) == 1:
        return None
    if kind == "json_object" and len(response_format) == 1:
        return Constraint.json_object()
    if kind == "json_schema" and "json_schema" in response_format:
        inner = response_format["json_schema"]
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if not isinstance(schema, Mapping | bool):
            raise ValueError("response_format.json_schema needs a 'schema' object")
        return Constraint.json_schema(schema if isinstance(schema, bool) else dict(schema))
    return Constraint.json_schema(dict(response_format))  # a JSON schema as it is


def _choice(tool_choice: object, names: Sequence[str]) -> tuple[str, str | None]:
    """``(mode, name)`` of a tool choice in OpenAI's or Anthropic's shape."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        mode = {"any": "required"}.get(tool_choice, tool_choice)
        if mode in ("auto", "none", "required"):
            return mode, None
        if tool_choice in names:  # a bare tool name
            return "function", tool_choice
        raise ValueError(
            f"tool_choice must be 'auto', 'none', 'required' or a tool's name, not {tool_choice!r}"
        )
    if isinstance(tool_choice, Mapping):
        kind = tool_choice.get("type")
        if kind in ("auto", "none", "any") and "name" not in tool_choice:
            return ("required" if kind == "any" else str(kind)), None
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
        if kind in ("function", "tool") and isinstance(name, str):
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return "function", name
    raise ValueError(f"tool_choice {tool_choice!r} is not understood")


def tool_options(request: ToolRequest) -> dict[str, Any]:
    """``request`` as the turn options that make it again (``tool_request(**...)``)."""
    choice: Any = request.choice
    if request.choice == "function":
        choice = {"type": "function", "function": {"name": request.name}}
    return {
        "tools": list(request.tools),
        "tool_choice": choice,
        "response_format": request.response,
        "parallel_tool_calls": request.parallel,
    }


def tool_request(
    tools: object = None,
    tool_choice: object = None,
    response_format: object = None,
    parallel_tool_calls: object = None,
) -> ToolRequest | None:
    """The turn's tool options as one :class:`ToolRequest` (None: a plain turn). Raises
    TypeError / ValueError naming the option that is wrong: tools of another kind, two
    tools of one name, a choice that names no tool, a choice that needs tools when there
    are none, a response format that is not one."""
    if tools is None and tool_choice is None and response_format is None:
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise TypeError("parallel_tool_calls must be a bool")
        return None
    if tools is None:
        tools = []
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise TypeError("tools must be a list")
    if len(tools) > 128:
        raise ValueError("tools takes at most 128 tools")
    definitions = [tool_definition(t) for t in tools]
    names = [d["function"]["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: two tools share a name ({sorted(names)})")
    mode, name = _choice(tool_choice, names)
    if mode in ("required", "function") and not names:
        raise ValueError(f"tool_choice {mode!r} needs tools")
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError("parallel_tool_calls must be a bool")
    try:
        response = response_constraint(response_format)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"response_format: {exc}") from None
    return ToolRequest(definitions, mode, name, parallel_tool_calls, response)
