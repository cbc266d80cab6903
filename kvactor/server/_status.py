"""What the server says about itself: ``GET /health`` and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._state import server_state


async def health(request: Request) -> Response:
    """``GET /health``: ok, the model id, the turn requests in flight."""
    state = server_state(request)
    return JSONResponse(
        {"status": "ok", "model": state.model_id, "in_flight": state.admission.pending}
    )


async def metrics(request: Request) -> Response:
    """``GET /metrics``: every metric in Prometheus' text format."""
    state = server_state(request)
    return Response(await state.metrics.render(state.session), media_type=CONTENT_TYPE_LATEST)
