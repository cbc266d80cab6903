"""An engine host: one machine's kvactor session, driven from another process.

:class:`EngineHost` owns a whole :class:`~kvactor.actors.session.Session` (engine, hot tier,
agents, and the warm tier on the host's local disk) and answers plain method calls with
picklable values, so that a cluster front (``kvactor.actors.cluster``) can run it as a Ray
actor on any node. It holds no Ray code itself: the front wraps the class with
``ray.remote``, and tests may call it in process.

Agents move between hosts with their warm caches: :meth:`EngineHost.export` hands over the
committed files of an agent it released, :meth:`EngineHost.adopt` writes them into a staging
folder, verifies them exactly as a warm load does (manifest checksum and identity, every
segment's checksum, header, shapes and metadata: ``read_cache``) and only then moves them
into place. A refused cache raises CacheRejected with the reason, and nothing of it stays.

Each agent's sharing scope (``spawn_agent(scope=)``: whose cached prefixes it may share)
is kept in ``scopes.json`` beside the host's warm tier, and in ``replicas/scopes.json`` for
its replicas: an agent the host resumes after a restart, adopts in a migration or promotes
from a replica keeps its scope, so a tenant's cache never becomes another's to share.

The session opens on the first call, in a task of its own (so a host that Ray restarts
after its process died opens again over the same cache folder, whose lock died with the old
process), and agents the host does not run yet are resumed from their warm caches when a
call names them. A host runs on asyncio (as Ray's async actors do).
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
import os
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ..engine import ModelSpec, default_memory_limit
from ..errors import AgentExists, CacheRejected, UnknownAgent
from ..ids import check_agent_id
from ..messages import Hint, MakeContext, Snapshot, SpawnAgent
from ..records import (
    AgentSnapshot,
    AgentState,
    CacheInfo,
    Completion,
    EngineBoard,
    EngineStats,
    ModelInfo,
    ModelState,
    TierMoves,
    ToolCallDelta,
)
from ..session import TURN_KINDS, Agent, Session, TurnKind, open_session
from ..warm import (
    MANIFEST,
    SEGMENT_FILES,
    CacheIdentity,
    Forgotten,
    SegmentEntry,
    StoreStats,
    WarmInfo,
    agent_dir,
    contained,
    link_or_copy,
    read_cache,
    read_manifest,
    verify_cache,
    write_atomic,
)
from ._prefixes import prefix_blocks

__all__ = ("EngineHost", "HostInfo", "ServedModel", "TurnEnd")

log = logging.getLogger("kvactor.cluster")

#: The most bytes one agent's files may take in a migration (a 128K-token cache of a large
#: model is a few GB; a peer that sends more is refused before anything is written).
MAX_MIGRATION_BYTES = 64 << 30


class HostInfo(msgspec.Struct, frozen=True):
    """What a host says of itself: where it runs, its hot budget and use, its agents."""

    name: str
    node: str  # the machine (Ray node id, or the host name outside Ray)
    pid: int
    budget_bytes: int | None
    cache_bytes: int  # bytes its hot tier holds now
    agents: list[str]  # running agents
    # Agents with a folder on its disk (warm or cold); from ``info``, refused ones left
    # out; from ``load_info``, every folder (no manifest read).
    warm_agents: list[str]
    stats: EngineStats
    migrations_in: int = 0
    migrations_out: int = 0
    replicas: list[str] = []  # agents of other hosts whose warm caches it keeps a copy of

    @property
    def free_bytes(self) -> float:
        """Budget left (infinite without a budget)."""
        if self.budget_bytes is None:
            return float("inf")
        return float(self.budget_bytes - self.cache_bytes)


class TurnEnd(msgspec.Struct, frozen=True):
    """A turn's last item from its host: its Completion, and the block hashes of what the
    agent's cache holds now (``prefix_blocks``), for the front's cache-aware placement;
    ``cold``: the host's agents whose caches went cold since its last TurnEnd (the disk
    limit, a quota, the TTL, or a hot cache with no copy on disk demoted) and are not
    hot again: they hold nothing the front should place by."""

    completion: Completion
    blocks: list[int]
    cold: list[str] = []


class ServedModel(msgspec.Struct, frozen=True):
    """The model a host runs, as a server over the cluster names and limits it."""

    info: ModelInfo
    max_prompt_chars: int


class EngineHost:
    """One session on this machine: ``model`` with its warm tier in ``cache_dir`` (local
    disk), opened with ``options`` (``kvactor.open``'s keywords). Without a
    ``memory_limit`` among them, the host's is its share of its node's default limit
    (``hosts_on_node`` hosts share the node's RAM)."""

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        cache_dir: str | os.PathLike[str],
        options: dict[str, Any] | None = None,
        node: str = "",
        hosts_on_node: int = 1,
    ) -> None:
        self.name = name
        self._model = model
        self.cache_dir = Path(cache_dir)
        self._options = dict(options or {})
        if "memory_limit" not in self._options:
            self._options["memory_limit"] = default_memory_limit() // max(1, hosts_on_node)
        self._node = node or os.uname().nodename
        self._session: Session | None = None
        self._opening = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._in = self._out = 0
        # How far each model's hot-tier and warm-tier move logs were read (``_went_cold``).
        self._moves_read: dict[str, int] = {}
        self._warm_moves_read: dict[str, int] = {}
        self._scopes = _Scopes(self.cache_dir / "scopes.json")  # its agents' scopes
        self._replica_scopes = _Scopes(self.cache_dir / "replicas" / "scopes.json")

    # -- the session ------------------------------------------------------------------
    async def _open(self) -> Session:
        """The session, opened on first use in a task of its own: it outlives the call
        that opened it (each call of a Ray actor runs in its own task) until ``close``."""
        async with self._opening:
            if self._session is None:
                ready: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
                self._stop = asyncio.Event()
                self._task = asyncio.create_task(self._serve(ready))
                self._session = await ready
        return self._session

    async def _serve(self, ready: asyncio.Future[Session]) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            async with open_session(self._model, cache_dir=self.cache_dir, **self._options) as s:
                # Staging folders of adoptions a killed process left (we hold the lock).
                shutil.rmtree(contained(self.cache_dir, "incoming"), ignore_errors=True)
                ready.set_result(s)
                await self._stop.wait()
        except BaseException as exc:
            if ready.done():
                raise
            ready.set_exception(exc)

    async def _agent(self, name: str) -> Agent:
        """The running agent ``name``, resumed from its warm cache when it is not running
        (after a restart of this host, or an adoption). Raises UnknownAgent."""
        session = await self._open()
        check_agent_id(name)
        if name in session.agents:
            return session.agent(name)
        if not agent_dir(self.cache_dir, name).is_dir():
            raise UnknownAgent(f"no agent named {name!r} on host {self.name!r}")
        return await session.spawn_agent(name, scope=self._scopes.get(name))

    async def close(self) -> None:
        """Close the session: every agent saves its last turn first."""
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            await task
        self._session = None

    # -- what a front asks ------------------------------------------------------------
    async def info(self) -> HostInfo:
        session = await self._open()
        warm = [w.agent for w in await session.warm_agents() if not w.rejected]
        return await self._info(session, warm)

    async def load_info(self) -> HostInfo:
        """``info`` as placement reads it, for every new agent: its ``warm_agents`` are its
        agent folders as one directory listing names them (``info`` reads and checks
        every manifest: seconds at 10,000 agents)."""
        session = await self._open()
        return await self._info(session, await session.warm_names())

    async def _info(self, session: Session, warm: list[str]) -> HostInfo:
        stats = await session.stats()
        return HostInfo(
            name=self.name,
            node=self._node,
            pid=os.getpid(),
            budget_bytes=session.config.budget_bytes,
            cache_bytes=stats.cache_bytes,
            agents=sorted(session.agents),
            warm_agents=warm,
            stats=stats,
            migrations_in=self._in,
            migrations_out=self._out,
            replicas=await anyio.to_thread.run_sync(self._replica_names),
        )

    async def spawn(self, spawn: SpawnAgent) -> None:
        """A new agent here (``SessionAPI.spawn_agent``, checked by the front); raises as
        that does."""
        session = await self._open()
        if spawn.fork_of is not None and spawn.fork_of not in session.agents:
            await self._agent(spawn.fork_of)  # a source on disk only: resume it first
        source = spawn.fork_of if spawn.fork_of is not None else spawn.context
        scope = spawn.scope
        if scope is None:  # a fork's or a context agent's is its source's
            scope = self._scopes.get(source) if source is not None else ""
        await session.spawn_agent(
            spawn.name,
            system=spawn.system,
            fork_of=spawn.fork_of,
            context=spawn.context,
            scope=scope,
            tool_wait_s=spawn.tool_wait_s,
        )
        await anyio.to_thread.run_sync(self._scopes.set, spawn.name, scope)

    async def context(self, made: MakeContext) -> None:
        """A shared context here (``SessionAPI.context``)."""
        await (await self._open()).context(made.name, made.text, scope=made.scope)
        await anyio.to_thread.run_sync(self._scopes.set, made.name, made.scope)

    async def turn(
        self,
        name: str,
        kind: TurnKind,
        payload: Any,
        sampling: dict[str, Any],
        pieces: bool = True,
    ) -> AsyncIterator[str | ToolCallDelta | TurnEnd]:
        """One turn of agent ``name``: its text pieces (and its tool calls' pieces as they
        form), then its TurnEnd (the Completion
        and what the agent's cache holds now). ``kind`` says what ``payload`` is: "text"
        (a user message), "raw" (a raw prompt) or "chat" (a whole conversation). Without
        ``pieces``, one empty piece once the turn has begun (a caller then knows that it
        ran), then the TurnEnd: two items through Ray, not one a token. Raises what
        ``Agent.stream`` and friends raise."""
        if kind not in TURN_KINDS:
            raise ValueError(f"kind must be one of {TURN_KINDS}, not {kind!r}")
        agent = await self._agent(name)
        stream = agent.turn_stream(kind, payload, **sampling)
        async with stream:
            begun = False
            async for piece in stream.events():
                if pieces:
                    yield piece
                elif not begun:
                    begun = True
                    yield ""
        assert stream.completion is not None
        yield TurnEnd(stream.completion, await self._blocks(agent), await self._went_cold())

    async def _blocks(self, agent: Agent) -> list[int]:
        """The block hashes of the tokens ``agent``'s cache holds now."""
        snapshot: AgentSnapshot = await agent.ref.ask(Snapshot())
        return prefix_blocks(snapshot.tokens)

    async def _went_cold(self) -> list[str]:
        """The agents whose latest move since the last call is to cold (made cold on disk,
        or demoted from the hot tier with no copy on disk) and that are not hot now."""
        session = await self._open()
        latest: dict[str, tuple[float, bool]] = {}  # agent -> (when, went cold)
        logs = (
            (self._moves_read, await session.tier_moves(self._moves_read)),
            (self._warm_moves_read, await session.warm_moves(self._warm_moves_read)),
        )
        for read, by_model in logs:
            for model, moves in by_model.items():
                read[model] = moves.last
                for m in moves.moves:
                    if m.agent not in latest or latest[m.agent][0] <= m.t:
                        latest[m.agent] = (m.t, m.kind == "demoted" and m.tier == "cold")
        cold = {agent for agent, (_, went) in latest.items() if went}
        if cold:
            cold -= {c.agent for c in await session.hot_caches()}
        return sorted(cold)

    async def generate(
        self, name: str, kind: TurnKind, payload: Any, sampling: dict[str, Any]
    ) -> Completion:
        """The whole turn (see ``turn``): its Completion."""
        done: Completion | None = None
        async for item in self.turn(name, kind, payload, sampling, pieces=False):
            if isinstance(item, TurnEnd):
                done = item.completion
        assert done is not None
        return done

    async def prompt_blocks(self, system: str | list[dict[str, Any]]) -> list[int]:
        """The block hashes of the prompt a new agent starts with, rendered and tokenized
        as its first turn does (``prefix_blocks``): ``system``, the system prompt of a
        new agent (or a shared context's text), or a conversation's messages (its first
        turn's). Raises what the chat template raises for messages it cannot render."""
        tokenizer = (await self._open()).tokenizer
        messages = [{"role": "system", "content": system}] if isinstance(system, str) else system

        def tokens() -> list[int]:
            head, literal = tokenizer.render_chat(messages, add_generation_prompt=False)
            return tokenizer.encode(head, literal=literal)

        return prefix_blocks(await anyio.to_thread.run_sync(tokens))

    async def held_blocks(self) -> dict[str, list[int]]:
        """The block hashes of every warm cache on this host's disk and every running
        agent's cache, by agent (what a front learns of the host when it connects)."""
        session = await self._open()
        identity = session.identity
        assert identity is not None  # a host always has a warm tier
        # A cold agent (no cached token) holds nothing: its manifest is not read.
        names = [w.agent for w in await session.warm_agents() if not w.rejected and w.tokens]

        def read() -> dict[str, list[int]]:
            held: dict[str, list[int]] = {}
            for name in names:
                try:
                    manifest = read_manifest(self.cache_dir, identity, name)
                except Exception:  # a cache that fails its checks is refused at its turn
                    continue
                if manifest is not None and manifest.n_tokens:
                    held[name] = prefix_blocks(manifest.token_ids)
            return held

        held = await anyio.to_thread.run_sync(read)
        for name in session.agents:
            held[name] = await self._blocks(session.agent(name))
        return held

    # -- what a server over the cluster reads -----------------------------------------
    async def served(self) -> ServedModel:
        """The model this host runs, and the longest prompt it takes (in characters)."""
        session = await self._open()
        return ServedModel(session.model, session.max_prompt_chars)

    async def warm_list(self) -> list[WarmInfo]:
        """Every agent with a warm cache on this host's disk (``Session.warm_agents``)."""
        return await (await self._open()).warm_agents()

    async def warm_names(self) -> list[str]:
        """The agents with a folder on this host's disk (``Session.warm_names``)."""
        return await (await self._open()).warm_names()

    async def stats(self) -> EngineStats:
        return await (await self._open()).stats()

    async def warm_stats(self) -> StoreStats:
        return await (await self._open()).warm_stats()

    async def board(self, since: dict[str, int]) -> EngineBoard:
        return await (await self._open()).board(since)

    async def warm_moves(self, since: dict[str, int]) -> dict[str, TierMoves]:
        return await (await self._open()).warm_moves(since)

    async def model_states(self) -> list[ModelState]:
        return await (await self._open()).model_states()

    async def cache_info(self, name: str) -> CacheInfo:
        return await (await self._open()).cache_info(name)

    async def state(self, name: str) -> AgentState:
        """Agent ``name``'s state (``Agent.state``), resumed here if it is on disk only."""
        return await (await self._agent(name)).state()

    async def history(self, name: str) -> list[dict[str, str]]:
        return await (await self._agent(name)).history()

    async def prefetch(self, name: str) -> None:
        await (await self._open()).prefetch(name)

    async def hint(self, hint: Hint, prefetch: int) -> None:
        """The part of a cluster's hint about this host's agents (``Session.hint``)."""
        session = await self._open()
        await session.hint(
            hint.next,
            expect_in_s=dict(hint.expect_in_s),
            priority=dict(hint.priority),
            done=hint.done,
            prefetch=prefetch,
        )

    async def forget(self, name: str) -> Forgotten:
        done = await (await self._open()).forget(name)
        await anyio.to_thread.run_sync(self._scopes.set, name, "")
        return done

    async def scope_of(self, name: str) -> str:
        """Agent ``name``'s sharing scope here ("" unless it was given one)."""
        await self._open()
        return self._scopes.get(name)

    async def end_turns(self) -> int:
        """End this host's turns (``Session.end_turns``); 0 when its session is not open."""
        return 0 if self._session is None else await self._session.end_turns()

    # -- migration --------------------------------------------------------------------
    async def export(self, name: str) -> bytes:
        """Release agent ``name`` (its last turn saved, its hot cache dropped) and hand
        over its warm cache as one portable file (``Session.export_agent``'s format: one
        format for moving agents, between hosts or by hand). It stays here until
        ``forget``: a migration that fails on the other side loses nothing. Raises
        UnknownAgent when it has no warm cache here."""
        session = await self._open()
        check_agent_id(name)
        if name in session.agents:
            await session.release(name)
        buffer = io.BytesIO()
        try:
            await session.export_agent(name, buffer)
        except UnknownAgent:
            raise UnknownAgent(f"agent {name!r} has no warm cache on host {self.name!r}") from None
        self._out += 1
        return buffer.getvalue()

    async def adopt(self, name: str, data: bytes, scope: str = "") -> int:
        """Take agent ``name`` (of sharing scope ``scope``) from another host: its portable
        file ``data`` (``export``) is imported (``Session.import_agent``: staged, verified
        as a warm load verifies a cache, then moved into place) and the agent resumes from
        it; returns the bytes taken. Raises CacheRejected (nothing kept) for a file that
        fails, ValueError when an agent of that name is here already."""
        session = await self._free_name(name)
        if not isinstance(data, (bytes, bytearray)):
            raise CacheRejected(f"a migration brings bytes, not {type(data).__name__}")
        await anyio.to_thread.run_sync(self._scopes.set, name, scope)
        await session.import_agent(bytes(data), name, scope=scope, max_bytes=MAX_MIGRATION_BYTES)
        self._in += 1
        return len(data)

    async def export_portable(self, name: str) -> bytes:
        """Agent ``name``'s portable file (``Session.export_agent``), the agent kept
        running here."""
        session = await self._open()
        await self._agent(name)  # resumed if it is on disk only
        buffer = io.BytesIO()
        await session.export_agent(name, buffer)
        return buffer.getvalue()

    async def import_portable(
        self, data: bytes, name: str | None, replace: bool, scope: str = ""
    ) -> str:
        """The agent of portable file ``data`` here, of sharing scope ``scope``
        (``Session.import_agent``); its name."""
        session = await self._open()
        agent = await session.import_agent(
            bytes(data), name, replace=replace, scope=scope, max_bytes=MAX_MIGRATION_BYTES
        )
        await anyio.to_thread.run_sync(self._scopes.set, agent.name, scope)
        return agent.name

    async def _free_name(self, name: str) -> Session:
        session = await self._open()
        check_agent_id(name)
        if name in session.agents or agent_dir(self.cache_dir, name).exists():
            raise AgentExists(f"agent {name!r} already exists on host {self.name!r}")
        return session

    async def _install(self, session: Session, root: Path, name: str, scope: str) -> None:
        """Verify ``<root>/agents/<name>`` as a warm load does (read_cache refuses with the
        reason: checksums, identity, shapes, metadata), move it into place, resume it."""
        identity, layout = session.identity, session.layout
        assert identity is not None and layout is not None  # a host always has a warm tier
        await anyio.to_thread.run_sync(read_cache, root, identity, layout, name)
        target = agent_dir(self.cache_dir, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(agent_dir(root, name), target)
        await session.spawn_agent(name, scope=scope)

    # -- replicas (another host's agents, kept for when that host is gone) ------------
    def _replica_names(self) -> list[str]:
        folder = contained(self.cache_dir, "replicas", "agents")
        if not folder.is_dir():
            return []
        return sorted(e for e in os.listdir(folder) if (folder / e / MANIFEST).is_file())

    async def files(
        self, name: str, have: list[tuple[str, int]]
    ) -> tuple[dict[str, bytes], list[str], str]:
        """Agent ``name``'s committed warm files as they are now (it keeps running): the
        manifest and the files not in ``have`` (name, size) already, the names of those in
        ``have`` that it still has, and its scope. Raises UnknownAgent when it has no warm
        cache here."""
        await self._open()
        folder = agent_dir(self.cache_dir, name)
        if not (folder / MANIFEST).is_file():
            raise UnknownAgent(f"agent {name!r} has no warm cache on host {self.name!r}")
        sent = await anyio.to_thread.run_sync(_read_files, folder, dict(have))
        kept = [f for f, _ in have if _cache_file(f) and f not in sent and (folder / f).is_file()]
        return sent, kept, self._scopes.get(name)

    async def replica_files(self, name: str) -> list[tuple[str, int]]:
        """The files (name, size) of the replica of agent ``name`` kept here."""
        check_agent_id(name)
        folder = agent_dir(contained(self.cache_dir, "replicas"), name)
        if not folder.is_dir():
            return []
        return [(e.name, e.stat().st_size) for e in sorted(folder.iterdir()) if e.is_file()]

    async def keep_replica(self, name: str, update: tuple[dict[str, bytes], list[str], str]) -> int:
        """Bring the replica of agent ``name`` up to date with ``update`` (what ``files``
        returns: new files, the replica's files to keep, its scope): together, verified as
        a warm load verifies them, they replace the replica. Returns the bytes received.
        Raises CacheRejected (the old replica stays) for files that fail."""
        files, keep, scope = update
        session = await self._open()
        check_agent_id(name)
        identity, layout = session.identity, session.layout
        assert identity is not None and layout is not None
        replicas = contained(self.cache_dir, "replicas")
        staging = contained(self.cache_dir, "incoming", secrets.token_hex(8))
        current = agent_dir(replicas, name)
        try:
            # What the replica so far was verified as: its kept files need no second read.
            verified = await anyio.to_thread.run_sync(_entries, replicas, identity, name)
            await anyio.to_thread.run_sync(_stage_replica, staging, name, files, current, keep)
            await anyio.to_thread.run_sync(
                functools.partial(
                    verify_cache,
                    staging,
                    identity,
                    layout,
                    name,
                    trusted={f: e for f, e in verified.items() if f in keep and f not in files},
                )
            )
            await anyio.to_thread.run_sync(self._replica_scopes.set, name, scope)
            await anyio.to_thread.run_sync(_swap_in, agent_dir(staging, name), replicas, name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return sum(len(data) for data in files.values())

    async def drop_replica(self, name: str) -> None:
        """Delete the replica of agent ``name`` kept here (nothing when there is none)."""
        check_agent_id(name)
        shutil.rmtree(agent_dir(contained(self.cache_dir, "replicas"), name), ignore_errors=True)
        await anyio.to_thread.run_sync(self._replica_scopes.set, name, "")

    async def promote(self, name: str) -> None:
        """Make the replica of agent ``name`` an agent of this host (its own host is
        gone): verified as a warm load does, moved into place, resumed. Raises UnknownAgent
        without a replica, CacheRejected for one that fails, ValueError when an agent of
        that name is here already."""
        session = await self._free_name(name)
        replicas = contained(self.cache_dir, "replicas")
        if not (agent_dir(replicas, name) / MANIFEST).is_file():
            raise UnknownAgent(f"no replica of agent {name!r} on host {self.name!r}")
        scope = self._replica_scopes.get(name)
        await anyio.to_thread.run_sync(self._scopes.set, name, scope)
        await self._install(session, replicas, name, scope)
        await anyio.to_thread.run_sync(self._replica_scopes.set, name, "")
        self._in += 1


def _cache_file(name: object) -> bool:
    return isinstance(name, str) and bool(
        name == MANIFEST or any(p.fullmatch(name) for p in SEGMENT_FILES)
    )


def _read_files(folder: Path, have: dict[str, int] | None = None) -> dict[str, bytes]:
    """The manifest and segment files of an agent's folder, by name; of the others than
    the manifest, those not in ``have`` with the same size."""
    have = have or {}
    out: dict[str, bytes] = {}
    for entry in sorted(os.listdir(folder)):
        if not _cache_file(entry):
            continue
        path = folder / entry
        if entry != MANIFEST and have.get(entry) == path.stat().st_size:
            continue
        out[entry] = path.read_bytes()
    return out


def _write_files(root: Path, name: str, files: dict[str, bytes]) -> None:
    """``files`` as ``<root>/agents/<name>/<file>``; refuses names that are not a manifest
    or a segment, and more than MAX_MIGRATION_BYTES in all, before writing anything."""
    if not isinstance(files, dict) or MANIFEST not in files:
        raise CacheRejected("the migrated files have no manifest", str(root))
    total = 0
    for file, data in files.items():
        if not _cache_file(file):
            raise CacheRejected(f"{str(file)[:80]!r} is not a cache file name", str(root))
        if not isinstance(data, bytes):
            raise CacheRejected(f"{file}: not bytes", str(root))
        total += len(data)
    if total > MAX_MIGRATION_BYTES:
        raise CacheRejected(f"{total} bytes is more than a migration may bring", str(root))
    folder = agent_dir(root, name)
    folder.mkdir(parents=True)
    for file, data in files.items():
        with open(folder / file, "xb") as f:
            f.write(data)


def _stage_replica(
    root: Path, name: str, files: dict[str, bytes], current: Path, keep: list[str]
) -> None:
    """``files`` as ``<root>/agents/<name>``, with hard links (copies where links fail)
    to the files ``keep`` of ``current`` (the replica so far)."""
    _write_files(root, name, files)
    folder = agent_dir(root, name)
    for entry in keep:
        if _cache_file(entry) and entry not in files and (current / entry).is_file():
            link_or_copy(current / entry, folder / entry)


def _swap_in(folder: Path, root: Path, name: str) -> None:
    """``folder`` becomes ``<root>/agents/<name>``, the one there before deleted. A crash
    between the two renames leaves no replica (the next one is sent whole), never a mix."""
    target = agent_dir(root, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    old = folder.parent / f".old-{name}"
    if target.exists():
        os.rename(target, old)
    os.rename(folder, target)
    shutil.rmtree(old, ignore_errors=True)


def _entries(root: Path, identity: CacheIdentity, name: str) -> dict[str, SegmentEntry]:
    """The segment entries of agent ``name``'s manifest under ``root`` by file (none when it
    has none or its manifest fails its checks)."""
    try:
        manifest = read_manifest(root, identity, name)
    except CacheRejected:
        return {}
    if manifest is None:
        return {}
    return {e.file: e for e in manifest.all_segments}


class _Scopes:
    """Agents' sharing scopes, kept in a JSON file (``{agent: scope}``, "" left out),
    rewritten whole at each change (``write_atomic``: a fsynced temp file, a rename, the
    folder fsynced). A file that cannot be read counts as empty (its agents resume in
    scope "", as before scopes were kept), and says so in the log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._of: dict[str, str] | None = None

    def _load(self) -> dict[str, str]:
        if self._of is None:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                data = {}
            except (OSError, ValueError) as exc:
                log.warning("%s cannot be read (%s): its agents resume in scope ''", self.path, exc)
                data = {}
            if not isinstance(data, dict):
                data = {}
            self._of = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
        return self._of

    def get(self, agent: str | None) -> str:
        return self._load().get(agent, "") if agent is not None else ""

    def set(self, agent: str, scope: str) -> None:
        """Keep ``agent``'s scope ("": forget it); on disk before it returns."""
        of = self._load()
        if of.get(agent, "") == scope:
            return
        if scope:
            of[agent] = scope
        else:
            of.pop(agent, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(of, sort_keys=True).encode()
        write_atomic(self.path.parent, self.path.name, [memoryview(body)])
