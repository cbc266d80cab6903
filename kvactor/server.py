"""``kvactor serve``: an OpenAI- and Anthropic-compatible HTTP server where every
conversation is an agent.

The app is a function of an open :class:`~kvactor.Session` (:func:`create_app`), so an
asyncio application can mount it beside its own routes; :func:`serve` opens a session and
runs the app under uvicorn (the ``kvactor[server]`` extra: Starlette, uvicorn,
prometheus-client).

A request names its agent with the ``X-Agent-Id`` header, else OpenAI's ``user`` field,
else Anthropic's ``metadata.user_id``. Each id is one agent actor with its own cache (hot,
warm, cold as in the Python API); clients resend the whole conversation, and prefix
matching turns it into an EXTEND of what the cache holds. A request without an id goes to
the anonymous agent whose last conversation is the longest prefix of this one (a new one
when none is), so plain clients benefit too; at most ``max_anonymous`` of them are kept.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /v1/messages`` (Anthropic), ``GET /health``, ``GET /v1/agents``,
``DELETE /v1/agents/{id}``, ``POST /v1/agents/{id}/prefetch``, ``GET /metrics``
(Prometheus text). Errors come in each API's own shape: 400 for malformed JSON, unknown
fields, bad values and hostile agent ids, 404 for an unknown model or agent, 413 for a
body over ``max_body_bytes`` or a prompt over the model's context, 429 (with
``Retry-After``) when ``max_pending`` requests are already in flight. A client that
disconnects mid-stream cancels its turn, which frees its batch slot.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from .actors import (
    Agent,
    Completion,
    ContextOverflow,
    EngineStopped,
    FinishReason,
    InvalidAgentId,
    Session,
    TextStream,
    Tier,
    UnknownAgent,
)
from .actors.protocol import check_agent_id

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "kvactor's server needs its extra: pip install 'kvactor[server]' "
        f"(Starlette, uvicorn, prometheus-client): {exc}"
    ) from exc

__all__ = ("create_app", "serve")

ANONYMOUS = "anon."  # prefix of the agents that serve requests without an id
_DEFAULT_MAX_TOKENS = 512
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ApiError(Exception):
    """An error answered in the API's own shape; ``kind`` is OpenAI's ``type``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = (
            status,
            message,
            kind,
            code,
            param,
        )


_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _openai_error(err: ApiError) -> JSONResponse:
    body = {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


def _anthropic_error(err: ApiError) -> JSONResponse:
    kind = _ANTHROPIC_KINDS.get(err.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


# ------------------------------------------------------------------------ request checks
def _check_fields(
    body: Mapping[str, Any], known: frozenset[str], required: tuple[str, ...]
) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    for name in required:
        if name not in body:
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name)


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be a number in [{low}, {high}], got {value!r}", param=name
        )
    return float(value)


