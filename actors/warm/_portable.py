"""An agent you can carry: its warm cache as one portable file, written and read as a
stream (a file, a pipe, an HTTP body), every byte checksummed.

Layout (integers little-endian)::

    MAGIC                       b"kvactor-agent\\n"
    u32 H                       the header's length (at most MAX_HEADER_BYTES)
    header                      JSON: a PortableHeader (identity, agent, the files)
    u64                         XXH3-64 of the header
    files                       each file's bytes, in the header's order
    u64                         XXH3-64 of every byte before it (the whole file)

The files are the agent's folder as the warm tier keeps it: ``manifest.json`` first, then
its segment, window and state files, whole (a fork's shared segments included: a portable
file stands alone). The header says each file's size and checksum (``xxh3t``: the
warm tier's own, so a segment's is copied from its manifest, not computed again) and what
the cache was made with: model and tokenizer fingerprint, codec, geometry, format. A
reader refuses another model, tokenizer or codec, a newer format, and sizes past its
limit from the header alone, before it reads a file; it writes the files into a staging
folder as they come, each summed on the way, and refuses a file whose sum differs, a
stream that ends early or goes on past its end. What it staged is then verified as a warm
load verifies a cache (``verify_cache``: manifest, headers, shapes, metadata) and only
then moved into place (``install_import``), so a refused file leaves nothing behind.

Why not tar (the standard library's ``tarfile`` streams too): its headers carry a
6-digit octal sum and its padding none, so it would need this file's checksums anyway,
and a second pass to sum files before their headers; the framing here is a few lines.
Everything here blocks: callers run it off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from ..errors import CacheRejected, CacheTooLarge, UnknownAgent
from ..ids import check_agent_id
from ._checksum import TreeHasher
from ._durable import fsync_dir, sync
from ._fileio import CLOEXEC, NOFOLLOW, open_regular
from ._manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SEGMENT_FILES,
    CacheIdentity,
    CacheManifest,
    codec_key,
    encode_manifest,
    parse_manifest,
)
from ._paths import agent_dir, contained

__all__ = (
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_IMPORT_BYTES",
    "PORTABLE_VERSION",
    "PortableFile",
    "PortableHeader",
    "PortableInfo",
    "PortableReader",
    "install_import",
    "mark_ready",
    "portable_chunks",
    "read_header",
    "rename_staged",
    "settle_imports",
    "staging_dir",
)

MAGIC = b"kvactor-agent\n"
PORTABLE_VERSION = 1  #: the portable format written now (readers take it and older)
MAX_HEADER_BYTES = 1 << 20
#: The most bytes an import takes by default (a 128K-token cache of a large model is a
#: few GB); a server passes its own limit.
MAX_IMPORT_BYTES = 64 << 30
_CHUNK = 1 << 20  # bytes per piece written or staged
_MAX_FILES = 1 << 16
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
#: Marks a staging folder whose agent is verified: a crash while it is moved into place
#: finishes the move at the next open (``settle_imports``).
_STAGING, _READY = "import-", "ready-"


class PortableFile(msgspec.Struct, frozen=True):
    """One file of an agent's folder: its name, size and ``xxh3t`` checksum."""

    name: str
    size: int
    checksum: str


class PortableHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a portable file carries besides the bytes: the agent, what its cache was made
    with, and its files. ``tokenizer`` and ``vocab_size`` are empty / 0 when the exporter
    did not have the model loaded (``kvactor export`` reads the folder only); the model
    fingerprint covers the tokenizer either way."""

    portable_version: int
    agent: str
    tokens: int
    cache_format: int
    model_fingerprint: str
    codec: dict[str, int | bool | str]
    geometry: list[list[int]]
    states: list[dict[str, Any]] = []
    tokenizer: str = ""
    vocab_size: int = 0
    model: str = ""
    messages: int = 0  # the conversation's length (its text is in the manifest)
    exported: float = 0.0
    kvactor: str = ""
    files: list[PortableFile] = []

    @property
    def nbytes(self) -> int:
        """The bytes of its files."""
        return sum(f.size for f in self.files)


class PortableInfo(msgspec.Struct, frozen=True):
    """An export or import done: the agent, its tokens, the portable file's bytes."""

    agent: str
    tokens: int
    nbytes: int
    cache_bytes: int  # of those, the agent's files (manifest and segments)


