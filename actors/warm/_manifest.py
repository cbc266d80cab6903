"""The warm tier's format: the identity a cache is checked against, the manifest that
commits an agent's segments, and where an agent's files live.

Layout under the cache root::

    agents/<agent>/manifest.json         the commit point (a CacheManifest, JSON)
    agents/<agent>/seg-<n>.safetensors   quantized K/V of tokens [start, stop), all layers
    rejected/<agent>/                    a refused cache set aside when the agent rewrote it

Format 3 (written now): ``manifest.json`` is exactly ``{"checksum":"xxh3:<16 hex>",
"manifest":BODY}``, BODY the CacheManifest as compact JSON; each segment's manifest entry
holds the checksum of the whole file, header included (``xxh3t:``: ``_checksum``). It
adds, for models with recurrent layers, ``states`` (their geometry) and
``state_segments`` (``st-<n>.safetensors``: the states at the end of ``seg-<n>``'s tokens,
for the last ``checkpoints`` segments). Format 2 (CRC-32, ``crc32:<8 hex>``, no states)
still loads; an append rewrites its manifest as format 3, naming the old segments.
Format 1 (the checksum over the tensor bytes only, in the segment header; an unchecked
manifest) is refused. Every folder is reached through ``agent_dir`` / ``rejected_dir``,
which refuse a symlink at any level below the root; every file through ``open_regular``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from ..errors import CacheRejected, InvalidAgentId
from ..ids import check_agent_id
from ._checksum import SEGMENT_CHECKSUM, body_checksum, body_matches
from ._fileio import open_regular
from ._paths import agent_dir as agent_dir
from ._paths import contained as contained
from ._paths import default_cache_dir as default_cache_dir
from ._paths import rejected_dir as rejected_dir
from ._safetensors import Expected

__all__ = (
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "READABLE_VERSIONS",
    "SEGMENT_FILE",
    "SEGMENT_FILES",
    "STATE_FILE",
    "WINDOW_FILE",
    "CacheIdentity",
    "CacheManifest",
    "ExpectFn",
    "Loaded",
    "SegmentEntry",
    "WarmInfo",
    "agent_dir",
    "codec_key",
    "contained",
    "default_cache_dir",
    "encode_manifest",
    "load_manifest",
    "parse_manifest",
    "read_manifest",
    "rejected_dir",
    "segment_metadata",
    "segment_holds",
    "SegmentKind",
    "LayerShape",
    "layer_shapes",
    "split_layers",
    "uniform_geometry",
    "warm_info",
)

FORMAT_VERSION = 3
#: The format versions this store reads (those up to its own).
READABLE_VERSIONS = (2, 3)
#: Token ids and text of a long conversation stay far below this; more is not ours.
MAX_MANIFEST_BYTES = 32 << 20
#: A manifest spends at least 2 bytes per token id (a digit and a comma): no segment of a
#: cache can reach past this many tokens.
_MAX_TOKENS = MAX_MANIFEST_BYTES // 2
#: A sanity bound on one segment's size entry (the real bound comes from the codec's
#: tensor sizes when the file is read).
_MAX_SEGMENT_BYTES = 1 << 40

MANIFEST = "manifest.json"
SEGMENT_FILE = re.compile(r"seg-([0-9]{1,12})\.safetensors")
#: The sliding-window layers' tensors of a segment, apart (see CacheManifest).
WINDOW_FILE = re.compile(r"win-([0-9]{1,12})\.safetensors")
#: The recurrent states at the end of a segment (its checkpoint), apart.
STATE_FILE = re.compile(r"st-([0-9]{1,12})\.safetensors")
#: Every kind of segment file an agent's folder holds.
SEGMENT_FILES = (SEGMENT_FILE, WINDOW_FILE, STATE_FILE)
_MAX_SEGMENT_NUMBER = 10**12 - 1  # so that the next number still has 12 digits
# manifest.json: this, then BODY, then "}" (nothing else: not even a newline).
_FRAME = re.compile(rb'\{"checksum":"(xxh3:[0-9a-f]{16}|crc32:[0-9a-f]{8})","manifest":')

#: ``expect(start, stop)``: exact tensor name -> (shape, numpy dtype name) of a segment
#: holding tokens [start, stop). Supplied by the codec.
ExpectFn = Callable[[int, int], Expected]


class SegmentKind(Enum):
    """The kinds of segment file an agent's folder holds, in the order the manifest lists
    them (``CacheManifest.of``); the value is the file name's prefix."""

    SEGMENT = "seg"  # K/V: of the global layers when the layers are split, else all
    WINDOW = "win"  # the sliding-window layers' K/V (split_layers), beside a segment
    STATE = "st"  # the recurrent states at a segment's end (its checkpoint), beside it

    @property
    def pattern(self) -> re.Pattern[str]:
        """Its files' names (the number in group 1)."""
        return _FILE_PATTERNS[self]


