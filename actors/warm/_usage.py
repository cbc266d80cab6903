"""What the warm tier holds on disk, against its limit: every regular file in the agents'
folders of a cache directory (one folder per model), a file hard-linked by several agents
(forks, shared prefixes) counted once, as it is stored.

The count is kept on the event loop: the files of an agent's folder are listed off it
(:func:`agent_files`, in a worker thread) and handed to :meth:`DiskUsage.update`, so the
stores of several models in one directory share one count without a lock.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from ._paths import agent_dir, contained

__all__ = (
    "DISK_CEILING",
    "DISK_FILE",
    "DISK_SHARE",
    "AgentFiles",
    "DiskUsage",
    "agent_files",
    "default_disk_limit",
    "read_disk_limit",
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
    folder = agent_dir(root, agent)
    out: AgentFiles = {}
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        try:
            info = os.lstat(folder / name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            out[(info.st_dev, info.st_ino)] = info.st_size
    return out


def scan_agents(root: Path) -> dict[str, AgentFiles]:
    """Every agent folder under ``root`` and its files (blocking)."""
    base = contained(root, "agents")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return {}
    return {
        name: agent_files(root, name)
        for name in names
        if not name.startswith(".") and (base / name).is_dir() and not (base / name).is_symlink()
    }


def default_disk_limit(root: str | os.PathLike[str], used: int = 0) -> int:
    """The default disk limit of a cache directory: ``DISK_SHARE`` of its file system's
    free space plus ``used`` (what the cache holds already), at most ``DISK_CEILING``
    (blocking: it asks the file system)."""
    path = Path(root)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    return min(DISK_CEILING, int((free + used) * DISK_SHARE))


#: In a cache directory: the disk limit of the session that last opened it.
DISK_FILE = "warm.json"


def record_disk_limit(root: Path, limit: int | None) -> None:
    """Write ``root``'s DISK_FILE (for ``kvactor inspect``); an OSError is ignored."""
    try:
        (root / DISK_FILE).write_text(json.dumps({"disk_limit_bytes": limit}) + "\n")
    except OSError:
        pass


def read_disk_limit(root: Path) -> int | None:
    """The disk limit ``root``'s DISK_FILE records (None: none, or unreadable)."""
    try:
        data = json.loads((root / DISK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    limit = data.get("disk_limit_bytes") if isinstance(data, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


class DiskUsage:
    """The warm tier's bytes on disk over one or more roots (a model's folder each).

    Invariant: the only writer of the count; ``used`` is the sum of the sizes of the
    distinct files (by inode) that the agents' folders hold, as last listed (each store
    lists an agent's folder after every change it makes to it)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._sizes: dict[tuple[int, int], int] = {}  # each file: its size
        self._users: dict[tuple[int, int], int] = {}  # each file: how many agents list it
        self._agents: dict[tuple[str, str], AgentFiles] = {}  # (root, agent) -> its files
        self.used = 0
        self.peak = 0

    def update(self, root: Path, agent: str, files: AgentFiles) -> None:
        """``agent``'s folder under ``root`` holds ``files`` now (none: it has no folder)."""
        key = (str(root), agent)
        for inode in self._agents.pop(key, {}):
            self._users[inode] -= 1
            if not self._users[inode]:
                del self._users[inode]
                self.used -= self._sizes.pop(inode)
        if files:
            self._agents[key] = dict(files)
        for inode, size in files.items():
            if inode in self._users:
                self._users[inode] += 1
                self.used += size - self._sizes[inode]  # a file may have grown (a manifest)
            else:
                self._users[inode] = 1
                self.used += size
            self._sizes[inode] = size
        self.peak = max(self.peak, self.used)
        assert self.used >= 0, "the disk count went below zero"

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

    def over(self, more: int = 0) -> int:
        """Bytes past the limit were ``more`` bytes added now (0: within it, or no limit)."""
        return 0 if self.limit is None else max(self.used + more - self.limit, 0)

    def files_of(self, roots: Iterable[Path]) -> int:
        """How many agents of ``roots`` have files."""
        wanted = {str(r) for r in roots}
        return sum(where in wanted for where, _ in self._agents)