def _is_cache_file(name: str) -> bool:
    return name == MANIFEST or any(p.fullmatch(name) for p in SEGMENT_FILES)


# ------------------------------------------------------------------------------ write
def _open_snapshot(folder: Path, agent: str) -> tuple[bytes, CacheManifest, dict[str, int]]:
    """The manifest's bytes, the manifest, and a descriptor per file it names, all of one
    commit: files are never rewritten, so once open they hold that commit's bytes even if
    a later one removes them; a file removed before it was opened means a newer commit,
    and the manifest is read again."""
    for _ in range(8):
        try:
            fd, _ = open_regular(folder / MANIFEST, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise UnknownAgent(f"agent {agent!r} has no warm cache in {folder.parent}") from None
        with open(fd, "rb", closefd=True) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        manifest = parse_manifest(raw, folder / MANIFEST, None, agent)
        fds: dict[str, int] = {}
        try:
            for entry in manifest.all_segments:
                fds[entry.file], _ = open_regular(folder / entry.file, 1 << 40)
        except BaseException as exc:
            for opened in fds.values():
                os.close(opened)
            if isinstance(exc, FileNotFoundError):
                continue
            raise
        return raw, manifest, fds
    raise CacheRejected(f"agent {agent!r}'s cache kept changing while it was exported")


def portable_chunks(
    root: str | os.PathLike[str],
    agent: str,
    *,
    identity: CacheIdentity | None = None,
    tokenizer: str = "",
    model: str = "",
    version: str = "",
    sizes: Callable[[PortableHeader], None] | None = None,
) -> Iterator[bytes | memoryview]:
    """Agent ``agent``'s warm cache under ``root`` as a portable file, in pieces of at most
    1 MiB, read from one commit of its folder (a turn may commit meanwhile). ``identity``
    and ``tokenizer``: the exporting session's (checked against the manifest; None: taken
    from the manifest, vocabulary unknown). ``sizes`` hears the header before the first
    piece. Raises UnknownAgent (no warm cache), CacheRejected (its manifest or a file
    fails a check: a corrupt source is never exported as sound; found mid-stream, the
    stream stops before its end, which every reader refuses)."""
    folder = agent_dir(root, agent)
    raw, manifest, fds = _open_snapshot(folder, agent)
    try:
        if identity is not None and manifest.model_fingerprint != identity.model_fingerprint:
            raise CacheRejected(f"agent {agent!r}'s cache was made by another model", str(folder))
        files = [PortableFile(MANIFEST, len(raw), _tree(raw))]
        for entry in manifest.all_segments:
            size = os.fstat(fds[entry.file]).st_size
            checksum = entry.checksum
            if not checksum.startswith("xxh3t:") or size != entry.nbytes:
                checksum = _fd_checksum(fds[entry.file])  # format 2, or a file to refuse
            files.append(PortableFile(entry.file, size, checksum))
        header = PortableHeader(
            portable_version=PORTABLE_VERSION,
            agent=agent,
            tokens=manifest.n_tokens,
            cache_format=manifest.format_version,
            model_fingerprint=manifest.model_fingerprint,
            codec=manifest.codec,
            geometry=manifest.layer_geometry(),
            states=manifest.states,
            tokenizer=tokenizer,
            vocab_size=identity.vocab_size if identity is not None else 0,
            model=model,
            messages=len(manifest.messages),
            exported=time.time(),
            kvactor=version,
            files=files,
        )
        if sizes is not None:
            sizes(header)
        yield from _framed(header, raw, fds, folder)
    finally:
        for fd in fds.values():
            os.close(fd)


def _framed(
    header: PortableHeader, raw: bytes, fds: dict[str, int], folder: Path
) -> Iterator[bytes | memoryview]:
    whole = xxhash.xxh3_64()

    def out(data: bytes | memoryview) -> bytes | memoryview:
        whole.update(data)
        return data

    body = msgspec.json.encode(header)
    yield out(MAGIC + _LEN.pack(len(body)) + body + _SUM.pack(xxhash.xxh3_64_intdigest(body)))
    yield out(raw)
    for file in header.files[1:]:
        fd, hasher, got = fds[file.name], TreeHasher(), 0
        os.lseek(fd, 0, os.SEEK_SET)
        while got < file.size:
            buffer = bytearray(min(_CHUNK, file.size - got))  # its own: the consumer keeps it
            n = os.readv(fd, [buffer])
            if not n:
                raise CacheRejected(f"{file.name} shrank while it was exported", str(folder))
            piece = memoryview(buffer)[:n]
            hasher.update(piece)
            got += n
            yield out(piece)
        if hasher.checksum() != file.checksum:
            raise CacheRejected(
                f"{file.name} does not match its checksum: the source cache is corrupt",
                str(folder),
            )
    yield _SUM.pack(whole.intdigest())


def _tree(data: bytes) -> str:
    hasher = TreeHasher()
    hasher.update(data)
    return hasher.checksum()


def _fd_checksum(fd: int) -> str:
    hasher = TreeHasher()
    os.lseek(fd, 0, os.SEEK_SET)
    while piece := os.read(fd, _CHUNK):
        hasher.update(piece)
    return hasher.checksum()


# ------------------------------------------------------------------------------- read
class PortableReader:
    """Reads a portable file pushed to it in pieces of any size (``feed``, then
    ``finish``) into ``<staging>/agents/<agent>/``, checking as it goes.

    ``identity`` and ``tokenizer``: what the cache must have been made with;
    ``max_bytes``: the most bytes of files it takes; ``check(header)``: the caller's own
    refusals (a name taken, a limit) before any file is written; ``on_file(header,
    name)``: the caller's own check of each file once staged and summed, in a worker thread (its
    error is raised by ``sync_staged``). Raises CacheRejected
    with the reason at the first byte that proves the file wrong (nothing staged is
    kept: the caller removes ``staging``)."""

    def __init__(
        self,
        staging: Path,
        identity: CacheIdentity,
        *,
        tokenizer: str = "",
        max_bytes: int = MAX_IMPORT_BYTES,
        check: Callable[[PortableHeader], None] | None = None,
        on_file: Callable[[PortableHeader, str], None] | None = None,
    ) -> None:
        self.staging = staging
        self.identity = identity
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.check = check
        self.header: PortableHeader | None = None
        self.nbytes = 0  # bytes taken so far
        self._whole = xxhash.xxh3_64()
        self._pending = bytearray()  # a frame's bytes not yet complete
        self._need = len(MAGIC) + _LEN.size  # bytes the current frame needs
        self._step: Callable[[bytes], None] = self._magic
        self._file = 0  # the index of the file being staged
        self._fd: int | None = None
        self._left = 0  # bytes of that file still to come
        self._hasher = TreeHasher()
        self._done = False
        self.on_file = on_file
        # Each staged file is checked (``on_file``) and flushed to disk by worker threads
        # as soon as its last byte is written, while the next is read and staged; the
        # manifest's flush waits for the last file's, to share its commit to the disk.
        self._workers: ThreadPoolExecutor | None = None
        self._jobs: list[Future[None]] = []
        self._held: int | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the stream."""
        view = memoryview(data).cast("B")
        self.nbytes += view.nbytes
        while view.nbytes:
            if self._done:
                raise self._refuse("bytes after the end of the file")
            if self._fd is not None:
                take = min(self._left, view.nbytes)
                self._stage(view[:take])
                view = view[take:]
                continue
            take = min(self._need - len(self._pending), view.nbytes)
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) == self._need:
                frame, self._pending = bytes(self._pending), bytearray()
                self._step(frame)

    def finish(self) -> PortableHeader:
        """The stream ended: its header, once every file is staged and the whole sum
        checked. Raises CacheRejected for a stream that ended early."""
        if not self._done:
            self.close()
            where = "in the header"
            if self.header is not None:
                files = self.header.files
                where = f"in {files[self._file].name}" if self._file < len(files) else "at its end"
            raise self._refuse(f"truncated {where} (after {self.nbytes} bytes)")
        assert self.header is not None
        return self.header

    def sync_staged(self) -> None:
        """Wait for each staged file's check and flush (begun as each was staged), then
        make their folder durable (after ``finish``). Raises the first check's error."""
        assert self._done and self.header is not None
        try:
            for job in self._jobs:
                job.result()
        finally:
            self._stop_workers()
        fsync_dir(agent_dir(self.staging, self.header.agent))

    def close(self) -> None:
        """Close the files being staged and wait for the work under way (a stream given
        up, or done with)."""
        for fd in (self._fd, self._held):
            if fd is not None:
                os.close(fd)
        self._fd = self._held = None
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._workers = None

    def _refuse(self, reason: str) -> CacheRejected:
        return CacheRejected(f"not a sound agent file: {reason}")

    def _frame(self, need: int, step: Callable[[bytes], None]) -> None:
        self._need, self._step = need, step

    def _magic(self, frame: bytes) -> None:
        self._whole.update(frame)
        if not frame.startswith(MAGIC):
            raise CacheRejected("not a kvactor agent file (no kvactor-agent signature)")
        (length,) = _LEN.unpack(frame[len(MAGIC) :])
        if length > MAX_HEADER_BYTES:
            raise self._refuse(f"a header of {length} bytes (the most is {MAX_HEADER_BYTES})")
        self._frame(length + _SUM.size, self._header)

    def _header(self, frame: bytes) -> None:
        self._whole.update(frame)
        body, said = frame[: -_SUM.size], _SUM.unpack(frame[-_SUM.size :])[0]
        if xxhash.xxh3_64_intdigest(body) != said:
            raise self._refuse("the header does not match its checksum")
        version = _version_of(body)
        if version > PORTABLE_VERSION:
            raise CacheRejected(
                f"written by a newer kvactor (portable format {version}; this one reads "
                f"{PORTABLE_VERSION} and older): upgrade kvactor to import it"
            )
        try:
            header = msgspec.json.decode(body, type=PortableHeader)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise self._refuse(f"a malformed header: {exc}") from None
        self._check(header)
        if self.check is not None:
            self.check(header)
        self.header = header
        folder = agent_dir(self.staging, header.agent)
        folder.mkdir(parents=True)
        self._next_file()

    def _check(self, h: PortableHeader) -> None:
        """Refuse another model, tokenizer, codec or geometry, a newer cache format, and
        files the header cannot honestly hold, before any is written."""
        ident = self.identity
        check_agent_id(h.agent)
        if h.cache_format not in ident.readable():
            newer = h.cache_format > ident.format_version
            raise CacheRejected(
                f"its cache is of format {h.cache_format}; this kvactor reads "
                f"{' and '.join(map(str, ident.readable()))}"
                + (": upgrade kvactor to import it" if newer else "")
            )
        if h.tokenizer and self.tokenizer and h.tokenizer != self.tokenizer:
            raise CacheRejected(
                f"made with another tokenizer ({h.tokenizer[:12]}, this model's is "
                f"{self.tokenizer[:12]}): its token ids mean other text here"
            )
        if h.model_fingerprint != ident.model_fingerprint:
            named = f" ({h.model})" if h.model else ""
            raise CacheRejected(
                f"made by another model {h.model_fingerprint[:12]}{named}; this session "
                f"runs {ident.model_fingerprint[:12]}"
            )
        if codec_key(h.codec) != codec_key(ident.codec):
            raise CacheRejected(f"made with codec {h.codec}, this session uses {ident.codec}")
        if h.geometry != ident.layer_geometry() or h.states != ident.states:
            raise CacheRejected("made for another layer geometry than this model's")
        names = [f.name for f in h.files]
        if not names or names[0] != MANIFEST:
            raise self._refuse(f"its first file is not {MANIFEST}")
        if len(names) > _MAX_FILES or len(set(names)) != len(names):
            raise self._refuse("too many files, or a file named twice")
        for f in h.files:
            if not _is_cache_file(f.name):
                raise self._refuse(f"{f.name[:80]!r} is not a cache file's name")
            if f.size < 0 or not f.checksum.startswith("xxh3t:"):
                raise self._refuse(f"{f.name}: a bad size or checksum")
        if h.files[0].size > MAX_MANIFEST_BYTES:
            raise self._refuse(f"a manifest of {h.files[0].size} bytes")
        if h.nbytes > self.max_bytes:
            raise CacheTooLarge(
                f"its {h.nbytes} bytes of cache are more than this import takes ({self.max_bytes})"
            )

    def _next_file(self) -> None:
        assert self.header is not None and self._fd is None
        files = self.header.files
        if self._file >= len(files):
            self._frame(_SUM.size, self._trailer)
            return
        file = files[self._file]
        path = agent_dir(self.staging, self.header.agent) / file.name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW
        self._fd = os.open(path, flags, 0o644)
        self._left, self._hasher = file.size, TreeHasher()
        if not self._left:
            self._file_done()

    def _stage(self, piece: memoryview) -> None:
        assert self._fd is not None
        self._whole.update(piece)
        self._hasher.update(piece)
        self._left -= piece.nbytes
        while piece.nbytes:
            piece = piece[os.write(self._fd, piece) :]
        if not self._left:
            self._file_done()

    def _file_done(self) -> None:
        assert self.header is not None and self._fd is not None
        file = self.header.files[self._file]
        if self._hasher.checksum() != file.checksum:
            raise self._refuse(f"{file.name} does not match its checksum")
        if self._workers is None:
            self._workers = ThreadPoolExecutor(3, "kvactor-import")
        if self.on_file is not None:
            self._jobs.append(self._workers.submit(self.on_file, self.header, file.name))
        fd, self._fd = self._fd, None
        if self._file == 0 and len(self.header.files) > 1:
            self._held = fd
        else:
            self._jobs.append(self._workers.submit(_sync_close, fd))
            if self._file == len(self.header.files) - 1 and self._held is not None:
                self._jobs.append(self._workers.submit(_sync_close, self._held))
                self._held = None
        self._file += 1
        self._next_file()

    def _trailer(self, frame: bytes) -> None:
        if _SUM.unpack(frame)[0] != self._whole.intdigest():
            raise self._refuse("the file does not match its checksum")
        self._done = True


def _sync_close(fd: int) -> None:
    try:
        sync(fd)
    finally:
        os.close(fd)


def read_header(data: bytes | memoryview) -> PortableHeader:
    """The header of the portable file that ``data`` begins with (its framing and checksum
    checked; nothing else). Raises CacheRejected."""
    view = memoryview(data).cast("B")
    start = len(MAGIC) + _LEN.size
    if view[: len(MAGIC)].tobytes() != MAGIC:
        raise CacheRejected("not a kvactor agent file (no kvactor-agent signature)")
    if view.nbytes < start:
        raise CacheRejected("not a sound agent file: truncated in the header")
    (length,) = _LEN.unpack(view[len(MAGIC) : start])
    if length > MAX_HEADER_BYTES or view.nbytes < start + length + _SUM.size:
        raise CacheRejected("not a sound agent file: truncated or oversized header")
    body = view[start : start + length].tobytes()
    said = _SUM.unpack(view[start + length : start + length + _SUM.size])[0]
    if xxhash.xxh3_64_intdigest(body) != said:
        raise CacheRejected("not a sound agent file: the header does not match its checksum")
    if _version_of(body) > PORTABLE_VERSION:
        raise CacheRejected("written by a newer kvactor: upgrade kvactor to import it")
    try:
        return msgspec.json.decode(body, type=PortableHeader)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise CacheRejected(f"not a sound agent file: a malformed header: {exc}") from None


class _Versioned(msgspec.Struct):
    portable_version: int


def _version_of(body: bytes) -> int:
    try:
        return msgspec.json.decode(body, type=_Versioned).portable_version
    except (msgspec.DecodeError, RecursionError):
        raise CacheRejected("not a sound agent file: a malformed header") from None


# ---------------------------------------------------------------------------- install
def staging_dir(root: str | os.PathLike[str]) -> Path:
    """A new folder name under ``<root>/incoming/`` for an import to stage into."""
    return contained(root, "incoming", f"{_STAGING}{secrets.token_hex(8)}")


def rename_staged(
    staging: Path, manifest: CacheManifest, header: PortableHeader, name: str
) -> CacheManifest:
    """Put the staged agent of ``header`` (its verified ``manifest``) under its new
    ``name`` (nothing to do for its own): its folder renamed, its manifest rewritten for
    ``name`` (each segment naming the agent it was written for, as a fork's do: their
    headers say so). Returns the manifest as it is now."""
    if name == header.agent:
        return manifest
    old = agent_dir(staging, header.agent)
    owned = [
        [msgspec.structs.replace(s, owner=s.owner or header.agent) for s in entries]
        for entries in (manifest.segments, manifest.window_segments, manifest.state_segments)
    ]
    renamed = msgspec.structs.replace(
        manifest,
        agent=name,
        segments=owned[0],
        window_segments=owned[1],
        state_segments=owned[2],
    )
    new = agent_dir(staging, name)
    os.rename(old, new)
    path = new / MANIFEST
    os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW, 0o644)
    try:
        data = memoryview(encode_manifest(renamed))
        while data.nbytes:
            data = data[os.write(fd, data) :]
        sync(fd)
    finally:
        os.close(fd)
    fsync_dir(new)
    return renamed


