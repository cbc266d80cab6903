"""A cluster's agents as its callers see them: the ``Agent`` API over an engine host."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..errors import HostLost
from ..records import AgentState, Completion, ToolCallDelta, ToolRequest
from ..session import AgentTurns, TurnKind
from ..tools import tool_options
from ..warm import PortableInfo
from ._calls import RESTART_WAIT_S, Host
from ._host import EngineHost, TurnEnd

if TYPE_CHECKING:
    from ._session import ClusterSession

__all__ = ("ClusterAgent", "ClusterTextStream")


class ClusterTextStream:
    """A turn's text pieces as they come from the agent's host, then ``completion``: the
    ``TextStream`` of a cluster. Leaving early cancels the turn on its host."""

    def __init__(
        self,
        session: ClusterSession,
        host: Host,
        turn: tuple[str, TurnKind, Any, dict[str, Any]],
        pieces: bool = True,
    ) -> None:
        self._session = session
        self._host = host
        self._agent, self._kind, self._payload, self._sampling = turn
        self._pieces = pieces
        self._gen: Any = None
        self.completion: Completion | None = None

    def __aiter__(self) -> ClusterTextStream:
        return self

    async def __anext__(self) -> str:
        while True:
            item = await self._next()
            if isinstance(item, str):
                return item

    async def _next(self) -> str | ToolCallDelta:
        if self.completion is not None:
            raise StopAsyncIteration
        from ray.exceptions import ActorUnavailableError

        started = self._gen is not None
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            if self._gen is None:
                self._gen = self._session.engine_hosts.stream(
                    self._host,
                    EngineHost.turn,
                    self._agent,
                    self._kind,
                    self._payload,
                    self._sampling,
                    self._pieces,
                )
            try:
                item = await self._session.engine_hosts.next(self._host, self._gen, raw=not started)
                break
            except ActorUnavailableError:
                # The call reached a host that had died and that Ray is restarting: it
                # never ran there. Wait until the host answers, then send it again.
                if time.monotonic() > deadline:
                    raise HostLost(f"engine host {self._host.name!r} did not come back") from None
                self._gen = None
                await self._session.engine_hosts.call(self._host, EngineHost.info)
        if item is None:
            raise HostLost(f"engine host {self._host.name!r} ended the turn without its result")
        if isinstance(item, TurnEnd):
            self._session.prefixes.went_cold(self._host.name, item.cold)
            self._session.prefixes.update(self._host.name, self._agent, item.blocks)
            await self._session.replicate(self._agent)  # before the turn is reported done
            self.completion = item.completion
            raise StopAsyncIteration
        assert isinstance(item, str | ToolCallDelta)
        return item

    async def aclose(self) -> None:
        if self._gen is not None and self.completion is None:
            import ray

            ray.cancel(self._gen)
            self._gen = None

    async def events(self) -> AsyncIterator[str | ToolCallDelta]:
        """The text pieces and the tool calls' pieces as they form (``TextStream.events``;
        a whole turn's calls are in its Completion only)."""
        while True:
            try:
                yield await self._next()
            except StopAsyncIteration:
                return

    async def __aenter__(self) -> ClusterTextStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class ClusterAgent(AgentTurns):
    """A handle on an agent of a cluster: the ``Agent`` API (:class:`AgentTurns`), served
    by its host."""

    def __init__(self, session: ClusterSession, name: str) -> None:
        self._session = session
        self.name = name

    def __repr__(self) -> str:
        return f"<ClusterAgent {self.name!r} on {self.host!r}>"

    @property
    def host(self) -> str:
        """The host that serves it now."""
        return self._session.where(self.name)

    def _turn_stream(
        self,
        kind: TurnKind,
        payload: Any,
        sampling: dict[str, Any],
        *,
        pieces: bool,
        tools: ToolRequest | None = None,
    ) -> ClusterTextStream:
        # A whole turn: the host sends its Completion, not each piece (two items through Ray).
        host = self._session.host_of(self.name)
        if tools is not None:  # plain data again: the host's agent reads it as options
            sampling = {**sampling, **tool_options(tools)}
        return ClusterTextStream(self._session, host, (self.name, kind, payload, sampling), pieces)

    async def state(self) -> AgentState:
        """Its state (``Agent.state``), asked of its host."""
        host = self._session.host_of(self.name)
        return await self._session.engine_hosts.call(host, EngineHost.state, self.name)

    async def history(self) -> list[dict[str, Any]]:
        host = self._session.host_of(self.name)
        return await self._session.engine_hosts.call(host, EngineHost.history, self.name)

    async def hint(self, *, expect_in_s: float | None = None, priority: int | None = None) -> None:
        """Advice about this agent, sent to its host (``Agent.hint``)."""
        await self._session.hint(
            expect_in_s=None if expect_in_s is None else {self.name: expect_in_s},
            priority=None if priority is None else {self.name: priority},
        )

    async def done(self) -> None:
        """Advice: this agent is done for now (``Agent.done``)."""
        await self._session.hint(done=[self.name])

    async def export(self, dest: Any) -> PortableInfo:
        """Write this agent's cache as one portable file (``Agent.export``)."""
        return await self._session.export_agent(self.name, dest)
