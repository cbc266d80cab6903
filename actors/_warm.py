"""The warm tier's operations: append, read, list and forget agents' caches on disk.

Every function here blocks; StoreActor runs them off the event loop, and a prefetch actor
or the CLI may call them directly. Reads may run while one writer appends: segment files
are never rewritten, and a manifest is replaced atomically before orphans are removed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import operator
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ._fileio import ShortRead, in_background, read_whole
from ._manifest import (
    CLOEXEC,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    NOFOLLOW,
    SEGMENT_FILE,
    CacheIdentity,
    CacheManifest,
    ExpectFn,
    Loaded,
    SegmentEntry,
    WarmInfo,
    agent_dir,
    default_cache_dir,
    inside,
    load_manifest,
    read_manifest,
    segment_metadata,
    warm_info,
)
from ._safetensors import (
    Expected,
    build_header,
    checksum,
    data_start,
    format_checksum,
    parse_segment,
    tensor_bytes,
)
from .errors import CacheRejected, InvalidAgentId, StoreWriteError, UnknownAgent
from .protocol import check_agent_id

# The format's public names are re-exported: the public home of all of them is ``store``.
__all__ = (
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "CacheIdentity",
    "CacheManifest",
    "ExpectFn",
    "Loaded",
    "SegmentEntry",
    "WarmInfo",
    "agent_dir",
    "append_cache",
    "default_cache_dir",
    "forget",
    "list_agents",
    "read_cache",
    "read_manifest",
)

_READ_ATTEMPTS = 8
_NO_CRC = format_checksum(0)  # a placeholder of the checksum's length
_LITTLE = sys.byteorder == "little"
_IOV_MAX = 512  # buffers per writev call (POSIX guarantees 16, Linux and macOS allow 1024)
_WRITE_BATCH = 4 << 20  # bytes per write call
_dtype = functools.cache(np.dtype)  # dtype objects by name (np.dtype(str) is slow)


# ------------------------------------------------------------------------------ read
def _expect(expect: ExpectFn, start: int, stop: int, path: Path) -> Expected:
    try:
        return expect(start, stop)
    except ValueError as exc:
        raise CacheRejected(
            f"the codec refuses tokens [{start}, {stop}): {exc}", str(path)
        ) from None


def _prefix(
    tensors: dict[str, np.ndarray[Any, Any]], want: Expected
) -> dict[str, np.ndarray[Any, Any]]:
    """The leading tokens of a segment: each wanted part sliced to its wanted shape."""
    out: dict[str, np.ndarray[Any, Any]] = {}
    for name, (shape, _) in want.items():
        array = tensors.get(name)
        if (
            array is None
            or array.ndim != len(shape)
            or any(w > h for w, h in zip(shape, array.shape, strict=True))
        ):
            raise ValueError(f"the codec's part {name!r} cannot be cut to a token prefix")
        out[name] = array[tuple(slice(0, w) for w in shape)]
    return out


def _read_segment(
    path: Path, entry: SegmentEntry, expected: Expected, identity: CacheIdentity, agent: str
) -> dict[str, np.ndarray[Any, Any]]:
    """Read and verify one segment file. FileNotFoundError propagates (a concurrent
    rewrite may have removed it); every other problem is a CacheRejected."""

    def refuse(reason: str) -> CacheRejected:
        return CacheRejected(f"{entry.file}: {reason}", str(path))

    try:
        fd = os.open(path, os.O_RDONLY | CLOEXEC | NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise refuse(f"cannot open: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < entry.nbytes:
            raise refuse(f"truncated: {size} of {entry.nbytes} bytes")
        if size != entry.nbytes:
            raise refuse(f"{size} bytes, the manifest says {entry.nbytes}")
        need = sum(
            math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in expected.values()
        )
        if size > need + 8 + (16 << 20):
            raise refuse(f"{size} bytes is far more than its {need} tensor bytes need")
        try:
            buffer, crc = read_whole(fd, size, data_start)
        except ShortRead as exc:
            raise refuse(f"truncated while reading: {exc.got} of {size} bytes") from None
        except OSError as exc:
            raise refuse(f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        parsed = parse_segment(buffer, expected)
    except CacheRejected as exc:
        raise refuse(exc.reason) from None
    want = segment_metadata(identity, agent, entry.start, entry.stop, entry.checksum)
    for key, value in want.items():
        found = parsed.metadata.get(key)
        if found != value:
            raise refuse(f"metadata {key} is {str(found)[:80]!r}, expected {value!r}")
    found = format_checksum(crc) if crc is not None else checksum([parsed.data])
    if found != entry.checksum:
        raise refuse(f"checksum mismatch: data has {found}, manifest says {entry.checksum}")
    return parsed.tensors


def _read_segments(
    folder: Path, manifest: CacheManifest, identity: CacheIdentity, expect: ExpectFn
) -> Loaded:
    segments = []
    for entry in manifest.segments:
        path = folder / entry.file
        full = _expect(expect, entry.start, entry.stop, path)
        tensors = _read_segment(path, entry, full, identity, manifest.agent)
        if entry.use < entry.stop - entry.start:
            tensors = _prefix(tensors, _expect(expect, entry.start, entry.start + entry.use, path))
        segments.append(tensors)
    return Loaded(manifest, segments, sum(s.nbytes for s in manifest.segments))


def read_cache(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    expect: ExpectFn,
    agent: str,
    *,
    delete_rejected: bool = False,
) -> Loaded:
    """Read and verify the agent's whole warm cache.

    Raises InvalidAgentId for an unsafe id (before touching the disk), UnknownAgent when
    the agent has no warm cache, CacheRejected (its message names the reason and path) for
    anything the cache cannot be trusted for: another model, codec or format version, a
    malformed or oversized manifest, segments that do not tile the tokens, a short file,
    a hostile header, unexpected tensors, metadata or checksum mismatches. A refused cache
    is kept for inspection unless ``delete_rejected``.
    """
    folder = agent_dir(root, agent)
    try:
        for _ in range(_READ_ATTEMPTS):
            loaded = load_manifest(folder, identity, agent)
            if loaded is None:
                raise UnknownAgent(f"agent {agent!r} has no warm cache under {root}")
            try:
                return _read_segments(folder, loaded[0], identity, expect)
            except (FileNotFoundError, CacheRejected) as exc:
                # A concurrent append may have replaced the manifest and removed what the
                # old one listed: look again, unless nothing changed.
                if load_manifest(folder, identity, agent) != loaded:
                    continue
                if isinstance(exc, CacheRejected):
                    raise
                raise CacheRejected("segment file missing", exc.filename or "") from None
        raise CacheRejected("the cache kept changing while being read", str(folder))
    except CacheRejected as exc:
        if not delete_rejected:
            raise CacheRejected(f"agent {agent!r}: {exc.reason}; kept", exc.path) from None
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)
        raise CacheRejected(f"agent {agent!r}: {exc.reason}; deleted", exc.path) from None


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
    fd = os.open(folder, os.O_RDONLY | flag | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(
    folder: Path,
    name: str,
    chunks: Iterable[memoryview],
    finish: Callable[[int], None] | None = None,
) -> int:
    """Write ``name`` in ``folder`` via a fsynced temp file and a rename; returns its size.
    ``finish(fd)``, when given, runs after the chunks are written and before the fsync.

    On any error the temp file is removed and ``name`` is as it was.
    """
    tmp = folder / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW, 0o644)
    size = 0
    try:
        try:
            size = _write_chunks(fd, list(chunks))
            if finish is not None:
                finish(fd)
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


def _set_aside(root: Path, folder: Path, agent: str, delete: bool) -> None:
    """Move a refused cache to ``rejected/<agent>`` (replacing an older one), or delete it."""
    if delete:
        shutil.rmtree(folder)
        return
    dest = inside(root / "rejected", agent)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(folder, dest)


def _remove_orphans(folder: Path, manifest: CacheManifest) -> None:
    live = {s.file for s in manifest.segments}
    for name in os.listdir(folder):
        ours = SEGMENT_FILE.fullmatch(name) or (name.startswith(".") and name.endswith(".tmp"))
        if ours and name not in live:
            with contextlib.suppress(OSError):  # best effort: the next append retries
                os.unlink(folder / name)


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
) -> WarmInfo:
    """Make the agent's warm cache hold ``tokens``: keep its first ``start`` tokens, write
    ``tensors`` (tokens [start, len(tokens))) as one new segment, then commit the manifest.

    ``start`` below the cached count cuts the cache there first (a DIVERGE); no tensors
    (``len(tokens) == start``) only rewrites the manifest. Orphan segment and temp files
    are removed after the commit. A cache that is refused (see ``read_cache``) is replaced
    by an append at 0, after being moved to ``rejected/<agent>`` (or deleted with
    ``delete_rejected``).

    Raises InvalidAgentId for an unsafe id (before touching the disk); ValueError or
    TypeError when tensors do not match ``expect``, ``start`` is past the cached tokens (a
    gap), ``tokens`` differs from the cached ones before ``start``, or the manifest would
    exceed MAX_MANIFEST_BYTES; CacheRejected for an append above 0 onto a refused cache;
    StoreWriteError when the disk fails (full, I/O error): the previous cache stays loadable.
    """
    folder = agent_dir(root, agent)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    token_ids = [operator.index(t) for t in tokens]
    if len(token_ids) < start:
        raise ValueError(f"tokens holds {len(token_ids)} ids, fewer than start={start}")
    arrays = _check_tensors(expect, start, tensors, len(token_ids) - start)

    refused = False
    try:
        loaded = load_manifest(folder, identity, agent)
    except CacheRejected as exc:
        if start:
            raise CacheRejected(
                f"agent {agent!r}: cannot extend a refused cache ({exc.reason}); "
                "append from token 0 to replace it",
                exc.path,
            ) from None
        loaded, refused = None, True
    old = loaded[0] if loaded is not None else None
    cached = old.n_tokens if old is not None else 0
    if start > cached:
        raise ValueError(f"append at token {start} leaves a gap: the cache holds {cached}")
    if old is not None and token_ids[:start] != old.token_ids[:start]:
        raise ValueError(f"tokens before {start} differ from the ones the cache holds")

    now = time.time()
    segments = _cut(old.segments, start) if old is not None else []
    manifest = CacheManifest(
        format_version=identity.format_version,
        model_fingerprint=identity.model_fingerprint,
        codec=dict(identity.codec),
        n_layers=identity.n_layers,
        n_kv_heads=identity.n_kv_heads,
        head_dim=identity.head_dim,
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
    )
    # Encoding now raises TypeError for what JSON cannot hold, before any disk work; the
    # segment entry added below is a few hundred bytes at most.
    if len(msgspec.json.encode(manifest)) + 1024 > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest would exceed {MAX_MANIFEST_BYTES} bytes")
    try:
        if refused:
            _set_aside(Path(root), folder, agent, delete_rejected)
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            _fsync_dir(folder.parent)
        if arrays:
            found = [m for m in map(SEGMENT_FILE.fullmatch, os.listdir(folder)) if m]
            number = max([manifest.last_segment, *(int(m.group(1)) for m in found)]) + 1
            entry = _write_segment(folder, number, identity, agent, start, len(token_ids), arrays)
            manifest = msgspec.structs.replace(
                manifest, segments=[*segments, entry], last_segment=number
            )
        raw = msgspec.json.encode(manifest)
        _write_atomic(folder, MANIFEST, [memoryview(raw)])
    except OSError as exc:
        code = errno.errorcode.get(exc.errno, "error") if exc.errno else "error"
        raise StoreWriteError(
            f"writing the warm cache of agent {agent!r} failed ({code}: "
            f"{exc.strerror or exc}); the previous cache stays loadable"
        ) from exc
    _remove_orphans(folder, manifest)
    return warm_info(manifest, len(raw))


def _write_segment(
    folder: Path,
    number: int,
    identity: CacheIdentity,
    agent: str,
    start: int,
    stop: int,
    arrays: list[tuple[str, np.ndarray[Any, Any]]],
) -> SegmentEntry:
    views = [tensor_bytes(array) for _, array in arrays]
    summing = in_background(checksum, views)  # while writing; the header holding it goes last
    header = build_header(arrays, segment_metadata(identity, agent, start, stop, _NO_CRC))
    crc = ""

    def finish(fd: int) -> None:
        nonlocal crc
        crc = summing.result()
        placeholder = msgspec.json.encode(_NO_CRC)
        if header.count(placeholder) != 1:
            raise AssertionError("a segment header must hold its checksum placeholder once")
        final = header.replace(placeholder, msgspec.json.encode(crc))
        if os.pwrite(fd, final, 0) != len(final):
            raise OSError(errno.EIO, "short write of a segment header")

    name = f"seg-{number}.safetensors"
    try:
        size = _write_atomic(folder, name, [memoryview(header), *views], finish)
    finally:
        summing.result()  # the views must outlive the thread that reads them
    return SegmentEntry(
        file=name, start=start, stop=stop, use=stop - start, nbytes=size, checksum=crc
    )


# ------------------------------------------------------------------------ list, forget
def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _refused_info(agent: str, folder: Path, reason: str) -> WarmInfo:
    try:
        updated = os.lstat(folder).st_mtime
    except OSError:
        updated = 0.0
    return WarmInfo(
        agent=agent,
        tokens=0,
        nbytes=0 if os.path.islink(folder) else _tree_bytes(folder),
        segments=0,
        updated=updated,
        rejected=reason,
    )


def list_agents(
    root: str | os.PathLike[str], identity: CacheIdentity | None = None
) -> list[WarmInfo]:
    """Every agent folder under the root, sorted by id, without raising for bad ones.

    Cheap checks only: the manifest (and, given ``identity``, that it matches) and the
    size of each segment file; ``read_cache`` verifies contents. A folder that fails has
    ``rejected`` set to the reason.
    """
    base = Path(root) / "agents"
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        folder = base / name
        if name.startswith(".") or not folder.is_dir():
            continue
        try:
            check_agent_id(name)
            loaded = load_manifest(inside(base, name), identity, name)
            if loaded is None:
                raise CacheRejected("no manifest.json (an interrupted first write?)")
            manifest, size = loaded
            for s in manifest.segments:
                try:
                    found = os.stat(folder / s.file).st_size
                except OSError as exc:
                    raise CacheRejected(f"{s.file}: {exc.strerror}") from None
                if found != s.nbytes:
                    raise CacheRejected(f"{s.file}: {found} bytes, the manifest says {s.nbytes}")
        except (CacheRejected, InvalidAgentId) as exc:
            reason = exc.reason if isinstance(exc, CacheRejected) else str(exc)
            out.append(_refused_info(name, folder, reason))
            continue
        out.append(warm_info(manifest, size))
    return out


def forget(root: str | os.PathLike[str], agent: str) -> int:
    """Delete every byte of the agent's warm cache (a refused copy set aside included);
    returns the bytes freed, 0 for an unknown agent.

    Raises InvalidAgentId for an unsafe id (before touching the disk), StoreWriteError
    when a file cannot be removed.
    """
    folders = (agent_dir(root, agent), inside(Path(root) / "rejected", agent))
    freed = 0
    try:
        for folder in folders:
            if os.path.lexists(folder):
                freed += _tree_bytes(folder)
                shutil.rmtree(folder)
                _fsync_dir(folder.parent)
    except OSError as exc:
        raise StoreWriteError(f"forgetting agent {agent!r} failed: {exc}") from exc
    return freed
