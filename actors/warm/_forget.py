"""Removing from the warm tier: forget an agent (every byte of its own), and collect what
no manifest names (what a process killed mid-write, mid-fork or mid-share left).

A segment file may have several names (forks and shared prefixes hard-link it into other
agents' folders): its bytes go with the last name, so removing one agent never takes a
file another agent's manifest names. Everything here blocks: StoreActor runs it off the
event loop, and the CLI may call it directly.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from ..errors import CacheRejected, StoreWriteError
from ._durable import commit, fsync_dir, orphans, remove_path, write_failed
from ._fileio import open_regular
from ._manifest import (
    COLD_KEY,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SEGMENT_FILES,
    CacheIdentity,
    held_state,
    load_manifest,
)
from ._paths import agent_dir, contained, rejected_dir
from ._read import tree_bytes

__all__ = (
    "Collected",
    "Forgotten",
    "SharedFile",
    "agent_folders",
    "collect",
    "collect_agents",
    "demote_cold",
    "forget",
    "forget_cache",
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
                remove_path(folder)
                fsync_dir(folder.parent)
    except OSError as exc:
        raise StoreWriteError(f"forgetting agent {agent!r} failed: {exc}") from exc
    return Forgotten(agent=agent, freed=freed, kept=kept)


# ------------------------------------------------------------------------------ cold
def demote_cold(root: str | os.PathLike[str], identity: CacheIdentity, agent: str) -> bool:
    """Make the agent's warm cache cold: its manifest keeps its conversation (messages),
    no cached tokens, and in ``extra[COLD_KEY]`` the token ids the cache held and where its
    stored ranges ended, committed atomically, then its segment files go (a file another agent
    names stays for it). Its next turn prefills the conversation again. Killed at any
    point it is warm (the old manifest) or cold (the new one; files the old one named are
    collected at the next open), never half. False when it had nothing to demote (no warm
    cache, one already cold, or one refused: that is the store's to set aside).

    Raises UnsafeCachePath for a symlinked folder; StoreWriteError when the disk fails."""
    folder = agent_dir(root, agent)
    try:
        loaded = load_manifest(folder, identity, agent)
    except CacheRejected:
        return False
    if loaded is None or loaded[0].n_tokens == 0:
        return False
    warm = loaded[0]
    # What the cache held, and where its stored ranges ended: a re-prefill of these exact
    # tokens, cut at these points, rebuilds the ranges as they were stored (each computed
    # from the quantized ones before it), so the agent answers as it would have warm.
    tokens, text, bounds = held_state(warm)  # under write-back, it may hold more
    held = {
        "token_ids": tokens or list(warm.token_ids),
        "text": text if tokens else warm.text,
        "bounds": bounds if tokens else sorted({e.start + e.use for e in warm.segments}),
    }
    cold = msgspec.structs.replace(
        warm,
        n_tokens=0,
        token_ids=[],
        text="",
        extra={**warm.extra, COLD_KEY: held},
        segments=[],
        window_segments=[],
        state_segments=[],
        updated=time.time(),
    )
    try:
        commit(folder, cold)
        fsync_dir(folder)
    except OSError as exc:
        raise write_failed(exc, f"making the warm cache of agent {agent!r} cold") from exc
    return True


# --------------------------------------------------------------------------- collect
class Collected(msgspec.Struct, frozen=True):
    """What ``collect`` removed: files (paths under the root) and their bytes."""

    removed: list[str] = []
    freed: int = 0


def agent_folders(root: str | os.PathLike[str]) -> list[str]:
    """The names of the agent folders under ``root`` (not hidden, not symlinks), sorted;
    none when there is no ``agents/``. Raises UnsafeCachePath when ``agents/`` is a
    symlink."""
    base = contained(root, "agents")
    try:
        entries = os.scandir(base)
    except FileNotFoundError:
        return []
    with entries:
        return sorted(
            entry.name
            for entry in entries
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False)
        )


def _all_named(folder: Path) -> bool:
    """A cheap look before ``collect`` checks a folder: True when it holds no temporary
    file and its manifest's bytes name each of its segment files (``"file":"<name>"``),
    so that nothing there is to go. It may only err towards keeping: a manifest that
    seems to name a file it does not (in data of its own) keeps that file until the
    agent's next write; a file is only ever removed after the manifest's full checks."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    if MANIFEST not in names or any(n.startswith(".") and n.endswith(".tmp") for n in names):
        return False
    try:
        fd, size = open_regular(folder / MANIFEST, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, CacheRejected):
        return False
    try:
        raw = os.read(fd, size + 1)
    except OSError:
        return False
    finally:
        os.close(fd)
    return all(
        b'"file":"%s"' % name.encode() in raw
        for name in names
        if any(p.fullmatch(name) for p in SEGMENT_FILES)
    )


def collect(root: str | os.PathLike[str]) -> Collected:
    """Remove what no manifest names: segment and temporary files in an agent's folder
    that its manifest does not list (left by a process killed mid-write, mid-fork or
    mid-share), and folders that never got a manifest. A file's bytes go when its last
    name does, so a segment another agent's manifest names is never lost. Idempotent;
    safe to kill at any point. A refused cache is left alone (its owner's next write
    sets it aside). Run it while holding the root's lock (a session's store does, a few
    folders at a time: ``collect_agents``).

    Raises UnsafeCachePath when ``agents/`` is a symlink; StoreWriteError when a file
    cannot be removed.
    """
    return collect_agents(root, agent_folders(root))


def collect_agents(root: str | os.PathLike[str], agents: Iterable[str]) -> Collected:
    """``collect`` over the folders of ``agents`` only (one that is gone, or is not a
    folder, is skipped). Raises as ``collect`` does."""
    base = contained(root, "agents")
    removed: list[str] = []
    freed = 0
    try:
        for agent in agents:
            folder = base / agent
            if agent.startswith(".") or folder.is_symlink() or not folder.is_dir():
                continue
            if _all_named(folder):
                continue
            try:
                loaded = load_manifest(folder, None, agent)
            except CacheRejected:
                continue
            for name in orphans(folder, None if loaded is None else loaded[0]):
                freed += tree_bytes(folder / name, owned=True)
                os.unlink(folder / name)
                removed.append(f"agents/{agent}/{name}")
            if loaded is None and not os.listdir(folder):
                folder.rmdir()
                removed.append(f"agents/{agent}")
    except OSError as exc:
        raise StoreWriteError(f"collecting unreferenced cache files failed: {exc}") from exc
    return Collected(removed=removed, freed=freed)
