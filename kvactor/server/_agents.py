"""The agent routes: ``GET /v1/agents`` (each agent's tier and size), ``DELETE
/v1/agents/{id}`` (forget it), ``POST /v1/agents/{id}/prefetch`` (stage its warm cache)."""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..actors import Session, UnknownAgent, WarmInfo
from ..actors.protocol import check_agent_id
from ._errors import ApiError
from ._state import server_state


async def _row(
    session: Session, name: str, warm: WarmInfo | None, last_used: float | None
) -> dict[str, Any]:
    """One agent as ``GET /v1/agents`` lists it; ``warm``: its warm cache, if any."""
    row: dict[str, Any] = {
        "id": name,
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
            tier="hot", form="quantized", tokens=info.tokens, bytes=info.nbytes, busy=info.busy
        )
    if last_used is not None:
        row["last_used"] = last_used
    return row


async def agents(request: Request) -> Response:
    """``GET /v1/agents``: every agent running or with a warm cache, by id."""
    state = server_state(request)
    session = state.session
    warm = {w.agent: w for w in await session.warm_agents()}
    names = sorted(set(session.agents) | set(warm))
    used = state.agents.last_used
    rows = [await _row(session, name, warm.get(name), used.get(name)) for name in names]
    return JSONResponse({"object": "list", "data": rows})


async def forget(request: Request) -> Response:
    """``DELETE /v1/agents/{agent_id}``: forget the agent (its own bytes, hot and warm).
    Raises InvalidAgentId (a 400) for a hostile id, ApiError (404) for an unknown one."""
    state = server_state(request)
    name = check_agent_id(request.path_params["agent_id"])
    session = state.session
    known = name in session.agents or any(w.agent == name for w in await session.warm_agents())
    if not known:
        raise ApiError(404, f"no agent {name!r}", code="agent_not_found")
    done = await state.agents.forget(name)
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
    """``POST /v1/agents/{agent_id}/prefetch``: stage the agent's warm cache hot (202).
    Raises InvalidAgentId (a 400) for a hostile id, ApiError (404) without a warm cache."""
    state = server_state(request)
    name = check_agent_id(request.path_params["agent_id"])
    if not any(w.agent == name for w in await state.session.warm_agents()):
        raise ApiError(404, f"agent {name!r} has no warm cache", code="agent_not_found")
    await state.session.prefetch(name)
    state.prefetched.add(name)
    return JSONResponse({"id": name, "prefetching": True}, status_code=202)
