"""The dashboard: ``GET /dashboard`` (one page, its script and style shipped in the wheel
under ``kvactor/server/dashboard/``; nothing fetched from elsewhere) and ``GET
/v1/status``, the JSON the page reads: once per request, or with ``stream=true`` as a
stream of server-sent events as it changes.

``/v1/status`` says, for the key that asks: the memory limit split (weights, hot caches,
ready copies, working copies, the rest, free), the disk limit (used, free, written
today), the agents (tier, tokens, bytes, last turn's path and TTFT, hint, tool wait,
last use), the loaded models and the recent events (turns; every demotion and reload
the hot tiers logged, with its bytes and, for a reload, whether a prefetch or a turn
staged it). A tenant's key sees its own agents, by the ids it knows them by, and
totals of them only (the memory bar: its hot caches against the limit); an admin key,
or a server without keys, sees everything. No prompt or answer text is ever in it.

Its work is bounded per request: the session is sampled at most every quarter second
whoever asks (``_board``), at most ``limit`` agents are sent (default 300, the most
recently used first; ``agents_total`` says how many there are; ``q`` keeps the ids
holding a text), and the events after ``since`` (an event's ``seq``), 500 at most.

The page reads the stream: a request a second cost each open browser more CPU than its
drawing (a fetch is a new request through the browser's network service; a stream's
event is a few bytes more on an open one), on the cores the engine decodes on
(docs/benchmarks.md, "The dashboard's cost"). A stream looks every ``STREAM_EVERY_S``
and sends a status at once when an agent came, went or changed tier or an event came;
when only figures changed (tokens, bytes, counts: each second while agents decode), at
most every ``STREAM_FIGURES_S``; and at least every ``STREAM_QUIET_S``. It ends after
``STREAM_LIFE_S`` (the page opens the next one where it left off) or within a second
of :meth:`Dashboard.close` (the server stops: uvicorn waits for open responses). At
most ``MAX_STREAMS`` are open at once (a 429 past them).

The page works on ``kvactor serve`` (``create_app``) and on ``kvactor run --dashboard``
(:func:`create_dashboard_app`: these routes alone, over a board that outlives the run's
session)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ._activity import Activity
from ._board import Board, Sample
from ._errors import Api, ApiError, error_response
from ._tenants import Keys, Tenant

__all__ = ("Dashboard", "asset", "create_dashboard_app", "new_board", "page", "status")

DEFAULT_ROWS = 300
MAX_ROWS = 5000
MAX_EVENTS = 500
STREAM_EVERY_S = 1.0  # a stream looks for a change this often...
STREAM_FIGURES_S = 2.0  # ... sends a change of figures alone at most this often...
STREAM_QUIET_S = 5.0  # ... and sends at least this often (the page's timeline moves on)
STREAM_LIFE_S = 30.0  # then the stream ends (the page opens the next at once): an
# app served by someone else's uvicorn, which waits for open responses, stops within it
MAX_STREAMS = 32  # open streams per app
_CLOCKS = ("time", "uptime_s", "sampled_at")  # a status that changed in these alone is not sent
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_NO_KEY = "a valid API key is needed: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"


@dataclass
class Dashboard:
    """What the dashboard's routes share: the board, the keys, each agent's sharing
    scope (its tenant's label) and when a request last named it (the server's)."""

    board: Board
    keys: Keys = field(default_factory=Keys)
    scope_of: Callable[[str], str] = lambda _: ""
    last_used: Mapping[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # Invariant: only _StatusStream changes streams; only close() sets closing.
    streams: int = 0  # status streams open now
    closing: bool = False  # the server stops: every stream ends within STREAM_EVERY_S

    def close(self) -> None:
        """End every status stream (within ``STREAM_EVERY_S``) and refuse new ones."""
        self.closing = True


def _dashboard(request: Request) -> Dashboard:
    dash = request.app.state.dashboard
    assert isinstance(dash, Dashboard)
    return dash


@functools.cache
def _read_asset(name: str) -> bytes:
    return (resources.files(__package__) / "dashboard" / name).read_bytes()


async def page(request: Request) -> Response:
    """``GET /dashboard``: the page (no key needed: it holds no data; it asks for one)."""
    return Response(_read_asset("index.html"), media_type="text/html; charset=utf-8")


async def asset(request: Request) -> Response:
    """``GET /dashboard/{name}``: the page's script or style. Raises ApiError (404)."""
    name = request.path_params["name"]
    if name not in _ASSETS:
        raise ApiError(404, f"no dashboard file {name[:40]!r}", code="not_found")
    return Response(_read_asset(name), media_type=_ASSETS[name] + "; charset=utf-8")


def _int_param(request: Request, name: str, default: int, top: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) > top:
        raise ApiError(400, f"'{name}' is a whole number from 0 to {top}", param=name)
    return int(raw)


