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

from ..errors import StoreWriteError
from ._fileio import CLOEXEC, NOFOLLOW
from ._manifest import MANIFEST, SEGMENT_FILES, CacheManifest, WarmInfo, encode_manifest, warm_info

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
_WRITE_BATCH = 16 << 20  # bytes per write call


#: fsyncs made so far (``bench/vs_mlx_lm.py`` counts them per commit). A turn's commit
#: makes four: the new segment's bytes, its name in the agent's folder (before a manifest
#: may name it), the new manifest's bytes, and its name (the commit itself, so that a
#: turn reported saved stays saved); an agent's first commit one more, for its folder.
fsyncs = 0


def sync(fd: int) -> None:
    """``os.fsync``, counted."""
    global fsyncs
    fsyncs += 1
    os.fsync(fd)


def write_chunks(fd: int, chunks: list[memoryview]) -> int:
    """Write the chunks in order, a few MiB per system call (writev where it exists), from
    their own buffers (no joined copy). Returns the bytes written; raises OSError as
    ``os.write`` does.

    Starting the write-back of each batch early (``POSIX_FADV_DONTNEED``) was measured
    here: 12 to 42 ms for a 26.6 MB segment's write + fsync, bimodal, against a steady
    16.3 ms without it (the bare write + fsync floor of ``bench/vs_mlx_lm.py``), so it is
    not done."""
    chunks = [c for c in chunks if c.nbytes]
    writev = getattr(os, "writev", None)
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
        sync(fd)
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
            sync(fd)
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
            sync(fd)
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
