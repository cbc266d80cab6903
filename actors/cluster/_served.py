"""A cluster as one server serves it (``kvactor serve --cluster``): the questions a server
asks of a one-process ``Session`` (its model, its agents warm and hot, its figures, the
moves of its tiers, an agent's cache as a stream), answered by asking every host and
putting their answers together; turns, spawns and forgets go to the cluster session.

Figures are summed over the hosts (a limit too: the cluster's budget is its hosts'); the
moves of each host's tiers are keyed ``"<model>@<host>"`` so that each host's log is read
on from where it was. A new agent of a conversation the server has not seen goes where its
prompt is cached (:meth:`ServedCluster.spawn_placed`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from ..records import CacheInfo, EngineBoard, EngineStats, ModelInfo, ModelState, TierMoves
from ..session import ExportStream
from ..warm import MAX_IMPORT_BYTES, Forgotten, StoreStats, WarmInfo, read_header
from ._agent import ClusterAgent
from ._host import EngineHost, ServedModel
from ._session import ClusterSession

__all__ = ("ServedCluster", "sum_structs")

S = TypeVar("S", bound=msgspec.Struct)
T = TypeVar("T")
PIECE = 1 << 20  # an export is sent on in pieces of this many bytes


def sum_structs(items: Sequence[S]) -> S:
    """One struct of ``items``' type whose numbers are the items' sums (a None among them:
    None, as a limit that one host does not have), flags any-true, lists joined, dicts
    merged; other fields the first item's. Raises ValueError for no items."""
    if not items:
        raise ValueError("no figures to sum")
    first = items[0]
    merged: dict[str, Any] = {}
    for name in first.__struct_fields__:
        values = [getattr(item, name) for item in items]
        head = values[0]
        if any(v is None for v in values):
            merged[name] = None if all(v is None or _number(v) for v in values) else head
        elif all(isinstance(v, bool) for v in values):
            merged[name] = any(values)
        elif all(_number(v) for v in values):
            merged[name] = sum(values)
        elif all(isinstance(v, list) for v in values):
            merged[name] = [x for v in values for x in v]
        elif all(isinstance(v, dict) for v in values):
            merged[name] = {k: x for v in values for k, x in v.items()}
        else:
            merged[name] = head
    return msgspec.structs.replace(first, **merged)


def _pieces(data: bytes) -> Iterator[bytes]:
    """``data`` past its first PIECE bytes, a PIECE at a time."""
    for at in range(PIECE, len(data), PIECE):
        yield data[at : at + PIECE]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _of_host(since: Mapping[str, int] | None, host: str) -> dict[str, int]:
    """The part of a merged ``since`` (keys ``"<model>@<host>"``) that is ``host``'s."""
    tail = f"@{host}"
    return {k[: -len(tail)]: v for k, v in (since or {}).items() if k.endswith(tail)}


def _keyed(moves: dict[str, TierMoves], host: str) -> dict[str, TierMoves]:
    return {f"{model}@{host}": part for model, part in moves.items()}


