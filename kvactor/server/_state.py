"""What every route of one app shares (on ``app.state.kvactor``): the session, the model id
clients name, the keys, the limits, the metrics, admission and the agent routing."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request

from ..actors.enums import FinishReason
from ..actors.records import Completion
from ._activity import Activity, TurnSeen
from ._admission import Admission
from ._board import Board
from ._dashboard import Dashboard
from ._metrics import Metrics
from ._routing import AgentRouter, Conversation
from ._served import Served, ServedAgent
from ._tenants import Keys, Tenant

log = logging.getLogger(__name__)

DEFAULT_MAX_IMPORT_BYTES = 16 << 30  # the largest agent file a PUT takes, by default


@dataclass
class ServerState:
    """One app's state; made by ``create_app``."""

    session: Served
    model_id: str
    models: tuple[str, ...]  # several models: the names requests choose among (else any)
    strict_model: bool  # only model_id (or "default") is a model's name; else any is
    max_body_bytes: int
    max_import_bytes: int  # the largest agent file PUT /v1/agents/{id}/cache takes
    max_prompt_chars: int  # past it no prompt fits the context: refused before any work
    keys: Keys
    metrics: Metrics
    admission: Admission
    agents: AgentRouter
    dashboard: Dashboard  # what /dashboard and /v1/status read (the recent turns included)
    created: int = field(default_factory=lambda: int(time.time()))
    # Agents staged by the prefetch route and not used since (their next turn is labelled).
    prefetched: set[str] = field(default_factory=set)
    # Invariant: the scopes of the turns a drain would end now; only drainable() adds.
    _drainable: set[anyio.CancelScope] = field(default_factory=set)
    draining: bool = False  # end_turns() was called: no turn starts now
    cutting: bool = False  # end_turns()'s grace is over: every turn is cancelled at once
    # Big bodies are parsed one at a time (``_request.parse_off_loop``).
    big_bodies: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))

    @classmethod
    def build(
        cls,
        session: Served,
        *,
        model_id: str,
        strict_model: bool,
        max_pending: int,
        max_body_bytes: int,
        max_anonymous: int,
        max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
        keys: Keys,
    ) -> ServerState:
        """The state of a new app over ``session``."""
        metrics = Metrics()
        router = AgentRouter(session, max_anonymous, keys.scope_of)
        board = Board(session, Activity())
        return cls(
            session=session,
            model_id=model_id,
            models=session.model_names,
            strict_model=strict_model,
            max_body_bytes=max_body_bytes,
            max_import_bytes=max_import_bytes,
            max_prompt_chars=session.max_prompt_chars,
            keys=keys,
            metrics=metrics,
            admission=Admission(max_pending, metrics.in_flight),
            agents=router,
            dashboard=Dashboard(board, keys, keys.scope_of, router.last_used),
        )

    @contextlib.contextmanager
    def drainable(self, *, starting: bool = False) -> Iterator[anyio.CancelScope]:
        """A scope :meth:`end_turns` cancels (see its ``cancelled_caught`` after): at once
        for a turn ``starting`` once the drain ended turns, else once its grace is over."""
        scope = anyio.CancelScope()
        if self.cutting or (starting and self.draining):
            scope.cancel()
        self._drainable.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._drainable.discard(scope)

    async def end_turns(self, grace_s: float = 3.0) -> None:
        """The server is stopping and its drain time is up: no turn starts now, and the
        session ends the running ones (``Session.end_turns``: a decoding turn at its next
        step, saved as any turn); each is answered as ended in its API's shape. What
        still runs ``grace_s`` later is cancelled."""
        self.draining = True
        deadline = anyio.current_time() + grace_s
        with anyio.move_on_after(grace_s):
            try:
                await self.session.end_turns()
            except Exception as exc:  # the engine is gone: the cancel below ends them
                log.warning("could not end the turns in the engine: %s", exc)
        await anyio.sleep_until(deadline)  # meanwhile turns end and their agents save them
        self.cutting = True
        for scope in list(self._drainable):
            scope.cancel()

    def vocab_size(self, model: str | None) -> int:
        """The vocabulary size of ``model`` (None: the session's first model)."""
        info = self.session.model if model is None else self.session.models[model]
        return info.vocab_size

    def finished(self, agent: ServedAgent, done: Completion, conversation: Conversation) -> None:
        """A turn is over: remember its conversation (anonymous routing; not of a turn the
        drain ended, which its client will not send again), count it."""
        if done.finish_reason != FinishReason.ENDED:
            self.agents.remember(agent, conversation)
        prefetched = agent.name in self.prefetched
        self.prefetched.discard(agent.name)
        self.metrics.turn(done, prefetched)
        self.activity.turn(TurnSeen.of(agent.name, done, prefetched))

    @property
    def activity(self) -> Activity:
        """The recent turns, demotions and hints the dashboard shows."""
        return self.dashboard.board.activity


def server_state(request: Request) -> ServerState:
    """The state of the app answering ``request``."""
    state = request.app.state.kvactor
    assert isinstance(state, ServerState)
    return state


def tenant_of(request: Request) -> Tenant:
    """The tenant the request authenticated as (set by the app before its handler)."""
    tenant = request.state.tenant  # never a default: a route without it fails closed
    assert isinstance(tenant, Tenant)
    return tenant
