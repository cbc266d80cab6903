"""Reading tool calls out of generated text as it streams: :class:`ToolStream` splits a
turn's text pieces into content (what ``Completion.text`` holds: no tool-call markup)
and :class:`~kvactor.actors.protocol.ToolCallDelta` pieces, and collects the calls."""

from __future__ import annotations

import json
import logging
from typing import Any

from ..records import ToolCall, ToolCallDelta
from ._formats import ToolFormat

__all__ = ("Event", "ToolStream", "parse_tool_calls")

log = logging.getLogger("kvactor.tools")

Event = str | ToolCallDelta
_PYTHON_TAG = "<|python_tag|>"
_ARGS = "[ARGS]"


class _Call:
    """The JSON object being read: its text, where its values start and end, and what
    of its arguments' text was sent."""

    def __init__(self, args_only: bool, name: str | None) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = -1
        self.last_string: str | None = None
        self.key: str | None = None  # the key whose value is being read (depth 1)
        self.value_start = -1
        self.name = name
        self.args_only = args_only  # the object is the arguments (mistral-args)
        self.args_start = 0 if args_only else -1
        self.args_end = -1
        self.sent = 0  # the index in text up to which arguments were sent
        self.id: str | None = None  # set when its first delta was sent

    @property
    def announced(self) -> bool:
        return self.id is not None


