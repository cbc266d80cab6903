"""Reading and checking a request body, shared by the OpenAI and Anthropic routes: each
check raises :class:`ApiError` (a 400 unless it says otherwise) naming the field at fault.

A body is read on the event loop (:func:`read_body`, bounded in bytes) and parsed and
checked on a worker thread (:func:`parse_off_loop`): a body of many megabytes never
holds the loop, and its nesting and number of values are bounded (``_json``)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from ._errors import ApiError
from ._json import JSONLimit, loads

DEFAULT_MAX_TOKENS = 512
MAX_DEPTH = 32  # levels of nesting a body may have (a chat body needs 5)
MAX_VALUES = 200_000  # JSON values a body may hold (a message is 3)
BIG_BODY = 1 << 20  # bodies from this size on are read one at a time, the GC paused

T = TypeVar("T")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body. Raises ApiError (413) past ``max_bytes`` (declared or read),
    ClientDisconnect when the client leaves mid-body."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def decode(raw: bytes) -> dict[str, Any]:
    """A body's JSON object. Raises ApiError for a body that is not UTF-8 JSON, not an
    object, nested deeper than MAX_DEPTH or holding more than MAX_VALUES values."""
    error = None
    try:
        body = loads(raw.decode("utf-8"), max_depth=MAX_DEPTH, max_values=MAX_VALUES)
    except JSONLimit as exc:
        error = ApiError(400, str(exc), param=exc.field or None)
    except (ValueError, UnicodeDecodeError) as exc:
        error = ApiError(400, f"the body is not valid JSON: {exc}")
    if error is not None:  # raised here: what was read is freed on this thread, not later
        raise error
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block: a body of many values makes many
    containers, and a full collection meanwhile would hold the GIL, and so the event
    loop, for a tenth of a second. What a body makes holds no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse(raw: bytes, parse: Callable[[dict[str, Any]], T]) -> T:
    if len(raw) < BIG_BODY:
        return parse(decode(raw))
    with _gc_paused():
        return parse(decode(raw))


async def parse_off_loop(
    raw: bytes, parse: Callable[[dict[str, Any]], T], big: anyio.CapacityLimiter
) -> T:
    """``parse`` of the JSON object ``raw`` spells, both on a worker thread; a body of
    BIG_BODY bytes or more waits for ``big`` (one at a time: the GC paused). Raises
    ApiError as :func:`decode` and ``parse`` do."""
    limiter = big if len(raw) >= BIG_BODY else None
    return await anyio.to_thread.run_sync(_parse, raw, parse, limiter=limiter)


def shown(value: Any) -> str:
    """``value`` as an error message quotes it: short, whatever it is."""
    if isinstance(value, str | int | float | bool) or value is None:
        text = repr(value)
    else:
        text = f"a JSON {'array' if isinstance(value, list) else 'object'}"
    return text if len(text) <= 40 else f"{text[:40]}..."


def check_fields(body: Mapping[str, Any], known: frozenset[str], required: tuple[str, ...]) -> None:
    """Raises ApiError for a field outside ``known`` or a ``required`` one missing."""
    unknown = sorted(set(body) - known)
    if unknown:
        listed = ", ".join(u[:40] for u in unknown[:5])
        raise ApiError(
            400, f"Unrecognized request argument supplied: {listed}", param=unknown[0][:64]
        )
    for name in required:
        if name not in body:
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name)


def check_model(
    body: Mapping[str, Any], model_id: str, strict: bool = False, models: tuple[str, ...] = ()
) -> str | None:
    """The model the request runs on: one of ``models`` (a session of several models:
    ``"default"`` is the first), else None (the one model served). Raises ApiError: 400
    unless ``model`` is a string; 404 for a name not among ``models``, and with
    ``strict`` for one model, unless it names ``model_id`` or ``"default"`` (without,
    any name is the one model served, as llama.cpp's and LM Studio's servers take it:
    many SDKs default to a name of their own)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {shown(model)}", param="model")
    if models:
        if model == "default":
            return models[0]
        if model not in models:
            raise ApiError(
                404,
                f"The model {shown(model)} does not exist: this server serves "
                f"{', '.join(repr(m) for m in models)}",
                code="model_not_found",
                param="model",
            )
        return model
    if strict and model not in (model_id, "default"):
        raise ApiError(
            404,
            f"The model {shown(model)} does not exist: this server serves "
            f"{model_id!r} (or say 'default')",
            code="model_not_found",
            param="model",
        )
    return None


def flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """The boolean field ``name`` (``default`` when unset or null). Raises ApiError unless
    it is a JSON boolean."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {shown(value)}", param=name)
    return value


def stream_flag(body: Mapping[str, Any]) -> bool:
    """The body's ``stream`` (default False). Raises ApiError unless it is a boolean."""
    return flag(body, "stream")