_FILE_PATTERNS = {
    SegmentKind.SEGMENT: SEGMENT_FILE,
    SegmentKind.WINDOW: WINDOW_FILE,
    SegmentKind.STATE: STATE_FILE,
}


class LayerShape(NamedTuple):
    """One entry of a geometry as ``CacheGeometry.describe`` writes it (window 0: none)."""

    n_kv_heads: int
    key_dim: int
    value_dim: int
    window: int


def layer_shapes(geometry: list[list[int]]) -> list[LayerShape | None]:
    """``geometry``'s entries by name (None: a layer without K/V)."""
    return [LayerShape(*entry) if entry else None for entry in geometry]


def split_layers(geometry: list[list[int]]) -> tuple[frozenset[int], int] | None:
    """For a geometry (``CacheGeometry.describe``) with both sliding-window and global
    layers: the sliding layers and their widest window, whose tensors the warm tier keeps
    apart. None for any other (every layer in one segment)."""
    shapes = layer_shapes(geometry)
    windows = {i: g.window for i, g in enumerate(shapes) if g is not None and g.window}
    if not windows or len(windows) == sum(g is not None for g in shapes):
        return None
    return frozenset(windows), max(windows.values())


def segment_holds(geometry: list[list[int]], kind: SegmentKind) -> Callable[[str], bool]:
    """Which tensor names (``{layer}.{k|v|s}.{part}``) a file of ``kind`` holds."""
    split = split_layers(geometry)
    sliding = split[0] if split is not None else frozenset()

    def holds(name: str) -> bool:
        layer, part = name.split(".", 2)[:2]
        if part == "s":
            return kind is SegmentKind.STATE
        if kind is SegmentKind.STATE:
            return False
        return (int(layer) in sliding) == (kind is SegmentKind.WINDOW)

    return holds


def uniform_geometry(n_layers: int, n_kv_heads: int, head_dim: int) -> list[list[int]]:
    """``CacheGeometry.describe`` of ``n_layers`` full-attention layers alike."""
    return [[n_kv_heads, head_dim, head_dim, 0] for _ in range(n_layers)]


class CacheIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What a warm cache must have been made with to be used: model, codec, format."""

    model_fingerprint: str
    codec: dict[str, int | bool | str]  # opaque: must match exactly
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int  # token ids must lie in [0, vocab_size): the ids the engine takes
    format_version: int = FORMAT_VERSION
    # Per layer [n_kv_heads, key_dim, value_dim, window] (CacheGeometry.describe); []: every
    # layer n_kv_heads heads of head_dim (what caches written before this field hold).
    geometry: list[list[int]] = msgspec.field(default_factory=list)
    # Recurrent layers' states (CacheGeometry.describe_states); []: none.
    states: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def layer_geometry(self) -> list[list[int]]:
        return self.geometry or uniform_geometry(self.n_layers, self.n_kv_heads, self.head_dim)

    def readable(self) -> tuple[int, ...]:
        """The format versions a store of this identity reads."""
        return tuple(v for v in READABLE_VERSIONS if v <= self.format_version)


class SegmentEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One segment file: it holds tokens [start, stop); the cache uses [start, start + use)."""

    file: str
    start: int
    stop: int
    use: int  # below stop - start after a DIVERGE cut into this segment
    nbytes: int
    checksum: str  # "xxh3t:..." (format 2: "crc32:...") over the whole file, header included
    owner: str = ""  # the agent the file was written for, when not this one (a fork's)


