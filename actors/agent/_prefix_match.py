"""Prefix matching: the tokens of a new prompt that reuse as much of an agent's cache as
is safe (EXACT / EXTEND / DIVERGE at a verified token boundary), and where a system prompt
ends in a prompt's tokens. Nothing here touches MLX."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..enums import Match
from ..models import Tokenizer

__all__ = ("match_prefix", "system_cut")


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts share thousands of characters.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_prefix(
    tokenizer: Tokenizer,
    tokens: list[int],
    text: str,
    new_text: str,
    literal: Sequence[tuple[int, int]] = (),
) -> tuple[list[int], Match]:
    """The tokens for ``new_text`` that reuse as much of ``tokens`` (which spell ``text``) as
    is safe, and the kind of match. ``literal``: spans of ``new_text`` whose special-token
    text is ordinary text (see ``Tokenizer.render_chat``)."""
    if not tokens:
        return tokenizer.encode(new_text, literal=literal), Match.NEW
    common = _common_chars(text, new_text)
    if common == len(text) == len(new_text):
        return list(tokens), Match.EXACT
    kind = Match.EXTEND if common == len(text) else Match.DIVERGE
    keep = len(tokens) if kind is Match.EXTEND else _tokens_within(tokenizer, tokens, common)
    while keep > 0:
        prefix = tokenizer.decode(tokens[:keep])
        if "\ufffd" in prefix[-1:] or not new_text.startswith(prefix):
            keep -= 1  # ends inside a character, or past the shared text
            continue
        suffix = new_text[len(prefix) :]
        if not suffix:
            return list(tokens[:keep]), kind
        last = tokenizer.decode(tokens[keep - 1 : keep])
        within = _shift(literal, len(prefix) - len(last))
        if _splits_after(tokenizer, last, suffix, within):
            return list(tokens[:keep]) + tokenizer.encode(
                suffix, literal=_shift(literal, len(prefix))
            ), kind
        keep -= 1  # the suffix would merge into the last cached token: step back
    return tokenizer.encode(new_text, literal=literal), Match.DIVERGE


def _shift(spans: Sequence[tuple[int, int]], offset: int) -> list[tuple[int, int]]:
    """``spans`` of a text as spans of ``text[offset:]`` (cut at its start)."""
    return [(max(a - offset, 0), b - offset) for a, b in spans if b > offset]


def _splits_after(
    tokenizer: Tokenizer, head: str, suffix: str, literal: Sequence[tuple[int, int]] = ()
) -> bool:
    """Whether tokenizing ``head + suffix`` puts a token boundary right after ``head``: then
    the suffix does not merge into the last cached token, and tokenizing it on its own is
    what a fresh tokenization would do there. ``literal``: spans of ``head + suffix``."""
    text = head + suffix[:64]
    spans = [(a, min(b, len(text))) for a, b in literal if a < len(text)]
    ids = tokenizer.encode(text, literal=spans)
    detok = tokenizer.detokenizer()
    length = 0
    for token in ids:
        length += len(detok.add(token))
        if length >= len(head):
            return length == len(head)
    return False


def _tokens_within(tokenizer: Tokenizer, tokens: list[int], chars: int) -> int:
    """The largest k such that the text of tokens[:k] has at most ``chars`` characters."""
    detok = tokenizer.detokenizer()
    length = 0
    for k, token in enumerate(tokens):
        length += len(detok.add(token))
        if length > chars:
            return k
    return len(tokens)


def system_cut(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tokens: list[int],
    cached: str = "",
) -> tuple[int, ...]:
    """Where the leading system message(s) of ``messages`` end in ``tokens`` (their rendered
    prompt), as ``Generate.cuts``: ``()`` when nothing follows them, when ``cached`` (the
    text the agent's cache holds) holds them already, or when their tokens are not a
    prefix of ``tokens``. A system prompt so stored on its own is shared by every agent
    that starts with it, and computed alike by those that share it and those that do not."""
    k = 0
    while k < len(messages) and messages[k].get("role") == "system":
        k += 1
    if k == 0 or k == len(messages):
        return ()
    head, literal = tokenizer.render_chat(messages[:k], add_generation_prompt=False)
    if cached.startswith(head):
        return ()
    ids = tokenizer.encode(head, literal=literal)
    return (len(ids),) if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids else ()
