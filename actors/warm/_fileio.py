"""Whole-file reads and writes for the warm tier, with the checksum computed alongside the I/O.

Every file the store reads is opened by ``open_regular``: without following a symlink and
without blocking (a FIFO would block an ``open`` for reading until a writer comes), then
checked to be a regular file of a bounded size. A segment is read by several threads at
once (``os.preadv`` into one buffer: a fast disk serves parallel requests faster than one
sequential stream), each thread summing the piece it has just read (``_checksum``: a
segment's checksum is a tree of its 1 MiB pieces' sums). A segment's bytes are summed on
a helper thread while they are written.
Everything here blocks: callers run it off the event loop.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import CacheRejected
from ._checksum import PIECE, piece_digest

__all__ = (
    "CLOEXEC",
    "NOFOLLOW",
    "ShortRead",
    "each_file",
    "file_kind",
    "in_background",
    "open_regular",
    "read_whole",
)

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

#: Bytes per read request: one summed piece. With 8 threads, 1 MiB requests measured
#: fastest here (a 26 MB segment: 21 ms vs 31 ms for one sequential read, cache dropped).
CHUNK = PIECE
_THREADS = 8
_pool: ThreadPoolExecutor | None = None
T = TypeVar("T")
R = TypeVar("R")


#: Files of one cache opened and read side by side (``each_file``): a cache written over
#: many departures is a file each, and each file's first read waits a round trip of the
#: disk (page cache dropped, a 1K cache in 10 files: its read 23-34 ms one file after
#: another, against 11-14 ms for the same bytes in 2 files).
_FILES = 4
_file_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvactor-io")
    return _pool


def _forget_pools() -> None:  # a forked child has none of its parent's threads
    global _pool, _file_pool
    _pool = _file_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def in_background(fn: Callable[[T], R], arg: T) -> Future[R]:
    """``fn(arg)`` on one of the I/O threads (for work that drops the GIL)."""
    return _executor().submit(fn, arg)


def each_file(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(item) for item in items]``, up to ``_FILES`` at once on threads of their own
    (not the I/O threads, which ``fn`` may wait on: ``read_whole``). Every call ends
    before it returns; then the first call that raised, in ``items``' order, raises."""
    global _file_pool
    if len(items) < 2:
        return [fn(item) for item in items]
    if _file_pool is None:
        _file_pool = ThreadPoolExecutor(_FILES, thread_name_prefix="kvactor-file")
    futures = [_file_pool.submit(fn, item) for item in items]
    wait(futures)
    return [future.result() for future in futures]


class ShortRead(Exception):
    """The file ended before ``size`` bytes (it shrank while being read)."""

    def __init__(self, got: int) -> None:
        super().__init__(got)
        self.got = got


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a reason: "a FIFO", "a directory"..."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _not_regular(path: Path, mode: int) -> CacheRejected:
    return CacheRejected(f"{path.name} is {file_kind(mode)}, not a regular file", str(path))


def open_regular(path: Path, max_bytes: int) -> tuple[int, int]:
    """Open ``path`` for reading; return the descriptor (blocking again, close-on-exec)
    and the file's size.

    Raises FileNotFoundError when there is no such file; CacheRejected (naming the file
    and what it is) for a symlink, directory, FIFO, device or socket, a file over
    ``max_bytes``, or an open that fails otherwise (permission, I/O error).
    """
    # lstat first, so that a device node is never opened (opening one can act on the
    # device); fstat after the open decides, as the entry may change in between.
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | NOFOLLOW | CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = "a symlink" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
        raise CacheRejected(f"{path.name} is {reason}", str(path)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, info.st_mode)
        if info.st_size > max_bytes:
            raise CacheRejected(
                f"{path.name} of {info.st_size} bytes exceeds {max_bytes}", str(path)
            )
        if _NONBLOCK:  # a regular file: its reads need no O_NONBLOCK, some file systems mind it
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_whole(fd: int, size: int) -> tuple[np.ndarray[Any, Any], list[int]]:
    """The first ``size`` bytes of ``fd`` as a uint8 array, and the XXH3 of each of its
    ``PIECE``-byte pieces, in order (``_checksum.tree_checksum`` makes the file's).

    Each thread sums the piece it has just read, while it is in the CPU's cache. Raises
    ShortRead when the file ends early and OSError as the reads raise it.
    """
    buffer = np.empty(size, np.uint8)
    view = buffer.data
    spans = [(at, min(at + CHUNK, size)) for at in range(0, size, CHUNK)]

    def read(span: tuple[int, int]) -> int:
        at, end = span
        got = at
        while got < end:
            n = os.preadv(fd, [view[got:end]], got)
            if not n:
                raise ShortRead(got)
            got += n
        return piece_digest(view[at:end])

    if not hasattr(os, "preadv") or len(spans) < 2:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            f.seek(0)
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise ShortRead(got)
                got += n
        return buffer, [piece_digest(view[at:end]) for at, end in spans]

    futures = [_executor().submit(read, span) for span in spans]
    try:
        return buffer, [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # wait: no thread may write into the buffer after we return
