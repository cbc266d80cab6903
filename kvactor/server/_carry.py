"""Carrying an agent between servers: ``GET /v1/agents/{id}/cache`` streams the agent's
portable file (its warm cache as one verified file: docs/moving-agents.md) and ``PUT
/v1/agents/{id}/cache`` takes one as the request body, streamed into the warm tier and
verified before the agent exists (201; ``?replace=true`` replaces an agent of that id).

Both are tenant-checked as the other agent routes are: the id is the tenant's own,
namespaced into its ``<label>.<id>`` on the session, so a tenant never reads nor
overwrites another's agent. A body past ``max_import_bytes`` is a 413 (refused from its
``Content-Length`` before any byte is read, else once the bytes read pass it); a file
refused (another model, tokenizer or codec, a newer format, truncated or altered, past the
disk limit, the tenant's quota or the hot budget) a 422 with the reason; an id already
taken a 409. Nothing of a refused import stays."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..actors.errors import (
    AgentExists,
    CacheRejected,
    CacheTooLarge,
    StoreWriteError,
    UnknownAgent,
)
from ._errors import ApiError
from ._routing import ANONYMOUS
from ._state import ServerState, server_state, tenant_of

MEDIA_TYPE = "application/octet-stream"
SUFFIX = ".kvagent"


def _too_big(limit: int) -> ApiError:
    return ApiError(
        413, f"an agent file of this server takes at most {limit} bytes", code="request_too_large"
    )


def _rejected(exc: CacheRejected, status: int = 422) -> ApiError:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, f"agent file refused: {exc.reason}", kind=kind, code="cache_rejected")


def _no_room(exc: StoreWriteError) -> ApiError:
    return ApiError(507, str(exc), kind="server_error", code="insufficient_storage")


async def export_cache(request: Request) -> Response:
    """``GET /v1/agents/{agent_id}/cache``: the agent's portable file, streamed. Raises
    InvalidAgentId / ApiError: 400 for a hostile id, 404 without a warm cache, 500 when
    a file of it fails its checksum, 507 when its last turns are not on disk."""
    state = server_state(request)
    name = request.path_params["agent_id"]
    full = tenant_of(request).full_id(name)
    try:
        stream = await state.session.export_stream(full)
    except UnknownAgent:
        raise ApiError(404, f"agent {name!r} has no warm cache", code="agent_not_found") from None
    except CacheRejected as exc:
        raise _rejected(exc, 500) from None
    except StoreWriteError as exc:
        raise _no_room(exc) from None
    headers = {
        "Content-Disposition": f'attachment; filename="{name}{SUFFIX}"',
        "X-KVActor-Tokens": str(stream.header.tokens),
        "X-KVActor-Cache-Bytes": str(stream.header.nbytes),
    }
    return StreamingResponse(stream, media_type=MEDIA_TYPE, headers=headers)


def _replace(request: Request) -> bool:
    """The ``replace`` query parameter. Raises ApiError unless true or false (or unset)."""
    value = request.query_params.get("replace", "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise ApiError(400, f"'replace' must be true or false, got {value[:20]!r}", param="replace")
    return value in ("true", "1")


def _model(request: Request, state: ServerState) -> str | None:
    """The model the import is for: the ``model`` query parameter on a server of several
    models (default: its first), else None. Raises ApiError (404) for a model not served."""
    model = request.query_params.get("model")
    if not state.models or model is None:
        return None
    if model == "default":
        return state.models[0]
    if model not in state.models:
        raise ApiError(404, f"this server serves no model {model[:40]!r}", code="model_not_found")
    return model


async def _limited(
    pieces: AsyncIterator[bytes], limit: int, seen: list[int]
) -> AsyncIterator[bytes]:
    """The body's pieces (their bytes counted in ``seen[0]``); raises ApiError (413) once
    they pass ``limit`` bytes."""
    async for piece in pieces:
        seen[0] += len(piece)
        if seen[0] > limit:
            raise _too_big(limit)
        yield piece


def _refused(exc: Exception, taken: ApiError) -> Exception:
    """What an import's refusal ``exc`` answers (``taken``: for a name already taken)."""
    if isinstance(exc, CacheRejected):
        if isinstance(exc, CacheTooLarge):  # its header says it is bigger than the limit
            return ApiError(413, f"agent file refused: {exc.reason}", code="request_too_large")
        return _rejected(exc)
    if isinstance(exc, StoreWriteError):
        return _no_room(exc)
    if isinstance(exc, AgentExists):
        return taken  # an agent of that name came meanwhile, or a cold one has it
    return exc


async def import_cache(request: Request) -> Response:
    """``PUT /v1/agents/{agent_id}/cache``: the body, a portable file, imported as the
    agent (201 with its id, tokens and bytes). Raises InvalidAgentId / ApiError: 400 for
    a hostile or reserved id, 409 for an id taken (without ``?replace=true``) or an agent
    answering a request, 413 past ``max_import_bytes``, 422 for a file refused (the
    reason), 507 when the disk limit leaves no room."""
    state = server_state(request)
    tenant = tenant_of(request)
    name = request.path_params["agent_id"]
    if name.startswith(ANONYMOUS):
        raise ApiError(
            400, f"agent ids starting with {ANONYMOUS!r} are the server's own", param="agent_id"
        )
    full = tenant.full_id(name)
    replace, model = _replace(request), _model(request, state)
    limit = state.max_import_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_big(limit)
    taken = ApiError(
        409,
        f"agent {name!r} already exists: PUT with ?replace=true to replace it",
        code="agent_exists",
        param="agent_id",
    )
    if not replace and full in state.session.agents:
        raise taken  # before any byte is read
    seen = [0]
    # An import is a request like a turn (it takes an admission slot), and holds the
    # agent: a turn for it that comes meanwhile waits for the import to end.
    async with state.admission.slot(), state.agents.importing(full):
        try:
            agent = await state.session.import_agent(
                _limited(request.stream(), limit, seen),
                full,
                replace=replace,
                model=model,
                scope=state.keys.scope_of(full),
                max_bytes=limit,
            )
        except (CacheRejected, StoreWriteError, ValueError) as exc:
            raise _refused(exc, taken) from None
        tokens = (await agent.state()).tokens  # not a listing of every agent: one ask
    return JSONResponse(
        {"id": name, "object": "agent", "tokens": tokens, "bytes": seen[0]}, status_code=201
    )
