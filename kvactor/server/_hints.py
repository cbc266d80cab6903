"""Hints over HTTP (``Session.hint``): a turn request's ``X-KVActor-Next`` header (the ids
of the agents that run after it, soonest first, comma-separated) and ``X-KVActor-Done``
(agents done for now), and ``POST /v1/agents/{id}/hint`` with a JSON body of
``expect_in_s``, ``priority``, ``done`` (all optional). Ids are the tenant's own, as in
every agent route; an agent the server does not know is fine (hints are advice), a
hostile id or a value of the wrong type is a 400. A conversation whose turn ended in tool
calls needs no hint: its cache is kept hot for ``tool_wait_s`` anyway."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._errors import ApiError
from ._request import decode, read_body, shown
from ._state import server_state, tenant_of

__all__ = ("NEXT_HEADER", "DONE_HEADER", "agent_hint", "header_hints")

NEXT_HEADER = "x-kvactor-next"
DONE_HEADER = "x-kvactor-done"
_MAX_NAMED = 64  # agents one header may name
_HINT_BODY = 4096  # bytes of a hint route's body


def _ids(request: Request, header: str) -> list[str]:
    """The tenant's session ids of the agents ``header`` names. Raises ApiError /
    InvalidAgentId (400s) for too many or a hostile one."""
    raw = request.headers.get(header, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if len(names) > _MAX_NAMED:
        raise ApiError(400, f"{header} names at most {_MAX_NAMED} agents", param=header)
    tenant = tenant_of(request)
    return [tenant.full_id(n) for n in names]


async def header_hints(request: Request) -> None:
    """Give the session the hints of a turn request's headers (none: nothing). Raises
    ApiError / InvalidAgentId (400s) for a malformed header."""
    following, done = _ids(request, NEXT_HEADER), _ids(request, DONE_HEADER)
    if following or done:
        state = server_state(request)
        await state.session.hint(next=following, done=done)
        for rank, agent in enumerate(following):
            state.activity.hinted(agent, "next" if rank == 0 else f"next +{rank}")
        for agent in done:
            state.activity.hinted(agent, "done")


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ApiError(400, f"'{name}' must be a number, got {shown(value)}", param=name)
    return value


async def agent_hint(request: Request) -> Response:
    """``POST /v1/agents/{agent_id}/hint``: advice about one agent (202): its next turn
    in ``expect_in_s`` seconds, its ``priority``, or ``done`` for now. Raises ApiError
    (400) for an unknown field or a value of the wrong type or range, InvalidAgentId for
    a hostile id."""
    state = server_state(request)
    name = request.path_params["agent_id"]
    full = tenant_of(request).full_id(name)
    raw = await read_body(request, _HINT_BODY)
    body = decode(raw) if raw.strip() else {}
    unknown = sorted(set(body) - {"expect_in_s", "priority", "done"})
    if unknown:
        raise ApiError(400, f"Unrecognized hint field: {unknown[0][:40]}", param=unknown[0][:64])
    wait = _number(body, "expect_in_s")
    rank = body.get("priority")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ApiError(400, f"'priority' must be an integer, got {shown(rank)}", param="priority")
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise ApiError(400, f"'done' must be a boolean, got {shown(done)}", param="done")
    try:
        await state.session.hint(
            expect_in_s=None if wait is None else {full: wait},
            priority=None if rank is None else {full: rank},
            done=[full] if done else [],
        )
    except ValueError as exc:
        raise ApiError(400, str(exc).replace(full, name)) from None
    said = [] if wait is None else [f"in {wait:g} s"]
    said += [] if rank is None else [f"priority {rank}"]
    state.activity.hinted(full, "done" if done else ", ".join(said) or "none")
    return JSONResponse({"id": name, "hinted": True}, status_code=202)
