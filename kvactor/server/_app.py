"""The ASGI app: :func:`create_app` builds a Starlette app over an open session from the
plain list of routes below; every route's errors go through one handler
(:func:`~._errors.error_response`) in its client API's shape, and every answer is counted in
``kvactor_http_requests`` by route and status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..actors import Session
from . import _agents, _anthropic, _openai, _status
from ._errors import Api, error_response
from ._state import ServerState, server_state

Handler = Callable[[Request], Awaitable[Response]]


def _answered(name: str, api: Api, handler: Handler) -> Handler:
    """``handler`` with its errors answered in ``api``'s shape and its status counted."""

    async def endpoint(request: Request) -> Response:
        status = 500  # counted so when the request is cancelled
        try:
            try:
                response = await handler(request)
            except Exception as exc:
                response = error_response(api, exc)
            status = response.status_code
            return response
        finally:
            server_state(request).metrics.requests.labels(name, str(status)).inc()

    return endpoint


def _route(path: str, name: str, method: str, api: Api, handler: Handler) -> Route:
    return Route(path, _answered(name, api, handler), methods=[method], name=name)


_O, _A = Api.OPENAI, Api.ANTHROPIC
ROUTES = (
    _route("/v1/chat/completions", "chat", "POST", _O, _openai.chat_completions),
    _route("/v1/completions", "completions", "POST", _O, _openai.completions),
    _route("/v1/messages", "messages", "POST", _A, _anthropic.messages_route),
    _route("/v1/models", "models", "GET", _O, _openai.models),
    _route("/health", "health", "GET", _O, _status.health),
    _route("/v1/agents", "agents", "GET", _O, _agents.agents),
    _route("/v1/agents/{agent_id}", "forget", "DELETE", _O, _agents.forget),
    _route("/v1/agents/{agent_id}/prefetch", "prefetch", "POST", _O, _agents.prefetch),
    _route("/metrics", "metrics", "GET", _O, _status.metrics),
)


def create_app(
    session: Session,
    *,
    model_id: str | None = None,
    max_pending: int = 64,
    max_body_bytes: int = 16 << 20,
    max_anonymous: int = 16,
) -> Starlette:
    """The ASGI app over an open session (mount it in an asyncio application, or let
    :func:`~kvactor.server.serve` run it). ``model_id``: the id clients name (default: the
    model's name; ``"default"`` is always accepted); ``max_pending``: requests in flight
    before 429s; ``max_body_bytes``: the largest request body (413 past it);
    ``max_anonymous``: anonymous agents kept (the least recently used idle one is
    forgotten past it). The app needs no lifespan: the session is the caller's to open
    and close."""
    app = Starlette(routes=list(ROUTES))
    app.state.kvactor = ServerState.build(
        session,
        model_id=model_id or session.model.name,
        max_pending=max_pending,
        max_body_bytes=max_body_bytes,
        max_anonymous=max_anonymous,
    )
    return app
