"""The ASGI app: :func:`create_app` builds a Starlette app over an open session from the
plain list of routes below; every route checks the request's key first (a 401 without a
valid one, when the app has keys; ``/health`` needs none), its errors go through one
handler (:func:`~._errors.error_response`) in its client API's shape, and every answer is
counted in ``kvactor_http_requests`` by route and status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import _agents, _anthropic, _carry, _dashboard, _hints, _openai, _status
from ._errors import Api, ApiError, error_response
from ._served import Served
from ._state import DEFAULT_MAX_IMPORT_BYTES, ServerState, server_state
from ._tenants import Keys

Handler = Callable[[Request], Awaitable[Response]]

_NO_KEY = "a valid API key is needed: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"


def _answered(name: str, api: Api, handler: Handler, *, open_route: bool = False) -> Handler:
    """``handler`` behind the key check (``open_route``: none needed), with its errors
    answered in ``api``'s shape and its status counted."""

    async def endpoint(request: Request) -> Response:
        state = server_state(request)
        status = 500  # counted so when the request is cancelled
        try:
            try:
                tenant = state.keys.tenant(request.headers)
                if tenant is None and not open_route:
                    raise ApiError(401, _NO_KEY, code="invalid_api_key")
                request.state.tenant = tenant
                response = await handler(request)
            except Exception as exc:
                response = error_response(api, exc)
            status = response.status_code
            return response
        finally:
            state.metrics.requests.labels(name, str(status)).inc()

    return endpoint


def _route(
    path: str, name: str, method: str, api: Api, handler: Handler, open_route: bool = False
) -> Route:
    endpoint = _answered(name, api, handler, open_route=open_route)
    return Route(path, endpoint, methods=[method], name=name)


_O, _A = Api.OPENAI, Api.ANTHROPIC
ROUTES = (
    _route("/v1/chat/completions", "chat", "POST", _O, _openai.chat_completions),
    _route("/v1/completions", "completions", "POST", _O, _openai.completions),
    _route("/v1/messages", "messages", "POST", _A, _anthropic.messages_route),
    _route("/v1/models", "models", "GET", _O, _openai.models),
    _route("/health", "health", "GET", _O, _status.health, open_route=True),
    _route("/v1/agents", "agents", "GET", _O, _agents.agents),
    _route("/v1/agents/{agent_id}", "forget", "DELETE", _O, _agents.forget),
    _route("/v1/agents/{agent_id}/prefetch", "prefetch", "POST", _O, _agents.prefetch),
    _route("/v1/agents/{agent_id}/hint", "hint", "POST", _O, _hints.agent_hint),
    _route("/v1/agents/{agent_id}/cache", "export", "GET", _O, _carry.export_cache),
    _route("/v1/agents/{agent_id}/cache", "import", "PUT", _O, _carry.import_cache),
    _route("/metrics", "metrics", "GET", _O, _status.metrics),
    # The dashboard checks the key of /v1/status itself: the page and its files hold no data.
    _route("/v1/status", "status", "GET", _O, _dashboard.status, open_route=True),
    _route("/dashboard", "dashboard", "GET", _O, _dashboard.page, open_route=True),
    _route("/dashboard/{name}", "dashboard_file", "GET", _O, _dashboard.asset, open_route=True),
)


def create_app(
    session: Served,
    *,
    model_id: str | None = None,
    strict_model: bool = False,
    max_pending: int = 64,
    max_body_bytes: int = 16 << 20,
    max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
    max_anonymous: int = 16,
    api_keys: Iterable[str] = (),
    admin_keys: Iterable[str] = (),
) -> Starlette:
    """The ASGI app over an open session (mount it in an asyncio application, or let
    :func:`~kvactor.server.serve` run it). ``model_id``: the id ``/v1/models`` lists and
    replies name (default: the model's name); a request may name any model (the one
    served answers), unless ``strict_model``: then only ``model_id`` or ``"default"``,
    else a 404. ``max_pending``: requests in flight
    before 429s; ``max_body_bytes``: the largest request body (413 past it);
    ``max_import_bytes``: the largest agent file ``PUT /v1/agents/{id}/cache`` takes
    (413 past it);
    ``max_anonymous``: anonymous agents kept per tenant (the least recently used idle one
    is forgotten past it). ``api_keys``: key entries (``KEY`` or ``NAME:KEY``, optionally
    then ``admin``: see ``kvactor.server._tenants``), each a tenant that sees only its own
    agents; ``admin_keys``: keys that see every agent and read ``/metrics``. Without
    either, every client sees everything (no authentication). The app needs no
    lifespan: the session is the caller's to open and close. Raises ValueError for a
    malformed key entry."""
    app = Starlette(routes=list(ROUTES))
    state = app.state.kvactor = ServerState.build(
        session,
        model_id=model_id or session.model.name,
        strict_model=strict_model,
        max_pending=max_pending,
        max_body_bytes=max_body_bytes,
        max_import_bytes=max_import_bytes,
        max_anonymous=max_anonymous,
        keys=Keys(api_keys, admin_keys),
    )
    app.state.dashboard = state.dashboard
    return app
