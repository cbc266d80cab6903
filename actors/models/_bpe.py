"""GPT-2 style byte-level BPE built from GGUF metadata (on Hugging Face's ``tokenizers``),
and the tiny tokenizer of the tiny test models.

Nothing here touches MLX, so tokenizers may be used off the engine thread.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from jinja2 import TemplateError
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from ._chat_template import compile_template
from ._tokenizer import Detokenizer, Tokenizer

__all__ = (
    "TINY_CHAT_TEMPLATE",
    "ByteLevelBPETokenizer",
    "tiny_byte_tokenizer",
    "tiny_vocab",
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

    @property
    def chat_template(self) -> str | None:
        return self._template_source

    def tokenizers_json(self) -> str | None:
        return self.to_json()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template_source is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_template(self._template_source)
        try:
            rendered: str = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
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
