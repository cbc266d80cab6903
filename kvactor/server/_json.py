"""Reading a request body's JSON with limits: at most ``max_depth`` levels of nesting and
``max_values`` values, refused as soon as the reader gets there (with the field where it
happened), never with a RecursionError.

The reader is iterative Python around the standard library's C string scanner, so that
on a worker thread it lets go of the GIL every few milliseconds: ``json.loads`` holds it
for the whole body (a quarter of a second for 16 MB of small values), and the event loop
would stand still meanwhile. Strings, however long, are read by the C scanner at once.
"""

from __future__ import annotations

import re
from json.decoder import scanstring  # type: ignore[attr-defined]  # the C scanner
from typing import Any

__all__ = ("JSONLimit", "loads")

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_WORDS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}


class JSONLimit(ValueError):
    """A body nested too deep or holding too many values; ``field`` is the top-level
    field where it happened ("" for the body itself)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _path(stack: list[list[Any]]) -> list[str]:
    """Where the value being read is: keys of objects, indices of arrays, from the top."""
    return [str(k) if isinstance(c, dict) else str(len(c)) for c, k in stack]


def _limit(message: str, stack: list[list[Any]]) -> JSONLimit:
    path = _path(stack)
    where = ".".join(path[:4]) + (".…" if len(path) > 4 else "")
    field = path[0] if path and isinstance(stack[0][0], dict) else ""
    return JSONLimit(f"{where or 'the body'}: {message}", field)


def _fail(text: str, pos: int, what: str) -> ValueError:
    return ValueError(f"{what} at character {pos}")


def _key(text: str, pos: int) -> tuple[str, int]:
    """An object's key and the position of its value (after the colon)."""
    if text[pos : pos + 1] != '"':
        raise _fail(text, pos, "expecting a property name in double quotes")
    key, pos = scanstring(text, pos + 1, True)
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    if text[pos : pos + 1] != ":":
        raise _fail(text, pos, "expecting ':'")
    return key, _WS.match(text, pos + 1).end()  # type: ignore[union-attr]


def _scalar(text: str, pos: int) -> tuple[Any, int]:
    """The string, number, true, false or null at ``pos``, and the position after it."""
    c = text[pos : pos + 1]
    if c == '"':
        return scanstring(text, pos + 1, True)
    word = _WORDS.get(c)
    if word is not None and text.startswith(word[0], pos):
        return word[1], pos + len(word[0])
    number = _NUMBER.match(text, pos)
    if number is None or not number.group():
        raise _fail(text, pos, "expecting a value")
    if number.group(1) or number.group(2):
        return float(number.group()), number.end()
    return int(number.group()), number.end()


def loads(text: str, *, max_depth: int = 32, max_values: int = 200_000) -> Any:
    """The JSON value ``text`` spells. Raises JSONLimit past ``max_depth`` or
    ``max_values``, ValueError for anything that is not JSON (RFC 8259: no NaN, no
    trailing commas, no second value; numbers past Python's digit limit)."""
    stack: list[list[Any]] = []  # [container, key (objects)] from the outside in
    values = 0
    pos = _WS.match(text, 0).end()  # type: ignore[union-attr]
    while True:
        values += 1
        if values > max_values:
            raise _limit(f"the body holds more than {max_values} JSON values", stack)
        c = text[pos : pos + 1]
        value: Any
        if c in ("{", "["):
            if len(stack) >= max_depth:
                raise _limit(f"nested deeper than {max_depth} levels", stack)
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
            if c == "{" and text[pos : pos + 1] != "}":
                key, pos = _key(text, pos)
                stack.append([{}, key])
                continue
            if c == "[" and text[pos : pos + 1] != "]":
                stack.append([[], None])
                continue
            value, pos = ({} if c == "{" else []), pos + 1
        else:
            value, pos = _scalar(text, pos)
        # Put the value where it belongs; close what it ends; go on to the next one.
        while True:
            pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
            if not stack:
                if pos != len(text):
                    raise _fail(text, pos, "extra data after the value")
                return value
            frame = stack[-1]
            container = frame[0]
            if isinstance(container, dict):
                container[frame[1]] = value
            else:
                container.append(value)
            c = text[pos : pos + 1]
            if c == ",":
                pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
                if isinstance(container, dict):
                    frame[1], pos = _key(text, pos)
                break
            if c != ("}" if isinstance(container, dict) else "]"):
                raise _fail(text, pos, "expecting ',' or the end of the object or array")
            stack.pop()
            value, pos = container, pos + 1
