"""Tokenizers behind one small interface: byte-level BPE built from GGUF metadata, and an
adapter over mlx-lm's tokenizer for model directories.

Nothing here touches MLX, so tokenizers may be used off the engine thread.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

__all__ = (
    "ByteLevelBPETokenizer",
    "Detokenizer",
    "MlxLmTokenizer",
    "Tokenizer",
    "tiny_byte_tokenizer",
)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Llama 3's pre-tokenizer split (the "llama-bpe" GGUF pre type).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> tuple[str, tuple[tuple[int, int], ...]]:
        """``messages`` rendered with the chat template, and the spans of special-token text
        that came from their contents: ``encode(text, literal=spans)`` gives the special ids
        only where the template put them, so text cannot forge a role or a turn.

        Raises ValueError when the template fails, or changes the contents so that their
        special-token text cannot be found again.
        """
        specials = sorted(self.special_texts, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        if pattern is None or not any(pattern.search(m.get("content", "")) for m in messages):
            return self.apply_chat_template(messages, add_generation_prompt), ()
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
            if "content" in m
            else m
            for m in messages
        ]
        rendered = self.apply_chat_template(marked, add_generation_prompt)
        expected = sum(len(pattern.findall(m.get("content", ""))) for m in messages)
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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template.

        Raises ValueError if the tokenizer has no chat template or the template fails.
        """


class _ByteDetokenizer(Detokenizer):
    """Exact and O(1) per token: tokens map to bytes; UTF-8 is decoded incrementally."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} outside the vocabulary")
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


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


@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _raise(message: str) -> NoReturn:
    raise TemplateError(message)


def _compile_template(source: str) -> Any:
    # Same sandbox and whitespace rules as Hugging Face's chat templates.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ByteLevelBPETokenizer(Tokenizer):
    """GPT-2 style byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``).

    ``pre`` is the GGUF ``tokenizer.ggml.pre`` name selecting the pre-tokenizer split.
    Raises ValueError for an unknown ``pre``, an inconsistent vocabulary, or a merge whose
    parts or result are not tokens.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        *,
        token_types: Sequence[int] | None = None,
        pre: str = "default",
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        n = len(tokens)
        if token_types is None:
            token_types = [TOKEN_NORMAL] * n
        if len(token_types) != n:
            raise ValueError(f"{len(token_types)} token types for {n} tokens")
        eos = frozenset(int(i) for i in eos_token_ids)
        for name, ids in (
            ("bos", [bos_token_id] if bos_token_id is not None else []),
            ("eos", list(eos)),
        ):
            if any(not 0 <= i < n for i in ids):
                raise ValueError(f"{name} token id outside the vocabulary of {n}")

        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)  # a duplicated string keeps its first id
        pairs: list[tuple[str, str]] = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            # Checked here: the Rust BPE builder panics (a BaseException) on a bad merge.
            if not sep or left not in vocab or right not in vocab or left + right not in vocab:
                raise ValueError(f"bad merge {merge!r}")
            pairs.append((left, right))

        split, ignore_merges = _pre_tokenizer(pre)
        rust = _RustTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        rust.pre_tokenizer = split
        rust.decoder = decoders.ByteLevel()  # unused by decode(); completes to_str() output
        special = [
            AddedToken(tok, special=kind == TOKEN_CONTROL, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        ]
        rust.add_special_tokens([t for t in special if t.special])
        rust.add_tokens([t for t in special if not t.special])
        self._rust = rust

        to_byte = {c: b for b, c in _byte_to_char().items()}
        self._bytes: list[bytes] = []
        for tok, kind in zip(tokens, token_types, strict=True):
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or any(c not in to_byte for c in tok):
                self._bytes.append(tok.encode("utf-8"))
            else:
                self._bytes.append(bytes(to_byte[c] for c in tok))
        self._special = frozenset(i for i, k in enumerate(token_types) if k == TOKEN_CONTROL)

        self._bos = bos_token_id
        self._eos = eos
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._template_source = chat_template
        self._template: Any = None
        self._bos_text = tokens[bos_token_id] if bos_token_id is not None else ""
        self._eos_text = tokens[min(eos)] if eos else ""
        canonical = {
            "kind": "byte-level-bpe",
            "pre": pre,
            "tokens": list(tokens),
            "merges": list(merges),
            "token_types": [int(t) for t in token_types],
            "bos": bos_token_id,
            "eos": sorted(eos),
            "add_bos": add_bos,
            "add_eos": add_eos,
            "chat_template": chat_template,
        }
        blob = json.dumps(canonical, ensure_ascii=False, separators=(",", ":"))
        self._digest = hashlib.sha256(blob.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def special_texts(self) -> frozenset[str]:
        return frozenset(self._bytes[i].decode("utf-8") for i in self._special)

    def to_json(self) -> str:
        """The Hugging Face ``tokenizers`` JSON (a ``tokenizer.json``) of the tokenizer that
        :meth:`encode` runs: vocabulary, merges, pre-tokenizer, added tokens, decoder."""
        return str(self._rust.to_str())

    @functools.cached_property
    def _plain(self) -> _RustTokenizer:
        """The same tokenizer with special tokens matched as ordinary text."""
        plain = _RustTokenizer.from_str(self._rust.to_str())
        plain.encode_special_tokens = True
        return plain

    def _encode(self, text: str, *, plain: bool = False, add_special: bool = False) -> list[int]:
        rust = self._plain if plain else self._rust
        ids: list[int] = rust.encode(text, add_special_tokens=False).ids
        if add_special:
            if self._add_bos and self._bos is not None:
                ids.insert(0, self._bos)
            if self._add_eos and self._eos:
                ids.append(min(self._eos))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        table, n = self._bytes, len(self._bytes)
        parts: list[bytes] = []
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} outside the vocabulary of {n}")
            if not (skip_special and i in self._special):
                parts.append(table[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer(self._bytes)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self._template_source is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self._template_source)
        try:
            rendered: str = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return rendered


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The split for a GGUF ``tokenizer.ggml.pre`` name, and BPE's ``ignore_merges``."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2", "olmo"):
        return byte_level, False
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits every digit on its own, then applies the GPT-2 regex.
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level]), False
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex]), True
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


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

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        try:
            rendered = self._wrapper.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError) as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return str(rendered)


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of the tiny test tokenizer: 3 specials (as in SmolLM2:
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), the 256 bytes, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_chars = [_byte_to_char()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + byte_chars + merged
    types = [TOKEN_CONTROL] * len(specials) + [TOKEN_NORMAL] * (len(tokens) - len(specials))
    return tokens, merges, types


def tiny_byte_tokenizer() -> ByteLevelBPETokenizer:
    """The tiny tokenizer used by ``make_tiny_model``: every string encodes, via bytes."""
    tokens, merges, types = tiny_vocab()
    return ByteLevelBPETokenizer(
        tokens,
        merges,
        token_types=types,
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template=TINY_CHAT_TEMPLATE,
    )
