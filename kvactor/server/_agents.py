"""The agent routes: ``GET /v1/agents`` (each agent's tier and size; a hot one's
``tool_wait_s``: the seconds its cache is still kept hot for its tool calls' results),
``DELETE
/v1/agents/{id}`` (forget it; 409 while it answers a request), ``POST
/v1/agents/{id}/prefetch`` (stage its warm cache). Each sees only the agents of the
request's tenant, by the ids the tenant knows them by (an admin: every agent, by its
session id)."""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors.errors import UnknownAgent
from ..actors.warm import Forgotten, WarmInfo
from ._errors import ApiError
from ._served import Served
from ._state import server_state, tenant_of
from ._tenants import Tenant


async def _row(
    session: Served,
    name: str,
    shown: str,
    warm: WarmInfo | None,
    last_used: float | None,
    host: str | None,
) -> dict[str, Any]:
    """One agent as ``GET /v1/agents`` lists it (``shown``: the id the client knows it
    by); ``warm``: its warm cache, if any; ``host``: a cluster's host that runs it."""
    row: dict[str, Any] = {
        "id": shown,
        "tier": "cold",
        "form": None,
        "tokens": 0,
        "bytes": 0,
        "warm_bytes": 0,
        "last_used": None,
    }
    if warm is not None:
        row.update(
            tier="warm",
            form="file",
            tokens=warm.tokens,
            warm_bytes=warm.nbytes,
            last_used=warm.updated,
            rejected=warm.rejected,
        )
    with contextlib.suppress(UnknownAgent):  # no hot cache: warm or cold
        info = await session.cache_info(name)
        row.update(
            tier="hot",
            form="quantized",
            tokens=info.tokens,
            bytes=info.nbytes,
            busy=info.busy,
            tool_wait_s=info.tool_wait_s,
        )
    if last_used is not None:
        row["last_used"] = last_used
    if host is not None:
        row["host"] = host
    return row


async def agents(request: Request) -> Response:
    """``GET /v1/agents``: every agent running or with a warm cache, by id."""
    state = server_state(request)
    tenant = tenant_of(request)
    session = state.session
    warm = {w.agent: w for w in await session.warm_agents() if tenant.owns(w.agent)}
    running = session.agents  # one copy, not one per row
    names = sorted({n for n in running if tenant.owns(n)} | set(warm))
    used = state.agents.last_used
    rows = [
        await _row(
            session,
            name,
            tenant.local_id(name),
            warm.get(name),
            used.get(name),
            getattr(running.get(name), "host", None),  # a cluster's agent: where it runs
        )
        for name in names
    ]
    return JSONResponse({"object": "list", "data": rows})


def _kept(tenant: Tenant, done: Forgotten) -> list[dict[str, Any]]:
    """The shared files a forget kept, with the users the tenant may see."""
    return [
        {
            "file": k.file,
            "bytes": k.nbytes,
            "used_by": [tenant.local_id(u) for u in k.users if tenant.owns(u)],
        }
        for k in done.kept
    ]


async def forget(request: Request) -> Response:
    """``DELETE /v1/agents/{agent_id}``: forget the agent (its own bytes, hot and warm).
    Raises InvalidAgentId / ApiError (400) for a hostile id, ApiError: 404 for an unknown
    one, 409 while it answers a request."""
    state = server_state(request)
    tenant = tenant_of(request)
    name = request.path_params["agent_id"]
    full = tenant.full_id(name)
    session = state.session
    known = full in session.agents or full in await session.warm_names()
    if not known:
        raise ApiError(404, f"no agent {name!r}", code="agent_not_found")
    done = await state.agents.forget(full)
    return JSONResponse(
        {
            "id": name,
            "object": "agent.deleted",
            "deleted": True,
            "freed_bytes": done.freed,
            "kept_shared": _kept(tenant, done),
        }
    )


async def prefetch(request: Request) -> Response:
    """``POST /v1/agents/{agent_id}/prefetch``: stage the agent's warm cache hot (202).
    Raises InvalidAgentId (a 400) for a hostile id, ApiError (404) without a warm cache."""
    state = server_state(request)
    name = request.path_params["agent_id"]
    full = tenant_of(request).full_id(name)
    if full not in await state.session.warm_names():  # one listing, no manifest read
        raise ApiError(404, f"agent {name!r} has no warm cache", code="agent_not_found")
    await state.session.prefetch(full)
    state.prefetched.add(full)
    return JSONResponse({"id": name, "prefetching": True}, status_code=202)
