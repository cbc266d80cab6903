"""The warm tier's format: the identity a cache is checked against, the manifest that
commits an agent's segments, and where an agent's files live.

Layout under the cache root::

    agents/<agent>/manifest.json         the commit point (a CacheManifest, JSON)
    agents/<agent>/seg-<n>.safetensors   quantized K/V of tokens [start, stop), all layers
    rejected/<agent>/                    a refused cache set aside when the agent rewrote it
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ._safetensors import Expected
from .errors import CacheRejected, InvalidAgentId
from .protocol import check_agent_id

__all__ = (
    "CLOEXEC",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "NOFOLLOW",
    "SEGMENT_FILE",
    "CacheIdentity",
    "CacheManifest",
    "ExpectFn",
    "Loaded",
    "SegmentEntry",
    "WarmInfo",
    "agent_dir",
    "codec_key",
    "default_cache_dir",
    "inside",
    "load_manifest",
    "read_manifest",
    "segment_metadata",
    "warm_info",
)

FORMAT_VERSION = 1
#: Token ids and text of a long conversation stay far below this; more is not ours.
MAX_MANIFEST_BYTES = 32 << 20

MANIFEST = "manifest.json"
SEGMENT_FILE = re.compile(r"seg-([0-9]{1,12})\.safetensors")
_CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: ``expect(start, stop)``: exact tensor name -> (shape, numpy dtype name) of a segment
#: holding tokens [start, stop). Supplied by the codec.
ExpectFn = Callable[[int, int], Expected]


class CacheIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What a warm cache must have been made with to be used: model, codec, format."""

    model_fingerprint: str
    codec: dict[str, int | bool | str]  # opaque: must match exactly
    n_layers: int
    n_kv_heads: int
    head_dim: int
    format_version: int = FORMAT_VERSION


class SegmentEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One segment file: it holds tokens [start, stop); the cache uses [start, start + use)."""

    file: str
    start: int
    stop: int
    use: int  # below stop - start after a DIVERGE cut into this segment
    nbytes: int
    checksum: str  # "crc32:xxxxxxxx" over the tensor bytes (the file's data area)


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
    messages: list[dict[str, str]]  # {role, content} of a chat agent; may be empty
    extra: dict[str, Any]
    created: float
    updated: float
    segments: list[SegmentEntry]
    last_segment: int = 0  # the highest seg-<n> ever written here: names never repeat


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

    def ranges(self) -> list[tuple[int, int, dict[str, np.ndarray[Any, Any]]]]:
        """``(start, stop, tensors)`` per segment, in token order."""
        return [
            (entry.start, entry.start + entry.use, tensors)
            for entry, tensors in zip(self.manifest.segments, self.segments, strict=True)
        ]


# ----------------------------------------------------------------------------- paths
def default_cache_dir() -> Path:
    """``$KVACTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvactor/agents-cache``, else
    ``~/.cache/kvactor/agents-cache``."""
    explicit = os.environ.get("KVACTOR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvactor" / "agents-cache"


def inside(base: Path, agent: str) -> Path:
    path = base / agent
    # A symlinked folder could lead anywhere: the real path must stay under the root.
    if os.path.realpath(path) != os.path.join(os.path.realpath(base), agent):
        raise InvalidAgentId(f"the cache folder of agent {agent!r} resolves outside {base}")
    return path


def agent_dir(root: str | os.PathLike[str], agent: str) -> Path:
    """``<root>/agents/<agent>``. Raises InvalidAgentId for an unsafe id (checked before any
    path work) or a folder that resolves outside the root (a symlink)."""
    check_agent_id(agent)
    return inside(Path(root) / "agents", agent)


# -------------------------------------------------------------------------- manifest
def codec_key(codec: Mapping[str, object]) -> bytes:
    # JSON, sorted: True and 1 compare equal in Python but are different codecs.
    return msgspec.json.encode(codec, order="sorted")


def _decode_manifest(raw: bytes, path: Path, format_version: int) -> CacheManifest:
    try:
        version = msgspec.json.decode(raw, type=_Versioned).format_version
        if version != format_version:
            raise CacheRejected(
                f"format version {version}, this store reads {format_version}", str(path)
            )
        return msgspec.json.decode(raw, type=CacheManifest)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise CacheRejected(f"malformed manifest: {exc}", str(path)) from None


def _check_manifest(
    manifest: CacheManifest, identity: CacheIdentity | None, agent: str, path: Path
) -> None:
    """Raise CacheRejected unless the manifest is this agent's, whole, and (given an
    identity) made by the same model and codec."""

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
    if m.agent != agent:
        raise refuse(f"manifest belongs to agent {m.agent!r}")
    if m.n_tokens != len(m.token_ids):
        raise refuse(f"manifest says {m.n_tokens} tokens but lists {len(m.token_ids)} ids")
    if not (math.isfinite(m.created) and math.isfinite(m.updated)):
        raise refuse("manifest times are not finite")
    position = 0
    files: set[str] = set()
    for s in m.segments:
        if not SEGMENT_FILE.fullmatch(s.file) or s.file in files:
            raise refuse(f"bad or repeated segment file name {s.file[:80]!r}")
        files.add(s.file)
        if s.start != position or not 0 < s.use <= s.stop - s.start:
            raise refuse(f"segment {s.file} does not continue the tokens at {position}")
        if s.nbytes <= 0 or not _CHECKSUM.fullmatch(s.checksum):
            raise refuse(f"segment {s.file} has a bad size or checksum entry")
        position += s.use
    if position != m.n_tokens:
        raise refuse(f"segments hold {position} tokens, manifest says {m.n_tokens}")


def load_manifest(
    folder: Path, identity: CacheIdentity | None, agent: str
) -> tuple[CacheManifest, int] | None:
    """The checked manifest and its size, or None when there is none."""
    path = folder / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | CLOEXEC | NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CacheRejected(f"cannot open the manifest: {exc.strerror}", str(path)) from None
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CacheRejected(f"manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES}", str(path))
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CacheRejected(f"manifest exceeds {MAX_MANIFEST_BYTES} bytes", str(path))
    version = identity.format_version if identity is not None else FORMAT_VERSION
    manifest = _decode_manifest(raw, path, version)
    _check_manifest(manifest, identity, agent, path)
    return manifest, len(raw)


def read_manifest(
    root: str | os.PathLike[str], identity: CacheIdentity, agent: str
) -> CacheManifest | None:
    """The agent's checked manifest; None when it has no warm cache.

    Raises InvalidAgentId for an unsafe id, CacheRejected for a manifest that is too large,
    malformed, not whole, or made by another model, codec or format version (segment
    files are not read: ``read_cache`` verifies them).
    """
    loaded = load_manifest(agent_dir(root, agent), identity, agent)
    return None if loaded is None else loaded[0]


def warm_info(manifest: CacheManifest, manifest_bytes: int) -> WarmInfo:
    return WarmInfo(
        agent=manifest.agent,
        tokens=manifest.n_tokens,
        nbytes=manifest_bytes + sum(s.nbytes for s in manifest.segments),
        segments=len(manifest.segments),
        updated=manifest.updated,
        model_fingerprint=manifest.model_fingerprint,
        codec=manifest.codec,
    )


def segment_metadata(
    identity: CacheIdentity, agent: str, start: int, stop: int, crc: str
) -> dict[str, str]:
    return {
        "format": "kvactor-warm-segment",
        "format_version": str(identity.format_version),
        "model_fingerprint": identity.model_fingerprint,
        "codec": codec_key(identity.codec).decode(),
        "agent": agent,
        "start": str(start),
        "stop": str(stop),
        "checksum": crc,
    }
