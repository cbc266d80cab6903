"""``kvactor serve``: an OpenAI- and Anthropic-compatible HTTP server where every
conversation is an agent.

The app is a function of an open :class:`~kvactor.Session` (:func:`create_app`), so an
asyncio application can mount it beside its own routes; :func:`serve` opens a session and
runs the app under uvicorn (the ``kvactor[server]`` extra: Starlette, uvicorn,
prometheus-client).

A request names its agent with the ``X-Agent-Id`` header, else OpenAI's ``user`` field,
else Anthropic's ``metadata.user_id``. Each id is one agent actor with its own cache (hot,
warm, cold as in the Python API); clients resend the whole conversation, and prefix
matching turns it into an EXTEND of what the cache holds. A request without an id goes to
the anonymous agent whose last conversation is the longest prefix of this one (a new one
when none is), so plain clients benefit too; at most ``max_anonymous`` of them are kept.

With API keys (``create_app(api_keys=..., admin_keys=...)``, ``kvactor serve --api-key``)
every request but ``/health`` needs one (401 in its API's shape without), and each key is a
tenant: its agents live in a namespace of their own (``<label>.<id>`` on the session), share
cached prefixes only with each other, and are all that its listing, forget, prefetch and
anonymous routing see; an admin key sees every agent and reads ``/metrics``. See
docs/serving-others.md.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST
/v1/messages`` (Anthropic), ``GET /health``, ``GET /v1/agents``, ``DELETE /v1/agents/{id}``,
``POST /v1/agents/{id}/prefetch``, ``POST /v1/agents/{id}/hint`` (``expect_in_s``,
``priority``, ``done``), ``GET`` / ``PUT /v1/agents/{id}/cache`` (the agent's portable
file, streamed out and in), ``GET /metrics`` (Prometheus text), ``GET /dashboard`` (a live
page of agents, tiers and memory) and ``GET /v1/status`` (its JSON). A turn request may say which
agents run after it (``X-KVActor-Next``) and which are done for now (``X-KVActor-Done``):
hints for the memory policy. Errors come in each API's own shape: 400 for malformed JSON
(nested too deep, too many values), unknown fields, a field of the wrong type, bad values,
hostile agent ids and a prompt over the model's context (saying the limit), 401 without a
valid key, 403 for /metrics without an admin key, 404 for an unknown model or agent, 409 for
forgetting an agent that is answering a request, 413 for a body over ``max_body_bytes``, 429
(with ``Retry-After``) when ``max_pending`` requests are already in flight, 503 (with
``Retry-After``) when the hot budget cannot hold a turn. A client that disconnects, before
or during its turn, streaming or not, cancels it, which frees its batch slot. Bodies are
parsed on a worker thread: nothing a client sends holds the event loop.

The modules, one concept each: ``_app`` (the app, its routes, the key check, the one error
handler), ``_openai`` and ``_anthropic`` (the two APIs), ``_agents`` and ``_status`` (agent
routes, health, metrics), ``_carry`` (an agent's file out and in), ``_turn`` (running a turn
whole or streamed, cancelled when its client leaves), ``_admission`` (requests in flight),
``_routing`` (which agent answers), ``_tenants`` (keys and tenants), ``_request`` and
``_json`` (body checks), ``_errors``, ``_metrics``, ``_state`` (what the routes share),
``_serve`` (uvicorn, signals, the default budget), ``_cli`` (``kvactor serve``'s arguments),
``_dashboard`` (``/dashboard`` and ``/v1/status``), ``_board`` (what it samples of the
session), ``_activity`` (the recent turns and demotions it shows).
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "kvactor's server needs its extra: pip install 'kvactor[server]' "
        f"(Starlette, uvicorn, prometheus-client): {exc}"
    ) from exc

from ._activity import TurnSeen as TurnSeen
from ._app import create_app as create_app
from ._cli import run_serve as run_serve
from ._dashboard import new_board as new_board
from ._serve import serve as serve
from ._serve import serve_dashboard as serve_dashboard

__all__ = ("TurnSeen", "create_app", "new_board", "run_serve", "serve", "serve_dashboard")
