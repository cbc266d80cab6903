"""Which agent answers a request: the one it names (``X-Agent-Id``, else the API's user
field), or for a request without an id the anonymous agent whose last conversation is the
longest prefix of this one (a new one when none is; at most ``max_anonymous`` kept)."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request

from ..actors import Agent, Session
from ..actors.protocol import check_agent_id
from ..actors.store import Forgotten
from ._errors import ApiError

ANONYMOUS = "anon."  # prefix of the agents that serve requests without an id

Conversation = list[dict[str, str]] | str  # what an agent last served (a chat or a raw prompt)


def agent_id(request: Request, *fields: Any) -> str | None:
    """The agent a request names: its ``X-Agent-Id`` header, else the first of the body's
    ``fields`` that is set (None: no id). Raises ApiError for a field that is not a str."""
    header = request.headers.get("x-agent-id")
    if header:
        return header
    for value in fields:
        if value is not None:
            if not isinstance(value, str):
                raise ApiError(400, "the agent id (user) must be a string", param="user")
            return value
    return None


def _prefix_len(seen: Conversation, new: Conversation) -> int:
    """How much of ``new`` repeats ``seen`` (characters, roughly); -1: it does not."""
    if isinstance(seen, str) or isinstance(new, str):
        if isinstance(seen, str) and isinstance(new, str) and new.startswith(seen):
            return len(seen)
        return -1
    if len(seen) <= len(new) and new[: len(seen)] == seen:
        return sum(len(m["content"]) + 1 for m in seen)
    return -1


class AgentRouter:
    """The session's agents as requests name them, and the anonymous ones."""

    def __init__(self, session: Session, max_anonymous: int) -> None:
        self._session = session
        self._max_anonymous = max_anonymous
        self._lock = anyio.Lock()  # spawning, choosing and forgetting agents
        # Invariant: the anonymous agents by least recently chosen, each with the
        # conversation it last served; the busy ones are answering a request now.
        self._anonymous: OrderedDict[str, Conversation] = OrderedDict()
        self._busy: set[str] = set()
        self._counter = 0
        self.last_used: dict[str, float] = {}  # agent -> when a request last named it

    @contextlib.asynccontextmanager
    async def agent(self, name: str | None, conversation: Conversation) -> AsyncIterator[Agent]:
        """The agent a request runs on for the block: the named one (spawned if new), or
        an idle anonymous one whose last conversation is the longest prefix of this one.
        Raises InvalidAgentId / ApiError (400) for a hostile or reserved id."""
        if name is not None:
            yield await self._named(name)
            return
        chosen = await self._choose_anonymous(conversation)
        try:
            yield self._session.agent(chosen)
        finally:
            self._busy.discard(chosen)

    def remember(self, agent: Agent, conversation: Conversation) -> None:
        """``agent`` now holds ``conversation`` (read by the anonymous routing)."""
        if agent.name in self._anonymous:
            self._anonymous[agent.name] = conversation

    async def forget(self, name: str) -> Forgotten:
        """Forget agent ``name``: its caches and its place here (``Session.forget``)."""
        async with self._lock:
            self._anonymous.pop(name, None)
            done = await self._session.forget(name)
        self.last_used.pop(name, None)
        return done

    async def _named(self, name: str) -> Agent:
        check_agent_id(name)  # InvalidAgentId: a 400
        if name.startswith(ANONYMOUS):
            raise ApiError(
                400, f"agent ids starting with {ANONYMOUS!r} are the server's own", param="agent_id"
            )
        async with self._lock:
            agent = self._session.agents.get(name)
            if agent is None:
                agent = await self._session.spawn_agent(name)
        self.last_used[name] = time.time()
        return agent

    async def _choose_anonymous(self, conversation: Conversation) -> str:
        """Mark busy and return the idle anonymous agent that continues ``conversation``
        best, else a new one (forgetting the least recently chosen idle one past
        ``max_anonymous``)."""
        async with self._lock:
            best, score = None, -1
            for name, seen in self._anonymous.items():
                got = _prefix_len(seen, conversation)
                if name not in self._busy and got > score:
                    best, score = name, got
            if best is None or score < 0:
                while len(self._anonymous) >= self._max_anonymous:
                    idle = next((n for n in self._anonymous if n not in self._busy), None)
                    if idle is None:
                        break
                    del self._anonymous[idle]
                    await self._session.forget(idle)
                self._counter += 1
                best = f"{ANONYMOUS}{self._counter}"
                await self._session.spawn_agent(best)
            self._busy.add(best)
            self._anonymous[best] = conversation
            self._anonymous.move_to_end(best)
        self.last_used[best] = time.time()
        return best
