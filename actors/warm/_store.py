"""The warm tier: StoreActor writes, verifies, lists and forgets agents' caches on disk.

One session at a time owns a root: it holds ``<root>/.lock`` (``lock_cache_dir``) while it
may write. Each agent owns a folder ``<root>/agents/<agent>/`` of immutable segment files
``seg-<n>.safetensors`` (the quantized K/V of one token range, all layers) and a
``manifest.json`` that commits them (the format: ``_manifest``; segment files:
``_safetensors``; reading and listing: ``_read``; appending: ``_write``; forgetting and
collecting: ``_forget``; forks and shared prefixes: ``_link``; temp files, renames and
the manifest commit: ``_durable``; the messages this actor answers: ``_protocol``; the
disk limit's count: ``_usage``; its list of warm agents: ``_warmlist``). A turn that
extends a warm cache appends one segment with only its new tokens. The actor runs every
file operation in a worker thread, never on the event loop or the engine's thread; the
same operations are plain functions here for the CLI, the scenario runner and
benchmarks. No MLX: numpy arrays and bytes only.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ...runtime import Actor, ActorDeadError, ActorRef, MailboxFull
from ..errors import AgentExists, CacheRejected, StoreWriteError
from ..hot import LRUPolicy, MoveLog, Rates, cold_candidates
from ..ids import check_agent_id, namespace_of
from ..messages import AskWith, EngineMessage, WarmAgent, WarmVictims
from ._dirlock import LOCK_FILE, CacheDirLock, lock_cache_dir
from ._forget import (
    Collected,
    Forgotten,
    SharedFile,
    agent_folders,
    collect,
    collect_agents,
    demote_cold,
    forget,
    forget_cache,
)
from ._link import fork_cache, share_cache
from ._manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    CacheIdentity,
    CacheManifest,
    ExpectFn,
    Loaded,
    SegmentEntry,
    WarmInfo,
    read_manifest,
)
from ._paths import agent_dir, default_cache_dir
from ._portable import install_import
from ._protocol import (
    Adopt,
    AgentNames,
    Append,
    FitDisk,
    Forget,
    ForkCache,
    ListAgents,
    Load,
    Manifest,
    Note,
    ShareCache,
    StoreMessage,
    StoreStats,
    StoreStatsQuery,
    Stream,
    Sweep,
    WarmMoves,
)
from ._read import agent_names, disk_footprint, list_agents, list_some, read_cache
from ._stream import StreamedRead, plan_stream
from ._usage import (
    AgentFiles,
    DiskUsage,
    agent_files,
    folder_files,
    free_reserve,
    make_reserve,
    record_disk_limit,
)
from ._warmlist import WarmList
from ._write import append_cache, note_conversation

log = logging.getLogger("kvactor.store")

__all__ = (
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MAX_MANIFEST_BYTES",
    "Adopt",
    "AgentNames",
    "Append",
    "CacheDirLock",
    "CacheIdentity",
    "CacheManifest",
    "Collected",
    "ExpectFn",
    "FitDisk",
    "Forget",
    "Forgotten",
    "ListAgents",
    "Load",
    "Loaded",
    "Manifest",
    "Note",
    "SegmentEntry",
    "SharedFile",
    "StoreActor",
    "StoreMessage",
    "Stream",
    "StreamedRead",
    "Sweep",
    "WarmInfo",
    "WarmMoves",
    "agent_dir",
    "append_cache",
    "collect",
    "default_cache_dir",
    "disk_footprint",
    "forget",
    "forget_cache",
    "list_agents",
    "lock_cache_dir",
    "read_cache",
    "read_manifest",
)


#: How many of the least recently written warm agents a write at the disk limit asks the
#: engine's policy about first (``StoreActor._victims_of``).
SHORTLIST = 64


# ------------------------------------------------------------------------------ actor
class StoreActor(Actor):
    """Owns the warm tier under ``root`` (default: ``default_cache_dir()``).

    ``identity`` is what caches must have been made with to be loaded; ``expect(start,
    stop)`` gives the exact tensors of a segment (from the codec). Handlers raise what the
    functions they run raise: InvalidAgentId, UnsafeCachePath (a symlinked folder under the
    root), UnknownAgent, CacheRejected, StoreWriteError, ValueError (see ``append_cache``
    and ``read_cache``).

    A refused cache stays in place, and ListAgents shows why, until the agent's next append
    from token 0 moves it to ``rejected/<agent>``. With ``delete_rejected`` it is deleted
    instead, at once when Load refuses it. Manifests are cached: this actor must be the
    only writer of its root, which the session that spawns it ensures by holding the
    root's lock (``lock_cache_dir``); that also makes its Sweep safe: a folder is collected
    between two of its messages, never while it writes there.
    """

    #: Folders a Sweep collects before the store handles its next message.
    sweep_folders = 32
    #: Manifests cached (the last read or loaded): a spawn reads its agent's, and a warm
    #: turn asks for it again first; a miss reads the file again.
    manifests_kept = 1024

    def __init__(
        self,
        identity: CacheIdentity,
        expect: ExpectFn,
        root: str | os.PathLike[str] | None = None,
        *,
        delete_rejected: bool = False,
        checkpoints: int | None = None,
        usage: DiskUsage | None = None,
        engine: ActorRef[EngineMessage] | None = None,
        ttl_s: float | None = None,
    ) -> None:
        self.identity = identity
        self.expect = expect
        self.checkpoints = checkpoints  # state files kept per agent (None: all)
        self.root = Path(root) if root is not None else default_cache_dir()
        self.delete_rejected = delete_rejected
        self._manifests: dict[str, CacheManifest | None] = {}
        # Why Load refused a cache still in place: for ListAgents, and so that the next
        # Append sets it aside instead of building on it.
        self._refused: dict[str, str] = {}
        # Streamed reads not known to have landed whole and matched (``Stream``).
        self._streams: dict[str, StreamedRead] = {}
        self._io = StoreStats()
        self.moves = MoveLog()  # the agents it made cold, for a dashboard
        # The disk limit (a count shared by the stores of one cache directory) and the
        # engine whose policy and hints order the agents that go cold (None: LRU).
        self.usage = usage
        self.engine = engine
        # The agents with tokens on disk, the least recently written first: listed during
        # the collector's pass where a limit or a TTL will ask for them.
        self._warm_list = WarmList()
        self._lists = usage is not None or ttl_s is not None
        self._left: set[str] = set()  # agents whose cache was written as they left
        # Agents whose cache was last written longer ago than this go cold (None: never).
        self.ttl_s = ttl_s
        self._expire_at = 0.0  # when to look for them next (monotonic)
        # The folders the sweep has yet to collect, the last first (None: not started),
        # whether a Sweep is queued, and the files it removed.
        self._sweep: list[str] | None = None
        self._sweep_queued = False
        self.swept = 0

    async def receive(self, message: StoreMessage) -> Any:
        if self._sweep and not self._sweep_queued:
            self._queue_sweep()  # its mailbox was full when the last Sweep ended
        match message:
            case Append():
                return await self._append(message)
            case Note():
                return await self._note(message)
            case Load(agent):
                return await self._load(check_agent_id(agent))
            case Stream(agent):
                return await self._stream(check_agent_id(agent))
            case Manifest(agent):
                return await self._manifest(check_agent_id(agent))
            case ListAgents():
                return await self._list()
            case AgentNames():
                return await anyio.to_thread.run_sync(agent_names, self.root)
            case Forget(agent):
                return await self._forget(check_agent_id(agent))
            case ForkCache(source, new):
                source, new = check_agent_id(source), check_agent_id(new)
                self._manifests.pop(new, None)
                forked = await anyio.to_thread.run_sync(
                    fork_cache, self.root, self.identity, source, new
                )
                await self._counted(new, forked)
                return forked
            case ShareCache(source, new, tokens, text, messages):
                source, new = check_agent_id(source), check_agent_id(new)
                self._manifests.pop(new, None)
                shared = await anyio.to_thread.run_sync(
                    functools.partial(
                        share_cache,
                        self.root,
                        self.identity,
                        source,
                        new,
                        tokens,
                        text=text,
                        messages=messages,
                    )
                )
                await self._counted(new, shared)
                return shared
            case Adopt():
                return await self._adopt(message)
            case StoreStatsQuery():
                return self._stats()
            case WarmMoves(since):
                return self.moves.after(since)
            case FitDisk():
                return await self._fit_all()
            case Sweep():
                return await self._sweep_some()
        raise TypeError(f"the store does not handle {type(message).__name__}")

    def _count(self, **more: float) -> None:
        self._io = msgspec.structs.replace(
            self._io, **{k: getattr(self._io, k) + v for k, v in more.items()}
        )

    async def _append(self, m: Append) -> WarmInfo | None:
        agent = check_agent_id(m.agent)
        self._manifests.pop(agent, None)  # unknown until the write ends, whatever happens
        await self._expire()
        usage = self.usage
        if usage is not None:
            bound = _write_bound(m, len(usage.files(self.root, agent)))
            try:  # a leaving write never makes cold one written while leaving
                await self._make_room(agent, bound, spare=self._left if m.leaving else set())
            except StoreWriteError:
                if not m.leaving:
                    raise
                self._count(left_unwritten=1)
                return None
        before = await self._listed(agent)
        t0 = time.perf_counter()
        try:
            info, after = await self._write(m, agent)
        except StoreWriteError as exc:
            # The disk filled before the limit: the limit comes down to what the file system
            # holds, agents go cold to make room, and the write is tried once more.
            if usage is None or not _no_space(exc) or not await self._adapt_limit():
                raise
            try:
                await self._make_room(agent, _write_bound(m, len(usage.files(self.root, agent))))
                info, after = await self._write(m, agent)
            finally:
                if usage.home is not None:  # the reserve again, once there is room
                    await anyio.to_thread.run_sync(make_reserve, usage.home)
        self._refused.pop(agent, None)
        # Exactly what the write put on disk: the files it made (a manifest is a new file).
        self._wrote(_new_bytes(before, after), writes=1, write_s=time.perf_counter() - t0)
        self._warm_list.remember(info)
        if m.leaving:
            self._left.add(agent)
        else:
            self._left.discard(agent)
        if usage is not None:
            if usage.home is not None and usage.written_due():
                await anyio.to_thread.run_sync(
                    record_disk_limit, usage.home, usage.limit, usage.written
                )
            # A bound that fell short: back under at once (a leaving write's, sparing the
            # caches written while leaving).
            spare = self._left if m.leaving else frozenset()
            await self._fit(0, keep=agent, spare=spare)
            await self._fit(0, keep=agent, namespace=namespace_of(agent), spare=spare)
        return info

    async def _note(self, m: Note) -> WarmInfo | None:
        agent = check_agent_id(m.agent)
        self._manifests.pop(agent, None)
        usage = self.usage
        if usage is not None:
            files = len(usage.files(self.root, agent))
            encoded = sum(len(msgspec.json.encode(x)) for x in (m.text, m.messages))
            await self._make_room(agent, 16 * len(m.tokens) + encoded + 320 * files + 4096)
        before = await self._listed(agent)
        t0 = time.perf_counter()
        note = functools.partial(
            note_conversation,
            self.root,
            self.identity,
            agent,
            m.tokens,
            text=m.text,
            messages=m.messages,
            bounds=m.bounds,
            answers=m.answers,
        )
        try:
            info: WarmInfo | None = await anyio.to_thread.run_sync(note)
        finally:
            after = await self._recount(agent)
        self._wrote(_new_bytes(before, after), writes=1, write_s=time.perf_counter() - t0)
        if info is not None:
            self._warm_list.remember(info)
        return info

    async def _adopt(self, m: Adopt) -> WarmInfo:
        agent = check_agent_id(m.agent)
        staging = Path(m.staging)
        if staging.parent != self.root / "incoming":
            raise ValueError(f"{m.staging} is not a staging folder of {self.root}")
        self._manifests.pop(agent, None)
        if self.usage is not None:
            await self._make_room(agent, m.nbytes)
        counted = self.usage.files(self.root, agent) if self.usage is not None else None
        t0 = time.perf_counter()
        # One trip to a worker thread: the check, the move, the count, the manifest.
        adopt = functools.partial(
            _adopt_files, self.root, self.identity, staging, agent, m.replace, counted, m.manifest
        )
        before, after, manifest = await anyio.to_thread.run_sync(adopt)
        if self.usage is not None:
            self.usage.update(self.root, agent, after)
        self._refused.pop(agent, None)
        self._wrote(_new_bytes(before, after), writes=1, write_s=time.perf_counter() - t0)
        self._keep(agent, manifest)
        info = WarmInfo(
            agent=agent,
            tokens=manifest.n_tokens,
            nbytes=sum(after.values()),
            segments=len(manifest.segments),
            updated=manifest.updated,
        )
        self._warm_list.remember(info)
        return info

    async def _write(self, m: Append, agent: str) -> tuple[WarmInfo, AgentFiles]:
        """Append ``m`` to ``agent``'s warm cache, and count its folder after, whatever
        happened; what it wrote and the folder's files after."""
        try:
            info: WarmInfo = await anyio.to_thread.run_sync(
                functools.partial(
                    append_cache,
                    self.root,
                    self.identity,
                    self.expect,
                    agent,
                    m.start,
                    m.tensors,
                    m.tokens,
                    text=m.text,
                    messages=m.messages,
                    extra=m.extra,
                    delete_rejected=self.delete_rejected,
                    refused=self._refused.get(agent),
                    checkpoints=self.checkpoints,
                )
            )
        finally:
            after = await self._recount(agent)
        return info, after

    async def _listed(self, agent: str) -> AgentFiles:
        """``agent``'s files now: as last counted under a limit, else listed."""
        if self.usage is not None:
            return self.usage.files(self.root, agent)
        return await anyio.to_thread.run_sync(agent_files, self.root, agent)

    def _wrote(self, nbytes: int, **more: float) -> None:
        """Count ``nbytes`` put on disk (exactly: the files a change made), and ``more``."""
        self._count(bytes_written=nbytes, **more)
        if self.usage is not None:
            self.usage.wrote(nbytes)

    async def _adapt_limit(self) -> bool:
        """After a write found the disk full: lower the limit to what the file system can
        hold now (what the tier holds plus the free space, less a tenth for the file
        system's own blocks); whether that lowered it."""
        usage = self.usage
        assert usage is not None
        free = (await anyio.to_thread.run_sync(shutil.disk_usage, self.root)).free
        fits = int((usage.used + free) * 0.9)
        if usage.limit is not None and fits >= usage.limit:
            return False
        if usage.home is not None:  # room for the manifests that make agents cold
            await anyio.to_thread.run_sync(free_reserve, usage.home)
        log.warning(
            "the disk under %s filled before the warm tier's limit (%s bytes): the limit is "
            "now %d bytes, and agents go cold to stay under it",
            self.root,
            usage.limit,
            fits,
        )
        usage.limit = fits
        return True

    # -- the disk limit ---------------------------------------------------------------
    async def _recount(self, agent: str) -> AgentFiles:
        """List ``agent``'s folder again and count it (its files now)."""
        files = await anyio.to_thread.run_sync(agent_files, self.root, agent)
        if self.usage is not None:
            self.usage.update(self.root, agent, files)
        return files

    async def _counted(self, agent: str, info: WarmInfo | None) -> None:
        """A fork or share made ``agent``'s folder: count it (and go back under the limit;
        its files are links, so it adds little more than a manifest)."""
        if info is None:
            return
        await self._recount(agent)
        self._warm_list.remember(info)
        if self.usage is not None and self.usage.over():
            await self._fit(0, keep=agent)

    async def _make_room(
        self, agent: str, bound: int, *, spare: AbstractSet[str] = frozenset()
    ) -> None:
        """Room for a write of at most ``bound`` bytes by ``agent``, under the limit and
        its namespace's quota, before it starts: both hold throughout. Never makes cold an
        agent in ``spare``. Raises StoreWriteError when no other agent can go cold for it."""
        usage = self.usage
        assert usage is not None
        if usage.limit is None or bound <= usage.limit:  # else none would do
            await self._fit(bound, keep=agent, spare=spare)
        if usage.over(bound):
            raise StoreWriteError(
                f"the warm tier is at its disk limit ({usage.used} of {usage.limit} bytes) "
                f"and no other agent can go cold for the {bound} bytes agent {agent!r} may "
                "write; its previous warm copy stays"
            )
        namespace = namespace_of(agent)
        if namespace is None or usage.quota is None:
            return
        if bound <= usage.quota:
            await self._fit(bound, keep=agent, namespace=namespace, spare=spare)
        if usage.over_quota(namespace, bound):
            raise StoreWriteError(
                f"the agents of {namespace!r} hold {usage.used_by(namespace)} bytes on disk "
                f"of their quota of {usage.quota}, and none of them can go cold for the "
                f"{bound} bytes agent {agent!r} may write; its previous warm copy stays"
            )

    def _over(self, more: int, namespace: str | None) -> int:
        usage = self.usage
        assert usage is not None
        if namespace is None:
            return usage.over(more + usage.headroom(usage.limit))
        return usage.over_quota(namespace, more + usage.headroom(usage.quota))

    async def _warm_agents(self) -> dict[str, WarmAgent]:
        """Every agent with tokens on disk, and when it was written: the warm list made
        whole (what the collector's pass has yet to list, or all at once)."""
        warm = self._warm_list
        if warm.complete:
            return warm.agents
        if warm.begun:
            rest = warm.pending()
            warm.listed(
                rest, await anyio.to_thread.run_sync(list_some, self.root, rest, self.identity)
            )
        else:
            warm.fill(await anyio.to_thread.run_sync(list_agents, self.root, self.identity))
        return warm.agents

    async def _fit(
        self,
        more: int,
        *,
        keep: str | None,
        namespace: str | None = None,
        spare: AbstractSet[str] = frozenset(),
    ) -> int:
        """Make agents cold (never ``keep`` or one in ``spare``), in the engine's policy
        order, until ``more`` bytes fit under the limit (with ``namespace``: under its
        quota, making only its own agents cold); how many went cold."""
        usage = self.usage
        if usage is None or not self._over(more, namespace):
            return 0
        warm = await self._warm_agents()
        demoted, tried = 0, {keep, *spare}

        def mine(order: Iterable[str]) -> Iterator[WarmAgent]:
            return (
                warm[a]
                for a in order
                if a in warm
                and a not in tried
                and (namespace is None or namespace_of(a) == namespace)
            )

        while need := self._over(more, namespace):
            victims = await self._victims_of(mine, need)
            if not victims:
                break
            for agent in victims:
                tried.add(agent)
                demoted += await self._demote(agent)
                if not self._over(more, namespace):
                    break
        if demoted:
            self._count(demoted_cold=demoted)
            under = "its limit" if namespace is None else f"the quota of {namespace!r}"
            log.info("%d agents went cold to keep the warm tier under %s", demoted, under)
        return demoted

    async def _demote(self, agent: str) -> bool:
        """Make ``agent`` cold (whole: see ``demote_cold``) and count its folder again (its
        new manifest is a write too)."""
        self._manifests.pop(agent, None)
        before = await self._listed(agent)
        try:
            done = await anyio.to_thread.run_sync(demote_cold, self.root, self.identity, agent)
        finally:
            self._warm_list.unlist(agent)
            after = await self._recount(agent)
            self._wrote(_new_bytes(before, after))
        if done:
            freed = sum(size for inode, size in before.items() if inode not in after)
            self.moves.went_cold(agent, freed)
        return bool(done)

    async def _fit_all(self) -> int:
        """Bring the directory under its limit and every namespace under its quota (at
        open: a limit or quota lower than the one the files were written under)."""
        await self._expire(force=True)
        demoted = await self._fit(0, keep=None)
        if self.usage is not None and self.usage.quota is not None:
            for namespace in sorted(self.usage.namespaces()):
                demoted += await self._fit(0, keep=None, namespace=namespace)
        return demoted

    async def _expire(self, *, force: bool = False) -> int:
        """Make cold the agents whose warm cache was last written more than ``ttl_s`` ago
        (the policy says which may go now: never one hot and busy, staged or being
        written); looks at most every ``ttl_s / 8`` seconds unless ``force``."""
        ttl = self.ttl_s
        now = time.monotonic()
        if ttl is None or (not force and now < self._expire_at):
            return 0
        self._expire_at = now + ttl / 8
        wall = time.time()
        old = [a for a in (await self._warm_agents()).values() if wall - a.updated > ttl]
        if not old:
            return 0
        victims = await self._victims(old, sum(a.nbytes for a in old) + 1)
        demoted = 0
        for agent in victims:
            demoted += await self._demote(agent)
        if demoted:
            self._count(demoted_cold=demoted, expired=demoted)
            log.info("%d agents unused for %g s went cold", demoted, ttl)
        return demoted

    async def _victims_of(
        self, mine: Callable[[Iterable[str]], Iterator[WarmAgent]], need: int
    ) -> list[str]:
        """The policy's victims for ``need`` bytes among the agents ``mine`` gives of the
        warm ones. The engine is asked of the first ``SHORTLIST`` of them in write order
        (least recently written first) first: with LRU that answers for all of them unless
        its pick reaches the last (``WarmVictims.beyond``), so that a write at the limit
        does not build a candidate for each of 10,000 agents on disk; with the hints, it
        may name the agents left out that they rank first (``AskWith``), asked again with
        the ``SHORTLIST`` least recently written of those; otherwise it is asked again of
        all."""
        usage = self.usage
        assert usage is not None

        def sized(some: Iterable[WarmAgent]) -> list[WarmAgent]:
            own = usage.own_bytes
            return [msgspec.structs.replace(a, nbytes=own(self.root, a.agent)) for a in some]

        if self.engine is not None:
            head = list(itertools.islice(mine(self._warm_list.by_write), SHORTLIST + 1))
            if len(head) > SHORTLIST:
                asked = sized(head[:SHORTLIST])
                beyond = head[-1].updated
                early = await self.engine.ask(WarmVictims(asked, need, beyond=beyond))
                if isinstance(early, AskWith):
                    # The least recently written of those still warm, the rest held back
                    # (a backlog of done agents can be hundreds: each a candidate built).
                    have = {a.agent for a in asked}
                    named = mine(a for a in early.agents if a not in have)
                    more = sorted(named, key=lambda a: a.updated)
                    held = more[SHORTLIST:]
                    again = WarmVictims(
                        asked + sized(more[:SHORTLIST]),
                        need,
                        beyond,
                        checked=early.agents,
                        held_back=tuple(a.agent for a in held),
                        held_beyond=held[0].updated if held else 0.0,
                    )
                    early = await self.engine.ask(again)
                if isinstance(early, list):
                    return early
        return await self._victims(sized(mine(self._warm_list.agents)), need)

    async def _victims(self, candidates: list[WarmAgent], need: int) -> list[str]:
        if not candidates:
            return []
        if self.engine is None:
            return LRUPolicy().victims(cold_candidates(candidates, None, Rates()), need)
        victims: list[str] = await self.engine.ask(WarmVictims(candidates, need))
        return victims

    def _stats(self) -> StoreStats:
        usage = self.usage
        io = msgspec.structs.replace(self._io, collector_left=len(self._sweep or ()))
        if usage is None:
            return io
        return msgspec.structs.replace(
            io,
            disk_bytes=usage.used,
            disk_peak_bytes=usage.peak,
            disk_limit_bytes=usage.limit,
        )

    async def _load(self, agent: str) -> Loaded:
        t0 = time.perf_counter()
        try:
            loaded = await anyio.to_thread.run_sync(
                functools.partial(
                    read_cache,
                    self.root,
                    self.identity,
                    self.expect,
                    agent,
                    delete_rejected=self.delete_rejected,
                )
            )
        except CacheRejected as exc:
            self._manifests.pop(agent, None)
            if not self.delete_rejected:
                self._refused[agent] = exc.reason
            self._count(rejected=1)
            raise
        self._keep(agent, loaded.manifest)
        self._count(reads=1, bytes_read=loaded.nbytes, read_s=time.perf_counter() - t0)
        return loaded

    async def _stream(self, agent: str) -> StreamedRead | Loaded:
        # Kept: reads still landing, and failed ones, whose agent's cache is read whole next
        # time (the only way to refuse it with the reason, set it aside and have its agent
        # go cold). A read never started was abandoned (the prefetch actor stages one cache
        # at a time, and its stage has ended): its files are closed.
        kept = {}
        for name, other in self._streams.items():
            if not other.started:
                other.close()
            elif not other.settled or other.wait() is not None:
                kept[name] = other
        self._streams = kept
        last = self._streams.pop(agent, None)
        if last is not None and await anyio.to_thread.run_sync(last.wait) is not None:
            return await self._load(agent)
        t0 = time.perf_counter()
        # Shielded: a read made is kept (and closed by the next Stream if its stage gives
        # up), never lost with its files open.
        with anyio.CancelScope(shield=True):
            try:
                read = await anyio.to_thread.run_sync(
                    plan_stream, self.root, self.identity, self.expect, agent
                )
            except (CacheRejected, FileNotFoundError):
                read = None  # read whole: Load names the reason (and sets the cache aside)
            if read is not None:
                self._streams[agent] = read
        if read is None:
            return await self._load(agent)
        self._keep(agent, read.manifest)
        self._count(reads=1, bytes_read=read.nbytes, read_s=time.perf_counter() - t0)
        return read

    async def _manifest(self, agent: str) -> CacheManifest | None:
        if agent in self._manifests:
            return self._manifests[agent]
        manifest = await anyio.to_thread.run_sync(read_manifest, self.root, self.identity, agent)
        self._keep(agent, manifest)
        return manifest

    def _keep(self, agent: str, manifest: CacheManifest | None) -> None:
        """Cache ``agent``'s manifest, the oldest cached going past ``manifests_kept``: an
        idle agent (spawned, its cache on disk) costs the store nothing once it is out."""
        self._manifests.pop(agent, None)
        self._manifests[agent] = manifest
        if len(self._manifests) > self.manifests_kept:
            del self._manifests[next(iter(self._manifests))]

    async def _list(self) -> list[WarmInfo]:
        infos = await anyio.to_thread.run_sync(list_agents, self.root, self.identity)
        return [
            msgspec.structs.replace(info, rejected=self._refused[info.agent])
            if info.rejected is None and info.agent in self._refused
            else info
            for info in infos
        ]

    # -- the collector, in the background -----------------------------------------------
    async def _sweep_some(self) -> None:
        """Collect the next ``sweep_folders`` folders, count them again where files went,
        and queue the next Sweep. A failure ends the sweep with a warning: a tell must not
        crash the store."""
        self._sweep_queued = False
        try:
            if self._sweep is None:
                self._sweep = await anyio.to_thread.run_sync(agent_folders, self.root)
                self._sweep.reverse()
                if self._lists:  # the warm list made beside it
                    self._warm_list.begin(self._sweep)
            some = self._sweep[-self.sweep_folders :]
            del self._sweep[-self.sweep_folders :]
            listing = self._warm_list.begun and not self._warm_list.complete
            collect = functools.partial(_collect, self.root, self.identity, some, listing=listing)
            done, infos = await anyio.to_thread.run_sync(collect)
            if listing:
                self._warm_list.listed(some, infos)
            # A folder it emptied may not be named as an agent's could be: listed by name.
            for name in sorted({path.split("/")[1] for path in done.removed}):
                files = await anyio.to_thread.run_sync(folder_files, self.root, name)
                if self.usage is not None:
                    self.usage.update(self.root, name, files)
        except Exception as exc:
            log.warning("unreferenced cache files not collected: %s", exc)
            self._sweep = []
            self._warm_list.abandon()
            return
        self.swept += len(done.removed)
        if done.removed:
            log.info("removed %d unreferenced cache files", len(done.removed))
        self._queue_sweep()

    def _queue_sweep(self) -> None:
        """Tell this store the next Sweep if folders are left (a full mailbox: the next
        message it handles tries again)."""
        if not self._sweep:
            return
        try:
            self.ref.tell_nowait(Sweep())
        except (MailboxFull, ActorDeadError):
            return
        self._sweep_queued = True

    async def _forget(self, agent: str) -> Forgotten:
        self._manifests.pop(agent, None)
        self._refused.pop(agent, None)
        self._warm_list.unlist(agent)
        try:
            done: Forgotten = await anyio.to_thread.run_sync(forget_cache, self.root, agent)
        finally:
            await self._recount(agent)
        return done


