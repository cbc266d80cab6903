"""Which agent answers a request: the one it names (``X-Agent-Id``, else the API's user
field) in its tenant's namespace, or for a request without an id the anonymous agent of
its tenant whose last conversation is the longest prefix of this one (a new one when none
is; at most ``max_anonymous`` kept per tenant, the least recently chosen idle one
forgotten past that).

No lock is held across an await that could last: choosing an anonymous agent is one
synchronous step; spawning waits only for that agent's spawn; a request for an agent
being forgotten waits only for that forget; forgetting an agent in use answers 409."""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request

from ..actors.warm import Forgotten
from ._errors import ApiError
from ._served import PlacesByPrompt, Served, ServedAgent
from ._tenants import Tenant

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
    """The session's agents as requests name them, per tenant, and the anonymous ones.

    ``scope_of`` gives the sharing scope of a session agent id (its tenant's label)."""

    def __init__(self, session: Served, max_anonymous: int, scope_of: Callable[[str], str]):
        self._session = session
        self._max_anonymous = max_anonymous
        self._scope_of = scope_of
        # Invariant: per tenant prefix, its anonymous agents by least recently chosen,
        # each with the conversation it last served. Only _choose and forget change it.
        self._anonymous: dict[str, OrderedDict[str, Conversation]] = {}
        # Invariant: the requests holding each agent now (an agent held is never
        # forgotten); only _acquire and _release change it.
        self._users: Counter[str] = Counter()
        self._spawning: dict[str, anyio.Event] = {}
        self._forgetting: dict[str, anyio.Event] = {}
        self._importing: dict[str, anyio.Event] = {}  # a request for one waits for it
        self._counter = 0
        self.last_used: dict[str, float] = {}  # agent -> when a request last named it

    @contextlib.asynccontextmanager
    async def agent(
        self,
        tenant: Tenant,
        name: str | None,
        conversation: Conversation,
        model: str | None = None,
    ) -> AsyncIterator[ServedAgent]:
        """The agent a request of ``tenant`` runs on for the block: the named one
        (spawned if new), or an idle anonymous one whose last conversation is the
        longest prefix of this one; of ``model`` (None: the session's one model). Raises
        InvalidAgentId / ApiError (400) for a hostile or reserved id, or an agent that
        runs another model."""
        victims: list[str] = []
        if name is None:
            full, victims = self._choose(tenant, conversation, model)
        else:
            if name.startswith(ANONYMOUS):
                raise ApiError(
                    400, f"agent ids starting with {ANONYMOUS!r} are the server's own", "agent_id"
                )
            full = tenant.full_id(name)
            self._users[full] += 1
        try:
            if victims:
                with anyio.CancelScope(shield=True):  # idle agents: quick, and marked
                    for victim in victims:
                        await self._forget_marked(victim)
            agent = await self._ready(full, model, conversation)
            self.last_used[full] = time.time()
            yield agent
        finally:
            self._release(full)

    def remember(self, agent: ServedAgent, conversation: Conversation) -> None:
        """``agent`` now holds ``conversation`` (read by the anonymous routing)."""
        for pool in self._anonymous.values():
            if agent.name in pool:
                pool[agent.name] = conversation

    def busy(self, full: str) -> bool:
        """Whether a request holds the session's agent ``full`` now."""
        return self._users[full] > 0

    async def forget(self, full: str) -> Forgotten:
        """Forget the session's agent ``full``: its caches and its place here. Raises
        ApiError (409) while a request holds it, or a forget or an import of it is under
        way: a forget never waits for a turn."""
        self._free_or_409(full, "the agent is answering a request: forget it once that ends")
        self._mark_forgotten(full)
        return await self._forget_marked(full)

    @contextlib.asynccontextmanager
    async def importing(self, full: str) -> AsyncIterator[None]:
        """Hold the session's agent ``full`` for an import, for the block: a request for
        it meanwhile waits until the import has ended (then runs on what it left).
        Raises ApiError (409) while a request holds it, or a forget or an import of it is
        under way."""
        self._free_or_409(full, "the agent is answering a request, or being imported or forgotten")
        self._importing[full] = anyio.Event()
        try:
            yield
        finally:
            self._importing.pop(full).set()

    def _free_or_409(self, full: str, message: str) -> None:
        """Raise ApiError (409, ``message``) while a request holds ``full``, or a forget
        or an import of it is under way."""
        if self.busy(full) or full in self._forgetting or full in self._importing:
            raise ApiError(409, message, code="agent_busy", param="agent_id")

    def _mark_forgotten(self, full: str) -> None:
        """From now on a request for ``full`` waits until it is forgotten."""
        self._forgetting[full] = anyio.Event()
        for pool in self._anonymous.values():
            pool.pop(full, None)
        self.last_used.pop(full, None)

    async def _forget_marked(self, full: str) -> Forgotten:
        try:
            return await self._session.forget(full)
        finally:
            self._forgetting.pop(full).set()

    def _release(self, full: str) -> None:
        self._users[full] -= 1
        if self._users[full] <= 0:
            del self._users[full]

    async def _ready(self, full: str, model: str | None, conversation: Conversation) -> ServedAgent:
        """The running agent ``full`` (the caller holds it): after a forget of it under
        way, spawned if new (one spawn at a time per agent, none for others to wait on);
        on a cluster, a new one goes where ``conversation``'s prompt is cached."""
        while (moving := self._forgetting.get(full) or self._importing.get(full)) is not None:
            await moving.wait()
        while (spawning := self._spawning.get(full)) is not None:
            await spawning.wait()
        agent = self._session.agents.get(full)
        if agent is not None:
            runs = self._session.model_of(full)
            if model is not None and runs != model:
                raise ApiError(400, f"this agent runs model {runs!r}, not {model!r}", param="model")
            return agent
        done = self._spawning[full] = anyio.Event()
        try:
            scope = self._scope_of(full)
            # A cluster places a new chat by its prompt (it serves one model: a request
            # that names one goes to spawn_agent, which says so).
            placing = self._session
            chat = conversation if isinstance(conversation, list) else None
            if isinstance(placing, PlacesByPrompt) and chat is not None and model is None:
                return await placing.spawn_placed(full, chat, scope=scope)
            return await self._session.spawn_agent(full, scope=scope, model=model)
        finally:
            del self._spawning[full]
            done.set()

    def _choose(
        self, tenant: Tenant, conversation: Conversation, model: str | None = None
    ) -> tuple[str, list[str]]:
        """Hold the idle anonymous agent of ``tenant`` that continues ``conversation``
        best, else a new one; returns its id and the least recently chosen idle ones past
        ``max_anonymous`` (marked to be forgotten: the caller forgets them). One step,
        no await: two requests never choose the same agent."""
        # One pool per model: an agent only ever continues conversations of its model.
        key = tenant.prefix if model is None else f"{tenant.prefix}\0{model}"
        pool = self._anonymous.setdefault(key, OrderedDict())
        best, score = None, -1
        for name, seen in pool.items():
            got = _prefix_len(seen, conversation)
            if not self.busy(name) and got > score:
                best, score = name, got
        victims: list[str] = []
        if best is None or score < 0:
            idle = [n for n in pool if not self.busy(n)]
            victims = idle[: max(0, len(pool) + 1 - self._max_anonymous)]
            for victim in victims:
                self._mark_forgotten(victim)
            self._counter += 1
            best = f"{tenant.prefix}{ANONYMOUS}{self._counter}"
        self._users[best] += 1
        pool[best] = conversation
        pool.move_to_end(best)
        return best, victims
