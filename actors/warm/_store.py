"""The warm tier: StoreActor writes, verifies, lists and forgets agents' caches on disk.

One session at a time owns a root: it holds ``<root>/.lock`` (``lock_cache_dir``) while it
may write. Each agent owns a folder ``<root>/agents/<agent>/`` of immutable segment files
``seg-<n>.safetensors`` (the quantized K/V of one token range, all layers) and a
``manifest.json`` that commits them (the format: ``_manifest``; segment files:
``_safetensors``; reading and listing: ``_warm_read``; appending: ``_warm_write``;
forgetting and collecting: ``_warm_forget``; forks and shared prefixes: ``_warm_link``;
temp files, renames and the manifest commit: ``_durable``). A turn that extends a warm
cache appends one segment with only its new tokens. The actor runs every file operation
in a worker thread, never on the event loop or the engine's thread; the same operations
are plain functions here for the CLI, the scenario runner and benchmarks. No MLX: numpy
arrays and bytes only.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from ...runtime import Actor
from ..errors import CacheRejected
from ..ids import check_agent_id
from ._dirlock import LOCK_FILE, CacheDirLock, lock_cache_dir
from ._forget import Collected, Forgotten, SharedFile, collect, forget, forget_cache
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
from ._read import disk_footprint, list_agents, read_cache
from ._write import append_cache

__all__ = (
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MAX_MANIFEST_BYTES",
    "Append",
    "CacheDirLock",
    "CacheIdentity",
    "CacheManifest",
    "Collected",
    "ExpectFn",
    "Forget",
    "Forgotten",
    "ListAgents",
    "Load",
    "Loaded",
    "Manifest",
    "SegmentEntry",
    "SharedFile",
    "StoreActor",
    "StoreMessage",
    "WarmInfo",
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


# --------------------------------------------------------------------------- messages
class Append(msgspec.Struct, frozen=True, tag=True):
    """Make ``agent``'s warm cache hold ``tokens``: keep its first ``start`` tokens, store
    ``tensors`` (tokens [start, len(tokens)), named ``"{layer}.{k|v}.{part}"``) as one new
    segment, then commit ``text``, ``messages`` and ``extra`` with them.

    ``start`` below the cached count cuts the cache first (a DIVERGE); empty ``tensors``
    with ``len(tokens) == start`` only rewrites the manifest. Answers a WarmInfo. The
    arrays are read in a worker thread: keep them alive and unchanged until the answer.
    """

    agent: str
    start: int
    tensors: dict[str, np.ndarray[Any, Any]]
    tokens: list[int]
    text: str = ""
    messages: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}


class Load(msgspec.Struct, frozen=True, tag=True):
    """Read and verify ``agent``'s warm cache: answers a Loaded. Raises UnknownAgent when
    there is none, CacheRejected when it cannot be trusted (ListAgents then says why)."""

    agent: str


class Manifest(msgspec.Struct, frozen=True, tag=True):
    """``agent``'s checked manifest (a CacheManifest), or None when it has no warm cache;
    raises CacheRejected for a manifest that is refused (see ``read_manifest``)."""

    agent: str


class ListAgents(msgspec.Struct, frozen=True, tag=True):
    """A WarmInfo for every agent folder, refused ones with their reason."""


class Forget(msgspec.Struct, frozen=True, tag=True):
    """Delete every byte of ``agent``'s warm cache that is its own; answers a Forgotten
    (bytes freed, 0 if none; its files that other agents' caches use stay)."""

    agent: str


class ForkCache(msgspec.Struct, frozen=True, tag=True):
    """Give ``new`` a warm cache that is ``source``'s, its segment files linked (see
    ``fork_cache``): answers a WarmInfo, or None when the source has none."""

    source: str
    new: str


class ShareCache(msgspec.Struct, frozen=True, tag=True):
    """Give ``new`` (no warm cache yet) a warm cache of ``tokens``, a prefix of
    ``source``'s ending at one of its segments, the files linked (see ``share_cache``):
    answers a WarmInfo, or None when that cannot be done (then write them)."""

    source: str
    new: str
    tokens: list[int]
    text: str = ""
    messages: list[dict[str, Any]] = []


class StoreStatsQuery(msgspec.Struct, frozen=True, tag=True):
    """The warm tier's I/O so far: answers a StoreStats."""


class StoreStats(msgspec.Struct, frozen=True):
    """Bytes the warm tier read (verified loads) and wrote (appends, segments and
    manifests), and the seconds those took (the reads' and writes' own time: the rate)."""

    reads: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_s: float = 0.0
    rejected: int = 0  # loads refused (the agent continued cold)


StoreMessage = (
    Append | Load | Manifest | ListAgents | Forget | ForkCache | ShareCache | StoreStatsQuery
)


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
    root's lock (``lock_cache_dir``).
    """

    def __init__(
        self,
        identity: CacheIdentity,
        expect: ExpectFn,
        root: str | os.PathLike[str] | None = None,
        *,
        delete_rejected: bool = False,
        checkpoints: int | None = None,
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
        self._io = StoreStats()

    async def receive(self, message: StoreMessage) -> Any:
        match message:
            case Append():
                return await self._append(message)
            case Load(agent):
                return await self._load(check_agent_id(agent))
            case Manifest(agent):
                return await self._manifest(check_agent_id(agent))
            case ListAgents():
                return await self._list()
            case Forget(agent):
                return await self._forget(check_agent_id(agent))
            case ForkCache(source, new):
                source, new = check_agent_id(source), check_agent_id(new)
                self._manifests.pop(new, None)
                return await anyio.to_thread.run_sync(
                    fork_cache, self.root, self.identity, source, new
                )
            case ShareCache(source, new, tokens, text, messages):
                source, new = check_agent_id(source), check_agent_id(new)
                self._manifests.pop(new, None)
                return await anyio.to_thread.run_sync(
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
            case StoreStatsQuery():
                return self._io
        raise TypeError(f"the store does not handle {type(message).__name__}")

    def _count(self, **more: float) -> None:
        self._io = msgspec.structs.replace(
            self._io, **{k: getattr(self._io, k) + v for k, v in more.items()}
        )

    async def _append(self, m: Append) -> WarmInfo:
        agent = check_agent_id(m.agent)
        self._manifests.pop(agent, None)  # unknown until the write ends, whatever happens
        t0 = time.perf_counter()
        info = await anyio.to_thread.run_sync(
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
        self._refused.pop(agent, None)
        written = sum(a.nbytes for a in m.tensors.values())  # the segments' tensor bytes
        self._count(writes=1, bytes_written=written, write_s=time.perf_counter() - t0)
        return info

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
        self._manifests[agent] = loaded.manifest
        self._count(reads=1, bytes_read=loaded.nbytes, read_s=time.perf_counter() - t0)
        return loaded

    async def _manifest(self, agent: str) -> CacheManifest | None:
        if agent not in self._manifests:
            self._manifests[agent] = await anyio.to_thread.run_sync(
                read_manifest, self.root, self.identity, agent
            )
        return self._manifests[agent]

    async def _list(self) -> list[WarmInfo]:
        infos = await anyio.to_thread.run_sync(list_agents, self.root, self.identity)
        return [
            msgspec.structs.replace(info, rejected=self._refused[info.agent])
            if info.rejected is None and info.agent in self._refused
            else info
            for info in infos
        ]

    async def _forget(self, agent: str) -> Forgotten:
        self._manifests.pop(agent, None)
        self._refused.pop(agent, None)
        done: Forgotten = await anyio.to_thread.run_sync(forget_cache, self.root, agent)
        return done
