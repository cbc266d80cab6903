"""The models of a session: the one engine actor over them, each model's part (engine
reference, what the model is, its warm tier), and the model each running agent runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path

import anyio
import msgspec

from ...runtime import ActorDeadError, ActorRef, LoopCaller, MailboxFull, Runtime
from ..engine import EngineActor, EngineConfig, ModelRef, ModelSpec, record_limit
from ..errors import UnknownAgent, UnsafeCachePath
from ..ids import check_agent_id
from ..messages import (
    BoardQuery,
    EndTurns,
    EngineMessage,
    ForModel,
    ModelsQuery,
    StatsQuery,
    WriteBack,
    Written,
)
from ..records import EngineBoard, EngineStats, Exported, ModelInfo, ModelState
from ..warm import (
    CacheDirLock,
    DiskUsage,
    FitDisk,
    Sweep,
    default_disk_limit,
    lock_cache_dir,
    make_reserve,
    read_written,
    record_disk_limit,
    scan_agents,
    written_on_record_today,
)
from ._model_part import ModelPart, model_folder, start_part

__all__ = ("DEFAULT", "Default", "Models", "SessionModels")

#: What ``kvactor.open(models=...)`` takes: a name per model, each a ModelSpec.
Models = dict[str, ModelSpec]

#: The engine's name for the one model of a session opened on ``model`` (not ``models``).
_ONE = "default"

log = logging.getLogger("kvactor.session")


class Default(Enum):
    """A keyword left out (where None means something else: no limit)."""

    DEFAULT = "default"


#: ``disk_limit`` left out: the default limit (``default_disk_limit``), set at open.
DEFAULT = Default.DEFAULT


class SessionModels:
    """A session's models (a part of the :class:`~kvactor.actors.session.Session`).

    ``models``: by name, or one ``model`` (its part is then named after the model and its
    warm tier is ``cache_dir`` itself; several models keep theirs under
    ``cache_dir/models/<name>``). ``memory_limit``: the engine's (None: none, one model
    only). Invariant: the only writer of the parts, of the locks on the models' folders and
    of which model each running agent runs."""

    def __init__(
        self,
        model: ModelSpec | Models,
        config: EngineConfig,
        cache_dir: Path | None,
        *,
        delete_rejected: bool,
        memory_limit: int | None,
        pins: frozenset[str] = frozenset(),
        model_ttl_s: float | None = None,
        disk_limit: int | Default | None = DEFAULT,
        disk_quota: int | None = None,
        warm_ttl_s: float | None = None,
        agent_ref: Callable[[str], ActorRef[object] | None] = lambda _: None,
    ) -> None:
        self.several = isinstance(model, dict)
        specs: Models = dict(model) if isinstance(model, dict) else {_ONE: model}
        if not specs:
            raise ValueError("models must name at least one model")
        if self.several:
            for name in specs:
                check_agent_id(name)  # a model's name names its warm tier's folder
            if memory_limit is None or memory_limit < 1:
                raise ValueError("several models need a positive memory_limit")
        unknown = sorted(pins - set(specs))
        if unknown:
            raise ValueError(f"pinned models {unknown} are not among {sorted(specs)}")
        self._specs = specs
        self._config = config
        self._root = cache_dir
        self._delete_rejected = delete_rejected
        self.memory_limit = memory_limit
        self._pins, self._ttl = pins, model_ttl_s
        self._parts: dict[str, ModelPart] = {}  # each model's (set at start)
        self._slots: dict[str, str] = {}  # part name -> the engine's name of its model
        self._agents: dict[str, str] = {}  # running agent -> the name of its model's part
        self._locks: list[CacheDirLock] = []  # each model's folder's (several models)
        self._engine: ActorRef[object] | None = None
        self._disk_limit = disk_limit
        self._disk_quota, self._warm_ttl_s = disk_quota, warm_ttl_s
        # The warm tier's bytes on disk against its limit, over every model's folder.
        self.usage: DiskUsage | None = None
        self._agent_ref = agent_ref  # a running agent's actor (write-backs go there)

    async def start(self, runtime: Runtime) -> None:
        """Spawn the engine (loading the models) and start each model's part."""
        root, rejected = self._root, self._delete_rejected
        post = None
        if self._config.write_back:  # the engine hands caches leaving a hot tier over here
            caller = LoopCaller()

            def post(model: str, agent: str, exported: Exported) -> None:
                caller.call_soon(self._write_back, model, agent, exported)

        # A day's write budget holds across restarts: what the directory records written
        # today is spent already (a shorter window starts empty: the record is per day).
        spent = 0
        if post is not None and root is not None and self._config.write_window_s >= 86_400:
            spent = await anyio.to_thread.run_sync(written_on_record_today, root)
        engine = await runtime.spawn(
            EngineActor,
            self._specs,
            self._config,
            self.memory_limit,
            self._pins,
            self._ttl,
            post,
            spent,
            name="engine",
        )
        self._engine = engine
        if root is not None and (self._disk_limit is not None or self._disk_quota is not None):
            limit = None if self._disk_limit is DEFAULT else self._disk_limit
            self.usage = DiskUsage(limit, self._disk_quota)
        for slot in self._specs:
            folder = root if not self.several or root is None else model_folder(root, slot)
            if self.several and folder is not None:
                lock = await anyio.to_thread.run_sync(lock_cache_dir, folder)
                self._locks.append(lock)
            part = await start_part(
                runtime,
                slot if self.several else None,  # one model: its part is named after it
                ModelRef(engine, slot),
                self._config,
                folder,
                delete_rejected=rejected,
                suffix=f":{slot}" if self.several else "",
                usage=self.usage,
                warm_ttl_s=self._warm_ttl_s,
            )
            self._parts[part.name] = part
            self._slots[part.name] = slot
        if self.usage is not None:
            await self._count_disk()
        elif self._warm_ttl_s is not None:  # no count, but agents past the TTL go cold now
            await self._fit_disk()
        for part in self._parts.values():
            # Files a killed process left unnamed (mid-write, mid-fork), collected in the
            # background: the store holds the lock's promise that it alone writes here.
            if part.store is not None:
                await part.store.tell(Sweep())
        if root is not None and self.memory_limit is not None:
            names = list(self._parts)
            await anyio.to_thread.run_sync(record_limit, root, self.memory_limit, names)

    def _write_back(self, model: str, agent: str, exported: Exported) -> None:
        """On the event loop: hand a cache that left model ``model``'s hot tier to its
        agent to write; when the agent cannot take it (stopped, its mailbox full) the
        engine hears at once that no write comes (the cache went cold)."""
        ref = self._agent_ref(agent)
        try:
            if ref is None:
                raise ActorDeadError(f"agent {agent!r} is not running")
            ref.tell_nowait(WriteBack(exported))
        except (ActorDeadError, MailboxFull) as exc:
            log.warning("agent %r: its cache leaves the hot tier unwritten: %s", agent, exc)
            written = Written(agent, exported.export_id, exported.persisted, failed=True)
            assert self._engine is not None
            try:
                self._engine.tell_nowait(ForModel(model, written))
            except (ActorDeadError, MailboxFull):
                log.error("the engine did not hear that agent %r's write will not come", agent)

    async def _count_disk(self) -> None:
        """Count every model's warm caches (before the collector's sweep: files a killed
        process left count until it removes them), set the default limit when none was
        given, and bring the directory under it (``_fit_disk``)."""
        usage = self.usage
        assert usage is not None
        for part in self._parts.values():
            if part.store is not None and part.root is not None:
                try:
                    found = await anyio.to_thread.run_sync(scan_agents, part.root)
                except UnsafeCachePath as exc:  # every use of it is refused the same way
                    log.warning("warm caches not counted: %s", exc)
                    continue
                usage.load(part.root, found)
        assert self._root is not None  # a disk limit needs a warm tier
        usage.home = self._root
        usage.written = await anyio.to_thread.run_sync(read_written, self._root)
        if self._disk_limit is DEFAULT:
            usage.limit = await anyio.to_thread.run_sync(default_disk_limit, self._root, usage.used)
        await self._fit_disk()
        await anyio.to_thread.run_sync(record_disk_limit, self._root, usage.limit, usage.written)
        await anyio.to_thread.run_sync(make_reserve, self._root)
        log.info("warm tier: %d of %s bytes on disk", usage.used, usage.limit)

    async def _fit_disk(self) -> None:
        """Every store makes cold what is past the TTL, and brings the directory under a
        lower limit or quota than the one it was filled under (by policy, least recently
        written first)."""
        for part in self._parts.values():
            if part.store is not None:
                await part.store.ask(FitDisk())

    def release_locks(self) -> None:
        """At close: record the bytes written (``kvactor inspect``), then unlock."""
        usage = self.usage
        if usage is not None and usage.home is not None:
            record_disk_limit(usage.home, usage.limit, usage.written)
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.release()

    # -- the parts --------------------------------------------------------------------
    @property
    def first(self) -> ModelPart:
        """The first model's part: the session's ``engine``, ``model``, warm tier."""
        return next(iter(self._parts.values()))

    def parts(self) -> list[ModelPart]:
        return list(self._parts.values())

    @property
    def infos(self) -> dict[str, ModelInfo]:
        """The models by name (one model: under its own name)."""
        return {name: part.model for name, part in self._parts.items()}

    def part(self, model: str | None) -> ModelPart:
        """Model ``model``'s part (None: the first). Raises ValueError for an unknown one."""
        if model is None:
            return self.first
        try:
            return self._parts[model]
        except KeyError:
            raise ValueError(f"no model {model!r}: the models are {sorted(self._parts)}") from None

    def same_model(self, source: str, model: str | None) -> ModelPart:
        """The model of an agent made from running agent ``source``: ``source``'s. Raises
        ValueError for another one (a cache never serves another model)."""
        part = self.part(self._agents.get(source))
        if model is not None and self.part(model) is not part:
            raise ValueError(
                f"{source!r} runs model {part.name!r}, not {model!r}: forks and shared "
                "contexts stay within a model"
            )
        return part

    # -- which model each agent runs --------------------------------------------------
    def assign(self, agent: str, part: ModelPart) -> None:
        self._agents[agent] = part.name

    def unassign(self, agent: str) -> ModelPart | None:
        """``agent`` stopped; the part of the model it ran (None: it ran none)."""
        name = self._agents.pop(agent, None)
        return None if name is None else self._parts[name]

    def model_of(self, agent: str) -> str:
        """The model running agent ``agent`` runs. Raises UnknownAgent."""
        try:
            return self._agents[agent]
        except KeyError:
            raise UnknownAgent(f"no agent named {agent!r}") from None

    def part_of(self, agent: str) -> ModelPart:
        """The part of running agent ``agent``'s model (the first when it is not running)."""
        return self.part(self._agents.get(agent))

    def agents_by_model(self) -> dict[str, str]:
        return dict(self._agents)

    # -- the engine, as a whole -------------------------------------------------------
    def _whole(self) -> ActorRef[object]:
        assert self._engine is not None, "the session's models have not started"
        return self._engine

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self._whole().ask(StatsQuery())
        return stats

    async def board(self, since: Mapping[str, int]) -> EngineBoard:
        """The engine's ``BoardQuery`` answer, by the session's names of the models (moves
        after ``since[name]``)."""
        names = {slot: name for name, slot in self._slots.items()}
        ask = {self._slots[n]: seq for n, seq in since.items() if n in self._slots}
        board: EngineBoard = await self._whole().ask(BoardQuery(ask))
        return EngineBoard(
            stats=board.stats,
            hot={names.get(k, k): v for k, v in board.hot.items()},
            moves={names.get(k, k): v for k, v in board.moves.items()},
            states=[
                msgspec.structs.replace(s, name=names.get(s.name, s.name)) for s in board.states
            ],
        )

    async def states(self) -> list[ModelState]:
        """Each model: loaded or not, pinned, weights, loads (named as the session names
        it: one model under its own name)."""
        states: list[ModelState] = await self._whole().ask(ModelsQuery())
        names = {slot: name for name, slot in self._slots.items()}
        return [msgspec.structs.replace(s, name=names.get(s.name, s.name)) for s in states]

    async def end_turns(self) -> int:
        ended: int = await self._whole().ask(EndTurns())
        return ended

    @property
    def names(self) -> tuple[str, ...]:
        """The names requests choose a model by: several models' (as ``models=`` named
        them), else none (one model serves any name)."""
        return tuple(self._parts) if len(self._parts) > 1 else ()

    @property
    def budget_bytes(self) -> int | None:
        """The hot tier's byte budget (None: unbounded), as the engine was opened with it."""
        return self._config.budget_bytes

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which no prompt fits any model's context."""
        return max(part.env.max_prompt_chars for part in self._parts.values())

    def engine_for(self, agent: str) -> ActorRef[EngineMessage]:
        """The engine as running agent ``agent``'s model sees it (the first model's when
        it is not running)."""
        return self.part_of(agent).engine