class CacheManifest(msgspec.Struct, frozen=True, kw_only=True):
    """``manifest.json``: identity, what the tokens spell, and the segments that hold them."""

    format_version: int
    model_fingerprint: str
    codec: dict[str, int | bool | str]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    agent: str
    n_tokens: int
    token_ids: list[int]  # exactly the tokens the cache holds
    text: str  # the prompt/conversation text those tokens spell (for prefix matching)
    messages: list[dict[str, Any]]  # {role, content, ...} of a chat agent; may be empty
    extra: dict[str, Any]
    created: float
    updated: float
    segments: list[SegmentEntry]
    last_segment: int = 0  # the highest seg-<n> ever written here: names never repeat
    geometry: list[list[int]] = msgspec.field(default_factory=list)  # as CacheIdentity's
    # A model with sliding-window and global layers (split_layers): ``segments`` hold the
    # global layers and ``window_segments`` (win-<n>, beside seg-<n>, same tokens) the
    # sliding ones, only for the last ranges: those a turn resuming anywhere in the last
    # segment attends to (older ones are deleted). Other models: all layers in segments.
    window_segments: list[SegmentEntry] = msgspec.field(default_factory=list)
    # Format 3, a model with recurrent layers: their geometry (as CacheIdentity's), and the
    # state files (st-<n>, beside seg-<n>, same tokens: the states after them) of the last
    # segments, those whose checkpoints the agent keeps.
    states: list[dict[str, Any]] = msgspec.field(default_factory=list)
    state_segments: list[SegmentEntry] = msgspec.field(default_factory=list)

    def layer_geometry(self) -> list[list[int]]:
        return self.geometry or uniform_geometry(self.n_layers, self.n_kv_heads, self.head_dim)

    def of(self, kind: SegmentKind) -> list[SegmentEntry]:
        """Its files of ``kind``."""
        if kind is SegmentKind.SEGMENT:
            return self.segments
        return self.window_segments if kind is SegmentKind.WINDOW else self.state_segments

    @property
    def all_segments(self) -> tuple[SegmentEntry, ...]:
        """Every file entry: the segments, the window segments, the state segments."""
        return (*self.segments, *self.window_segments, *self.state_segments)


#: In a manifest's ``extra``: what the agent's cache held beyond its cached tokens (``token_ids``,
#: ``text``) and where its stored ranges ended (``bounds``), for an exact re-prefill: a
#: cold manifest's (no cached tokens), or under write-back one whose conversation went on
#: past what is on disk (its token ids extend the cached ones).
COLD_KEY = "cold"


def held_state(m: CacheManifest) -> tuple[list[int], str, list[int]]:
    """The tokens, text and range ends the agent's cache held beyond what ``m`` caches
    (all empty when it holds nothing more, or a manifest written before they were kept)."""
    held = m.extra.get(COLD_KEY)
    if not isinstance(held, dict):
        return [], "", []
    tokens, text, bounds = held.get("token_ids"), held.get("text"), held.get("bounds")
    if not (
        isinstance(tokens, list)
        and all(isinstance(t, int) and t >= 0 for t in tokens)
        and isinstance(text, str)
        and isinstance(bounds, list)
        and all(isinstance(b, int) and 0 < b <= len(tokens) for b in bounds)
        and len(tokens) > m.n_tokens
        and tokens[: m.n_tokens] == m.token_ids
    ):
        return [], "", []  # hand-edited, foreign or stale: the cached tokens are what it has
    return tokens, text, sorted(set(bounds))


#: In a manifest's ``extra``: where the agent's answers began (token counts, increasing),
#: each decoded one token a step up to the end of its stored range, so that a re-prefill
#: feeds them as they were decoded (``Generate.answers``). Missing or malformed: none.
ANSWERS_KEY = "answers"


def held_answers(m: CacheManifest, tokens: int) -> list[int]:
    """The answer starts ``m`` keeps (``ANSWERS_KEY``) below ``tokens`` (what the agent
    resumes holding); [] when it keeps none or they are malformed."""
    answers = m.extra.get(ANSWERS_KEY)
    if not (
        isinstance(answers, list)
        and all(isinstance(a, int) and not isinstance(a, bool) for a in answers)
        and answers == sorted(set(answers))
    ):
        return []
    return [a for a in answers if 0 < a < tokens]


class _Versioned(msgspec.Struct):
    format_version: int


class WarmInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A summary of one agent's warm cache; ``rejected`` says why it cannot be used."""

    agent: str
    tokens: int
    nbytes: int  # on disk: segments plus manifest (a refused folder: every file in it)
    segments: int
    updated: float
    model_fingerprint: str = ""
    codec: dict[str, int | bool | str] = {}
    rejected: str | None = None