class ServedCluster:
    """``cluster`` as a server reads and drives it (what ``kvactor.server.create_app``
    takes; see the module doc). Make it with :meth:`over`."""

    def __init__(self, cluster: ClusterSession, served: ServedModel) -> None:
        self.cluster = cluster
        self._served = served

    @classmethod
    async def over(cls, cluster: ClusterSession) -> ServedCluster:
        """The server's view of the open ``cluster`` (asks one host what it runs)."""
        hosts = cluster.engine_hosts
        served: ServedModel = await hosts.call(hosts.live()[0], EngineHost.served)
        return cls(cluster, served)

    # -- the model --------------------------------------------------------------------
    @property
    def model(self) -> ModelInfo:
        return self._served.info

    @property
    def models(self) -> dict[str, ModelInfo]:
        return {self._served.info.name: self._served.info}

    @property
    def model_names(self) -> tuple[str, ...]:
        return ()  # one model: it serves any name

    @property
    def max_prompt_chars(self) -> int:
        return self._served.max_prompt_chars

    def model_of(self, name: str) -> str:
        self.cluster.host_of(name)  # UnknownAgent, HostLost
        return self._served.info.name

    # -- agents -----------------------------------------------------------------------
    @property
    def agents(self) -> dict[str, ClusterAgent]:
        return self.cluster.agents

    async def spawn_agent(
        self, name: str, *, scope: str | None = None, model: str | None = None
    ) -> ClusterAgent:
        return await self.cluster.spawn_agent(name, scope=scope, model=model)

    async def spawn_placed(
        self, name: str, messages: list[dict[str, Any]], *, scope: str = ""
    ) -> ClusterAgent:
        return await self.cluster.spawn_placed(name, messages, scope=scope)

    async def forget(self, name: str) -> Forgotten:
        return await self.cluster.forget(name)

    async def hint(
        self,
        next: Sequence[str] = (),
        *,
        expect_in_s: Mapping[str, float] | None = None,
        priority: Mapping[str, int] | None = None,
        done: Sequence[str] = (),
        prefetch: int = 2,
    ) -> None:
        await self.cluster.hint(
            next, expect_in_s=expect_in_s, priority=priority, done=done, prefetch=prefetch
        )

    async def prefetch(self, name: str) -> None:
        await self.cluster.prefetch(name)

    async def cache_info(self, name: str) -> CacheInfo:
        hosts = self.cluster.engine_hosts
        return await hosts.call(self.cluster.host_of(name), EngineHost.cache_info, name)

    async def export_stream(self, name: str) -> ExportStream:
        """Agent ``name``'s portable file from its host, whole (through Ray's object
        store), as the stream a one-process session gives."""
        hosts = self.cluster.engine_hosts
        data = await hosts.call(self.cluster.host_of(name), EngineHost.export_portable, name)
        header = await anyio.to_thread.run_sync(read_header, data)
        return ExportStream(header, data[:PIECE], _pieces(data))

    async def import_agent(
        self,
        src: Any,
        name: str | None = None,
        *,
        replace: bool = False,
        model: str | None = None,
        scope: str | None = None,
        max_bytes: int = MAX_IMPORT_BYTES,
    ) -> ClusterAgent:
        return await self.cluster.import_agent(
            src, name, replace=replace, model=model, scope=scope, max_bytes=max_bytes
        )

    async def end_turns(self) -> int:
        return await self.cluster.end_turns()

    # -- figures, by asking every host --------------------------------------------------
    async def stats(self) -> EngineStats:
        """The engine figures of every host, summed."""
        return sum_structs(await self.cluster.engine_hosts.each(EngineHost.stats))

    async def warm_stats(self) -> StoreStats:
        return sum_structs(await self.cluster.engine_hosts.each(EngineHost.warm_stats))

    async def warm_agents(self) -> list[WarmInfo]:
        """Every agent with a warm cache on the disk of the host that serves it."""
        return await self._served_here(EngineHost.warm_list, lambda w: w.agent)

    async def warm_names(self) -> list[str]:
        """The agents with a folder on the disk of the host that serves them (no manifest
        read: ``EngineHost.warm_names``)."""
        return sorted(await self._served_here(EngineHost.warm_names, str))

    async def _served_here(
        self, ask: Callable[[EngineHost], Awaitable[list[T]]], agent: Callable[[T], str]
    ) -> list[T]:
        """``ask``'s items from every host, each kept from the host that serves its
        ``agent`` only (a replica's or a migrated agent's old copy left out)."""
        hosts = self.cluster.engine_hosts
        where = {name: a.host for name, a in self.cluster.agents.items()}
        answers = await hosts.gather(lambda h: hosts.call(h, ask))
        return [
            x for host, xs in answers for x in xs if where.get(agent(x), host.name) == host.name
        ]

    async def model_states(self) -> list[ModelState]:
        """The model's state on the first live host (every host runs it)."""
        hosts = self.cluster.engine_hosts
        return await hosts.call(hosts.live()[0], EngineHost.model_states)

    async def board(self, since: Mapping[str, int] | None = None) -> EngineBoard:
        """Every host's board at once: its figures summed, its hot caches together, its
        moves after ``since`` keyed by ``"<model>@<host>"``."""
        hosts = self.cluster.engine_hosts
        answers = await hosts.gather(
            lambda h: hosts.call(h, EngineHost.board, _of_host(since, h.name))
        )
        hot: dict[str, list[CacheInfo]] = {}
        moves: dict[str, TierMoves] = {}
        for host, board in answers:
            for model, caches in board.hot.items():
                hot.setdefault(model, []).extend(caches)
            moves.update(_keyed(board.moves, host.name))
        return EngineBoard(
            stats=sum_structs([b.stats for _, b in answers]),
            hot=hot,
            moves=moves,
            states=answers[0][1].states,
        )

    async def warm_moves(self, since: Mapping[str, int] | None = None) -> dict[str, TierMoves]:
        hosts = self.cluster.engine_hosts
        answers = await hosts.gather(
            lambda h: hosts.call(h, EngineHost.warm_moves, _of_host(since, h.name))
        )
        moves: dict[str, TierMoves] = {}
        for host, part in answers:
            moves.update(_keyed(part, host.name))
        return moves
