"""What a turn asks of the sampler: :class:`Sampling` (how to pick each token) and
:class:`Constraint` (a grammar the output must follow). Plain data, checked here once."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import msgspec

__all__ = (
    "CONSTRAINT_KINDS",
    "MAX_GRAMMAR_CHARS",
    "SEED_LIMIT",
    "Constraint",
    "ConstraintKind",
    "Sampling",
)

SEED_LIMIT = 1 << 64  # MLX random keys take an unsigned 64-bit seed
MAX_STOPS = 16
MAX_LOGIT_BIAS = 1024  # tokens one turn may bias (OpenAI allows 300)
MAX_GRAMMAR_CHARS = 128 * 1024  # a larger schema or grammar is refused before it compiles


class UnknownOption(TypeError, ValueError):
    """A sampling option the sampler does not know (a TypeError, as a wrong keyword is,
    and a ValueError, as a bad value is: either ``except`` catches it)."""


def _check_range(name: str, value: float, low: float, high: float, *, open_low: bool) -> None:
    ok = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens. ``temperature == 0`` is greedy (the default).

    Filters, applied in this order to each row's logits: ``repetition_penalty`` (> 1
    lowers the logits of the tokens among the last ``repetition_context_size`` of the
    context, prompt included, as mlx-lm and llama.cpp do), ``presence_penalty`` and
    ``frequency_penalty`` (subtracted once per token generated in this turn / per time it
    was, as OpenAI does), ``logit_bias`` (token id -> added to its logit; -100 bans it),
    the turn's grammar mask, then with ``temperature > 0``: ``top_k`` (0: off), ``top_p``
    (the nucleus), ``min_p`` (drop tokens less likely than ``min_p`` times the most
    likely; 0: off) and a draw with ``seed``. ``stop``: strings that end the turn (not
    included in its text). A greedy row with none of the filters picks exactly what it
    picked before they existed.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids increasing

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Sampling:
        """Build from keyword options. Raises UnknownOption (a TypeError and a ValueError)
        for an unknown name, TypeError for ``stop`` or ``logit_bias`` of a wrong type,
        ValueError naming the option for a bad value."""
        known = set(cls.__struct_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise UnknownOption(
                f"unknown sampling option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        options = dict(options)
        stop = options.get("stop", ())
        if isinstance(stop, str):
            options["stop"] = (stop,)
        elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
            options["stop"] = tuple(stop)
        else:
            raise TypeError(f"stop must be a str or a list of str, not {type(stop).__name__}")
        if "logit_bias" in options:
            options["logit_bias"] = _logit_bias(options["logit_bias"])
        try:
            sampling = msgspec.convert(options, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad sampling option: {exc}") from None
        sampling.validate()
        return sampling

    @property
    def penalized(self) -> bool:
        """Whether any filter before the mask changes logits (the sampler then reads the
        row's tokens on the host each step)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )

    def validate(self) -> None:
        """Raises ValueError naming the first option out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(self.stop)}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0, open_low=False)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 100.0, open_low=True)
        if not 0 < self.repetition_context_size <= 1 << 20:
            raise ValueError(
                f"repetition_context_size must be in [1, 2**20], got {self.repetition_context_size}"
            )
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, open_low=False)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, open_low=False)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        ids = [t for t, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be distinct ints >= 0")
        for token, bias in self.logit_bias:
            _check_range(f"logit_bias[{token}]", bias, -100.0, 100.0, open_low=False)


def _logit_bias(raw: object) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` mapping (ids as ints or decimal strings, as JSON sends them)
    as sorted pairs. Raises TypeError for another shape, ValueError for a bad id."""
    if raw is None:
        return ()
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list | tuple):
        items = [tuple(p) for p in raw]
    else:
        raise TypeError(f"logit_bias must be a dict of token id -> bias, not {type(raw).__name__}")
    out: dict[int, float] = {}
    for item in items:
        if len(item) != 2:
            raise TypeError("logit_bias must map token ids to numbers")
        key, bias = item
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise TypeError(f"logit_bias[{key!r}] must be a number")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


#: What a constraint's ``source`` is: a JSON schema (JSON text), a Lark grammar (with
#: llguidance's extensions: ``%json {...}`` inline schemas, ``<|special|>`` tokens), a
#: regular expression, or a whole llguidance grammar (its JSON form).
ConstraintKind = Literal["json_schema", "lark", "regex", "llguidance"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)


class Constraint(msgspec.Struct, frozen=True):
    """A grammar a turn's output must follow (llguidance's grammar formats): compiled
    once when the engine admits the turn, then each step masks the tokens that would
    leave it; the turn ends when the grammar is complete. Raises ValueError for an
    unknown kind or a source over ``MAX_GRAMMAR_CHARS`` (``check``)."""

    kind: ConstraintKind
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Constraint:
        """Output that is JSON valid against ``schema``. Raises ValueError for a schema
        that is not JSON-serialisable or too large."""
        try:
            text = msgspec.json.encode(schema).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        return cls("json_schema", text).check()

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object."""
        return cls("json_schema", '{"type": "object"}')

    def check(self) -> Constraint:
        """Itself, checked: a known kind and a source of at most ``MAX_GRAMMAR_CHARS``."""
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraint kind must be one of {CONSTRAINT_KINDS}, not {self.kind!r}"
            )
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("a constraint needs a non-empty source")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"the {self.kind} grammar has {len(self.source)} characters: more than "
                f"{MAX_GRAMMAR_CHARS} are refused"
            )
        return self
