"""Writing the warm tier: append a turn's tokens to an agent's cache.

Every function here blocks; StoreActor runs them off the event loop, and the CLI, the
scenario runner or a benchmark may call them directly. Appends to one agent must not
overlap (StoreActor handles one message at a time); reads may run alongside them. How a
change is made durable (temp files, renames, the manifest commit) is ``_durable``'s;
forgetting and collecting are ``_warm_forget``'s, forks and shared prefixes ``_warm_link``'s.
"""

from __future__ import annotations

import operator
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..errors import CacheRejected
from ._checksum import file_checksum
from ._durable import commit, fsync_dir, remove_path, write_atomic, write_failed
from ._fileio import in_background
from ._manifest import (
    ANSWERS_KEY,
    COLD_KEY,
    MAX_MANIFEST_BYTES,
    SEGMENT_FILES,
    CacheIdentity,
    CacheManifest,
    ExpectFn,
    SegmentEntry,
    SegmentKind,
    WarmInfo,
    load_manifest,
    segment_holds,
    segment_metadata,
    split_layers,
)
from ._paths import agent_dir, rejected_dir
from ._safetensors import build_header, dtype_named, tensor_bytes

__all__ = ("append_cache", "note_conversation")

_LITTLE = sys.byteorder == "little"

Arrays = list[tuple[str, np.ndarray[Any, Any]]]


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
    refused: str | None = None,
    checkpoints: int | None = None,
) -> WarmInfo:
    """Make the agent's warm cache hold ``tokens``: keep its first ``start`` tokens, write
    ``tensors`` (tokens [start, len(tokens))) as one new segment, then commit the manifest.
    With recurrent layers ``tensors`` may hold the states at its end (all or none: its
    checkpoint), written apart; only the last ``checkpoints`` segments' are kept (None:
    every one).

    ``start`` below the cached count cuts the cache there first (a DIVERGE); no tensors
    (``len(tokens) == start``) only rewrites the manifest. Orphan segment and temp files
    are removed after the commit. A refused cache (its manifest fails the checks of
    ``read_manifest``, or ``refused`` says why ``read_cache`` refused it) is replaced by an
    append at 0, after being moved to ``rejected/<agent>`` (or deleted with
    ``delete_rejected``).

    Raises InvalidAgentId for an unsafe id (before touching the disk); UnsafeCachePath when
    ``agents/``, ``rejected/`` (for a set-aside) or a folder in them is a symlink (before
    touching it); ValueError or TypeError when tensors do not match ``expect``, ``start``
    is past the cached tokens (a gap), ``tokens`` differs from the cached ones before
    ``start`` or holds an id outside [0, vocab_size), or the manifest would exceed
    MAX_MANIFEST_BYTES; CacheRejected for an append above 0 onto a refused cache;
    StoreWriteError when the disk fails (full, I/O error): the previous cache stays loadable.
    """
    folder = agent_dir(root, agent)
    token_ids = _checked_ids(identity, start, tokens)
    arrays = _check_tensors(expect, start, tensors, len(token_ids) - start)
    old, set_aside = _previous(folder, identity, agent, start, token_ids, refused)
    grows = len(token_ids) > start
    manifest = _next_manifest(
        identity, agent, old, start, token_ids, grows, text, messages, extra or {}
    )
    _check_size(manifest)
    try:
        if set_aside:
            _set_aside(Path(root), folder, agent, delete_rejected)
        _make_folder(folder)
        if grows:
            manifest = _write_new_segment(folder, identity, manifest, start, arrays)
            manifest = _keep_checkpoints(manifest, checkpoints)
        return commit(folder, manifest)
    except OSError as exc:
        raise write_failed(exc, f"writing the warm cache of agent {agent!r}") from exc


def note_conversation(
    root: str | os.PathLike[str],
    identity: CacheIdentity,
    agent: str,
    tokens: Sequence[int],
    *,
    text: str,
    messages: Sequence[Mapping[str, Any]],
    bounds: Sequence[int],
    answers: Sequence[int] = (),
) -> WarmInfo | None:
    """Write-back's turn end: commit the agent's conversation (``messages``) and what its
    cache holds now (``tokens``, the ``text`` they spell, its ranges' ends ``bounds``,
    where its answers began ``answers``) in
    its manifest, its warm cache unchanged: after a crash it resumes the conversation, the
    tokens past its warm cache prefilled again. A folder without a manifest gets a cold
    one; when the warm cache is not a prefix of ``tokens`` (a turn cut into it) only the
    messages change. None (nothing written) for a refused cache: its next write from token
    0 sets it aside. Raises StoreWriteError when the disk fails, ValueError as
    ``append_cache`` does for ids or a manifest too large."""
    folder = agent_dir(root, agent)
    token_ids = _checked_ids(identity, 0, tokens)
    try:
        loaded = load_manifest(folder, identity, agent)
    except CacheRejected:
        return None
    old = loaded[0] if loaded is not None else None
    if old is None:
        old = _next_manifest(identity, agent, None, 0, [], False, "", messages, {})
    extra = {k: v for k, v in old.extra.items() if k != COLD_KEY}
    extra[ANSWERS_KEY] = sorted({int(a) for a in answers if 0 < a < len(token_ids)})
    if len(token_ids) > old.n_tokens and token_ids[: old.n_tokens] == old.token_ids:
        kept = sorted({int(b) for b in bounds if 0 < b <= len(token_ids)})
        extra[COLD_KEY] = {"token_ids": token_ids, "text": text, "bounds": kept}
    manifest = msgspec.structs.replace(
        old, messages=[dict(m) for m in messages], extra=extra, updated=time.time()
    )
    _check_size(manifest)
    try:
        _make_folder(folder)
        return commit(folder, manifest)
    except OSError as exc:
        raise write_failed(exc, f"noting the conversation of agent {agent!r}") from exc


