"""What the server needs of a session: :class:`Served` (one process's ``Session`` is one,
and so is a cluster as :class:`~kvactor.actors.cluster.ServedCluster` shows it), and of
its agents, :class:`ServedAgent`. A session that can place a new agent by the prompt it
will start with (a cluster: on the host that holds the longest prefix of it) is also a
:class:`PlacesByPrompt`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..actors.records import (
    AgentState,
    CacheInfo,
    EngineBoard,
    EngineStats,
    ModelInfo,
    ModelState,
    TierMoves,
)
from ..actors.session import ExportStream, TurnStream
from ..actors.warm import Forgotten, StoreStats, WarmInfo


class ServedAgent(Protocol):
    """An agent as the server runs its turns."""

    @property
    def name(self) -> str: ...
    def stream_chat(self, messages: list[dict[str, Any]], **sampling: Any) -> TurnStream: ...
    def stream_raw(self, prompt: str, **sampling: Any) -> TurnStream: ...
    async def state(self) -> AgentState: ...


class Served(Protocol):
    """A session as the server reads and drives it."""

    @property
    def agents(self) -> Mapping[str, ServedAgent]: ...
    @property
    def model(self) -> ModelInfo: ...
    @property
    def models(self) -> Mapping[str, ModelInfo]: ...
    @property
    def model_names(self) -> tuple[str, ...]: ...
    @property
    def max_prompt_chars(self) -> int: ...
    def model_of(self, name: str) -> str: ...
    async def spawn_agent(
        self, name: str, *, scope: str | None = None, model: str | None = None
    ) -> ServedAgent: ...
    async def forget(self, name: str) -> Forgotten: ...
    async def hint(
        self,
        next: Sequence[str] = (),
        *,
        expect_in_s: Mapping[str, float] | None = None,
        priority: Mapping[str, int] | None = None,
        done: Sequence[str] = (),
        prefetch: int = 2,
    ) -> None: ...
    async def prefetch(self, name: str) -> None: ...
    async def stats(self) -> EngineStats: ...
    async def warm_stats(self) -> StoreStats: ...
    async def warm_agents(self) -> list[WarmInfo]: ...
    async def warm_names(self) -> list[str]: ...
    async def board(self, since: Mapping[str, int] | None = None) -> EngineBoard: ...
    async def warm_moves(self, since: Mapping[str, int] | None = None) -> dict[str, TierMoves]: ...
    async def model_states(self) -> list[ModelState]: ...
    async def cache_info(self, name: str) -> CacheInfo: ...
    async def export_stream(self, name: str) -> ExportStream: ...
    async def import_agent(
        self,
        src: Any,
        name: str | None = None,
        *,
        replace: bool = False,
        model: str | None = None,
        scope: str | None = None,
        max_bytes: int = ...,
    ) -> ServedAgent: ...
    async def end_turns(self) -> int: ...


@runtime_checkable
class PlacesByPrompt(Protocol):
    """A session whose new agents go where the prompt they start with is cached."""

    async def spawn_placed(
        self, name: str, messages: list[dict[str, Any]], *, scope: str = ""
    ) -> ServedAgent: ...
