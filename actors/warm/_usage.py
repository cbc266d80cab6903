"""What the warm tier holds on disk, against its limit: every regular file in the agents'
folders of a cache directory (one folder per model), a file hard-linked by several agents
(forks, shared prefixes) counted once, as it is stored.

The count is kept on the event loop: the files of an agent's folder are listed off it
(:func:`agent_files`, in a worker thread) and handed to :meth:`DiskUsage.update`, so the
stores of several models in one directory share one count without a lock.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..ids import namespace_of
from ._paths import agent_dir, contained

__all__ = (
    "DISK_CEILING",
    "DISK_FILE",
    "DISK_SHARE",
    "AgentFiles",
    "DiskUsage",
    "agent_files",
    "default_disk_limit",
    "folder_files",
    "read_disk_limit",
    "read_written",
    "RESERVE_FILE",
    "free_reserve",
    "make_reserve",
    "record_disk_limit",
    "scan_agents",
)

#: The default disk limit: this share of what the cache directory's file system could
#: give it (its free space plus what the cache already holds) ...
DISK_SHARE = 0.25
#: ... and never more than this (LM Studio's cap: min(30 GiB, free / 4)).
DISK_CEILING = 30 << 30

#: An agent's files: (device, inode) -> size.
AgentFiles = dict[tuple[int, int], int]


def agent_files(root: Path, agent: str) -> AgentFiles:
    """The regular files of ``agent``'s folder under ``root`` (blocking; none when it has
    no folder)."""
    return _folder_files(agent_dir(root, agent))


def folder_files(root: Path, name: str) -> AgentFiles:
    """The regular files of the folder ``name`` in ``root``'s ``agents/``, whatever its
    name (a folder the collector went through need not be a valid agent id's). Blocking;
    raises UnsafeCachePath when ``agents/`` is a symlink."""
    return _folder_files(contained(root, "agents") / name)


def _folder_files(folder: str | Path) -> AgentFiles:
    """The regular files directly in ``folder`` (none when it is not a folder)."""
    out: AgentFiles = {}
    try:
        entries = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return out
    with entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                out[(info.st_dev, info.st_ino)] = info.st_size
    return out


def scan_agents(root: Path) -> dict[str, AgentFiles]:
    """Every agent folder under ``root`` and its files (blocking). One pass over the
    directory: ``agents/`` is checked not to be a symlink once, and a folder in it that
    is one is skipped by its directory entry (no path is resolved per agent)."""
    base = contained(root, "agents")
    try:
        entries = os.scandir(base)
    except FileNotFoundError:
        return {}
    with entries:
        folders = sorted(
            (e.name, e.path)
            for e in entries
            if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        )
    return {name: _folder_files(path) for name, path in folders}


def default_disk_limit(root: str | os.PathLike[str], used: int = 0) -> int:
    """The default disk limit of a cache directory: ``DISK_SHARE`` of its file system's
    free space plus ``used`` (what the cache holds already), at most ``DISK_CEILING``
    (blocking: it asks the file system)."""
    path = Path(root)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    return min(DISK_CEILING, int((free + used) * DISK_SHARE))


#: In a cache directory: the disk limit of the session that last opened it, and the bytes
#: written to its warm tier on each of the last days (local dates).
DISK_FILE = "warm.json"
WRITTEN_DAYS = 7  # days of written bytes kept in DISK_FILE
WRITTEN_FLUSH_S = 60.0  # the written bytes go to DISK_FILE at most this often (and at close)


def today() -> str:
    """The local date, as DISK_FILE keys the bytes written on it."""
    return datetime.date.today().isoformat()


def record_disk_limit(
    root: Path, limit: int | None, written: Mapping[str, int] | None = None
) -> None:
    """Write ``root``'s DISK_FILE (for ``kvactor inspect``) atomically: the limit and the
    bytes ``written`` per day (the last WRITTEN_DAYS); an OSError is ignored."""
    days = dict(sorted((written or {}).items())[-WRITTEN_DAYS:])
    body = json.dumps({"disk_limit_bytes": limit, "written_bytes": days}) + "\n"
    temp = root / f".{DISK_FILE}.tmp"
    try:
        temp.write_text(body)
        os.replace(temp, root / DISK_FILE)
    except OSError:
        pass


#: In a cache directory: a little of the disk kept back while the tier has a limit, so
#: that a disk that fills before the limit still has room for the small manifests that
#: make agents cold (freed then, made again once there is room).
RESERVE_FILE = "warm.reserve"
RESERVE_MAX = 1 << 20


def make_reserve(root: Path) -> int:
    """Write ``root``'s RESERVE_FILE: RESERVE_MAX bytes, or a sixteenth of the free space
    when that is less (random bytes, which no file system compresses away); its size (0
    when even that does not fit: an OSError leaves no file). Blocking."""
    path = root / RESERVE_FILE
    try:
        if path.exists():
            return path.stat().st_size
        size = min(RESERVE_MAX, shutil.disk_usage(root).free // 16)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    except OSError:
        path.unlink(missing_ok=True)
        return 0
    return size


def free_reserve(root: Path) -> int:
    """Remove ``root``'s RESERVE_FILE: the bytes it freed (0: there was none). Blocking."""
    path = root / RESERVE_FILE
    try:
        size = path.stat().st_size
        path.unlink()
    except OSError:
        return 0
    return size


def _read_disk_file(root: Path) -> dict[str, object]:
    try:
        data = json.loads((root / DISK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def written_on_record_today(root: Path) -> int:
    """The bytes ``root``'s DISK_FILE records written today (0: none recorded)."""
    return read_written(root).get(today(), 0)


def read_written(root: Path) -> dict[str, int]:
    """The bytes written per day that ``root``'s DISK_FILE records (empty: none)."""
    days = _read_disk_file(root).get("written_bytes")
    if not isinstance(days, dict):
        return {}
    return {
        str(day): n
        for day, n in days.items()
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0
    }


def read_disk_limit(root: Path) -> int | None:
    """The disk limit ``root``'s DISK_FILE records (None: none, or unreadable)."""
    limit = _read_disk_file(root).get("disk_limit_bytes")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


class DiskUsage:
    """The warm tier's bytes on disk over one or more roots (a model's folder each).

    Invariant: the only writer of the count; ``used`` is the sum of the sizes of the
    distinct files (by inode) that the agents' folders hold, as last listed (each store
    lists an agent's folder after every change it makes to it)."""

    def __init__(self, limit: int | None, quota: int | None = None) -> None:
        self.limit = limit
        # The most the agents of one namespace (ids ``<namespace>.<name>``: a server's
        # tenant) may hold, their shared files counted once (None: no quota).
        self.quota = quota
        self._sizes: dict[tuple[int, int], int] = {}  # each file: its size
        self._users: dict[tuple[int, int], int] = {}  # each file: how many agents list it
        self._agents: dict[tuple[str, str], AgentFiles] = {}  # (root, agent) -> its files
        # Each namespace: its files (how many of its agents list each), and their bytes.
        self._spaces: dict[str, dict[tuple[int, int], int]] = {}
        self._space_used: dict[str, int] = {}
        self.used = 0
        self.peak = 0
        # Bytes written per local day (carried over from DISK_FILE at open), and when they
        # go to DISK_FILE next (monotonic; see ``written_due``).
        self.written: dict[str, int] = {}
        self._flush_at = 0.0
        self.home: Path | None = None  # the cache directory whose DISK_FILE records them

    def update(self, root: Path, agent: str, files: AgentFiles) -> None:
        """``agent``'s folder under ``root`` holds ``files`` now (none: it has no folder)."""
        key = (str(root), agent)
        namespace = namespace_of(agent)
        for inode in self._agents.pop(key, {}):
            if namespace is not None:
                self._leave(namespace, inode)
            self._users[inode] -= 1
            if not self._users[inode]:
                del self._users[inode]
                self.used -= self._sizes.pop(inode)
        if files:
            self._agents[key] = dict(files)
        for inode, size in files.items():
            if inode in self._users:
                self._users[inode] += 1
                grown = size - self._sizes[inode]  # a file may have grown (a manifest)
                self.used += grown
                if grown:
                    self._grew(inode, grown)
            else:
                self._users[inode] = 1
                self.used += size
            self._sizes[inode] = size
            if namespace is not None:
                self._join(namespace, inode, size)
        self.peak = max(self.peak, self.used)
        assert self.used >= 0, "the disk count went below zero"

    # Each namespace's bytes are kept as its agents' folders change, so that a write under a
    # quota never sums the files of every agent (a server's tenants may have thousands).
    def _join(self, namespace: str, inode: tuple[int, int], size: int) -> None:
        users = self._spaces.setdefault(namespace, {})
        if inode in users:
            users[inode] += 1
        else:
            users[inode] = 1
            self._space_used[namespace] = self._space_used.get(namespace, 0) + size

    def _leave(self, namespace: str, inode: tuple[int, int]) -> None:
        users = self._spaces[namespace]
        users[inode] -= 1
        if not users[inode]:
            del users[inode]
            self._space_used[namespace] -= self._sizes[inode]
        if not users:
            del self._spaces[namespace], self._space_used[namespace]

    def _grew(self, inode: tuple[int, int], grown: int) -> None:
        """A file listed before has ``grown`` bytes more now: in every namespace listing it
        (rare: files are replaced, not rewritten; so the namespaces are searched)."""
        for namespace, users in self._spaces.items():
            if inode in users:
                self._space_used[namespace] += grown

    def load(self, root: Path, agents: dict[str, AgentFiles]) -> None:
        """Count every agent of ``root`` as listed (at open)."""
        for agent, files in agents.items():
            self.update(root, agent, files)

    def files(self, root: Path, agent: str) -> AgentFiles:
        """``agent``'s files under ``root`` as last counted."""
        return dict(self._agents.get((str(root), agent), {}))

    def agents(self, root: Path) -> list[str]:
        """The agents of ``root`` with files counted."""
        prefix = str(root)
        return [agent for (where, agent) in self._agents if where == prefix]

    def own_bytes(self, root: Path, agent: str) -> int:
        """What removing ``agent``'s folder under ``root`` would free: its files that no
        other agent lists."""
        files = self._agents.get((str(root), agent), {})
        return sum(size for inode, size in files.items() if self._users.get(inode) == 1)

    def wrote(self, nbytes: int) -> None:
        """A write put ``nbytes`` on disk now."""
        day = today()
        self.written[day] = self.written.get(day, 0) + nbytes

    def written_today(self) -> int:
        """Bytes written to the warm tier on today's local date (the days before: none)."""
        return self.written.get(today(), 0)

    def written_due(self) -> bool:
        """Whether the bytes written are due to be recorded (at most every WRITTEN_FLUSH_S);
        True starts the next wait."""
        now = time.monotonic()
        if now < self._flush_at:
            return False
        self._flush_at = now + WRITTEN_FLUSH_S
        return True

    def over(self, more: int = 0) -> int:
        """Bytes past the limit were ``more`` bytes added now (0: within it, or no limit)."""
        return 0 if self.limit is None else max(self.used + more - self.limit, 0)

    @staticmethod
    def headroom(limit: int | None) -> int:
        """What making room keeps free under ``limit`` (the limit or a quota) beyond what
        a write needs: a cold demotion commits its new manifest before the old files go,
        so both exist for a moment. A 64th of the limit (at least 64 KiB, at most an
        eighth): more than any agent's manifest but of the largest contexts."""
        if limit is None:
            return 0
        return min(max(64 << 10, limit // 64), limit // 8)

    def used_by(self, namespace: str) -> int:
        """What the agents of ``namespace`` hold (every root; a file several of them list
        counted once)."""
        return self._space_used.get(namespace, 0)

    def over_quota(self, namespace: str | None, more: int = 0) -> int:
        """Bytes past the quota were ``more`` bytes added to ``namespace`` now (0: within
        it, no quota, or an agent in no namespace)."""
        if self.quota is None or namespace is None:
            return 0
        return max(self.used_by(namespace) + more - self.quota, 0)

    def namespaces(self) -> set[str]:
        """The namespaces with files counted."""
        return set(self._space_used)

    def files_of(self, roots: Iterable[Path]) -> int:
        """How many agents of ``roots`` have files."""
        wanted = {str(r) for r in roots}
        return sum(where in wanted for where, _ in self._agents)
