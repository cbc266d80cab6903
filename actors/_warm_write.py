"""Writing the warm tier: append a turn's tokens to an agent's cache, forget an agent.

Every function here blocks; StoreActor runs them off the event loop, and the CLI, the
scenario runner or a benchmark may call them directly. Appends to one agent must not
overlap (StoreActor handles one message at a time); reads may run alongside them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import operator
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ._fileio import CLOEXEC, NOFOLLOW, in_background
from ._manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SEGMENT_FILE,
    WINDOW_FILE,
    CacheIdentity,
    CacheManifest,
    ExpectFn,
    SegmentEntry,
    WarmInfo,
    agent_dir,
    contained,
    encode_manifest,
    load_manifest,
    rejected_dir,
    segment_holds,
    segment_metadata,
    split_layers,
    warm_info,
)
from ._safetensors import build_header, checksum, tensor_bytes
from ._warm_read import tree_bytes
from .errors import CacheRejected, StoreWriteError

__all__ = (
    "Collected",
    "Forgotten",
    "SharedFile",
    "append_cache",
    "collect",
    "fork_cache",
    "forget",
    "forget_cache",
    "link_or_copy",
    "share_cache",
)

_LITTLE = sys.byteorder == "little"
_IOV_MAX = 512  # buffers per writev call (POSIX guarantees 16, Linux and macOS allow 1024)
_WRITE_BATCH = 4 << 20  # bytes per write call
_dtype = functools.cache(np.dtype)  # dtype objects by name (np.dtype(str) is slow)


# ----------------------------------------------------------------------------- write
def _write_chunks(fd: int, chunks: list[memoryview]) -> int:
    """Write the chunks in order, a few MiB per system call (writev where it exists), and
    start the disk writing each batch right away where the OS allows, so that the fsync to
    come overlaps the rest of the writes (on Linux, ``POSIX_FADV_DONTNEED`` starts the
    write-back of dirty pages: ~20% off a 26 MB segment's write + fsync here). Returns the
    bytes written."""
    chunks = [c for c in chunks if c.nbytes]
    writev = getattr(os, "writev", None)
    advise = getattr(os, "posix_fadvise", None)
    written = 0
    i = 0
    while i < len(chunks):
        j, size = i, 0
        while j < len(chunks) and j - i < _IOV_MAX and (j == i or size < _WRITE_BATCH):
            size += chunks[j].nbytes
            j += 1
        if writev is None or j - i == 1:
            n = os.write(fd, chunks[i][: 1 << 30])
        else:
            n = writev(fd, chunks[i:j])
        if advise is not None and n >= _WRITE_BATCH:
            advise(fd, written, n, os.POSIX_FADV_DONTNEED)
        written += n
        while n:  # skip what was written: writev, like write, may stop short anywhere
            if n >= chunks[i].nbytes:
                n -= chunks[i].nbytes
                i += 1
            else:
                chunks[i] = chunks[i][n:]
                n = 0
    return written


def _fsync_dir(folder: Path) -> None:
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:  # Windows: directories cannot be opened for fsync
        return
    fd = os.open(folder, os.O_RDONLY | flag | NOFOLLOW | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(folder: Path, name: str, chunks: Iterable[memoryview]) -> int:
    """Write ``name`` in ``folder`` via a fsynced temp file and a rename; returns its size.

    On any error the temp file is removed and ``name`` is as it was.
    """
    tmp = folder / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW, 0o644)
    size = 0
    try:
        try:
            size = _write_chunks(fd, list(chunks))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return size


def _check_tensors(
    expect: ExpectFn,
    start: int,
    tensors: Mapping[str, np.ndarray[Any, Any]],
    n: int,
) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """The tensors of tokens [start, start + n) in file order (aligned, largest items
    first), contiguous and little-endian. Raises ValueError/TypeError when they are not
    exactly what ``expect`` says."""
    if n == 0:
        if tensors:
            raise ValueError("tensors were given for an empty range (tokens has start ids)")
        return []
    want = expect(start, start + n)
    if set(tensors) != set(want):
        missing = sorted(set(want) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(want))[:5]
        raise ValueError(
            f"tensors for tokens [{start}, {start + n}) do not match the codec: "
            f"missing {missing}, unexpected {extra}"
        )
    out = []
    for name, (shape, dtype) in want.items():
        array = tensors[name]
        if not isinstance(array, np.ndarray):
            raise TypeError(f"tensor {name!r} is a {type(array).__name__}, not a numpy array")
        if array.shape != tuple(shape) or array.dtype != _dtype(dtype):
            raise ValueError(
                f"tensor {name!r} is {array.dtype.name}{list(array.shape)}, "
                f"expected {dtype}{list(shape)} for tokens [{start}, {start + n})"
            )
        if _LITTLE and array.dtype.isnative:
            out.append((name, np.ascontiguousarray(array)))
        else:
            out.append((name, np.ascontiguousarray(array, array.dtype.newbyteorder("<"))))
    out.sort(key=lambda item: (-item[1].dtype.itemsize, item[0]))
    return out


def _cut(segments: Sequence[SegmentEntry], keep: int) -> list[SegmentEntry]:
    """The segments that hold the first ``keep`` tokens; one straddling ``keep`` is cut."""
    kept = []
    for s in segments:
        if s.start >= keep:
            break
        use = min(s.use, keep - s.start)
        kept.append(s if use == s.use else msgspec.structs.replace(s, use=use))
    return kept


def _remove(path: Path) -> None:
    """Delete a folder and everything in it, or a single file of any kind (a FIFO...)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _set_aside(root: Path, folder: Path, agent: str, delete: bool) -> None:
    """Move a refused cache to ``rejected/<agent>`` (replacing an older one), or delete it.
    Raises UnsafeCachePath, before touching anything, when a move would go through a
    symlinked ``rejected/`` or folder in it."""
    if delete:
        _remove(folder)
        return
    dest = rejected_dir(root, agent)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(dest):
        _remove(dest)
    os.replace(folder, dest)


def _orphans(folder: Path, manifest: CacheManifest | None) -> list[str]:
    """The segment, window and temporary files in ``folder`` that ``manifest`` (None: no
    manifest) does not name: what an interrupted write, fork or share left."""
    live = set() if manifest is None else {s.file for s in manifest.all_segments}
    out = []
    for name in os.listdir(folder):
        named = SEGMENT_FILE.fullmatch(name) or WINDOW_FILE.fullmatch(name)
        ours = named or (name.startswith(".") and name.endswith(".tmp"))
        if ours and name not in live:
            out.append(name)
    return out


def _remove_orphans(folder: Path, manifest: CacheManifest) -> None:
    for name in _orphans(folder, manifest):
        with contextlib.suppress(OSError):  # best effort: the next append retries
            os.unlink(folder / name)


def _commit(folder: Path, manifest: CacheManifest) -> WarmInfo:
    """Write the manifest (the commit point), then remove what it no longer lists."""
    raw = encode_manifest(manifest)
    _write_atomic(folder, MANIFEST, [memoryview(raw)])
    _remove_orphans(folder, manifest)
    return warm_info(manifest, len(raw))


def _write_failed(exc: OSError, doing: str) -> StoreWriteError:
    code = errno.errorcode.get(exc.errno, "error") if exc.errno else "error"
    return StoreWriteError(
        f"{doing} failed ({code}: {exc.strerror or exc}); the previous cache stays loadable"
    )


def append_cache(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    expect: ExpectFn,
    agent: str,
    start: int,
    tensors: Mapping[str, np.ndarray[Any, Any]],
    tokens: Sequence[int],
    *,
    text: str = "",
    messages: Sequence[Mapping[str, str]] = (),
    extra: Mapping[str, Any] | None = None,
    delete_rejected: bool = False,
    refused: str | None = None,
) -> WarmInfo:
    """Make the agent's warm cache hold ``tokens``: keep its first ``start`` tokens, write
    ``tensors`` (tokens [start, len(tokens))) as one new segment, then commit the manifest.

    ``start`` below the cached count cuts the cache there first (a DIVERGE); no tensors
    (``len(tokens) == start``) only rewrites the manifest. Orphan segment and temp files
    are removed after the commit. A refused cache (its manifest fails the checks of
    ``read_manifest``, or ``refused`` says why ``read_cache`` refused it) is replaced by an
    append at 0, after being moved to ``rejected/<agent>`` (or deleted with
    ``delete_rejected``).

    Raises InvalidAgentId for an unsafe id (before touching the disk); UnsafeCachePath when
    ``agents/``, ``rejected/`` (for a set-aside) or a folder in them is a symlink (before
    touching it); ValueError or TypeError when tensors do not match ``expect``, ``start``
    is past the cached tokens (a gap), ``tokens`` differs from the cached ones before
    ``start`` or holds an id outside [0, vocab_size), or the manifest would exceed
    MAX_MANIFEST_BYTES; CacheRejected for an append above 0 onto a refused cache;
    StoreWriteError when the disk fails (full, I/O error): the previous cache stays loadable.
    """
    folder = agent_dir(root, agent)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    token_ids = [operator.index(t) for t in tokens]
    if len(token_ids) < start:
        raise ValueError(f"tokens holds {len(token_ids)} ids, fewer than start={start}")
    # A cache of ids the model cannot take would be refused when read: never write one.
    if token_ids and not 0 <= min(token_ids) <= max(token_ids) < identity.vocab_size:
        raise ValueError(f"token ids must be in [0, {identity.vocab_size})")
    arrays = _check_tensors(expect, start, tensors, len(token_ids) - start)

    set_aside = False
    try:
        loaded = load_manifest(folder, identity, agent)
        if loaded is not None and refused is not None:
            raise CacheRejected(refused, str(folder))
    except CacheRejected as exc:
        if start:
            raise CacheRejected(
                f"agent {agent!r}: cannot extend a refused cache ({exc.reason}); "
                "append from token 0 to replace it",
                exc.path,
            ) from None
        loaded, set_aside = None, True
    old = loaded[0] if loaded is not None else None
    cached = old.n_tokens if old is not None else 0
    if start > cached:
        raise ValueError(f"append at token {start} leaves a gap: the cache holds {cached}")
    if old is not None and token_ids[:start] != old.token_ids[:start]:
        raise ValueError(f"tokens before {start} differ from the ones the cache holds")

    now = time.time()
    segments = _cut(old.segments, start) if old is not None else []
    windows = _cut(old.window_segments, start) if old is not None else []
    split = split_layers(identity.layer_geometry())
    if split is not None and arrays:
        # The new segment is the last range now: keep the sliding layers' tensors that a
        # turn resuming anywhere in it attends to (as AgentKV.slide keeps them hot).
        windows = [w for w in windows if w.start + w.use > start - split[1] + 1]
    manifest = CacheManifest(
        format_version=identity.format_version,
        model_fingerprint=identity.model_fingerprint,
        codec=dict(identity.codec),
        n_layers=identity.n_layers,
        n_kv_heads=identity.n_kv_heads,
        head_dim=identity.head_dim,
        geometry=identity.layer_geometry(),
        agent=agent,
        n_tokens=len(token_ids),
        token_ids=token_ids,
        text=text,
        messages=[dict(m) for m in messages],
        extra=dict(extra or {}),
        created=old.created if old is not None else now,
        updated=now,
        segments=segments,
        last_segment=old.last_segment if old is not None else 0,
        window_segments=windows,
    )
    # Encoding now raises TypeError for what JSON cannot hold, before any disk work; the
    # segment entry added below and the checksum frame are a few hundred bytes at most.
    if len(msgspec.json.encode(manifest)) + 1024 > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest would exceed {MAX_MANIFEST_BYTES} bytes")
    try:
        if set_aside:
            _set_aside(Path(root), folder, agent, delete_rejected)
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            _fsync_dir(folder.parent)
        if arrays:
            names = os.listdir(folder)
            found = [m for p in (SEGMENT_FILE, WINDOW_FILE) for m in map(p.fullmatch, names) if m]
            number = max([manifest.last_segment, *(int(m.group(1)) for m in found)]) + 1
            stop = len(token_ids)
            if split is None:
                entry = _write_segment(folder, number, identity, agent, start, stop, arrays)
                manifest = msgspec.structs.replace(
                    manifest, segments=[*segments, entry], last_segment=number
                )
            else:
                in_window = segment_holds(identity.layer_geometry(), window=True)
                sliding = [(k, a) for k, a in arrays if in_window(k)]
                rest = [(k, a) for k, a in arrays if not in_window(k)]
                entry = _write_segment(folder, number, identity, agent, start, stop, rest)
                window = _write_segment(
                    folder, number, identity, agent, start, stop, sliding, prefix="win"
                )
                manifest = msgspec.structs.replace(
                    manifest,
                    segments=[*segments, entry],
                    window_segments=[*windows, window],
                    last_segment=number,
                )
        return _commit(folder, manifest)
    except OSError as exc:
        raise _write_failed(exc, f"writing the warm cache of agent {agent!r}") from exc


def _write_segment(
    folder: Path,
    number: int,
    identity: CacheIdentity,
    agent: str,
    start: int,
    stop: int,
    arrays: list[tuple[str, np.ndarray[Any, Any]]],
    prefix: str = "seg",
) -> SegmentEntry:
    header = build_header(arrays, segment_metadata(identity, agent, start, stop))
    chunks = [memoryview(header), *(tensor_bytes(array) for _, array in arrays)]
    summing = in_background(checksum, chunks)  # the whole file, while it is written
    name = f"{prefix}-{number}.safetensors"
    try:
        size = _write_atomic(folder, name, chunks)
    finally:
        crc = summing.result()  # the views must outlive the thread that reads them
    return SegmentEntry(
        file=name, start=start, stop=stop, use=stop - start, nbytes=size, checksum=crc
    )


# ---------------------------------------------------------------------------- forget
class SharedFile(msgspec.Struct, frozen=True):
    """A file of a forgotten agent's cache that stays on disk: ``users`` (other agents:
    forks, agents that shared a prefix, their sources) name it too. It goes with the last
    of them."""

    file: str
    nbytes: int
    users: list[str]


class Forgotten(msgspec.Struct, frozen=True):
    """What ``forget`` did: ``freed`` bytes deleted (0: the agent had no warm cache), and
    the agent's files that stay because other agents' caches use them (``kept``)."""

    agent: str
    freed: int = 0
    kept: list[SharedFile] = []


def _shared_files(folder: Path) -> list[SharedFile]:
    """The files in ``folder`` that other agents' folders name too (hard links)."""
    linked: dict[tuple[int, int], tuple[str, int]] = {}
    for name in sorted(os.listdir(folder)):
        with contextlib.suppress(OSError):
            info = os.lstat(folder / name)
            if info.st_nlink > 1 and not name.startswith("."):
                linked[(info.st_dev, info.st_ino)] = (name, info.st_size)
    if not linked:
        return []
    users: dict[tuple[int, int], set[str]] = {key: set() for key in linked}
    base = folder.parent
    for other in os.listdir(base):
        there = base / other
        if there == folder or other.startswith(".") or not there.is_dir() or there.is_symlink():
            continue
        for name in os.listdir(there):
            with contextlib.suppress(OSError):
                info = os.lstat(there / name)
                key = (info.st_dev, info.st_ino)
                if key in users:
                    users[key].add(other)
    return [
        SharedFile(file=name, nbytes=size, users=sorted(users[key]))
        for key, (name, size) in linked.items()
    ]


def forget(root: str | os.PathLike[str], agent: str) -> int:
    """``forget_cache``'s bytes freed (0 for an unknown agent)."""
    return forget_cache(root, agent).freed


def forget_cache(root: str | os.PathLike[str], agent: str) -> Forgotten:
    """Delete every byte of the agent's warm cache that is its own (a refused copy set
    aside included). Segment files that other agents' caches name too (forks of it, the
    agent it forked or shared a prefix from, agents that shared one from it) stay for
    them: ``kept`` lists them with their users, and they do not count in ``freed``.

    Raises InvalidAgentId for an unsafe id and UnsafeCachePath when ``agents/``,
    ``rejected/`` or the agent's folder in either is a symlink, both before touching the
    disk; StoreWriteError when a file cannot be removed.
    """
    # Both checked before anything is deleted: a refusal leaves the cache whole.
    folders = (agent_dir(root, agent), rejected_dir(root, agent))
    freed = 0
    kept: list[SharedFile] = []
    try:
        for n, folder in enumerate(folders):
            if os.path.lexists(folder):
                if n == 0 and folder.is_dir():
                    kept = _shared_files(folder)
                freed += tree_bytes(folder, owned=True)
                _remove(folder)
                _fsync_dir(folder.parent)
    except OSError as exc:
        raise StoreWriteError(f"forgetting agent {agent!r} failed: {exc}") from exc
    return Forgotten(agent=agent, freed=freed, kept=kept)


# --------------------------------------------------------------------------- collect
class Collected(msgspec.Struct, frozen=True):
    """What ``collect`` removed: files (paths under the root) and their bytes."""

    removed: list[str] = []
    freed: int = 0


def collect(root: str | os.PathLike[str]) -> Collected:
    """Remove what no manifest names: segment and temporary files in an agent's folder
    that its manifest does not list (left by a process killed mid-write, mid-fork or
    mid-share), and folders that never got a manifest. A file's bytes go when its last
    name does, so a segment another agent's manifest names is never lost. Idempotent;
    safe to kill at any point. A refused cache is left alone (its owner's next write
    sets it aside). Run it while holding the root's lock (a session does, at start).

    Raises UnsafeCachePath when ``agents/`` is a symlink; StoreWriteError when a file
    cannot be removed.
    """
    base = contained(root, "agents")
    removed: list[str] = []
    freed = 0
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return Collected()
    try:
        for agent in names:
            folder = base / agent
            if agent.startswith(".") or folder.is_symlink() or not folder.is_dir():
                continue
            try:
                loaded = load_manifest(folder, None, agent)
            except CacheRejected:
                continue
            for name in _orphans(folder, None if loaded is None else loaded[0]):
                freed += tree_bytes(folder / name, owned=True)
                os.unlink(folder / name)
                removed.append(f"agents/{agent}/{name}")
            if loaded is None and not os.listdir(folder):
                folder.rmdir()
                removed.append(f"agents/{agent}")
    except OSError as exc:
        raise StoreWriteError(f"collecting unreferenced cache files failed: {exc}") from exc
    return Collected(removed=removed, freed=freed)


# ------------------------------------------------------------------------------ fork
def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` holding ``src``'s bytes: a hard link (no copy, the same file), else a copy
    (another file system, no link support), made durable."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copyfile(src, dst, follow_symlinks=False)
        fd = os.open(dst, os.O_RDONLY | CLOEXEC | NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fork_cache(
    root: str | os.PathLike[str], identity: CacheIdentity, source: str, new: str
) -> WarmInfo | None:
    """Give agent ``new`` a warm cache that is ``source``'s as it is on disk now: its
    segment files hard-linked into ``new``'s folder (one copy of the bytes; a copy where
    links fail), then its manifest, the commit point. The source and the fork append,
    cut and forget on their own from then on: files are never rewritten, and a file stays
    until its last name is deleted. None when the source has no warm cache.

    Raises InvalidAgentId / UnsafeCachePath like ``append_cache``, CacheRejected when the
    source's manifest is refused, ValueError when ``new`` has a warm cache already,
    StoreWriteError when the disk fails (nothing of ``new`` is loadable then).
    """
    src, dst = agent_dir(root, source), agent_dir(root, new)
    loaded = load_manifest(src, identity, source)
    if loaded is None:
        return None
    try:
        if load_manifest(dst, identity, new) is not None:
            raise ValueError(f"agent {new!r} has a warm cache already")
    except CacheRejected:
        raise ValueError(f"agent {new!r} has a (refused) warm cache already") from None
    old = loaded[0]
    manifest = _linked_manifest(old, source, new, old.segments, old.window_segments)
    doing = f"forking the warm cache of agent {source!r} into {new!r}"
    return _link_into(src, dst, manifest, doing)


def share_cache(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    source: str,
    new: str,
    tokens: Sequence[int],
    *,
    text: str = "",
    messages: Sequence[Mapping[str, str]] = (),
) -> WarmInfo | None:
    """Give agent ``new``, which has no warm cache, one holding ``tokens``: a prefix of
    ``source``'s cache that ends where one of its segments ends, its segment files linked
    as ``fork_cache`` links them (one copy of the bytes). ``text`` and ``messages`` are
    ``new``'s. None, touching nothing, when that cannot be done: ``source`` has no such
    segments (or a refused cache), ``new`` has a warm cache (even a refused one), or the
    model has sliding-window layers (whose window files belong to the last segments);
    the caller then writes the tokens itself.

    Raises InvalidAgentId / UnsafeCachePath like ``append_cache``; StoreWriteError when
    the disk fails (nothing of ``new`` is loadable then).
    """
    src, dst = agent_dir(root, source), agent_dir(root, new)
    upto = len(tokens)
    try:
        loaded = load_manifest(src, identity, source)
        if load_manifest(dst, identity, new) is not None:
            return None
    except CacheRejected:
        return None
    if loaded is None or split_layers(identity.layer_geometry()) is not None:
        return None
    old = loaded[0]
    if old.window_segments or list(old.token_ids[:upto]) != [operator.index(t) for t in tokens]:
        return None
    segments = [s for s in old.segments if s.start < upto]
    if not segments or segments[-1].start + segments[-1].use != upto:
        return None
    manifest = _linked_manifest(old, source, new, segments, [])
    manifest = msgspec.structs.replace(
        manifest,
        n_tokens=upto,
        token_ids=list(old.token_ids[:upto]),
        text=text,
        messages=[dict(m) for m in messages],
        extra={},
    )
    return _link_into(src, dst, manifest, f"sharing agent {source!r}'s warm cache with {new!r}")


def _linked_manifest(
    old: CacheManifest,
    source: str,
    new: str,
    segments: list[SegmentEntry],
    windows: list[SegmentEntry],
) -> CacheManifest:
    """``new``'s manifest naming ``source``'s ``segments`` (their first owner kept)."""

    def owned(entries: list[SegmentEntry]) -> list[SegmentEntry]:
        return [msgspec.structs.replace(s, owner=s.owner or source) for s in entries]

    now = time.time()
    return msgspec.structs.replace(
        old,
        agent=new,
        segments=owned(segments),
        window_segments=owned(windows),
        created=now,
        updated=now,
    )


def _link_into(src: Path, dst: Path, manifest: CacheManifest, doing: str) -> WarmInfo:
    """Link the files ``manifest`` names from ``src`` into ``dst``, then commit it there."""
    try:
        fresh = not dst.is_dir()
        dst.mkdir(parents=True, exist_ok=True)
        if fresh:
            _fsync_dir(dst.parent)
        for entry in manifest.all_segments:
            tmp = dst / f".{entry.file}.{secrets.token_hex(4)}.tmp"
            link_or_copy(src / entry.file, tmp)
            os.replace(tmp, dst / entry.file)
        _fsync_dir(dst)
        return _commit(dst, manifest)
    except OSError as exc:
        raise _write_failed(exc, doing) from exc