class Loaded(msgspec.Struct, frozen=True):
    """A verified warm cache: ``segments[i]`` holds the tokens of ``manifest.segments[i]``
    that the cache uses, as numpy views of the file bytes (cut segments are sliced views)."""

    manifest: CacheManifest
    segments: list[dict[str, np.ndarray[Any, Any]]]
    nbytes: int  # bytes read
    windows: list[dict[str, np.ndarray[Any, Any]]] = []  # of manifest.window_segments
    states: list[dict[str, np.ndarray[Any, Any]]] = []  # of manifest.state_segments

    def ranges(self) -> list[tuple[int, int, dict[str, np.ndarray[Any, Any]]]]:
        """``(start, stop, tensors)`` per segment, in token order; a segment's window
        tensors (sliding-window layers, for the last ranges) and state tensors (its
        checkpoint, for the last ranges) joined to its own."""
        extra: dict[int, dict[str, np.ndarray[Any, Any]]] = {}
        for entries, found in (
            (self.manifest.window_segments, self.windows),
            (self.manifest.state_segments, self.states),
        ):
            for entry, tensors in zip(entries, found, strict=True):
                extra.setdefault(entry.start, {}).update(tensors)
        return [
            (entry.start, entry.start + entry.use, {**tensors, **extra.get(entry.start, {})})
            for entry, tensors in zip(self.manifest.segments, self.segments, strict=True)
        ]


# -------------------------------------------------------------------------- manifest
def codec_key(codec: Mapping[str, object]) -> bytes:
    # JSON, sorted: True and 1 compare equal in Python but are different codecs.
    return msgspec.json.encode(codec, order="sorted")


def encode_manifest(manifest: CacheManifest) -> bytes:
    """The bytes of ``manifest.json``: the manifest framed with the checksum of its JSON."""
    body = msgspec.json.encode(manifest)
    return b'{"checksum":"%s","manifest":%s}' % (body_checksum(body).encode(), body)


def _version(raw: bytes) -> int | None:
    try:
        return msgspec.json.decode(raw, type=_Versioned).format_version
    except (msgspec.DecodeError, RecursionError):
        return None


def _decode_manifest(raw: bytes, path: Path, readable: tuple[int, ...]) -> CacheManifest:
    def refuse(reason: str) -> CacheRejected:
        return CacheRejected(reason, str(path))

    reads = " and ".join(map(str, readable))

    frame = _FRAME.match(raw)
    if frame is None or not raw.endswith(b"}"):
        # Format 1 wrote the bare manifest: say which version it is when it says so.
        version = _version(raw)
        if version is not None and version not in readable:
            raise refuse(f"format version {version}, this store reads {reads}")
        raise refuse("malformed manifest: not framed with its checksum")
    body = raw[frame.end() : -1]
    said = frame.group(1).decode()
    found = body_matches(said, body)
    if found is not None:
        raise refuse(f"manifest checksum mismatch: its body has {found}, it says {said}")
    version = _version(body)
    if version is not None and version not in readable:
        raise refuse(f"format version {version}, this store reads {reads}")
    if (version == FORMAT_VERSION) != said.startswith("xxh3:"):
        raise refuse(f"a format {version} manifest framed with {said.split(':')[0]}")
    try:
        return msgspec.json.decode(body, type=CacheManifest)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise refuse(f"malformed manifest: {exc}") from None


def _first_outside(ids: list[int], stop: int | None) -> tuple[int, int] | None:
    """(position, id) of the first id below 0 or (given ``stop``) from ``stop`` on."""
    if not ids or (min(ids) >= 0 and (stop is None or max(ids) < stop)):
        return None  # the usual answer, found in C
    return next((i, t) for i, t in enumerate(ids) if t < 0 or (stop is not None and t >= stop))


