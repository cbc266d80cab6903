"""What kvactor needs of a tokenizer (``Tokenizer``, ``Detokenizer``), and the adapter over
mlx-lm's tokenizer for model directories. The byte-level BPE built from GGUF metadata is
``_bpe``'s; chat-template rendering ``_chat_template``'s.

Nothing here touches MLX, so tokenizers may be used off the engine thread.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jinja2 import TemplateError

from ._chat_template import render_literal

__all__ = ("Detokenizer", "MlxLmTokenizer", "Tokenizer")


class Detokenizer(ABC):
    """Turns a stream of token ids into text pieces; ``"".join`` of all pieces plus
    :meth:`flush` equals ``Tokenizer.decode`` of all the ids."""

    @abstractmethod
    def add(self, token_id: int) -> str:
        """Consume one token; return the text it completes (may be ``""``)."""

    @abstractmethod
    def flush(self) -> str:
        """Return whatever text is still held back (e.g. an unfinished UTF-8 sequence)."""


class Tokenizer(ABC):
    """What the engine needs from a tokenizer. Subclasses set ``_eos``, ``_bos`` and
    ``_digest`` in their constructor."""

    _eos: frozenset[int]
    _bos: int | None
    _digest: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation."""
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, if the model has one."""
        return self._bos

    @property
    def digest(self) -> str:
        """sha256 hex identifying vocabulary, merges and chat template (for cache fingerprints)."""
        return self._digest

    @property
    @abstractmethod
    def special_texts(self) -> frozenset[str]:
        """The text of every special (control) token: ``<|im_start|>``, ``</s>`` ..."""

    @abstractmethod
    def _encode(self, text: str, *, plain: bool = False, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``plain`` special-token text is ordinary text."""

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: none); tool-call formats are read from it."""
        return None

    def tokenizers_json(self) -> str | None:
        """The Hugging Face ``tokenizers`` JSON of this tokenizer, if it has one: what a
        grammar engine builds its token table from (None: it decodes each token)."""
        return None

    def encode(
        self,
        text: str,
        *,
        add_special: bool = False,
        literal: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids of ``text``. Special-token text (``<|im_start|>``) becomes its single id,
        except inside the ``literal`` spans (character ranges, sorted, not overlapping: what
        ``render_chat`` says came from message contents), where it is ordinary text.
        ``add_special`` adds the BOS/EOS ids the model asks for, if any (not with spans)."""
        if not literal:
            return self._encode(text, add_special=add_special)
        if add_special:
            raise ValueError("add_special and literal spans cannot be combined")
        ids: list[int] = []
        at = 0
        # Special tokens are always token boundaries, so cutting the text at the spans
        # tokenizes everything outside them exactly as one call would.
        for start, stop in literal:
            if start < at or stop < start:
                raise ValueError(f"literal spans must be sorted and disjoint, got {literal}")
            if at < start:
                ids += self._encode(text[at:start])
            ids += self._encode(text[start:stop], plain=True)
            at = stop
        if at < len(text):
            ids += self._encode(text[at:])
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, tuple[tuple[int, int], ...]]:
        """``messages`` rendered with the chat template, and the spans of special-token text
        that came from their contents: ``encode(text, literal=spans)`` gives the special ids
        only where the template put them, so text cannot forge a role or a turn.

        ``tools``: tool definitions (OpenAI's shape) given to the template as its ``tools``.

        Raises ValueError when the template fails, or changes the contents so that their
        special-token text cannot be found again.
        """

        def apply(marked: list[dict[str, Any]], generation: bool) -> str:
            if tools is None:
                return self.apply_chat_template(marked, generation)
            return self.apply_chat_template(marked, generation, tools=tools)

        return render_literal(apply, self.special_texts, messages, add_generation_prompt)

    @abstractmethod
    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD.

        Raises ValueError for an id outside the vocabulary (byte-level tokenizers).
        """

    @abstractmethod
    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for streaming."""

    @abstractmethod
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template (``tools``: its ``tools``).

        Raises ValueError if the tokenizer has no chat template or the template fails.
        """


class _WindowDetokenizer(Detokenizer):
    """For tokenizers we cannot map to bytes: decode a short window, emit what is stable.

    A piece is held back while the window's text ends in U+FFFD (a split UTF-8 sequence).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids up to here have been emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class MlxLmTokenizer(Tokenizer):
    """Adapter over mlx-lm's ``TokenizerWrapper`` (a Hugging Face tokenizer)."""

    def __init__(self, wrapper: Any, digest: str) -> None:
        self._wrapper = wrapper
        self._hf = getattr(wrapper, "_tokenizer", wrapper)
        self._digest = digest
        self._eos = frozenset(int(i) for i in wrapper.eos_token_ids)
        bos = getattr(self._hf, "bos_token_id", None)
        self._bos = int(bos) if bos is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @functools.cached_property
    def special_texts(self) -> frozenset[str]:
        added = getattr(self._hf, "added_tokens_decoder", {})
        texts = {str(t.content) for t in added.values() if getattr(t, "special", False)}
        return frozenset(texts | set(getattr(self._hf, "all_special_tokens", ())))

    def _encode(self, text: str, *, plain: bool = False, add_special: bool = False) -> list[int]:
        if plain:
            return list(
                self._hf.encode(text, add_special_tokens=add_special, split_special_tokens=True)
            )
        return list(self._hf.encode(text, add_special_tokens=add_special))

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        text: str = self._hf.decode(list(ids), skip_special_tokens=skip_special)
        return text

    def detokenizer(self) -> Detokenizer:
        return _WindowDetokenizer(self.decode)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def tokenizers_json(self) -> str | None:
        backend = getattr(self._hf, "backend_tokenizer", None)
        return None if backend is None else str(backend.to_str())

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        extra = {} if tools is None else {"tools": tools}
        try:
            rendered = self._wrapper.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except (TemplateError, ValueError) as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return str(rendered)