def include_usage(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage`` (False when unset). Raises ApiError unless
    ``stream_options`` is an object (or null) of known boolean fields."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(
            400, f"'stream_options' must be an object, got {shown(options)}", param="stream_options"
        )
    try:
        check_fields(options, frozenset({"include_usage", "include_obfuscation"}), ())
        flag(options, "include_obfuscation")
        return flag(options, "include_usage")
    except ApiError as exc:
        raise ApiError(400, f"stream_options: {exc.message}", param="stream_options") from None


def string(body: Mapping[str, Any], name: str) -> str | None:
    """The string field ``name`` (None when unset or null). Raises ApiError otherwise."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {shown(value)}", param=name)
    return value


def number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    """The number field ``name`` in [low, high] (None when unset or null). Raises
    ApiError otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be a number in [{low}, {high}], got {shown(value)}", param=name
        )
    return float(value)


def integer(body: Mapping[str, Any], name: str, low: int) -> int | None:
    """The integer field ``name``, at least ``low`` (None when unset or null). Raises
    ApiError otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"'{name}' must be an integer >= {low}, got {shown(value)}", param=name)
    return value


MAX_STOPS = 16  # stop strings a turn takes (``Sampling``'s bound; OpenAI's is 4)
MAX_LOGIT_BIAS = 1024  # tokens one turn may bias (OpenAI's bound is 300)


def _stops(body: Mapping[str, Any], name: str) -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'{name}' must be a string or a list of non-empty strings", param=name)
    if len(stop) > MAX_STOPS:
        raise ApiError(400, f"'{name}' takes at most {MAX_STOPS} strings", param=name)
    return stop


def _logit_bias(body: Mapping[str, Any], vocab: int) -> dict[int, float] | None:
    """``logit_bias`` (token id as a decimal string -> a bias in [-100, 100]), checked
    against the vocabulary (``vocab`` tokens; 0: unknown). Raises ApiError otherwise."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    bad = ApiError(
        400,
        "'logit_bias' must map token ids (decimal strings) to numbers in [-100, 100]",
        param="logit_bias",
    )
    if not isinstance(raw, dict):
        raise bad
    if len(raw) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise bad
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad
        token = int(key)
        if vocab and token >= vocab:
            raise ApiError(
                400,
                f"'logit_bias': token {token} is not in the vocabulary ({vocab} tokens)",
                param="logit_bias",
            )
        out[token] = float(bias)
    return out


# Filters local clients send (llama.cpp's, vLLM's, mlx-lm's names) and their ranges
# (repetition_penalty must be > 0 too). top_k -1 is vLLM's "off" (ours is 0).
_FILTERS = (
    ("min_p", 0.0, 1.0),
    ("repetition_penalty", 0.0, 100.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
)


def sampling(
    body: Mapping[str, Any], max_name: str, stop_name: str, vocab: int = 0
) -> dict[str, Any]:
    """Our sampling options from an API body (OpenAI's or Anthropic's names: the token
    limit in ``max_name`` or ``max_completion_tokens``, the stop strings in
    ``stop_name``; the filters ``top_k``, ``min_p``, ``repetition_penalty``,
    ``repetition_context_size``, ``presence_penalty``, ``frequency_penalty``,
    ``logit_bias`` when the body has them: each route's fields say which it takes).
    Raises ApiError for a value out of range or of the wrong type."""
    options: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name in (max_name, "max_completion_tokens"):
        value = integer(body, name, 1)
        if value is not None:
            options["max_tokens"] = value
    temperature = number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        options["temperature"] = temperature
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise ApiError(400, "'top_p' must be > 0", param="top_p")
        options["top_p"] = top_p
    seed = integer(body, "seed", 0)
    if seed is not None:
        if seed >= 1 << 64:
            raise ApiError(400, "'seed' must be below 2**64", param="seed")
        options["seed"] = seed
    stop = _stops(body, stop_name)
    if stop:
        options["stop"] = stop
    top_k = integer(body, "top_k", -1)
    if top_k is not None:
        options["top_k"] = max(top_k, 0)
    for name, low, high in _FILTERS:
        filtered = number(body, name, low, high)
        if filtered == 0 and name == "repetition_penalty":
            raise ApiError(400, "'repetition_penalty' must be > 0", param=name)
        if filtered is not None:
            options[name] = filtered
    context = integer(body, "repetition_context_size", 1)
    if context is not None:
        if context > 1 << 20:
            raise ApiError(
                400, "'repetition_context_size' must be <= 2**20", param="repetition_context_size"
            )
        options["repetition_context_size"] = context
    bias = _logit_bias(body, vocab)
    if bias:
        options["logit_bias"] = bias
    return options


def check_prompt_chars(conversation: list[dict[str, Any]] | str, limit: int, param: str) -> None:
    """Raises ApiError (400, ``context_length_exceeded``) for a prompt with more
    characters than any prompt that fits the model's context can have (``limit``),
    before any agent sees it."""
    if isinstance(conversation, str):
        chars = len(conversation)
    else:
        chars = sum(len(m["content"]) for m in conversation)
    if chars > limit:
        raise ApiError(
            400,
            f"the prompt has {chars} characters: more than any prompt that fits the model's "
            f"context can have ({limit})",
            code="context_length_exceeded",
            param=param,
        )
