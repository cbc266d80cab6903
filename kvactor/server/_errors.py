"""Errors answered in each client API's own shape: :class:`ApiError`, what an exception
means for a client (:func:`as_api_error`), and the one response for it
(:func:`error_response`)."""

from __future__ import annotations

import enum

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from ..actors.errors import (
    BudgetExceeded,
    ContextOverflow,
    EngineStopped,
    HostLost,
    InvalidAgentId,
    TurnEnded,
)


class Api(enum.Enum):
    """The client API a route speaks, which picks the shape of its errors."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ApiError(Exception):
    """An error answered in the API's own shape; ``kind`` is OpenAI's ``type``;
    ``retry_after``: seconds, sent as ``Retry-After``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client left before its answer was ready (its turn was cancelled)."""


# Anthropic's error type by status (OpenAI's is the ApiError's kind).
_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

# The status a client that left before its request was read is counted under (nginx's).
CLIENT_CLOSED = 499


def ended() -> ApiError:
    """What a turn that the server's drain ended answers (a 503)."""
    return ApiError(
        503,
        "the server is shutting down: this turn was ended",
        kind="server_error",
        code="shutting_down",
        retry_after=5,
    )


def as_api_error(exc: Exception) -> ApiError:
    """What ``exc``, raised while answering a request, tells the client."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextOverflow):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, BudgetExceeded):
        message = f"the hot memory budget cannot hold this turn now: {exc}"
        return ApiError(503, message, kind="server_error", code="budget_exceeded", retry_after=5)
    if isinstance(exc, InvalidAgentId):
        return ApiError(400, str(exc), param="agent_id")
    if isinstance(exc, TypeError | ValueError):
        return ApiError(400, str(exc))
    if isinstance(exc, TurnEnded):
        return ended()
    if isinstance(exc, HostLost):  # the next request runs on a live host
        return ApiError(503, str(exc), kind="server_error", code="host_lost", retry_after=1)
    if isinstance(exc, EngineStopped):
        return ApiError(503, "the engine stopped", kind="server_error")
    return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


def error_response(api: Api, exc: Exception) -> Response:
    """The response to a request that raised ``exc``, in ``api``'s error shape (an empty
    499 when the client left); a 429 or 503 says when to retry (``Retry-After``), a 401
    how to authenticate."""
    if isinstance(exc, ClientDisconnect | ClientGone):
        return Response(status_code=CLIENT_CLOSED)
    err = as_api_error(exc)
    if api is Api.ANTHROPIC:
        kind = _ANTHROPIC_KINDS.get(err.status, "api_error")
        body: dict[str, object] = {"type": "error", "error": {"type": kind, "message": err.message}}
    else:
        body = {
            "error": {
                "message": err.message,
                "type": err.kind,
                "param": err.param,
                "code": err.code,
            }
        }
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=err.status, headers=headers)
