"""Grammar-constrained decoding with llguidance: a :class:`~kvactor.actors.options.Constraint`
compiled once per turn (:class:`GrammarCompiler`, at admission), and the turn's
:class:`RowGrammar`: the matcher that follows its tokens and the token mask of its next
step, computed on the host while the step's forward pass runs.

llguidance (a Rust core, no Python dependencies) was measured on this CPU with the default
model's 49,152-token vocabulary before it was picked: docs/tools.md has the numbers.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..models import Tokenizer
from ..options import Constraint

if TYPE_CHECKING:
    import llguidance

__all__ = ("JSON_FORMAT", "GrammarCompiler", "RowGrammar", "closed_objects", "mask_words")

#: How constrained JSON is spelled: no free whitespace, and the separators of Python's
#: ``json.dumps`` (which chat templates' ``tojson`` uses), so that a tool call the model
#: generated renders back the same way in the next turn's prompt (its cache EXTENDs).
JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


class RowGrammar:
    """One turn's grammar state: consumes its tokens, gives the mask of the next one.

    Invariant: ``mask`` is the mask of the state after the tokens consumed so far
    (computed lazily: ``fill``)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self.mask = np.zeros(words, dtype=np.int32)
        self._fresh = False
        self.mask_s = 0.0  # seconds spent computing masks and consuming tokens
        self.masks = 0  # masks computed

    def fill(self, out: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        """Write the next token's mask into ``out`` (a C-contiguous int32 row)."""
        if not self._fresh:
            started = time.perf_counter()
            mask = self.mask
            self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            self._fresh = True
            self.mask_s += time.perf_counter() - started
            self.masks += 1
        out[:] = self.mask

    def consume(self, token: int) -> bool:
        """Follow a sampled token; False when the grammar refuses it (then it is in error)."""
        started = time.perf_counter()
        ok = bool(self._matcher.consume_token(token))
        self._fresh = False
        self.mask_s += time.perf_counter() - started
        return ok

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (the turn ends here)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles constraints for one tokenizer (the engine's). The token table is built
    once, on the first constrained turn (~0.2 s for a 49K vocabulary)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._limits: llguidance.LLParserLimits | None = None
        self.compile_s = 0.0  # the last compile's seconds

    @property
    def words(self) -> int:
        return mask_words(self._tokenizer.vocab_size)

    def _table(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            import llguidance

            tok = self._tokenizer
            eos = sorted(tok.eos_token_ids)
            source = tok.tokenizers_json()
            if source is not None:
                self._ll = llguidance.LLTokenizer(source, n_vocab=tok.vocab_size, eos_token=eos)
            else:
                self._ll = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Table(tok)), n_vocab=tok.vocab_size
                )
            # Bounds a hostile grammar's build and each step's work (llguidance measures
            # them in "fuel"; these are its defaults, a few tens of ms at most).
            self._limits = llguidance.LLParserLimits(
                max_items_in_row=2000,
                initial_lexer_fuel=1_000_000,
                step_lexer_fuel=200_000,
                step_max_items=50_000,
                max_lexer_states=250_000,
                max_grammar_size=500_000,
                verbose_errors=False,
            )
        return self._ll

    def compile(self, constraint: Constraint) -> RowGrammar:
        """A turn's grammar state for ``constraint``, its first mask computed. Raises
        ValueError (at once, nothing kept) for an invalid, unsupported or too complex
        grammar, or one that admits no output."""
        import llguidance

        constraint.check()
        table = self._table()
        started = time.perf_counter()
        grammar = _grammar(llguidance, constraint)
        matcher = llguidance.LLMatcher(table, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"bad {constraint.kind} constraint: {_short(matcher.get_error())}")
        row = RowGrammar(matcher, self.words)
        first = np.zeros(self.words, dtype=np.int32)
        row.fill(first)
        self.compile_s = time.perf_counter() - started
        if matcher.is_error():
            raise ValueError(f"bad {constraint.kind} constraint: {_short(matcher.get_error())}")
        if not first.any():
            raise ValueError(f"the {constraint.kind} constraint admits no output")
        return row


def _grammar(llguidance: Any, constraint: Constraint) -> str:
    """llguidance's grammar text for ``constraint``. Raises ValueError for a schema that
    is not JSON."""
    kind, source = constraint.kind, constraint.source
    if kind == "json_schema":
        try:
            schema = json.loads(source)
            text = json.dumps(closed_objects(schema))
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        except RecursionError:
            raise ValueError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object or a boolean")
        return str(llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_FORMAT))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(source))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(source))
    return source


_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in each object schema that names
    its ``properties`` and says nothing of other keys: the output then holds only keys the
    schema names (still valid against the original), where a model would otherwise be
    free to invent keys without end."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    if (
        isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def _short(error: str) -> str:
    return error if len(error) <= 300 else error[:300] + "..."


class _Table:
    """A tokenizer's tokens as llguidance's ``TokenizerWrapper`` reads them (for
    tokenizers without a ``tokenizers`` JSON): each token's bytes as it decodes alone."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(tokenizer.vocab_size)]
        specials = tokenizer.special_texts
        self.special_token_ids = [
            i for i, t in enumerate(self.tokens) if t.decode("utf-8", "replace") in specials
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)