def mark_ready(staging: Path) -> Path:
    """Say that the agent staged in ``staging`` (``import-<hex>``) is verified: the folder
    becomes ``ready-<hex>`` (one rename, made durable), which ``settle_imports`` moves into
    place after a crash. Returns its new path."""
    ready = staging.with_name(_READY + staging.name[len(_STAGING) :])
    os.rename(staging, ready)
    fsync_dir(ready.parent)
    return ready


def install_import(root: str | os.PathLike[str], staging: Path, name: str) -> None:
    """Move the verified agent ``name`` staged in ``staging`` (ready) into
    ``<root>/agents/``, replacing the agent of that name there if any; ``staging`` is
    removed. A crash before the move is durable leaves the ready folder, and a crash
    between the two renames of a replace leaves the old folder aside in it: either way
    ``settle_imports`` finishes the move at the next open, so the agent is the old one or
    the new one, never neither once settled (no fsync here: that is what makes it so)."""
    target = agent_dir(root, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        os.rename(target, staging / "replaced")
    os.rename(agent_dir(staging, name), target)
    try:  # what is left: empty folders, unless an agent was replaced
        os.rmdir(staging / "agents")
        os.rmdir(staging)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def settle_imports(root: str | os.PathLike[str]) -> int:
    """At open (the root locked): finish the imports a crash stopped after their agent was
    verified (moved into place unless an agent of that name is there), and remove every
    other staging folder. Returns how many it finished."""
    incoming = contained(root, "incoming")
    if not incoming.is_dir():
        return 0
    done = 0
    for entry in sorted(os.listdir(incoming)):
        staging = incoming / entry
        if not entry.startswith((_STAGING, _READY)) or not staging.is_dir():
            continue
        if entry.startswith(_READY):
            with contextlib.suppress(OSError, ValueError):
                names = os.listdir(staging / "agents")
                name = check_agent_id(names[0]) if len(names) == 1 else ""
                if name and not agent_dir(root, name).exists():
                    install_import(root, staging, name)
                    done += 1
        shutil.rmtree(staging, ignore_errors=True)
    return done
