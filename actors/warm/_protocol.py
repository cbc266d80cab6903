"""What the store actor answers: its messages (each says what it answers) and its I/O
counts. The senders are the agent's warm tier (``_tier``), the prefetch actor and the
session; ``StoreActor`` (``_store``) handles them."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ._manifest import CacheManifest

__all__ = (
    "Adopt",
    "AgentNames",
    "Append",
    "FitDisk",
    "Forget",
    "ForkCache",
    "ListAgents",
    "Load",
    "Manifest",
    "Note",
    "ShareCache",
    "StoreMessage",
    "StoreStats",
    "StoreStatsQuery",
    "Stream",
    "Sweep",
    "WarmMoves",
)


class Append(msgspec.Struct, frozen=True, tag=True):
    """Make ``agent``'s warm cache hold ``tokens``: keep its first ``start`` tokens, store
    ``tensors`` (tokens [start, len(tokens)), named ``"{layer}.{k|v}.{part}"``) as one new
    segment, then commit ``text``, ``messages`` and ``extra`` with them.

    ``start`` below the cached count cuts the cache first (a DIVERGE); empty ``tensors``
    with ``len(tokens) == start`` only rewrites the manifest. Answers a WarmInfo. The
    arrays are read in a worker thread: keep them alive and unchanged until the answer.

    ``leaving``: under write-back, the cache of an agent that leaves the session (it
    stops). Such a write never makes cold another cache written while leaving: where only
    those could make room under the limit, it is not written (None answered), and the
    agent stays cold on disk, its conversation kept. A close then writes what the limit
    keeps, not caches that push each other out.
    """

    agent: str
    start: int
    tensors: dict[str, np.ndarray[Any, Any]]
    tokens: list[int]
    text: str = ""
    messages: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    leaving: bool = False


class Note(msgspec.Struct, frozen=True, tag=True):
    """Under write-back, a turn's end: commit ``agent``'s conversation and what its cache
    holds now in its manifest, its warm cache unchanged (see ``note_conversation``).
    Answers a WarmInfo, or None for a refused cache (nothing written)."""

    agent: str
    tokens: list[int]
    text: str
    messages: list[dict[str, Any]]
    bounds: list[int]
    answers: list[int] = []


class Load(msgspec.Struct, frozen=True, tag=True):
    """Read and verify ``agent``'s warm cache: answers a Loaded. Raises UnknownAgent when
    there is none, CacheRejected when it cannot be trusted (ListAgents then says why)."""

    agent: str


class Stream(msgspec.Struct, frozen=True, tag=True):
    """Ready ``agent``'s warm cache to stream into the engine (a layer-streamed load: its
    files open, their headers and metadata checked, no data read): answers a
    StreamedRead, or a Loaded (read and verified whole, as Load answers) where the cache
    cannot stream or its last streamed read failed its checksum (that read refuses it
    with the reason). Raises as Load does."""

    agent: str


class Manifest(msgspec.Struct, frozen=True, tag=True):
    """``agent``'s checked manifest (a CacheManifest), or None when it has no warm cache;
    raises CacheRejected for a manifest that is refused (see ``read_manifest``)."""

    agent: str


class ListAgents(msgspec.Struct, frozen=True, tag=True):
    """A WarmInfo for every agent folder, refused ones with their reason."""


class AgentNames(msgspec.Struct, frozen=True, tag=True):
    """The name of every agent folder (``agent_names``: no manifest read)."""


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


class Adopt(msgspec.Struct, frozen=True, tag=True):
    """Move agent ``agent``, verified and staged under ``staging`` (an import), into place:
    room made under the disk limit and its namespace's quota first (other agents go cold
    by policy), an agent of that name there replaced only with ``replace`` (ValueError
    without). ``manifest``: the staged one as its verification read it (else it is read
    again). Answers a WarmInfo; raises StoreWriteError when no room can be made."""

    staging: str
    agent: str
    nbytes: int
    replace: bool = False
    manifest: CacheManifest | None = None


class StoreStatsQuery(msgspec.Struct, frozen=True, tag=True):
    """The warm tier's I/O so far: answers a StoreStats."""


class WarmMoves(msgspec.Struct, frozen=True, tag=True):
    """The warm tier's moves (agents made cold: for room under the disk limit or a quota,
    or past the TTL) after seq ``since``: answers a TierMoves."""

    since: int = 0


class FitDisk(msgspec.Struct, frozen=True, tag=True):
    """Make agents past the store's TTL cold, and bring the warm tier under its disk limit
    and each namespace under its quota (at open: lower ones than the directory was filled
    under) by making agents cold in the policy's order: answers how many went cold."""


class Sweep(msgspec.Struct, frozen=True, tag=True):
    """Collect (see ``collect``) what no manifest names in the next few agent folders of
    the directory, then tell itself the next Sweep until every folder the directory held
    at the first one is done: a session's collector, in the background, so that opening
    a directory of many agents reads none of their manifests. Under a disk limit or a TTL
    it lists those folders' warm agents too (``WarmList``), so that the first write at
    the limit does not read every manifest. A tell; answers nothing."""


class StoreStats(msgspec.Struct, frozen=True):
    """Bytes the warm tier read (verified loads) and wrote (the files its appends made:
    segments and manifests, exactly), and the seconds those took (the reads' and writes'
    own time: the rate)."""

    reads: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_s: float = 0.0
    rejected: int = 0  # loads refused (the agent continued cold)
    # The disk limit (None: none): what the cache directory's agents hold now (a file
    # linked by several counted once), the limit, and the agents made cold to stay under.
    disk_bytes: int = 0
    disk_peak_bytes: int = 0
    disk_limit_bytes: int | None = None
    demoted_cold: int = 0
    expired: int = 0  # of which: unused for longer than the store's ttl_s
    # Caches of agents leaving under write-back not written: only caches written while
    # leaving could have made room for them (``Append.leaving``).
    left_unwritten: int = 0
    # Agent folders the collector's pass after open has yet to go through (0: done). Under
    # a disk limit or a TTL the pass also lists the warm agents that may go cold.
    collector_left: int = 0


StoreMessage = (
    Append
    | Note
    | Load
    | Stream
    | Manifest
    | ListAgents
    | AgentNames
    | Forget
    | ForkCache
    | ShareCache
    | Adopt
    | StoreStatsQuery
    | WarmMoves
    | FitDisk
    | Sweep
)
