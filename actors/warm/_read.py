"""Reading the warm tier: read and verify an agent's whole cache, list every agent folder.

Every function here blocks; StoreActor runs them off the event loop, and the CLI, the
scenario runner or a benchmark may call them directly. Reads may run while one writer
appends: segment files are never rewritten, and a manifest is replaced atomically before
orphans are removed.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CacheRejected, InvalidAgentId, UnknownAgent
from ..ids import check_agent_id
from ._checksum import segment_matches, segment_version
from ._fileio import ShortRead, each_file, file_kind, open_regular, read_whole
from ._manifest import (
    CacheIdentity,
    CacheManifest,
    ExpectFn,
    Loaded,
    SegmentEntry,
    SegmentKind,
    WarmInfo,
    load_manifest,
    segment_holds,
    segment_metadata,
    split_layers,
    warm_info,
)
from ._paths import agent_dir, contained
from ._safetensors import (
    MAX_HEADER_BYTES,
    Expected,
    ParsedSegment,
    dtype_named,
    parse_segment,
)

__all__ = (
    "agent_names",
    "disk_footprint",
    "list_agents",
    "open_segment",
    "read_cache",
    "tree_bytes",
    "verify_cache",
    "verify_file",
)

_READ_ATTEMPTS = 8

Planned = tuple[SegmentKind, SegmentEntry, Path, Callable[[int, int], Expected]]
"""A segment file of a manifest (``_planned``): its kind, entry, path and the tensors
expected of it for a range of tokens."""


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
        have = () if array is None else array.shape
        if array is None or len(have) != len(shape) or not all(map(operator.le, shape, have)):
            raise ValueError(f"the codec's part {name!r} cannot be cut to a token prefix")
        out[name] = array if have == shape else array[tuple(map(slice, shape))]
    return out


def _read_segment(
    path: Path,
    entry: SegmentEntry,
    expected: Expected,
    identity: CacheIdentity,
    agent: str,
    version: int,
    *,
    summed: str | None = None,
    arrays: bool = True,
) -> dict[str, np.ndarray[Any, Any]]:
    """Read and verify one segment file. FileNotFoundError propagates (a concurrent
    rewrite may have removed it); every other problem is a CacheRejected. ``summed``: the
    file's ``xxh3t`` checksum, taken as its bytes were written (an import): then only its
    header is read, the data bytes left as they are on disk (the arrays returned are not
    the file's: a check only). ``arrays`` False: a check only, no arrays returned."""
    refuse = _refuser(entry, path)
    fd = _opened(path, entry, expected, refuse)
    try:
        with _read_errors(refuse, entry.nbytes):
            if summed is not None:
                buffer = _read_header(fd, entry.nbytes)
            else:
                buffer, pieces = read_whole(fd, entry.nbytes)
    finally:
        os.close(fd)
    # The sum covers the header too: nothing of the file is parsed before it matches.
    if summed is not None:
        found = None if summed == entry.checksum else summed
    else:
        found = segment_matches(entry.checksum, buffer, pieces)
    if found is not None:
        raise refuse(f"checksum mismatch: the file has {found}, manifest says {entry.checksum}")
    return _checked(buffer, entry, expected, identity, agent, version, refuse, arrays).tensors


def _checked(
    buffer: np.ndarray[Any, Any],
    entry: SegmentEntry,
    expected: Expected,
    identity: CacheIdentity,
    agent: str,
    version: int,
    refuse: Callable[[str], CacheRejected],
    arrays: bool = True,
) -> ParsedSegment:
    """The segment in ``buffer`` parsed, its header checked against ``expected`` and its
    metadata against the cache's (``refuse`` makes the error naming the first problem)."""
    try:
        parsed = parse_segment(buffer, expected, arrays=arrays)
    except CacheRejected as exc:
        raise refuse(exc.reason) from None
    # A fork's segments are its source's files (linked): their header names the source.
    owner = entry.owner or agent
    # Each segment says the format it was written in; its checksum's kind says which
    # (a format-3 manifest may name the format-2 segments of a cache written before).
    written = segment_version(entry.checksum)
    if written > version:
        raise refuse(f"a format {written} segment in a format {version} cache")
    for key, value in segment_metadata(identity, owner, entry.start, entry.stop, written).items():
        said = parsed.metadata.get(key)
        if said != value:
            raise refuse(f"metadata {key} is {str(said)[:80]!r}, expected {value!r}")
    return parsed


def open_segment(
    path: Path,
    entry: SegmentEntry,
    expected: Expected,
    identity: CacheIdentity,
    agent: str,
    version: int,
) -> tuple[int, ParsedSegment]:
    """A segment file opened (the descriptor, for the caller to close) with only its header
    read, parsed and checked as ``_read_segment`` checks it; its data bytes and checksum
    are the caller's to read and check (``_stream``). Raises as ``_read_segment`` does."""
    refuse = _refuser(entry, path)
    fd = _opened(path, entry, expected, refuse)
    try:
        with _read_errors(refuse, entry.nbytes):
            buffer = _read_header(fd, entry.nbytes)
        parsed = _checked(buffer, entry, expected, identity, agent, version, refuse, False)
    except BaseException:
        os.close(fd)
        raise
    return fd, parsed


def _refuser(entry: SegmentEntry, path: Path) -> Callable[[str], CacheRejected]:
    """The error refusing ``entry``'s file (at ``path``) for a reason."""

    def refuse(reason: str) -> CacheRejected:
        return CacheRejected(f"{entry.file}: {reason}", str(path))

    return refuse


def _opened(
    path: Path, entry: SegmentEntry, expected: Expected, refuse: Callable[[str], CacheRejected]
) -> int:
    """The segment file opened (its descriptor, the caller's to close) once it is a regular
    file of the size its manifest entry says."""
    need = sum(math.prod(shape) * dtype_named(dtype).itemsize for shape, dtype in expected.values())
    fd, size = open_regular(path, need + 8 + MAX_HEADER_BYTES)
    if size != entry.nbytes:
        os.close(fd)
        if size < entry.nbytes:
            raise refuse(f"truncated: {size} of {entry.nbytes} bytes")
        raise refuse(f"{size} bytes, the manifest says {entry.nbytes}")
    return fd


@contextlib.contextmanager
def _read_errors(refuse: Callable[[str], CacheRejected], size: int) -> Iterator[None]:
    """A short read or an OS error of a ``size``-byte file's read, as its refusal."""
    try:
        yield
    except ShortRead as exc:
        raise refuse(f"truncated while reading: {exc.got} of {size} bytes") from None
    except OSError as exc:
        raise refuse(f"cannot read: {exc.strerror}") from None


def _read_header(fd: int, size: int) -> np.ndarray[Any, Any]:
    """A buffer of the file's ``size`` with only its safetensors header read in (the rest
    never touched: numpy's empty pages), for ``parse_segment`` to check."""
    buffer = np.empty(size, np.uint8)
    view = buffer.data
    head = os.pread(fd, min(size, 8), 0)
    view[: len(head)] = head
    if size >= 8:
        length = min(int.from_bytes(head, "little"), size - 8, MAX_HEADER_BYTES)
        got = os.pread(fd, length, 8)
        if len(got) < length:
            raise ShortRead(8 + len(got))
        view[8 : 8 + length] = got
    return buffer


def _planned(
    folder: Path, manifest: CacheManifest, identity: CacheIdentity, expect: ExpectFn
) -> Iterator[Planned]:
    """Each segment file the manifest names, its kind, its path, and the tensors expected
    of it for a range of tokens."""
    geometry = identity.layer_geometry()
    # A model with neither sliding-window layers nor states keeps every tensor in its
    # segments: no names to sift (a cache in many files has thousands).
    whole = split_layers(geometry) is None and not identity.states
    for kind in SegmentKind:
        keep = None if whole and kind is SegmentKind.SEGMENT else segment_holds(geometry, kind)
        for entry in manifest.of(kind):
            path = folder / entry.file

            def layout(
                start: int, stop: int, path: Path = path, keep: Callable[[str], bool] | None = keep
            ) -> Expected:
                found = _expect(expect, start, stop, path)
                return found if keep is None else {k: v for k, v in found.items() if keep(k)}

            yield kind, entry, path, layout


def _read_segments(
    folder: Path, manifest: CacheManifest, identity: CacheIdentity, expect: ExpectFn
) -> Loaded:
    out: dict[SegmentKind, list[dict[str, np.ndarray[Any, Any]]]] = {k: [] for k in SegmentKind}
    planned = list(_planned(folder, manifest, identity, expect))

    def read(plan: Planned) -> dict[str, np.ndarray[Any, Any]]:
        _, entry, path, layout = plan
        tensors = _read_entry(path, entry, layout, identity, manifest)
        if entry.use < entry.stop - entry.start:
            tensors = _prefix(tensors, layout(entry.start, entry.start + entry.use))
        return tensors

    # Side by side: each file's first read waits a round trip of the disk.
    for (kind, *_), tensors in zip(planned, each_file(read, planned), strict=True):
        out[kind].append(tensors)
    nbytes = sum(s.nbytes for s in manifest.all_segments)
    return Loaded(
        manifest,
        out[SegmentKind.SEGMENT],
        nbytes,
        windows=out[SegmentKind.WINDOW],
        states=out[SegmentKind.STATE],
    )


def verify_cache(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    expect: ExpectFn,
    agent: str,
    *,
    trusted: Mapping[str, SegmentEntry] | None = None,
    summed: Mapping[str, str] | None = None,
) -> CacheManifest:
    """``read_cache``'s checks of the agent's warm cache, its arrays not kept; its
    manifest. A file of ``trusted`` (verified before, as the manifest entry given there:
    a segment kept unchanged, files are never rewritten) is read only when the manifest
    now says another checksum or size of it; else it must still be a regular file of
    its size. A file of ``summed`` (its ``xxh3t`` checksum taken as it was written: an
    import) must have the manifest's checksum, and only its header is read and checked.
    Raises as ``read_cache`` does (without setting anything aside)."""
    folder = agent_dir(root, agent)
    loaded = load_manifest(folder, identity, agent)
    if loaded is None:
        raise UnknownAgent(f"agent {agent!r} has no warm cache under {root}")
    manifest = loaded[0]
    known = trusted or {}
    for _, entry, path, layout in _planned(folder, manifest, identity, expect):
        before = known.get(entry.file)
        same = before is not None and (before.checksum, before.nbytes) == (
            entry.checksum,
            entry.nbytes,
        )
        if same:
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                raise CacheRejected(f"{entry.file}: missing", str(path)) from None
            if not stat.S_ISREG(info.st_mode) or info.st_size != entry.nbytes:
                raise CacheRejected(f"{entry.file}: not the file the manifest names", str(path))
            continue
        summed_now = (summed or {}).get(entry.file)
        _read_entry(path, entry, layout, identity, manifest, summed_now, arrays=False)
    return manifest


def verify_file(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    expect: ExpectFn,
    manifest: CacheManifest,
    file: str,
    summed: str,
) -> SegmentEntry | None:
    """``verify_cache``'s check of the one file ``file`` of ``manifest``'s agent (its
    ``xxh3t`` checksum ``summed`` taken as it was written: an import checks each file as
    it is staged); the manifest's entry of it (then ``verify_cache`` may trust it), None
    for a file the manifest does not name."""
    folder = agent_dir(root, manifest.agent)
    for _, entry, path, layout in _planned(folder, manifest, identity, expect):
        if entry.file == file:
            _read_entry(path, entry, layout, identity, manifest, summed, arrays=False)
            return entry
    return None


def _read_entry(
    path: Path,
    entry: SegmentEntry,
    layout: Callable[[int, int], Expected],
    identity: CacheIdentity,
    manifest: CacheManifest,
    summed: str | None = None,
    *,
    arrays: bool = True,
) -> dict[str, np.ndarray[Any, Any]]:
    """``_read_segment`` of the file of ``manifest``'s ``entry`` (at ``path``)."""
    if summed is not None and not entry.checksum.startswith("xxh3t:"):
        summed = None  # a format-2 segment: its CRC is taken by reading it
    return _read_segment(
        path,
        entry,
        layout(entry.start, entry.stop),
        identity,
        manifest.agent,
        manifest.format_version,
        summed=summed,
        arrays=arrays,
    )


def read_cache(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    expect: ExpectFn,
    agent: str,
    *,
    delete_rejected: bool = False,
) -> Loaded:
    """Read and verify the agent's whole warm cache.

    Raises InvalidAgentId for an unsafe id (before touching the disk), UnsafeCachePath when
    ``agents/`` or the agent's folder is a symlink (before touching it), UnknownAgent when
    the agent has no warm cache, CacheRejected (its message names the reason and path) for
    anything the cache cannot be trusted for: a file that is not a regular file (FIFO,
    directory, symlink, device), another model, codec or format version, a malformed,
    oversized or altered manifest (its checksum), token ids outside the vocabulary,
    segments that do not tile the tokens, a short file, a hostile header, unexpected
    tensors, metadata or checksum (whole file) mismatches. A refused cache is left where
    it is (``append_cache`` sets it aside) unless ``delete_rejected``, which deletes it.
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


# ------------------------------------------------------------------------------ list
def tree_bytes(path: Path, *, owned: bool = False) -> int:
    """The bytes of every file under ``path``; of ``path`` itself when it is not a folder.
    ``owned``: only files with no other name (what deleting ``path`` frees: a fork's
    segments are hard links that keep their bytes while another agent names them)."""

    def size(file: str | Path) -> int:
        with contextlib.suppress(OSError):
            info = os.lstat(file)
            return 0 if owned and info.st_nlink > 1 else info.st_size
        return 0

    if not os.path.isdir(path) or os.path.islink(path):
        return size(path)
    return sum(
        size(os.path.join(folder, name)) for folder, _, files in os.walk(path) for name in files
    )


def disk_footprint(
    root: str | os.PathLike[str] | None, names: Sequence[str]
) -> tuple[int, int, int]:
    """(files, bytes with each hard-linked file once, bytes with every name counted) of
    the regular files in the warm caches of ``names`` (agents sharing files, forks)."""
    if root is None:
        return 0, 0, 0
    seen: set[tuple[int, int]] = set()
    files = once = each = 0
    for name in names:
        for folder, _, filenames in os.walk(agent_dir(root, name)):
            for filename in filenames:
                info = os.lstat(os.path.join(folder, filename))
                if not stat.S_ISREG(info.st_mode):
                    continue
                each += info.st_size
                if (info.st_dev, info.st_ino) not in seen:
                    seen.add((info.st_dev, info.st_ino))
                    files += 1
                    once += info.st_size
    return files, once, each


def _refused_info(agent: str, folder: Path, reason: str) -> WarmInfo:
    try:
        updated = os.lstat(folder).st_mtime
    except OSError:
        updated = 0.0
    return WarmInfo(
        agent=agent,
        tokens=0,
        nbytes=0 if os.path.islink(folder) else tree_bytes(folder),
        segments=0,
        updated=updated,
        rejected=reason,
    )


def agent_names(root: str | os.PathLike[str]) -> list[str]:
    """The names of the agent folders under the root, sorted, their manifests not read (a
    cache :func:`list_agents` would refuse is named too; a folder whose name is no agent
    id is not): what counting a host's agents needs, one directory listing (12 ms at
    10,000 agents, where ``list_agents`` reads every manifest: 1.06 s). Raises
    UnsafeCachePath when ``agents/`` is a symlink."""
    base = contained(root, "agents")
    try:
        with os.scandir(base) as listed:
            return sorted(
                e.name
                for e in listed
                if not e.name.startswith(".") and e.is_dir() and _agent_id(e.name)
            )
    except FileNotFoundError:
        return []


def _agent_id(name: str) -> bool:
    try:
        check_agent_id(name)
    except InvalidAgentId:
        return False
    return True


def list_agents(
    root: str | os.PathLike[str], identity: CacheIdentity | None = None
) -> list[WarmInfo]:
    """Every agent folder under the root, sorted by id, without raising for bad ones.

    Cheap checks only: the manifest (and, given ``identity``, that it matches) and the
    kind and size of each segment file; ``read_cache`` verifies contents. A folder that
    fails has ``rejected`` set to the reason. Raises UnsafeCachePath when ``agents/`` is a
    symlink, OSError when it cannot be listed.
    """
    base = contained(root, "agents")
    try:
        with os.scandir(base) as listed:
            entries = sorted(listed, key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [
        _listed(root, base / e.name, identity, e.is_symlink())
        for e in entries
        if not e.name.startswith(".") and e.is_dir()
    ]


def list_some(
    root: str | os.PathLike[str], names: Iterable[str], identity: CacheIdentity | None = None
) -> list[WarmInfo]:
    """:func:`list_agents` over the folders of ``names`` only, in their order (one that is
    gone, hidden or no folder is skipped): a list made a few folders at a time."""
    base = contained(root, "agents")
    out = []
    for name in names:
        folder = base / name
        if not name.startswith(".") and folder.is_dir():
            out.append(_listed(root, folder, identity, folder.is_symlink()))
    return out


def _listed(
    root: str | os.PathLike[str], folder: Path, identity: CacheIdentity | None, link: bool
) -> WarmInfo:
    """One agent folder's line of :func:`list_agents`: refused with the reason where a
    cheap check fails."""
    name = folder.name
    try:
        check_agent_id(name)
        if link:  # refused (UnsafeCachePath); a real folder needs no check
            contained(root, "agents", name)
        loaded = load_manifest(folder, identity, name)
        if loaded is None:
            raise CacheRejected("no manifest.json (an interrupted first write?)")
        manifest, size = loaded
        where = os.fspath(folder)  # joined as strings: 10,000 folders at open
        for s in manifest.all_segments:
            try:
                info = os.lstat(os.path.join(where, s.file))
            except OSError as exc:
                raise CacheRejected(f"{s.file}: {exc.strerror}") from None
            if not stat.S_ISREG(info.st_mode):
                kind = file_kind(info.st_mode)
                raise CacheRejected(f"{s.file} is {kind}, not a regular file")
            if info.st_size != s.nbytes:
                raise CacheRejected(f"{s.file}: {info.st_size} bytes, the manifest says {s.nbytes}")
    except (CacheRejected, InvalidAgentId) as exc:
        reason = exc.reason if isinstance(exc, CacheRejected) else str(exc)
        return _refused_info(name, folder, reason)
    return warm_info(manifest, size)