def _sampling(body: Mapping[str, Any], max_name: str, stop_name: str) -> dict[str, Any]:
    """Our sampling options from an API body (OpenAI's or Anthropic's names)."""
    options: dict[str, Any] = {"max_tokens": _DEFAULT_MAX_TOKENS}
    for name in (max_name, "max_completion_tokens"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(400, f"'{name}' must be an integer >= 1, got {value!r}", param=name)
            options["max_tokens"] = value
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        options["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise ApiError(400, "'top_p' must be > 0", param="top_p")
        options["top_p"] = top_p
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ApiError(400, f"'seed' must be an integer >= 0, got {seed!r}", param="seed")
        options["seed"] = seed
    stop = body.get(stop_name)
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(
                400,
                f"'{stop_name}' must be a string or a list of non-empty strings",
                param=stop_name,
            )
        if stop:
            options["stop"] = stop
    return options


def _text_content(content: Any, where: str) -> str:
    """A message content: a string, or a list of text parts (both APIs' shapes)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(400, f"{where}: only text content is supported", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def _messages(raw: Any, system: str | None = None) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = [{"role": "system", "content": system}] if system is not None else []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m:
            raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(
                400, f"messages[{i}]: unsupported field(s) {sorted(extra)}", param="messages"
            )
        role = m["role"]
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role {role!r} is not supported", param="messages")
        out.append({"role": role, "content": _text_content(m.get("content"), f"messages[{i}]")})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    return out


# ------------------------------------------------------------------------ metrics
class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "kvactor_ttft_seconds",
            "Time to first token of a turn, by path",
            ["path"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.ttft_part = Histogram(
            "kvactor_ttft_part_seconds",
            "Where a turn's time to first token went: queue (waiting), load (reading its "
            "warm cache), dequantize (making the working copy) and prefill",
            ["part"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.turns = Counter(
            "kvactor_turns", "Turns by the tier their cache came from", ["path"], registry=r
        )
        self.prompt_tokens = Counter("kvactor_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvactor_cached_tokens", "Prompt tokens reused from a cache", registry=r
        )
        self.generated_tokens = Counter("kvactor_generated_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "kvactor_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.in_flight = Gauge("kvactor_requests_in_flight", "Requests being answered", registry=r)
        self.engine = {
            name: Gauge(f"kvactor_{name}", help_, registry=r)
            for name, help_ in (
                ("cache_bytes", "Hot-tier bytes in use"),
                ("budget_bytes", "Hot-tier budget (0: none)"),
                ("peak_bytes", "Hot-tier peak bytes"),
                ("agents_cached", "Agents with a hot cache"),
                ("ready_agents", "Hot agents keeping a float copy"),
                ("demoted_warm", "Caches demoted to the warm tier"),
                ("demoted_cold", "Caches dropped (no warm copy)"),
                ("installs", "Caches reloaded from the warm tier"),
                ("warm_writes", "Turns written to the warm tier"),
                ("warm_write_failures", "Turns whose warm write failed"),
                ("max_batch_seen", "The largest decode batch so far"),
                ("decoding", "Agents decoding now"),
                ("waiting", "Turns waiting to start"),
            )
        }

        self.warm = {
            name: Gauge(f"kvactor_warm_tier_{name}", help_, registry=r)
            for name, help_ in (
                ("reads", "Warm caches read and verified"),
                ("bytes_read", "Bytes the warm tier read"),
                ("read_s", "Seconds the warm tier spent reading and verifying"),
                ("writes", "Appends to warm caches"),
                ("bytes_written", "Tensor bytes the warm tier wrote"),
                ("write_s", "Seconds the warm tier spent writing (fsyncs included)"),
                ("rejected", "Warm caches refused when read (their agents went cold)"),
            )
        }
        self.warm_rate = Gauge(
            "kvactor_warm_tier_bytes_per_second",
            "The warm tier's read and write rates (bytes over their own time)",
            ["direction"],
            registry=r,
        )

    def turn(self, done: Completion, prefetched: bool = False) -> None:
        """Count a finished turn; ``prefetched``: a prefetch had staged its cache (a hot
        turn then counts under path ``prefetched``)."""
        t = done.timings
        path = "prefetched" if prefetched and done.path == Tier.HOT else str(done.path)
        self.ttft.labels(path).observe(t.ttft_s)
        self.ttft_part.labels("queue").observe(t.queue_s - t.load_s)
        self.ttft_part.labels("load").observe(t.load_s)
        self.ttft_part.labels("dequantize").observe(t.dequantize_s)
        self.ttft_part.labels("prefill").observe(t.prefill_s - t.dequantize_s)
        self.turns.labels(path).inc()
        self.prompt_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.reused_tokens)
        self.generated_tokens.inc(t.generated_tokens)

    async def render(self, session: Session) -> bytes:
        stats = await session.stats()
        for name, gauge in self.engine.items():
            value = getattr(stats, name, 0)
            gauge.set(value or 0)
        io = await session.warm_stats()
        for name, gauge in self.warm.items():
            gauge.set(getattr(io, name))
        self.warm_rate.labels("read").set(io.bytes_read / io.read_s if io.read_s else 0)
        self.warm_rate.labels("write").set(io.bytes_written / io.write_s if io.write_s else 0)
        return generate_latest(self.registry)


# ------------------------------------------------------------------------ the app state
@dataclass
class _Anonymous:
    """The conversation (or raw prompt) each anonymous agent last served."""

    last: OrderedDict[str, list[dict[str, str]] | str] = field(default_factory=OrderedDict)
    busy: set[str] = field(default_factory=set)
    counter: int = 0


def _prefix_len(seen: list[dict[str, str]] | str, new: list[dict[str, str]] | str) -> int:
    if isinstance(seen, str) or isinstance(new, str):
        if isinstance(seen, str) and isinstance(new, str) and new.startswith(seen):
            return len(seen)
        return -1
    if len(seen) <= len(new) and new[: len(seen)] == seen:
        return sum(len(m["content"]) + 1 for m in seen)
    return -1


class _Server:
    def __init__(
        self, session: Session, model_id: str, max_pending: int, max_body: int, max_anonymous: int
    ) -> None:
        self.session = session
        self.model_id = model_id
        self.max_pending = max_pending
        self.max_body = max_body
        self.max_anonymous = max_anonymous
        self.pending = 0
        self.created = int(time.time())
        self.metrics = _Metrics()
        self.anon = _Anonymous()
        self.lock = anyio.Lock()
        self.last_used: dict[str, float] = {}
        self.prefetched: set[str] = set()  # agents staged by the prefetch route, not used yet

    def finished(self, agent: Agent, done: Completion, conversation: Conversation) -> None:
        """A turn is over: remember its conversation (anonymous routing), count it."""
        self.remember(agent, conversation)
        prefetched = agent.name in self.prefetched
        self.prefetched.discard(agent.name)
        self.metrics.turn(done, prefetched)

    # -- admission and parsing ---------------------------------------------------------
    def admit(self) -> None:
        if self.pending >= self.max_pending:
            raise ApiError(
                429,
                f"{self.pending} requests in flight: retry shortly",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self.pending += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        self.pending -= 1
        self.metrics.in_flight.dec()

    async def body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise ApiError(
                413, f"the request body exceeds {self.max_body} bytes", code="request_too_large"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise ApiError(
                    413, f"the request body exceeds {self.max_body} bytes", code="request_too_large"
                )
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model not in (self.model_id, "default"):
            raise ApiError(
                404,
                f"The model {model!r} does not exist: this server serves "
                f"{self.model_id!r} (or say 'default')",
                code="model_not_found",
                param="model",
            )

    # -- agents ------------------------------------------------------------------------
    async def named(self, agent_id: str) -> Agent:
        check_agent_id(agent_id)  # InvalidAgentId: a 400 (_api_errors)
        if agent_id.startswith(ANONYMOUS):
            raise ApiError(
                400, f"agent ids starting with {ANONYMOUS!r} are the server's own", param="agent_id"
            )
        async with self.lock:
            agent = self.session.agents.get(agent_id)
            if agent is None:
                agent = await self.session.spawn_agent(agent_id)
        self.last_used[agent_id] = time.time()
        return agent

    @contextlib.asynccontextmanager
    async def agent(
        self, agent_id: str | None, conversation: list[dict[str, str]] | str
    ) -> AsyncIterator[Agent]:
        """The agent a request runs on: the named one, or an idle anonymous one whose last
        conversation is the longest prefix of this one (a new one if none is)."""
        if agent_id is not None:
            yield await self.named(agent_id)
            return
        anon = self.anon
        async with self.lock:
            best, score = None, -1
            for name, seen in anon.last.items():
                got = _prefix_len(seen, conversation)
                if name not in anon.busy and got > score:
                    best, score = name, got
            if best is None or score < 0:
                while len(anon.last) >= self.max_anonymous:
                    idle = next((n for n in anon.last if n not in anon.busy), None)
                    if idle is None:
                        break
                    del anon.last[idle]
                    await self.session.forget(idle)
                anon.counter += 1
                best = f"{ANONYMOUS}{anon.counter}"
                await self.session.spawn_agent(best)
            anon.busy.add(best)
            anon.last[best] = conversation
            anon.last.move_to_end(best)
        self.last_used[best] = time.time()
        try:
            yield self.session.agent(best)
        finally:
            anon.busy.discard(best)

    def remember(self, agent: Agent, conversation: list[dict[str, str]] | str) -> None:
        if agent.name in self.anon.last:
            self.anon.last[agent.name] = conversation


def _agent_id(request: Request, *fields: Any) -> str | None:
    header = request.headers.get("x-agent-id")
    if header:
        return header
    for value in fields:
        if value is not None:
            if not isinstance(value, str):
                raise ApiError(400, "the agent id (user) must be a string", param="user")
            return value
    return None


Conversation = list[dict[str, str]] | str  # what an agent last served (anonymous routing)
Start = Callable[[Agent], TextStream]  # starts the turn on the agent chosen
After = Callable[[Completion], Conversation]  # the conversation once the turn is done


def _openai_usage(done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.generated_tokens,
        "total_tokens": t.prompt_tokens + t.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": t.reused_tokens},
    }


def _chat_turn(messages: list[dict[str, str]], options: dict[str, Any]) -> tuple[Start, After]:
    """How a chat request's turn starts on its agent, and the conversation once it is done
    (for anonymous routing)."""

    def start(agent: Agent) -> TextStream:
        return agent.stream_chat(messages, **options)

    def after(done: Completion) -> Conversation:
        return [*messages, {"role": "assistant", "content": done.text}]

    return start, after


def _finish_reason(done: Completion) -> str:
    return "length" if done.finish_reason == FinishReason.LENGTH else "stop"


def _kvactor_info(agent: Agent, done: Completion) -> dict[str, Any]:
    t = done.timings
    return {
        "agent": agent.name,
        "path": str(done.path),
        "match": str(done.match),
        "ttft_s": t.ttft_s,
        "reused_tokens": t.reused_tokens,
        "saved": done.saved,
    }


def _api_errors(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextOverflow):
        return ApiError(413, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, InvalidAgentId):
        return ApiError(400, str(exc), param="agent_id")
    if isinstance(exc, TypeError | ValueError):
        return ApiError(400, str(exc))
    if isinstance(exc, EngineStopped):
        return ApiError(503, "the engine stopped", kind="server_error")
    return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


Shaper = Callable[[ApiError], JSONResponse]


class _Streamed:
    """A streamed turn: its agent, its text stream and first piece, and its Completion
    once the stream is drained (``finished``)."""

    def __init__(
        self,
        agent: Agent,
        stream: TextStream,
        first: str | None,
        on_done: Callable[[Completion], None],
    ) -> None:
        self.agent, self.stream, self.first, self.on_done = agent, stream, first, on_done
        self.done: Completion | None = None

    async def texts(self) -> AsyncIterator[str]:
        if self.first:
            yield self.first
        async for piece in self.stream:
            yield piece

    def finished(self) -> Completion:
        """The Completion (after ``texts`` ran out), handed to ``on_done`` once."""
        if self.done is None:
            self.done = self.stream.completion
            assert self.done is not None
            self.on_done(self.done)
        return self.done


async def _started(stream: TextStream) -> str | None:
    """Enter the stream and wait for its first piece (None: the reply is empty), so that
    errors answer with a status before any byte of a 200 goes out."""
    await stream.__aenter__()
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


def create_app(
    session: Session,
    *,
    model_id: str | None = None,
    max_pending: int = 64,
    max_body_bytes: int = 16 << 20,
    max_anonymous: int = 16,
) -> Starlette:
    """The ASGI app over an open session (mount it in an asyncio application, or let
    :func:`serve` run it). ``model_id``: the id clients name (default: the model's name;
    ``"default"`` is always accepted); ``max_pending``: requests in flight before 429s;
    ``max_body_bytes``: the largest request body (413 past it); ``max_anonymous``:
    anonymous agents kept (the least recently used idle one is forgotten past it)."""
    server = _Server(
        session, model_id or session.model.name, max_pending, max_body_bytes, max_anonymous
    )

    def route(
        path: str,
        name: str,
        methods: list[str],
        shape: Shaper,
        handler: Callable[[Request], Awaitable[Response]],
        admit: bool = False,
    ) -> Route:
        async def endpoint(request: Request) -> Response:
            status = 500
            try:
                if admit:
                    server.admit()
                try:
                    response = await handler(request)
                except BaseException:
                    if admit:
                        server.release()
                    raise
                if admit and not isinstance(response, StreamingResponse):
                    server.release()
                status = response.status_code
                return response
            except ClientDisconnect:
                status = 499
                return Response(status_code=499)
            except Exception as exc:
                err = _api_errors(exc)
                status = err.status
                return shape(err)
            finally:
                server.metrics.requests.labels(name, str(status)).inc()

        return Route(path, endpoint, methods=methods, name=name)

    async def whole(
        agent_id: str | None, conversation: Conversation, start: Start, after: After
    ) -> tuple[Agent, Completion]:
        """A turn answered at once: the agent, its Completion (remembered and counted)."""
        async with server.agent(agent_id, conversation) as agent:
            async with start(agent) as pieces:
                async for _ in pieces:
                    pass
            done = pieces.completion
            assert done is not None
            server.finished(agent, done, after(done))
        return agent, done

    async def streamed(
        agent_id: str | None,
        conversation: Conversation,
        start: Start,
        after: After,
        events: Callable[[_Streamed], AsyncIterator[str]],
    ) -> StreamingResponse:
        """A turn streamed as server-sent ``events`` of it, once its first piece (or its
        error, answered with a status instead) is there."""
        choose = server.agent(agent_id, conversation)
        agent = await choose.__aenter__()
        try:
            pieces = start(agent)
            first = await _started(pieces)
        except BaseException:
            await choose.__aexit__(None, None, None)
            raise

        def on_done(done: Completion) -> None:
            server.finished(agent, done, after(done))

        turn = _Streamed(agent, pieces, first, on_done)

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events(turn):
                    yield event
            finally:
                with anyio.CancelScope(shield=True):
                    await pieces.aclose()
                    await choose.__aexit__(None, None, None)
                server.release()

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # -- OpenAI: chat completions ------------------------------------------------------
    openai_fields = frozenset(
        {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed"}
        | {"stop", "user", "n", "logprobs"}
    )
    chat_fields = openai_fields | {
        "messages",
        "max_completion_tokens",
        "presence_penalty",
        "frequency_penalty",
        "response_format",
    }

    async def chat_completions(request: Request) -> Response:
        body = await server.body(request)
        _check_fields(body, chat_fields, ("model", "messages"))
        server.check_model(body)
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name, 0) not in (0, 0.0, None):
                raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
        if body.get("logprobs"):
            raise ApiError(400, "'logprobs' is not supported", param="logprobs")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise ApiError(
                400, "only response_format {'type': 'text'} is supported", param="response_format"
            )
        messages = _messages(body["messages"])
        options = _sampling(body, "max_tokens", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        usage_in_stream = bool((body.get("stream_options") or {}).get("include_usage"))
        ident = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        agent_id = _agent_id(request, body.get("user"))

        def chunk(
            delta: dict[str, Any], finish: str | None = None, info: dict[str, Any] | None = None
        ) -> str:
            data: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": server.model_id,
                "system_fingerprint": None,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if info is not None:
                data["kvactor"] = info
            return f"data: {json.dumps(data)}\n\n"

        start, after = _chat_turn(messages, options)

        if not stream:
            agent, done = await whole(agent_id, messages, start, after)
            return JSONResponse(
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": created,
                    "model": server.model_id,
                    "system_fingerprint": None,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": done.text},
                            "logprobs": None,
                            "finish_reason": _finish_reason(done),
                        }
                    ],
                    "usage": _openai_usage(done),
                    "kvactor": _kvactor_info(agent, done),
                }
            )

        async def events(turn: _Streamed) -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            async for piece in turn.texts():
                yield chunk({"content": piece})
            done = turn.finished()
            yield chunk({}, _finish_reason(done), _kvactor_info(turn.agent, done))
            if usage_in_stream:
                data = {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": server.model_id,
                    "choices": [],
                    "usage": _openai_usage(done),
                }
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"

        return await streamed(agent_id, messages, start, after, events)

    # -- OpenAI: completions -----------------------------------------------------------
    completion_fields = openai_fields | {"prompt", "echo"}

    async def completions(request: Request) -> Response:
        body = await server.body(request)
        _check_fields(body, completion_fields, ("model", "prompt"))
        server.check_model(body)
        if body.get("n", 1) != 1 or body.get("echo") or body.get("logprobs"):
            raise ApiError(400, "n > 1, echo and logprobs are not supported")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        options = _sampling(body, "max_tokens", "stop")
        options.setdefault("max_tokens", 16)
        stream = body.get("stream", False)
        ident = f"cmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        agent_id = _agent_id(request, body.get("user"))

        def payload(text: str, finish: str | None, done: Completion | None) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": server.model_id,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }
            if done is not None:
                out["usage"] = _openai_usage(done)
            return out

        def start(agent: Agent) -> TextStream:
            return agent.stream_raw(prompt, **options)

        def after(done: Completion) -> Conversation:
            return prompt + done.text

        if not stream:
            _, done = await whole(agent_id, prompt, start, after)
            return JSONResponse(payload(done.text, _finish_reason(done), done))

        async def events(turn: _Streamed) -> AsyncIterator[str]:
            async for piece in turn.texts():
                yield f"data: {json.dumps(payload(piece, None, None))}\n\n"
            done = turn.finished()
            yield f"data: {json.dumps(payload('', _finish_reason(done), done))}\n\n"
            yield "data: [DONE]\n\n"

        return await streamed(agent_id, prompt, start, after, events)

    # -- Anthropic: messages -----------------------------------------------------------
    message_fields = frozenset(
        [
            "model",
            "messages",
            "max_tokens",
            "system",
            "stream",
            "temperature",
            "top_p",
            "stop_sequences",
            "metadata",
        ]
    )

    async def messages_route(request: Request) -> Response:
        body = await server.body(request)
        _check_fields(body, message_fields, ("model", "messages", "max_tokens"))
        server.check_model(body)
        system = body.get("system")
        if system is not None:
            system = _text_content(system, "system")
        for i, m in enumerate(body["messages"] if isinstance(body["messages"], list) else []):
            if isinstance(m, dict) and m.get("role") not in ("user", "assistant"):
                raise ApiError(
                    400, f"messages.{i}.role: must be 'user' or 'assistant'", param="messages"
                )
        messages = _messages(body["messages"], system)
        options = _sampling(body, "max_tokens", "stop_sequences")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise ApiError(400, "metadata may only hold user_id", param="metadata")
        agent_id = _agent_id(request, metadata.get("user_id"))
        ident = f"msg_{secrets.token_hex(12)}"
        stops = options.get("stop", [])

        def stop_reason(done: Completion) -> tuple[str, str | None]:
            if done.finish_reason == FinishReason.LENGTH:
                return "max_tokens", None
            if done.finish_reason == FinishReason.STOP:
                # Which string matched is not recorded: named when there is only one.
                return "stop_sequence", stops[0] if len(stops) == 1 else None
            return "end_turn", None

        def usage(done: Completion) -> dict[str, Any]:
            t = done.timings
            return {
                "input_tokens": t.prompt_tokens - t.reused_tokens,
                "cache_read_input_tokens": t.reused_tokens,
                "cache_creation_input_tokens": 0,
                "output_tokens": t.generated_tokens,
            }

        def event(kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        start, after = _chat_turn(messages, options)

        if not stream:
            _, done = await whole(agent_id, messages, start, after)
            reason, sequence = stop_reason(done)
            return JSONResponse(
                {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": server.model_id,
                    "content": [{"type": "text", "text": done.text}],
                    "stop_reason": reason,
                    "stop_sequence": sequence,
                    "usage": usage(done),
                }
            )

        async def events(turn: _Streamed) -> AsyncIterator[str]:
            begin: dict[str, Any] = {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": server.model_id,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            yield event("message_start", {"message": begin})
            block = {"type": "text", "text": ""}
            yield event("content_block_start", {"index": 0, "content_block": block})
            yield event("ping", {})
            async for piece in turn.texts():
                delta = {"type": "text_delta", "text": piece}
                yield event("content_block_delta", {"index": 0, "delta": delta})
            done = turn.finished()
            reason, sequence = stop_reason(done)
            yield event("content_block_stop", {"index": 0})
            end = {"stop_reason": reason, "stop_sequence": sequence}
            yield event("message_delta", {"delta": end, "usage": usage(done)})
            yield event("message_stop", {})

        return await streamed(agent_id, messages, start, after, events)

    # -- the rest ----------------------------------------------------------------------
    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_id,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "kvactor",
                    },
                ],
            }
        )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": server.model_id, "in_flight": server.pending})

    async def agents(request: Request) -> Response:
        warm = {w.agent: w for w in await session.warm_agents()}
        names = sorted(set(session.agents) | set(warm))
        rows = []
        for name in names:
            row: dict[str, Any] = {
                "id": name,
                "tier": "cold",
                "form": None,
                "tokens": 0,
                "bytes": 0,
                "warm_bytes": 0,
                "last_used": None,
            }
            if name in warm:
                w = warm[name]
                row.update(
                    tier="warm",
                    form="file",
                    tokens=w.tokens,
                    warm_bytes=w.nbytes,
                    last_used=w.updated,
                    rejected=w.rejected,
                )
            with contextlib.suppress(UnknownAgent):  # no hot cache: warm or cold
                info = await session.cache_info(name)
                row.update(
                    tier="hot",
                    form="quantized",
                    tokens=info.tokens,
                    bytes=info.nbytes,
                    busy=info.busy,
                )
            if name in server.last_used:
                row["last_used"] = server.last_used[name]
            rows.append(row)
        return JSONResponse({"object": "list", "data": rows})

    async def forget(request: Request) -> Response:
        name = check_agent_id(request.path_params["agent_id"])  # else a 400 (_api_errors)
        known = name in session.agents or any(w.agent == name for w in await session.warm_agents())
        if not known:
            raise ApiError(404, f"no agent {name!r}", code="agent_not_found")
        async with server.lock:
            server.anon.last.pop(name, None)
            done = await session.forget(name)
        server.last_used.pop(name, None)
        kept = [{"file": k.file, "bytes": k.nbytes, "used_by": k.users} for k in done.kept]
        return JSONResponse(
            {
                "id": name,
                "object": "agent.deleted",
                "deleted": True,
                "freed_bytes": done.freed,
                "kept_shared": kept,
            }
        )

    async def prefetch(request: Request) -> Response:
        name = check_agent_id(request.path_params["agent_id"])  # else a 400 (_api_errors)
        if not any(w.agent == name for w in await session.warm_agents()):
            raise ApiError(404, f"agent {name!r} has no warm cache", code="agent_not_found")
        await session.prefetch(name)
        server.prefetched.add(name)
        return JSONResponse({"id": name, "prefetching": True}, status_code=202)

    async def metrics(request: Request) -> Response:
        return Response(await server.metrics.render(session), media_type=CONTENT_TYPE_LATEST)

    o, a = _openai_error, _anthropic_error
    routes = [
        route("/v1/chat/completions", "chat", ["POST"], o, chat_completions, admit=True),
        route("/v1/completions", "completions", ["POST"], o, completions, admit=True),
        route("/v1/messages", "messages", ["POST"], a, messages_route, admit=True),
        route("/v1/models", "models", ["GET"], o, models),
        route("/health", "health", ["GET"], o, health),
        route("/v1/agents", "agents", ["GET"], o, agents),
        route("/v1/agents/{agent_id}", "forget", ["DELETE"], o, forget),
        route("/v1/agents/{agent_id}/prefetch", "prefetch", ["POST"], o, prefetch),
        route("/metrics", "metrics", ["GET"], o, metrics),
    ]
    app = Starlette(routes=routes)
    app.state.kvactor = server
    return app


async def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[int], None] | None = None,
    model_id: str | None = None,
    max_pending: int = 64,
    **options: Any,
) -> None:
    """Open a session (``model`` and ``options`` as ``kvactor.open`` takes them) and serve
    it until SIGINT / SIGTERM: then the server stops taking connections, lets in-flight
    turns finish (their warm writes included) for up to 10 s, cancels the rest, and the
    session closes (a second signal stops at once). ``port`` 0 picks a free one;
    ``ready(port)`` is called once it listens."""
    import signal
    import socket

    import uvicorn

    from .actors import open as open_session

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # the signals are handled below
            yield

    async with open_session(model, **options) as session:
        app = create_app(session, model_id=model_id, max_pending=max_pending)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=10, lifespan="off"
        )
        server = Server(config)

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    if server.should_exit:
                        server.force_exit = True
                    server.should_exit = True

        async def announce() -> None:
            while not server.started:
                await anyio.sleep(0.01)
            if ready is not None:
                ready(sock.getsockname()[1])

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signals)
            tg.start_soon(announce)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
