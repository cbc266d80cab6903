"""What every route of one app shares (on ``app.state.kvactor``): the session, the model id
clients name, the limits, the metrics, admission and the agent routing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from ..actors import Agent, Completion, Session
from ._admission import Admission
from ._metrics import Metrics
from ._routing import AgentRouter, Conversation


@dataclass
class ServerState:
    """One app's state; made by ``create_app``."""

    session: Session
    model_id: str
    max_body_bytes: int
    metrics: Metrics
    admission: Admission
    agents: AgentRouter
    created: int = field(default_factory=lambda: int(time.time()))
    # Agents staged by the prefetch route and not used since (their next turn is labelled).
    prefetched: set[str] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        session: Session,
        *,
        model_id: str,
        max_pending: int,
        max_body_bytes: int,
        max_anonymous: int,
    ) -> ServerState:
        """The state of a new app over ``session``."""
        metrics = Metrics()
        return cls(
            session=session,
            model_id=model_id,
            max_body_bytes=max_body_bytes,
            metrics=metrics,
            admission=Admission(max_pending, metrics.in_flight),
            agents=AgentRouter(session, max_anonymous),
        )

    def finished(self, agent: Agent, done: Completion, conversation: Conversation) -> None:
        """A turn is over: remember its conversation (anonymous routing), count it."""
        self.agents.remember(agent, conversation)
        prefetched = agent.name in self.prefetched
        self.prefetched.discard(agent.name)
        self.metrics.turn(done, prefetched)


def server_state(request: Request) -> ServerState:
    """The state of the app answering ``request``."""
    state = request.app.state.kvactor
    assert isinstance(state, ServerState)
    return state
