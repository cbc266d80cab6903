"""Chat templates: compiling one (Jinja, sandboxed, as Hugging Face's are), and rendering
messages so that special-token text inside their contents stays literal text.

Nothing here touches MLX or a tokenizer's vocabulary.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ("compile_template", "render_literal")


def _raise(message: str) -> NoReturn:
    raise TemplateError(message)


def compile_template(source: str) -> Any:
    """A compiled Jinja chat template, with the sandbox, whitespace rules and helpers of
    Hugging Face's chat templates. Raises jinja2.TemplateError for a bad source."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def render_literal(
    apply: Callable[[list[dict[str, Any]], bool], str],
    special_texts: Iterable[str],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``messages`` rendered by ``apply`` (a chat template), and the spans of the special
    texts that came from their (str) contents (see ``Tokenizer.render_chat``).

    Raises ValueError when ``apply`` does, or when the template changes the contents so
    that their special-token text cannot be found again.
    """
    specials = sorted(special_texts, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    if pattern is None or not any(pattern.search(_content(m)) for m in messages):
        return apply(messages, add_generation_prompt), ()
    # Render with each special text in a content replaced by a marker no text contains,
    # then put the special texts back where the markers landed.
    nonce = secrets.token_hex(8)
    index = {text: i for i, text in enumerate(specials)}
    marked = [
        {
            **m,
            "content": pattern.sub(
                lambda found: f"\ue000{nonce}:{index[found.group()]}\ue001", m["content"]
            ),
        }
        if isinstance(m.get("content"), str)
        else m
        for m in messages
    ]
    rendered = apply(marked, add_generation_prompt)
    expected = sum(len(pattern.findall(_content(m))) for m in messages)
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0
    at = 0
    for found in re.finditer(f"\ue000{nonce}:([0-9]+)\ue001", rendered):
        out.append(rendered[at : found.start()])
        length += found.start() - at
        text = specials[int(found.group(1))]
        out.append(text)
        spans.append((length, length + len(text)))
        length += len(text)
        at = found.end()
    out.append(rendered[at:])
    if len(spans) != expected:
        raise ValueError(
            "the chat template changes message contents: special-token text in them "
            "cannot be kept literal"
        )
    return "".join(out), tuple(spans)