def _collect(
    root: Path, identity: CacheIdentity, folders: list[str], *, listing: bool
) -> tuple[Collected, list[WarmInfo]]:
    """The collector's step over ``folders``: what it removed, then (``listing``) the
    folders listed as they are after."""
    done = collect_agents(root, folders)
    return done, list_some(root, folders, identity) if listing else []


def _adopt_files(
    root: Path,
    identity: CacheIdentity,
    staging: Path,
    agent: str,
    replace: bool,
    before: AgentFiles | None,
    manifest: CacheManifest | None,
) -> tuple[AgentFiles, AgentFiles, CacheManifest]:
    """The files of ``Adopt``: an agent of that name there refused unless ``replace``,
    the staged one moved into place, its files before (``before``: as counted) and after,
    and its manifest (checked: ``manifest``, the one verified, else read again)."""
    if os.path.lexists(agent_dir(root, agent)) and not replace:
        raise AgentExists(
            f"agent {agent!r} already has a cache here: import it with replace to replace it"
        )
    if before is None:
        before = agent_files(root, agent)
    if manifest is not None and manifest.agent != agent:
        raise ValueError(f"the staged manifest is agent {manifest.agent!r}'s, not {agent!r}'s")
    install_import(root, staging, agent)
    if manifest is None:
        manifest = read_manifest(root, identity, agent)
    assert manifest is not None  # verified before it was staged
    return before, agent_files(root, agent), manifest


def _new_bytes(before: AgentFiles, after: AgentFiles) -> int:
    """The bytes of the files in ``after`` that ``before`` did not have (new inodes: every
    write makes new files, a manifest included)."""
    return sum(size for inode, size in after.items() if inode not in before)


def _no_space(exc: StoreWriteError) -> bool:
    """Whether a write failed for want of space (ENOSPC, or EDQUOT: a user's disk quota)."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_bound(m: Append, files: int) -> int:
    """A bound on the bytes an append adds on disk: its tensors with their files' headers
    (a segment, a window and a state file at most), and a new manifest: its token ids (at
    most 8 bytes each in JSON), text, messages and extra as JSON, and an entry for each of
    the agent's ``files`` and the new ones."""
    tensors = sum(int(a.nbytes) for a in m.tensors.values())
    headers = 192 * len(m.tensors) + 3 * 256
    encoded = sum(len(msgspec.json.encode(x)) for x in (m.text, m.messages, m.extra))
    return tensors + headers + 8 * len(m.tokens) + encoded + 320 * (files + 3) + 1024