async def status(request: Request) -> Response:
    """``GET /v1/status``: the dashboard's JSON for the request's key (see the module
    doc). Raises ApiError: 401 without a valid key, 400 for a bad query parameter."""
    dash = _dashboard(request)
    tenant = dash.keys.tenant(request.headers)
    if tenant is None:
        raise ApiError(401, _NO_KEY, code="invalid_api_key")
    limit = _int_param(request, "limit", DEFAULT_ROWS, MAX_ROWS)
    since = _int_param(request, "since", 0, 1 << 62)
    query = request.query_params.get("q", "")[:64]
    if _flag(request, "stream"):
        if dash.closing or dash.streams >= MAX_STREAMS:
            why = "the server is stopping" if dash.closing else f"{dash.streams} are open"
            raise ApiError(
                429,
                f"no new status stream ({why}): poll /v1/status without 'stream'",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after=5,
            )
        return _StatusStream(dash, _stream(dash, tenant, limit=limit, since=since, query=query))
    sample = await dash.board.sample()
    body = _body(dash, sample, tenant, limit=limit, since=since, query=query)
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise ApiError(400, f"'{name}' is true or false", param=name)
    return raw in ("true", "1")


class _StatusStream(StreamingResponse):
    """A status stream, counted in ``Dashboard.streams`` from its request until its
    response ends, however it ends (a client gone before the first event included: the
    generator's own ``finally`` would not run then, and a count taken at its first event
    would let a burst of requests past ``MAX_STREAMS``)."""

    def __init__(self, dash: Dashboard, events: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.dash = dash
        dash.streams += 1

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.dash.streams -= 1


async def _stream(
    dash: Dashboard, tenant: Tenant, *, limit: int, since: int, query: str
) -> AsyncIterator[str]:
    """The status as ``tenant`` sees it, as server-sent events (see the module doc)."""
    end = time.monotonic() + STREAM_LIFE_S
    sent: tuple[Any, str] = (None, "")
    sent_at = float("-inf")
    while not dash.closing and time.monotonic() < end:
        sample = await dash.board.sample()
        body = _body(dash, sample, tenant, limit=limit, since=since, query=query)
        since = body["events_next"]
        shape = (body["ready"], body["final"], [(a["id"], a["tier"]) for a in body["agents"]])
        plain = json.dumps({k: v for k, v in body.items() if k not in _CLOCKS}, sort_keys=True)
        age = time.monotonic() - sent_at
        if (
            body["events"]
            or shape != sent[0]
            or (plain != sent[1] and age >= STREAM_FIGURES_S)
            or age >= STREAM_QUIET_S
        ):
            sent, sent_at = (shape, plain), time.monotonic()
            yield "data: " + json.dumps(body, separators=(",", ":"), allow_nan=False) + "\n\n"
        await anyio.sleep(STREAM_EVERY_S)


def _body(
    dash: Dashboard, sample: Sample | None, tenant: Tenant, *, limit: int, since: int, query: str
) -> dict[str, Any]:
    """The status JSON of ``sample`` as ``tenant`` may see it."""
    board, activity = dash.board, dash.board.activity
    body: dict[str, Any] = {
        "object": "status",
        "instance": board.instance,
        "time": time.time(),
        "uptime_s": time.time() - dash.started,
        "final": board.final,
        "scope": {"tenant": tenant.label or None, "admin": tenant.admin},
        "events": [_shown(e, tenant) for e in activity.events(tenant.owns, since, MAX_EVENTS)],
        "events_next": activity.seq,
    }
    if sample is None:  # the session has not answered yet
        return {**body, "ready": False, "agents": [], "agents_total": 0, "models": []}
    rows = _rows(dash, sample, tenant)
    own_hot = sum(r["bytes"] for r in rows if r["tier"] == "hot")
    own_warm = sum(r["warm_bytes"] for r in rows)
    tiers = {t: sum(r["tier"] == t for r in rows) for t in ("hot", "warm", "cold")}
    shown = [r for r in rows if query in r["id"]] if query else rows
    shown.sort(key=lambda r: r["last_used"] or 0.0, reverse=True)
    body.update(
        ready=True,
        sampled_at=sample.t,
        memory=_memory(sample, tenant, own_hot),
        disk=_disk(sample, tenant, own_warm),
        totals={
            "agents": len(rows),
            **tiers,
            "hot_bytes": own_hot,
            "warm_bytes": own_warm,
            "tokens": sum(r["tokens"] for r in rows),
        },
        agents=shown[:limit],
        agents_total=len(shown),
        models=_models(sample, tenant),
    )
    if tenant.admin:  # the engine's counts are of every tenant
        s = sample.stats
        body["counters"] = {
            "turns": activity.turns,
            "demoted_warm": s.demoted_warm,
            "demoted_cold": s.demoted_cold + s.demoted_warm_to_cold,
            "reloads": s.installs,
            "moves_lost": activity.moves_lost,  # left a hot tier's log before it was read
            "decoding": s.decoding,
            "waiting": s.waiting,
            "generated_tokens": s.generated_tokens,
        }
    return body


def _shown(event: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    return {**event, "agent": tenant.local_id(event["agent"])}


def _rows(dash: Dashboard, sample: Sample, tenant: Tenant) -> list[dict[str, Any]]:
    """Every agent ``tenant`` may see: running, hot or with a warm cache."""
    activity = dash.board.activity
    by_print = {info.fingerprint: name for name, info in sample.models.items()}
    hot = {c.agent: c for c in sample.hot if tenant.owns(c.agent)}
    warm = {w.agent: w for w in sample.warm if tenant.owns(w.agent)}
    names = {n for n in sample.running if tenant.owns(n)} | set(hot) | set(warm)
    rows = []
    for name in names:
        w, h, last = warm.get(name), hot.get(name), activity.last_turn(name)
        model = sample.running.get(name) or (by_print.get(w.model_fingerprint, "") if w else "")
        used = [t for t in (dash.last_used.get(name), last and last["t"]) if t]
        if w is not None:
            used.append(w.updated)
        usable = w is not None and w.rejected is None
        rows.append(
            {
                "id": tenant.local_id(name),
                "tenant": dash.scope_of(name) or None,
                "model": model,
                "tier": "hot" if h else "warm" if usable else "cold",
                "tokens": h.tokens if h else w.tokens if w else 0,
                "bytes": h.nbytes if h else 0,
                "warm_bytes": w.nbytes if w else 0,
                "busy": bool(h and h.busy),
                "tool_wait_s": h.tool_wait_s if h else 0.0,
                "hint": activity.hint(name),
                "last_path": last and last["path"],
                "last_ttft_s": last and last["ttft_s"],
                "last_decode_tok_s": last and last["decode_tok_s"],
                "last_used": max(used) if used else None,
                "rejected": w.rejected if w else None,
            }
        )
    return rows


def _memory(sample: Sample, tenant: Tenant, own_hot: int) -> list[dict[str, Any]]:
    """One bar per limit: the session's memory limit split (weights, hot caches, ready
    and working copies, activations and MLX's buffers, free), then the hot budget's
    (when there is one). A tenant sees its own hot caches against each, nothing else."""
    s = sample.stats
    ready, working = s.ready_bytes, min(s.working_bytes, s.cache_bytes - s.ready_bytes)
    caches = [
        {"name": "hot caches", "bytes": max(s.cache_bytes - ready - working, 0)},
        {"name": "ready copies", "bytes": ready},
        {"name": "working copies", "bytes": working},
    ]
    bars = []
    if s.memory_limit_bytes is not None:
        other = max(s.memory_bytes - s.weights_bytes - s.cache_bytes, 0)
        parts = [{"name": "weights", "bytes": s.weights_bytes}, *caches]
        parts.append({"name": "activations and buffers", "bytes": other})
        used = max(s.memory_bytes, s.weights_bytes + s.cache_bytes)
        bars.append(_bar("memory limit", s.memory_limit_bytes, parts, used, s.memory_peak_bytes))
    if s.budget_bytes is not None:
        bars.append(_bar("hot budget", s.budget_bytes, caches, s.cache_bytes, s.peak_bytes))
    if not tenant.admin:
        mine = [{"name": "your hot caches", "bytes": own_hot}]
        return [{**bar, "parts": mine, "free_bytes": None, "peak_bytes": None} for bar in bars]
    return bars


def _bar(
    kind: str, limit: int, parts: list[dict[str, Any]], used: int, peak: int
) -> dict[str, Any]:
    return {
        "kind": kind,
        "limit_bytes": limit,
        "parts": parts,
        "free_bytes": max(limit - used, 0),
        "peak_bytes": peak,
    }


def _disk(sample: Sample, tenant: Tenant, own_warm: int) -> dict[str, Any] | None:
    """The disk bar (None without a disk limit): used and free, written today."""
    s = sample.stats
    if s.warm_limit_bytes is None:
        return None
    used = s.warm_bytes if tenant.admin else own_warm
    return {
        "limit_bytes": s.warm_limit_bytes,
        "used_bytes": used,
        "free_bytes": max(s.warm_limit_bytes - s.warm_bytes, 0) if tenant.admin else None,
        "written_today_bytes": s.warm_written_today_bytes if tenant.admin else None,
    }


def _models(sample: Sample, tenant: Tenant) -> list[dict[str, Any]]:
    out = []
    for m in sample.states:
        info = sample.models.get(m.name)
        row: dict[str, Any] = {
            "name": m.name,
            "loaded": m.loaded,
            "context_length": info.context_length if info else None,
        }
        if tenant.admin:
            row.update(
                pinned=m.pinned, weights_bytes=m.weights_bytes, loads=m.loads, idle_s=m.idle_s
            )
        out.append(row)
    return out


def _plain(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """``handler`` with its errors answered as JSON (the run's app has no other handler)."""

    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except Exception as exc:
            return error_response(Api.OPENAI, exc)

    return endpoint


def create_dashboard_app(board: Board) -> Starlette:
    """An app of the dashboard alone over ``board`` (``kvactor run --dashboard``: no keys,
    served on 127.0.0.1)."""
    routes = [
        Route("/dashboard", _plain(page), methods=["GET"]),
        Route("/dashboard/{name}", _plain(asset), methods=["GET"]),
        Route("/v1/status", _plain(status), methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.dashboard = Dashboard(board)
    return app


def new_board(activity: Activity | None = None) -> Board:
    """A board with no session yet (``kvactor run``: attached once the run opens one)."""
    return Board(None, activity or Activity())