def _check_size(manifest: CacheManifest) -> None:
    """Raise ValueError for a manifest too large to commit. Encoding it raises TypeError
    for what JSON cannot hold, before any disk work; a segment entry added after and the
    checksum frame are a few hundred bytes at most."""
    if len(msgspec.json.encode(manifest)) + 1024 > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest would exceed {MAX_MANIFEST_BYTES} bytes")


def _make_folder(folder: Path) -> None:
    """Make the agent's folder if it has none yet, durably (its parent synced)."""
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(folder.parent)


def _checked_ids(identity: CacheIdentity, start: int, tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list of ints. Raises ValueError for a negative ``start``, fewer ids
    than ``start``, or an id outside [0, vocab_size); TypeError for a non-integer id."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    token_ids = [operator.index(t) for t in tokens]
    if len(token_ids) < start:
        raise ValueError(f"tokens holds {len(token_ids)} ids, fewer than start={start}")
    # A cache of ids the model cannot take would be refused when read: never write one.
    if token_ids and not 0 <= min(token_ids) <= max(token_ids) < identity.vocab_size:
        raise ValueError(f"token ids must be in [0, {identity.vocab_size})")
    return token_ids


def _check_tensors(
    expect: ExpectFn,
    start: int,
    tensors: Mapping[str, np.ndarray[Any, Any]],
    n: int,
) -> Arrays:
    """The tensors of tokens [start, start + n) in file order (aligned, largest items
    first), contiguous and little-endian. Raises ValueError/TypeError when they are not
    exactly what ``expect`` says."""
    if n == 0:
        if tensors:
            raise ValueError("tensors were given for an empty range (tokens has start ids)")
        return []
    want = expect(start, start + n)
    states = {k for k in want if k.split(".", 2)[1] == "s"}
    if states and not states & set(tensors):  # a range whose checkpoint was dropped
        want = {k: v for k, v in want.items() if k not in states}
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
        if array.shape != tuple(shape) or array.dtype != dtype_named(dtype):
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


def _previous(
    folder: Path,
    identity: CacheIdentity,
    agent: str,
    start: int,
    token_ids: list[int],
    refused: str | None,
) -> tuple[CacheManifest | None, bool]:
    """The manifest the append extends (None: none, or a refused one) and whether a
    refused cache must be set aside first. Raises CacheRejected for an append above 0
    onto a refused cache; ValueError for a gap or tokens that differ before ``start``."""
    set_aside = False
    try:
        loaded = load_manifest(folder, identity, agent)
        if loaded is not None and refused is not None:
            raise CacheRejected(refused, str(folder))
    except CacheRejected as exc:
        if start:
            raise CacheRejected(
                f"agent {agent!r}: cannot extend a refused cache ({exc.reason}); "
                "append from token 0 to replace it",
                exc.path,
            ) from None
        loaded, set_aside = None, True
    old = loaded[0] if loaded is not None else None
    cached = old.n_tokens if old is not None else 0
    if start > cached:
        raise ValueError(f"append at token {start} leaves a gap: the cache holds {cached}")
    if old is not None and token_ids[:start] != old.token_ids[:start]:
        raise ValueError(f"tokens before {start} differ from the ones the cache holds")
    return old, set_aside


def _next_manifest(
    identity: CacheIdentity,
    agent: str,
    old: CacheManifest | None,
    start: int,
    token_ids: list[int],
    grows: bool,
    text: str,
    messages: Sequence[Mapping[str, str]],
    extra: Mapping[str, Any],
) -> CacheManifest:
    """The manifest of ``old`` cut at ``start`` and holding ``token_ids``, before the new
    segment (``grows``: there is one) is added."""
    now = time.time()
    segments = _cut(old.segments, start) if old is not None else []
    windows = _cut(old.window_segments, start) if old is not None else []
    # A checkpoint is the state after a whole segment: one cut into is gone.
    states = [s for s in old.state_segments if s.stop <= start] if old is not None else []
    split = split_layers(identity.layer_geometry())
    if split is not None and grows:
        # The new segment is the last range now: keep the sliding layers' tensors that a
        # turn resuming anywhere in it attends to (as AgentKV.slide keeps them hot).
        windows = [w for w in windows if w.start + w.use > start - split[1] + 1]
    return CacheManifest(
        format_version=identity.format_version,
        model_fingerprint=identity.model_fingerprint,
        codec=dict(identity.codec),
        n_layers=identity.n_layers,
        n_kv_heads=identity.n_kv_heads,
        head_dim=identity.head_dim,
        geometry=identity.layer_geometry(),
        states=list(identity.states),
        state_segments=states,
        agent=agent,
        n_tokens=len(token_ids),
        token_ids=token_ids,
        text=text,
        messages=[dict(m) for m in messages],
        extra=dict(extra),
        created=old.created if old is not None else now,
        updated=now,
        segments=segments,
        last_segment=old.last_segment if old is not None else 0,
        window_segments=windows,
    )


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
    """Move a refused cache to ``rejected/<agent>`` (replacing an older one), or delete it.
    Raises UnsafeCachePath, before touching anything, when a move would go through a
    symlinked ``rejected/`` or folder in it; OSError when the disk fails."""
    if delete:
        remove_path(folder)
        return
    dest = rejected_dir(root, agent)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(dest):
        remove_path(dest)
    os.replace(folder, dest)


def _write_new_segment(
    folder: Path,
    identity: CacheIdentity,
    manifest: CacheManifest,
    start: int,
    arrays: Arrays,
) -> CacheManifest:
    """Write tokens [start, manifest.n_tokens) as the next segment (and its window file,
    for a model with sliding-window layers, and its state file, for a checkpoint of
    recurrent layers); the manifest that names them. The number is past every segment
    file in the folder, orphans included, so no file is ever rewritten. Raises OSError
    when the disk fails."""
    names = os.listdir(folder)
    found = [m for p in SEGMENT_FILES for m in map(p.fullmatch, names) if m]
    number = max([manifest.last_segment, *(int(m.group(1)) for m in found)]) + 1
    agent, stop = manifest.agent, manifest.n_tokens
    geometry = identity.layer_geometry()
    split = split_layers(geometry) is not None
    entries: dict[SegmentKind, SegmentEntry] = {}
    for kind in SegmentKind:
        holds = segment_holds(geometry, kind)
        group = [(k, a) for k, a in arrays if holds(k)]
        # Every range has its segment; a window or state file only when it holds anything
        # (a window file always, once the layers are split).
        if kind is SegmentKind.SEGMENT or group or (kind is SegmentKind.WINDOW and split):
            entries[kind] = _write_segment(
                folder, number, identity, agent, start, stop, group, prefix=kind.value
            )
    grown = {
        kind: [*manifest.of(kind), *([entries[kind]] if kind in entries else [])]
        for kind in SegmentKind
    }
    return msgspec.structs.replace(
        manifest,
        segments=grown[SegmentKind.SEGMENT],
        window_segments=grown[SegmentKind.WINDOW],
        state_segments=grown[SegmentKind.STATE],
        last_segment=number,
    )


def _keep_checkpoints(manifest: CacheManifest, checkpoints: int | None) -> CacheManifest:
    """The manifest naming the state files of its last ``checkpoints`` segments only (as
    the hot cache keeps them: ``AgentKV.checkpoints``); the others become orphans."""
    if checkpoints is None or not manifest.state_segments:
        return manifest
    last = {s.start for s in manifest.segments[-checkpoints:]}
    kept = [s for s in manifest.state_segments if s.start in last]
    return msgspec.structs.replace(manifest, state_segments=kept)


def _write_segment(
    folder: Path,
    number: int,
    identity: CacheIdentity,
    agent: str,
    start: int,
    stop: int,
    arrays: Arrays,
    prefix: str = "seg",
) -> SegmentEntry:
    """Write one segment file of ``arrays`` (its checksum summed while it is written) and
    return its entry. Raises OSError when the disk fails."""
    header = build_header(arrays, segment_metadata(identity, agent, start, stop))
    chunks = [memoryview(header), *(tensor_bytes(array) for _, array in arrays)]
    summing = in_background(file_checksum, chunks)  # the whole file, while it is written
    name = f"{prefix}-{number}.safetensors"
    try:
        size = write_atomic(folder, name, chunks)
    finally:
        crc = summing.result()  # the views must outlive the thread that reads them
    return SegmentEntry(
        file=name, start=start, stop=stop, use=stop - start, nbytes=size, checksum=crc
    )
