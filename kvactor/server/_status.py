"""What the server says about itself: ``GET /health`` and ``GET /metrics`` (Prometheus).

With keys, ``/health`` answers anyone (a liveness probe needs no key) but tells the
requests in flight only to an admin, and ``/metrics`` answers admin keys only: its
counts and the engine's figures are of every tenant together, so a tenant who watched
them could learn of another's turns and caches."""

from __future__ import annotations

from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors.cluster import ServedCluster
from ._errors import ApiError
from ._state import server_state, tenant_of


async def health(request: Request) -> Response:
    """``GET /health``: ok, the model id (the first model's), every model served, the
    turn requests in flight and a cluster's engine hosts (for an admin, or anyone without
    keys)."""
    state = server_state(request)
    tenant = getattr(request.state, "tenant", None)  # None: no valid key presented
    models = list(state.models or (state.model_id,))
    body: dict[str, Any] = {"status": "ok", "model": state.model_id, "models": models}
    if tenant is not None and tenant.admin:
        body["in_flight"] = state.admission.pending
        if isinstance(state.session, ServedCluster):
            body["hosts"] = [
                {"name": h.name, "node": h.node, "pid": h.pid, "agents": len(h.agents)}
                for h in await state.session.cluster.hosts()
            ]
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: every metric in Prometheus' text format. Raises ApiError (403)
    for a tenant's key: the figures are of every tenant."""
    state = server_state(request)
    if not tenant_of(request).admin:
        raise ApiError(
            403, "/metrics needs an admin key: its figures are of every tenant", "permission_error"
        )
    return Response(await state.metrics.render(state.session), media_type=CONTENT_TYPE_LATEST)
