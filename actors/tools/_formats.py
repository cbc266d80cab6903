"""A model's own tool-call format, read from its chat template and tokenizer: how tools
and tool messages are rendered into its prompt, and the grammar that makes it call them
(``tool_choice`` required or named, a JSON ``response_format``).

- ``hermes`` (Qwen 2.5 / 3, Hermes, SmolLM3 ...): ``<tool_call>\\n{"name": ..,
  "arguments": {..}}\\n</tool_call>`` blocks, one a line.
- ``llama3`` (Llama 3.1 - 3.3): the whole message is ``{"name": .., "parameters": {..}}``
  (after an optional ``<|python_tag|>``).
- ``mistral``: ``[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]``; ``mistral-args``
  (newer Mistral templates): ``[TOOL_CALLS]name[ARGS]{..}`` per call.
- ``generic``: a template that knows no tools (the default model's). The tools are
  described in the system message (:data:`GENERIC_TOOL_PROMPT`), the model answers with
  ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks, and its calls and the
  results (``<tool_response>`` blocks in a user message) are rendered as text in the
  conversation, so a tool loop's next prompt spells what the model generated.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ..models import Tokenizer
from ..options import Constraint
from ..records import ToolRequest
from ._grammar import JSON_FORMAT, closed_objects

__all__ = (
    "GENERIC_TOOL_PROMPT",
    "MAX_PARALLEL_CALLS",
    "ToolFormat",
    "detect_format",
    "render_with_tools",
)

#: The most calls a constrained turn makes (the grammar ends there: a turn always ends).
MAX_PARALLEL_CALLS = 8
_MORE = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"

#: Appended to the system message (a new one if there is none) for a model whose chat
#: template knows no tools; ``{tools}`` is one JSON tool definition a line.
GENERIC_TOOL_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. "
    "The functions, as JSON signatures:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a <tool_call></tool_call> block holding a JSON "
    "object with its name and arguments, one block a call:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<arguments>}}}}</tool_call>\n'
    "The results come back in <tool_response></tool_response> blocks."
)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    """How one model calls tools. ``native``: its template renders tools and tool
    messages itself; ``start``: the text where its calls begin (``""``: the message is
    the call); ``args_key``: the name of the arguments' key; ``marker``: the special token
    that starts its calls, if one does."""

    name: str
    native: bool
    start: str
    args_key: str = "arguments"
    marker: int | None = None

    def new_id(self) -> str:
        """A fresh tool call id (Mistral's templates want 9 letters and digits)."""
        if self.name.startswith("mistral"):
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    # -- the grammar ------------------------------------------------------------------
    def _body(self, tool: dict[str, Any]) -> str:
        fn = tool["function"]
        params = closed_objects(fn.get("parameters") or {"type": "object"})
        if self.name == "mistral-args":
            args = _dumps({**params, "x-guidance": JSON_FORMAT})
            return f'{_dumps(fn["name"])} "[ARGS]" %json {args}'
        schema = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, self.args_key: params},
            "required": ["name", self.args_key],
            "additionalProperties": False,
            "x-guidance": JSON_FORMAT,
        }
        return f"%json {_dumps(schema)}"

    def _calls(self, tools: list[dict[str, Any]], parallel: bool) -> list[str]:
        """Lark rules ``calls`` (one call, or with ``parallel`` several) of ``tools``."""
        rules = [f"body_{i}: {self._body(t)}" for i, t in enumerate(tools)]
        rules.append("body: " + " | ".join(f"body_{i}" for i in range(len(tools))))
        marker = f"<[{self.marker}]>" if self.marker is not None else _dumps(self.start)
        many = parallel and self.name != "llama3"
        if self.name == "hermes":
            rules.append('call: "<tool_call>\\n" body "\\n</tool_call>"')
            rules.append(f'calls: call ("\\n" call){_MORE}' if many else "calls: call")
        elif self.name == "generic":
            rules.append('call: "<tool_call>" body "</tool_call>"')
            rules.append(f'calls: call ("\\n" call){_MORE}' if many else "calls: call")
        elif self.name == "mistral":
            rules.append(
                f'calls: {marker} " [" body ("," " " body){_MORE} "]"'
                if many
                else f'calls: {marker} " [" body "]"'
            )
        elif self.name == "mistral-args":
            one = f"{marker} body"
            rules.append(f"calls: {one} ({one}){_MORE}" if many else f"calls: {one}")
        else:  # llama3: the message is the call
            rules.append("calls: body")
        return rules

    def constraint(self, request: ToolRequest) -> Constraint | None:
        """The grammar a turn of ``request`` follows: its calls when they are required
        (any tool, or the named one), else calls or the response format's JSON when it has
        one, else the response format alone; None: free text."""
        response = request.response
        tools = request.tools
        if request.choice == "function":
            tools = [t for t in tools if t["function"]["name"] == request.name]
        if request.choice in ("required", "function"):
            parallel = request.parallel and request.choice == "required"
            return Constraint("lark", "\n".join(["start: calls", *self._calls(tools, parallel)]))
        if response is None:
            return None
        if request.choice == "none" or not tools or response.kind != "json_schema":
            return response
        schema = json.loads(response.source)
        if not isinstance(schema, dict):
            return response
        answer = _dumps({**closed_objects(schema), "x-guidance": JSON_FORMAT})
        rules = ["start: calls | answer", f"answer: %json {answer}"]
        return Constraint("lark", "\n".join([*rules, *self._calls(tools, request.parallel)]))

    # -- the prompt ---------------------------------------------------------------------
    def generic_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """``messages`` as a template without tools renders them: the tool prompt in the
        system message, calls as text in their assistant message, results as
        ``<tool_response>`` blocks in a user message (consecutive ones in one)."""
        out: list[dict[str, Any]] = []
        if tools:
            prompt = GENERIC_TOOL_PROMPT.format(tools="\n".join(_dumps(t) for t in tools))
            if messages and messages[0]["role"] == "system":
                head = messages[0]["content"]
                out.append({"role": "system", "content": f"{head}\n\n{prompt}" if head else prompt})
                messages = messages[1:]
            else:
                out.append({"role": "system", "content": prompt})
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(
                    "<tool_call>"
                    + _dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    )
                    + "</tool_call>"
                    for c in m["tool_calls"]
                )
                text = f"{m['content']}\n{calls}" if m["content"] else calls
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                block = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
                else:
                    out.append({"role": "user", "content": block, "tool_results": True})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def detect_format(tokenizer: Tokenizer) -> ToolFormat:
    """The tool-call format of ``tokenizer``'s chat template (``generic`` when it knows no
    tools or none of the formats here)."""
    template = tokenizer.chat_template or ""
    specials = tokenizer.special_texts
    if "tools" in template:
        if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in specials:
            ids = tokenizer.encode("[TOOL_CALLS]")
            marker = ids[0] if len(ids) == 1 and "[TOOL_CALLS]" in specials else None
            name = "mistral-args" if "[ARGS]" in template else "mistral"
            return ToolFormat(name, True, "[TOOL_CALLS]", marker=marker)
        if "<tool_call>" in template:
            return ToolFormat("hermes", True, "<tool_call>")
        if "<|python_tag|>" in template or '"parameters": ' in template:
            return ToolFormat("llama3", True, "", args_key="parameters")
    return ToolFormat("generic", False, "<tool_call>")


def render_with_tools(
    tokenizer: Tokenizer,
    fmt: ToolFormat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The prompt of ``messages`` with ``tools`` offered, in ``fmt``, and its literal spans
    (``Tokenizer.render_chat``). Raises ValueError when the template fails."""
    if fmt.native:
        return tokenizer.render_chat(messages, add_generation_prompt, tools=tools or None)
    return tokenizer.render_chat(fmt.generic_messages(messages, tools), add_generation_prompt)