class ToolStream:
    """Splits one turn's text into content and tool calls, in ``fmt``. ``feed`` takes a
    piece and returns what can be sent now (content text and call deltas, in order);
    ``close`` the rest. ``calls``: the complete calls read so far; ``content``: the text
    outside them."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.content = ""
        self._held = ""
        self.cut_off = False  # the turn ended inside a call (its deltas were sent; dropped)
        self._region = False
        self._plain = False  # llama3: the message is not a call, all of it is content
        self._call: _Call | None = None
        self._index = 0  # the index of the call being read
        self._between = ""  # text outside calls in the region (mistral-args: the name)
        self._args_keys = (fmt.args_key, "arguments", "parameters")

    # -- content ------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._region:
            self._scan(text, out)
            return _merged(out)
        buffer = self._held + text
        if self.fmt.start == "":
            return _merged(self._feed_bare(buffer, out))
        at = buffer.find(self.fmt.start)
        if at >= 0:
            self._say(buffer[:at], out)
            self._held = ""
            self._region = True
            self._scan(buffer[at + len(self.fmt.start) :], out)
            return _merged(out)
        hold = _partial_suffix(buffer, self.fmt.start)
        self._say(buffer[: len(buffer) - hold], out)
        self._held = buffer[len(buffer) - hold :]
        return _merged(out)

    def _feed_bare(self, buffer: str, out: list[Event]) -> list[Event]:
        """llama3: the message is a call when it begins ``{"name"`` (or the python tag)."""
        if self._plain:
            self._say(buffer, out)
            return out
        head = buffer.lstrip()
        if head.startswith(_PYTHON_TAG):
            self._region, self._held = True, ""
            self._scan(head[len(_PYTHON_TAG) :], out)
            return out
        rest = head[1:].lstrip() if head.startswith("{") else None
        if rest is not None and rest.startswith('"name"'):
            self._region, self._held = True, ""
            self._scan(head, out)
            return out
        if (
            not head
            or _PYTHON_TAG.startswith(head)
            or (rest is not None and '"name"'.startswith(rest))
        ):
            self._held = buffer
            return out
        self._plain, self._held = True, ""
        self._say(buffer, out)
        return out

    def _say(self, text: str, out: list[Event]) -> None:
        if text:
            self.content += text
            out.append(text)

    def close(self) -> list[Event]:
        """What is left once the turn ended: held content (a marker never completed), a
        call cut off (dropped: its deltas were sent, it is not among ``calls``)."""
        out: list[Event] = []
        if not self._region:
            self._say(self._held, out)
            self._held = ""
        elif self._call is not None:
            log.debug("a tool call was cut off: %r", self._call.text[:200])
            self._call = None
            self.cut_off = True
        return _merged(out)

    # -- the calls ----------------------------------------------------------------------
    def _scan(self, text: str, out: list[Event]) -> None:
        for ch in text:
            call = self._call
            if call is None:
                if ch == "{" and (self.fmt.name != "mistral-args" or _ARGS in self._between):
                    self._start(out)
                    call = self._call
                    assert call is not None
                else:
                    self._between += ch
                    continue
            self._step(call, ch, out)

    def _start(self, out: list[Event]) -> None:
        name = None
        if self.fmt.name == "mistral-args":
            head = self._between.split(_ARGS)[0].replace(self.fmt.start, "")
            name = head.split("[CALL_ID]")[0].strip()
        self._between = ""
        self._call = _Call(self.fmt.name == "mistral-args", name)
        if name is not None:
            self._announce(self._call, out)

    def _step(self, call: _Call, ch: str, out: list[Event]) -> None:
        call.text += ch
        at = len(call.text) - 1
        if call.in_string:
            if call.escaped:
                call.escaped = False
            elif ch == "\\":
                call.escaped = True
            elif ch == '"':
                call.in_string = False
                if call.depth == 1:
                    call.last_string = _loads(call.text[call.string_start :])
        elif ch == '"':
            call.in_string = True
            call.string_start = at
        elif ch in "{[":
            call.depth += 1
        elif ch in "}]":
            call.depth -= 1
            if call.depth == 0:
                self._value_end(call, at, out)
                if call.args_only:
                    call.args_end = at + 1
                self._send_args(call, len(call.text), out)
                self._finish(call, out)
                return
        elif ch == ":" and call.depth == 1:
            call.key, call.value_start = call.last_string, at + 1
            if call.key in self._args_keys and not call.args_only:
                call.args_start = at + 1
        elif ch == "," and call.depth == 1:
            self._value_end(call, at, out)
        self._send_args(call, at + 1, out)

    def _value_end(self, call: _Call, at: int, out: list[Event]) -> None:
        """A value at depth 1 ended just before ``at``."""
        if call.value_start < 0:
            return
        if call.key == "name" and call.name is None:
            name = _loads(call.text[call.value_start : at].strip())
            if isinstance(name, str):
                call.name = name
                self._announce(call, out)
        if call.key in self._args_keys and call.args_start == call.value_start:
            call.args_end = at
        call.key, call.value_start = None, -1

    def _announce(self, call: _Call, out: list[Event]) -> None:
        call.id = self.fmt.new_id()
        out.append(ToolCallDelta(self._index, id=call.id, name=call.name))

    def _send_args(self, call: _Call, upto: int, out: list[Event]) -> None:
        """Send the arguments' text read up to ``upto`` (once the call is announced)."""
        if not call.announced or call.args_start < 0:
            return
        stop = upto if call.args_end < 0 else min(upto, call.args_end)
        start = max(call.sent, call.args_start)
        if call.sent <= call.args_start:  # not begun: skip the spaces after the colon
            while start < stop and call.text[start].isspace():
                start += 1
        if stop > start:
            out.append(ToolCallDelta(self._index, arguments=call.text[start:stop]))
            call.sent = stop
        else:
            call.sent = max(call.sent, start)

    def _finish(self, call: _Call, out: list[Event]) -> None:
        self._call = None
        parsed = _loads(call.text)
        if call.args_only:
            name, arguments = call.name, parsed
        elif isinstance(parsed, dict):
            name = parsed.get("name")
            arguments = next((parsed[k] for k in self._args_keys if k in parsed), {})
        else:
            name, arguments = None, None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            log.debug("not a tool call: %r", call.text[:200])
            if call.announced:
                self._index += 1
            return
        if call.id is None:  # its name came after its arguments: all of it now
            call.name = name
            self._announce(call, out)
            out.append(ToolCallDelta(self._index, arguments=json.dumps(arguments)))
        assert call.id is not None
        self.calls.append(ToolCall(call.id, name, arguments))
        self._index += 1


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content pieces joined, adjacent argument pieces of one call joined."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, str) and isinstance(last, str):
            out[-1] = last + e
        elif (
            isinstance(e, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and e.index == last.index
            and e.id is None
        ):
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + e.arguments)
        else:
            out.append(e)
    return out


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a whole generated ``text`` in ``fmt``."""
    stream = ToolStream(fmt)
    stream.feed(text)
    stream.close()
    return stream.content, stream.calls
