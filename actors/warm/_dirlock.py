"""One owner per cache directory: an exclusive ``flock`` on ``<root>/.lock``.

The store caches manifests and appends without re-reading what another writer did, so two
sessions writing one cache directory would silently overwrite each other's turns. The
session (and ``kvactor forget``) holds this lock while it may write; a second one gets
CacheDirLocked at once. The OS drops the lock when the process dies, so a crash never
leaves a stale one. Reading (``kvactor inspect``, ``list_agents``) needs no lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path
from types import TracebackType

from ..errors import CacheDirLocked
from ._fileio import CLOEXEC, NOFOLLOW

__all__ = ("LOCK_FILE", "CacheDirLock", "lock_cache_dir")

LOCK_FILE = ".lock"
_FLAGS = os.O_RDWR | os.O_CREAT | CLOEXEC | NOFOLLOW


class CacheDirLock:
    """The lock on one cache directory, held until ``release()`` (or ``with`` ends)."""

    def __init__(self, root: Path, fd: int | None) -> None:
        self.root = root
        self._fd = fd

    def release(self) -> None:
        """Give the directory back; releasing twice does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> CacheDirLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def lock_cache_dir(root: str | os.PathLike[str]) -> CacheDirLock:
    """Take ``root``'s lock (creating the directory), without waiting.

    Raises CacheDirLocked when another session holds it (another process, or another
    session of this one: flock locks belong to an open file, not to a process), and
    OSError when the directory cannot be created or the lock file opened.
    """
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":  # no flock: one session per directory is up to the user
        return CacheDirLock(folder, None)
    import fcntl

    fd = os.open(folder / LOCK_FILE, _FLAGS, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").split()
        os.close(fd)
        raise CacheDirLocked(
            f"cache directory {str(folder)!r} is in use by {_who(holder)}: one session at "
            "a time may use a cache_dir (close the other one, or use another cache_dir)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    # Who holds it, for the message above; only informative, so a full disk is no error.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return CacheDirLock(folder, fd)


def _who(holder: list[str]) -> str:
    if len(holder) != 2 or not holder[0].isdigit():
        return "another process"
    pid, host = holder
    if host != socket.gethostname():
        return f"process {pid} on host {host!r}"
    if int(pid) == os.getpid():
        return f"another session of this process (pid {pid})"
    return f"process {pid}"