def _check_manifest(
    manifest: CacheManifest, identity: CacheIdentity | None, agent: str, path: Path
) -> None:
    """Raise CacheRejected unless the manifest is this agent's, whole, within bounds, and
    (given an identity) made by the same model and codec for token ids the model takes.
    Without an identity (``kvactor inspect``) only negative token ids are refused."""

    def refuse(reason: str) -> CacheRejected:
        return CacheRejected(reason, str(path))

    m = manifest
    if identity is not None:
        if m.model_fingerprint != identity.model_fingerprint:
            raise refuse(
                f"made by model {m.model_fingerprint!r}, not {identity.model_fingerprint!r}"
            )
        if codec_key(m.codec) != codec_key(identity.codec):
            raise refuse(f"made with codec {m.codec}, not {identity.codec}")
        shape = (m.n_layers, m.n_kv_heads, m.head_dim)
        want = (identity.n_layers, identity.n_kv_heads, identity.head_dim)
        if shape != want:
            raise refuse(f"layers/kv heads/head dim {shape}, expected {want}")
        if m.layer_geometry() != identity.layer_geometry():
            raise refuse(
                f"layer geometry {m.layer_geometry()}, expected {identity.layer_geometry()}"
            )
        if m.states != identity.states:
            raise refuse(f"recurrent states {m.states}, expected {identity.states}")
    elif m.n_layers <= 0 or min(m.n_kv_heads, m.head_dim) < 0:
        raise refuse("layers must be positive, kv heads/head dim not negative")
    if m.agent != agent:
        raise refuse(f"manifest belongs to agent {m.agent!r}")
    if m.n_tokens != len(m.token_ids):
        raise refuse(f"manifest says {m.n_tokens} tokens but lists {len(m.token_ids)} ids")
    # An id the model cannot take would make every turn of the agent fail.
    vocab = identity.vocab_size if identity is not None else None
    outside = _first_outside(m.token_ids, vocab)
    if outside is not None:
        at, bad = outside
        if vocab is None:
            raise refuse(f"token id {bad} at {at} is negative")
        raise refuse(f"token id {bad} at {at} is outside the vocabulary [0, {vocab})")
    for name, when in (("created", m.created), ("updated", m.updated)):
        if not (math.isfinite(when) and when >= 0):
            raise refuse(f"manifest time {name} is not a finite time >= 0")
    if not 0 <= m.last_segment < _MAX_SEGMENT_NUMBER:
        raise refuse(f"last segment number {m.last_segment} is out of range")
    files: set[str] = set()

    def entries(kind: str, pattern: re.Pattern[str], listed: list[SegmentEntry], at: int) -> int:
        """Check one list of segment entries, tiling tokens from ``at``; where they end."""
        for s in listed:
            named = pattern.fullmatch(s.file)
            if named is None or s.file in files:
                raise refuse(f"bad or repeated {kind} file name {s.file[:80]!r}")
            files.add(s.file)
            if int(named.group(1)) > m.last_segment:
                raise refuse(f"{kind} {s.file} is numbered past the last one, {m.last_segment}")
            if (
                s.start != at
                or not s.start < s.stop <= _MAX_TOKENS
                or not 0 < s.use <= s.stop - s.start
            ):
                raise refuse(f"{kind} {s.file} does not continue the tokens at {at}")
            if not 0 < s.nbytes <= _MAX_SEGMENT_BYTES or not SEGMENT_CHECKSUM.fullmatch(s.checksum):
                raise refuse(f"{kind} {s.file} has a bad size or checksum entry")
            if s.owner:
                try:
                    check_agent_id(s.owner)
                except InvalidAgentId as exc:
                    raise refuse(f"{kind} {s.file}: bad owner: {exc}") from None
            at += s.use
        return at

    position = entries("segment", SEGMENT_FILE, m.segments, 0)
    if position != m.n_tokens:
        raise refuse(f"segments hold {position} tokens, manifest says {m.n_tokens}")
    windows = m.window_segments
    if windows and split_layers(m.layer_geometry()) is None:
        raise refuse("window segments for a model without sliding-window layers")
    mains = {(s.start, s.stop, s.use) for s in m.segments}
    for s in windows:
        if (s.start, s.stop, s.use) not in mains:
            raise refuse(f"window segment {s.file} does not match a segment")
    position = entries("window segment", WINDOW_FILE, windows, windows[0].start if windows else 0)
    if windows and position != m.n_tokens:
        raise refuse(f"window segments end at {position}, manifest says {m.n_tokens}")
    _check_states(m, mains, files, refuse)


