"""Linking warm caches: a fork (another agent's whole cache) and a shared prefix (the
segments of another agent's cache up to a segment boundary, with the state files of its
recurrent layers' checkpoints), both by hard-linking the source's segment files into the
new agent's folder (one copy of the bytes) and then committing the new agent's manifest.

Files are never rewritten, so the source and the new agent append, cut and forget on
their own from then on. Everything here blocks: StoreActor runs it off the event loop.
"""

from __future__ import annotations

import operator
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from ..errors import CacheRejected
from ._durable import commit, fsync_dir, link_or_copy, write_failed
from ._manifest import (
    CacheIdentity,
    CacheManifest,
    SegmentEntry,
    WarmInfo,
    load_manifest,
    split_layers,
)
from ._paths import agent_dir

__all__ = ("fork_cache", "share_cache")


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
    manifest = _linked_manifest(
        old, source, new, old.segments, old.window_segments, old.state_segments
    )
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
    ``new``'s. A cold agent (its manifest kept, no tokens) has no warm cache either: its
    first write after a re-prefill links too, its manifest replaced as a whole write's
    would be. None, touching nothing, when that cannot be done: ``source`` has no such
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
        if (mine := load_manifest(dst, identity, new)) is not None and mine[0].n_tokens:
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
    # With recurrent layers the shared prefix needs the checkpoint at its end.
    states = [s for s in old.state_segments if s.stop <= upto]
    if old.states and (not states or states[-1].stop != upto):
        return None
    manifest = _linked_manifest(old, source, new, segments, [], states)
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
    states: list[SegmentEntry],
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
        state_segments=owned(states),
        created=now,
        updated=now,
    )


def _link_into(src: Path, dst: Path, manifest: CacheManifest, doing: str) -> WarmInfo:
    """Link the files ``manifest`` names from ``src`` into ``dst``, then commit it there."""
    try:
        fresh = not dst.is_dir()
        dst.mkdir(parents=True, exist_ok=True)
        if fresh:
            fsync_dir(dst.parent)
        for entry in manifest.all_segments:
            tmp = dst / f".{entry.file}.{secrets.token_hex(4)}.tmp"
            link_or_copy(src / entry.file, tmp)
            os.replace(tmp, dst / entry.file)
        fsync_dir(dst)
        return commit(dst, manifest)
    except OSError as exc:
        raise write_failed(exc, doing) from exc
