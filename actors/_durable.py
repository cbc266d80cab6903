"""How the warm tier changes the disk durably: files written through a fsynced temp file
and a rename, links (or durable copies) of existing files, removals, and the manifest
write that commits a cache change, after which the files it no longer names go.

A cache folder is only ever changed by writing new files and then committing a manifest
that names them: a crash at any point leaves the previous manifest and every file it
names intact, plus at most some orphans (``orphans``) that the next commit or the
collector removes. Everything here blocks: callers run it off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from ._fileio import CLOEXEC, NOFOLLOW
from ._manifest import (
    MANIFEST,
    SEGMENT_FILES,
    CacheManifest,
    WarmInfo,
    encode_manifest,
    warm_info,
)
from .errors import StoreWriteError

__all__ = (
    "commit",
    "fsync_dir",
    "link_or_copy",
    "orphans",
    "remove_path",
    "write_atomic",
    "write_chunks",
    "write_failed",
)

_IOV_MAX = 512  # buffers per writev call (POSIX guarantees 16, Linux and macOS allow 1024)
_WRITE_BATCH = 4 << 20  # bytes per write call


def write_chunks(fd: int, chunks: list[memoryview]) -> int:
    """Write the chunks in order, a few MiB per system call (writev where it exists), and
    start the disk writing each batch right away where the OS allows, so that the fsync to
    come overlaps the rest of the writes (on Linux, ``POSIX_FADV_DONTNEED`` starts the
    write-back of dirty pages: ~20% off a 26 MB segment's write + fsync here). Returns the
    bytes written; raises OSError as ``os.write`` does."""
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


def fsync_dir(folder: Path) -> None:
    """Make the names in ``folder`` durable (a no-op where directories cannot be opened:
    Windows). Raises OSError when the folder cannot be opened or synced."""
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    fd = os.open(folder, os.O_RDONLY | flag | NOFOLLOW | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(folder: Path, name: str, chunks: Iterable[memoryview]) -> int:
    """Write ``name`` in ``folder`` via a fsynced temp file and a rename; returns its size.

    Raises OSError when the disk fails; the temp file is removed then and ``name`` is as
    it was.
    """
    tmp = folder / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW, 0o644)
    size = 0
    try:
        try:
            size = write_chunks(fd, list(chunks))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
    return size


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` holding ``src``'s bytes: a hard link (no copy, the same file), else a copy
    (another file system, no link support), made durable. No symlink is followed. Raises
    OSError when neither works."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copyfile(src, dst, follow_symlinks=False)
        fd = os.open(dst, os.O_RDONLY | CLOEXEC | NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_path(path: Path) -> None:
    """Delete a folder and everything in it, or a single file of any kind (a FIFO...).
    Raises OSError when something cannot be removed."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def orphans(folder: Path, manifest: CacheManifest | None) -> list[str]:
    """The segment, window, state and temporary files in ``folder`` that ``manifest`` (None: no
    manifest) does not name: what an interrupted write, fork or share left. Raises
    OSError when the folder cannot be listed."""
    live = set() if manifest is None else {s.file for s in manifest.all_segments}
    out = []
    for name in os.listdir(folder):
        named = any(p.fullmatch(name) for p in SEGMENT_FILES)
        ours = named or (name.startswith(".") and name.endswith(".tmp"))
        if ours and name not in live:
            out.append(name)
    return out


def commit(folder: Path, manifest: CacheManifest) -> WarmInfo:
    """Write the manifest (the commit point), then remove what it no longer lists (best
    effort: the next commit retries). Raises OSError when the manifest cannot be written;
    the previous one stays then."""
    raw = encode_manifest(manifest)
    write_atomic(folder, MANIFEST, [memoryview(raw)])
    for name in orphans(folder, manifest):
        with contextlib.suppress(OSError):
            os.unlink(folder / name)
    return warm_info(manifest, len(raw))


def write_failed(exc: OSError, doing: str) -> StoreWriteError:
    """The StoreWriteError that reports ``exc`` raised while ``doing`` something."""
    code = errno.errorcode.get(exc.errno, "error") if exc.errno else "error"
    return StoreWriteError(
        f"{doing} failed ({code}: {exc.strerror or exc}); the previous cache stays loadable"
    )