def _check_states(
    m: CacheManifest, mains: set[tuple[int, int, int]], files: set[str], refuse: Any
) -> None:
    """Raise (``refuse``) unless the state segments are files of their own, each of a
    whole segment's tokens, in order, and only for a model with recurrent layers."""
    if m.state_segments and not m.states:
        raise refuse("state segments for a model without recurrent layers")
    at = -1
    for s in m.state_segments:
        named = STATE_FILE.fullmatch(s.file)
        if named is None or s.file in files or int(named.group(1)) > m.last_segment:
            raise refuse(f"bad or repeated state segment file name {s.file[:80]!r}")
        files.add(s.file)
        if (s.start, s.stop, s.use) not in mains or s.use != s.stop - s.start or s.start <= at:
            raise refuse(f"state segment {s.file} does not match a whole segment")
        if not 0 < s.nbytes <= _MAX_SEGMENT_BYTES or not SEGMENT_CHECKSUM.fullmatch(s.checksum):
            raise refuse(f"state segment {s.file} has a bad size or checksum entry")
        if s.owner:
            try:
                check_agent_id(s.owner)
            except InvalidAgentId as exc:
                raise refuse(f"state segment {s.file}: bad owner: {exc}") from None
        at = s.start


def load_manifest(
    folder: Path, identity: CacheIdentity | None, agent: str
) -> tuple[CacheManifest, int] | None:
    """The checked manifest and its size, or None when there is none.

    Raises CacheRejected when ``manifest.json`` is not a regular file (a FIFO, directory,
    symlink...), is too large, or fails the checks of ``read_manifest``.
    """
    path = folder / MANIFEST
    try:
        fd, size = open_regular(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    try:
        parts, got = [], 0
        # To the end, not fstat's size: it may grow. Each read asks for what fstat saw
        # plus a little, never the whole bound: os.read allocates what it is asked for,
        # and 32 MB twice a manifest was a quarter of listing 10,000 agents.
        chunk = max(size + 1, 1 << 16)
        while got <= MAX_MANIFEST_BYTES:
            part = os.read(fd, min(chunk, MAX_MANIFEST_BYTES + 1 - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
    except OSError as exc:
        raise CacheRejected(f"{MANIFEST} is unreadable ({exc.strerror})", str(path)) from None
    finally:
        os.close(fd)
    raw = b"".join(parts)
    return parse_manifest(raw, path, identity, agent), len(raw)


def parse_manifest(
    raw: bytes, path: Path, identity: CacheIdentity | None, agent: str
) -> CacheManifest:
    """The bytes ``raw`` of ``manifest.json`` (at ``path``, for reasons) decoded and checked
    as ``load_manifest`` checks them. Raises CacheRejected."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CacheRejected(f"{MANIFEST} exceeds {MAX_MANIFEST_BYTES} bytes", str(path))
    readable = identity.readable() if identity is not None else READABLE_VERSIONS
    manifest = _decode_manifest(raw, path, readable)
    _check_manifest(manifest, identity, agent, path)
    return manifest


def read_manifest(
    root: str | os.PathLike[str], identity: CacheIdentity, agent: str
) -> CacheManifest | None:
    """The agent's checked manifest; None when it has no warm cache.

    Raises InvalidAgentId for an unsafe id, UnsafeCachePath when ``agents/`` or the agent's
    folder is a symlink, CacheRejected for a manifest that is not a regular file, too
    large, unframed or failing its checksum, malformed, not whole, out of bounds (token
    ids outside the vocabulary, huge ranges), or made by another model, codec or format
    version (segment files are not read: ``read_cache`` verifies them).
    """
    loaded = load_manifest(agent_dir(root, agent), identity, agent)
    return None if loaded is None else loaded[0]


def warm_info(manifest: CacheManifest, manifest_bytes: int) -> WarmInfo:
    return WarmInfo(
        agent=manifest.agent,
        tokens=manifest.n_tokens,
        nbytes=manifest_bytes + sum(s.nbytes for s in manifest.all_segments),
        segments=len(manifest.segments),
        updated=manifest.updated,
        model_fingerprint=manifest.model_fingerprint,
        codec=manifest.codec,
    )


def segment_metadata(
    identity: CacheIdentity, agent: str, start: int, stop: int, version: int | None = None
) -> dict[str, str]:
    """What a segment's header says about it (its checksum is in the manifest);
    ``version``: the format it was written in (default the identity's)."""
    return {
        "format": "kvactor-warm-segment",
        "format_version": str(identity.format_version if version is None else version),
        "model_fingerprint": identity.model_fingerprint,
        "codec": codec_key(identity.codec).decode(),
        "agent": agent,
        "start": str(start),
        "stop": str(stop),
    }
