"""Carrying agents between processes and machines: an agent's warm cache exported as one
portable file (the format: ``kvactor.actors.warm`` ``_portable``) to a path, a file or a
stream, and imported from one: where the bytes come from and go to, and the checks a
session makes around them (a name taken, the disk limit and quotas, the hot budget).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio

from ..errors import AgentExists, CacheRejected, StoreWriteError
from ..ids import check_agent_id, namespace_of
from ..warm import (
    MAX_HEADER_BYTES,
    MAX_IMPORT_BYTES,
    CacheIdentity,
    CacheManifest,
    DiskUsage,
    ExpectFn,
    PortableHeader,
    PortableInfo,
    PortableReader,
    SegmentEntry,
    agent_dir,
    mark_ready,
    portable_chunks,
    read_manifest,
    rename_staged,
    staging_dir,
    verify_cache,
    verify_file,
)
from ._model_part import ModelPart

__all__ = (
    "ExportStream",
    "behind",
    "folder_taken",
    "ImportSource",
    "Staged",
    "export_to",
    "kvactor_version",
    "open_export",
    "read_source",
    "write_bytes",
    "write_pieces",
    "stage_import",
)

#: What an import reads: a path, the bytes, a binary file open for reading, or an async
#: iterable of byte pieces (an HTTP body).
ImportSource = (
    str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes] | AsyncIterable[bytes]
)
_FEED = 4 << 20  # bytes handed to the reader's thread at a time
_READ = 1 << 20  # bytes read from an import's file at a time


@functools.cache
def kvactor_version() -> str:
    """This kvactor's version ("" when it is not installed): what an export says made it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvactor")
    except PackageNotFoundError:
        return ""


# ------------------------------------------------------------------------------ export
def _chunks(
    part: ModelPart, name: str, check: Callable[[PortableHeader], None] | None
) -> Iterator[bytes | memoryview]:
    if part.root is None or part.identity is None:
        raise ValueError("exporting an agent needs a warm tier: open the session with a cache_dir")
    return portable_chunks(
        part.root,
        name,
        identity=part.identity,
        tokenizer=part.tokenizer.digest,
        model=part.name,
        version=kvactor_version(),
        sizes=check,
    )


def write_pieces(chunks: Iterable[bytes | memoryview], dest: Any) -> int:
    """Write every piece of an export to ``dest`` (a path: through a temp file renamed at
    the end, so that the path never holds a partial export; a binary file object: as it
    is, flushed at the end); the bytes written."""
    if not isinstance(dest, (str, os.PathLike)):
        if not callable(getattr(dest, "write", None)):
            raise TypeError(f"export to a path or a binary file, not {type(dest).__name__}")
        total = sum(_write_piece(dest, piece) for piece in chunks)
        flush = getattr(dest, "flush", None)
        if callable(flush):
            flush()
        return total
    path = Path(dest)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            total = sum(_write_piece(f, piece) for piece in chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return total


def write_bytes(data: bytes, dest: Any) -> int:
    """Write a whole portable file held in memory to ``dest`` (as ``export_agent`` does)."""
    view = memoryview(data)
    return write_pieces(iter([view[at : at + _FEED] for at in range(0, len(view), _FEED)]), dest)


async def read_source(src: ImportSource, max_bytes: int = MAX_IMPORT_BYTES) -> bytes:
    """The whole of ``src`` (an import's source) in memory, at most ``max_bytes`` past its
    header (a cluster sends it to a host whole). Raises CacheRejected past that."""
    limit = max_bytes + MAX_HEADER_BYTES + 64
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    elif isinstance(src, (str, os.PathLike)):
        data = await anyio.to_thread.run_sync(_read_limited, Path(src), limit)
    elif callable(getattr(src, "read", None)):
        data = await anyio.to_thread.run_sync(src.read, limit + 1)  # type: ignore[union-attr]
    elif isinstance(src, AsyncIterable):
        pieces, size = [], 0
        async for piece in src:
            pieces.append(bytes(piece))
            size += len(piece)
            if size > limit:
                break
        data = b"".join(pieces)
    else:
        raise TypeError(f"import from a path, bytes, a file or an async iterable, not {src!r}")
    if len(data) > limit:
        raise CacheRejected(f"the file has more than the {max_bytes} bytes this import takes")
    return data


def _read_limited(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit + 1)


def _write_piece(f: Any, piece: bytes | memoryview) -> int:
    f.write(piece)
    return len(piece)


@dataclass
class ExportStream:
    """An export under way: its ``header`` (known before the first byte is sent), then
    its bytes (``async for``). Leaving early closes the agent's files."""

    header: PortableHeader
    _first: bytes | memoryview
    _rest: Iterator[bytes | memoryview]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            yield bytes(self._first)
            while True:
                piece = await anyio.to_thread.run_sync(next, self._rest, None)
                if piece is None:
                    return
                yield bytes(piece)
        finally:
            self._rest.close()  # type: ignore[attr-defined]


async def open_export(
    part: ModelPart, name: str, check: Callable[[PortableHeader], None] | None = None
) -> ExportStream:
    """Agent ``name``'s export as a stream; raises (UnknownAgent, CacheRejected, what
    ``check`` raises) before its first byte."""
    seen: list[PortableHeader] = []

    def hear(header: PortableHeader) -> None:
        if check is not None:
            check(header)
        seen.append(header)

    chunks = _chunks(part, name, hear)
    first = await anyio.to_thread.run_sync(next, chunks)
    return ExportStream(seen[0], first, chunks)


async def export_to(
    part: ModelPart, name: str, dest: Any, check: Callable[[PortableHeader], None] | None = None
) -> PortableInfo:
    """Write agent ``name``'s export to ``dest`` (a path or a binary file)."""
    seen: list[PortableHeader] = []

    def hear(header: PortableHeader) -> None:
        if check is not None:
            check(header)
        seen.append(header)

    def run() -> int:
        return write_pieces(_chunks(part, name, hear), dest)

    nbytes = await anyio.to_thread.run_sync(run)
    header = seen[0]
    return PortableInfo(header.agent, header.tokens, nbytes, header.nbytes)


def behind(messages: int, header: PortableHeader) -> None:
    """Raise StoreWriteError when the agent's conversation (``messages`` long) has turns
    its warm cache on disk lacks (their write failed): the export would lose them."""
    if header.messages < messages:
        raise StoreWriteError(
            f"agent {header.agent!r}'s last turns are not on disk ({header.messages} of "
            f"{messages} messages: their write failed); its export would lose them. Take "
            "another turn once the disk has room, then export"
        )


# ------------------------------------------------------------------------------ import
@dataclass
class Staged:
    """An import read and verified, waiting in ``staging`` to be moved into place."""

    staging: Path
    header: PortableHeader
    name: str
    nbytes: int  # the portable file's
    manifest: CacheManifest  # verified, under ``name``

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


async def stage_import(
    part: ModelPart,
    src: ImportSource,
    name: str | None,
    *,
    taken: Callable[[str], bool],
    usage: DiskUsage | None,
    budget: int | None,
    max_bytes: int = MAX_IMPORT_BYTES,
) -> Staged:
    """Read ``src`` into a staging folder of ``part``'s warm tier and verify it as a warm
    load does, under ``name`` (None: the name it was exported under). ``taken(name)``:
    whether an agent of that name is in the way (refused before any byte of a file is
    written); ``usage`` and ``budget``: the disk limit and quotas, and the hot budget, an
    import must fit. Raises CacheRejected with the reason, ValueError for a name taken;
    nothing stays of a refused import."""
    root, identity, layout = part.root, part.identity, part.layout
    if root is None or identity is None or layout is None:
        raise ValueError("importing an agent needs a warm tier: open the session with a cache_dir")
    if name is not None:
        check_agent_id(name)
    staging = staging_dir(root)

    def check(header: PortableHeader) -> None:
        target = check_agent_id(name or header.agent)
        if taken(target):
            raise AgentExists(
                f"agent {target!r} already exists: import with replace=True to replace it, "
                "or under another name"
            )
        _fits(header, target, usage, budget)

    checker = _FileChecker(staging, identity, layout)
    reader = PortableReader(
        staging,
        identity,
        tokenizer=part.tokenizer.digest,
        max_bytes=max_bytes,
        check=check,
        on_file=checker.check,
    )
    try:
        await _feed(src, reader)

        def verify() -> tuple[Path, PortableHeader, CacheManifest]:
            header = reader.finish()
            reader.sync_staged()  # each file checked and flushed as it was staged
            # The whole as a warm load checks it, the files checked above trusted.
            try:
                manifest = checker.whole() or verify_cache(
                    staging, identity, layout, header.agent, trusted=checker.checked
                )
            except FileNotFoundError as exc:
                raise CacheRejected(
                    f"not a sound agent file: its manifest names {Path(str(exc.filename)).name}, "
                    "which it does not hold"
                ) from None
            manifest = rename_staged(staging, manifest, header, name or header.agent)
            return mark_ready(staging), header, manifest

        ready, header, manifest = await anyio.to_thread.run_sync(verify)
    except BaseException:
        reader.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Staged(ready, header, manifest.agent, reader.nbytes, manifest)


class _FileChecker:
    """Checks each file of an import as a warm load does, as soon as it is staged (in
    the reader's worker threads, while the next bytes are read): the manifest parsed
    once, each segment's header against it (the file's data was summed as it was
    written: it is not read again). ``checked``: the manifest's entries of the files
    checked, which ``verify_cache`` then trusts."""

    def __init__(self, staging: Path, identity: CacheIdentity, layout: ExpectFn) -> None:
        self.staging, self.identity, self.layout = staging, identity, layout
        self.checked: dict[str, SegmentEntry] = {}
        self._manifest: CacheManifest | None = None
        self._sums: dict[str, str] = {}
        self._lock = threading.Lock()

    def check(self, header: PortableHeader, file: str) -> None:
        if file == header.files[0].name:
            return  # the manifest: read with the first segment (or by verify_cache)
        with self._lock:  # every file after the manifest is staged after it
            if self._manifest is None:
                self._manifest = read_manifest(self.staging, self.identity, header.agent)
                self._sums = {f.name: f.checksum for f in header.files}
            manifest = self._manifest
        if manifest is None:
            raise CacheRejected("the agent file holds no manifest")
        entry = verify_file(
            self.staging, self.identity, self.layout, manifest, file, self._sums[file]
        )
        if entry is not None:
            with self._lock:
                self.checked[file] = entry

    def whole(self) -> CacheManifest | None:
        """The manifest, when every file it names was checked as it was staged (then
        nothing is left to check); else None (``verify_cache`` checks the rest)."""
        manifest = self._manifest
        if manifest is None:
            return None
        named = manifest.all_segments
        if len(named) != len(self.checked) or any(self.checked.get(s.file) != s for s in named):
            return None
        return manifest


def _fits(header: PortableHeader, name: str, usage: DiskUsage | None, budget: int | None) -> None:
    """Refuse an import that could never fit: past the disk limit or its namespace's quota
    on its own, or more than the hot budget holds."""
    size = header.nbytes
    if usage is not None and usage.limit is not None and size > usage.limit:
        raise CacheRejected(
            f"its {size} bytes of cache are more than the warm tier's disk limit "
            f"({usage.limit} bytes)"
        )
    space = namespace_of(name)
    if usage is not None and usage.quota is not None and space is not None and size > usage.quota:
        raise CacheRejected(
            f"its {size} bytes of cache are more than the disk quota of {space!r} "
            f"({usage.quota} bytes)"
        )
    hot = size - header.files[0].size  # the segments: as the hot tier holds them
    if budget is not None and hot > budget:
        raise CacheRejected(
            f"its cache takes {hot} bytes in memory, more than the hot budget ({budget} "
            "bytes): it could never be resumed warm here"
        )


async def _feed(src: ImportSource, reader: PortableReader) -> None:
    if isinstance(src, (bytes, bytearray, memoryview)):
        await anyio.to_thread.run_sync(reader.feed, src)
    elif isinstance(src, (str, os.PathLike)):
        await anyio.to_thread.run_sync(_feed_file, Path(src), reader)
    elif callable(getattr(src, "read", None)):
        await anyio.to_thread.run_sync(_feed_reads, src, reader)
    elif isinstance(src, AsyncIterable):
        await _feed_pieces(src, reader)
    else:
        raise TypeError(
            "import from a path, bytes, a binary file or an async iterable of bytes, "
            f"not {type(src).__name__}"
        )


def _feed_file(path: Path, reader: PortableReader) -> None:
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        raise FileNotFoundError(f"no agent file {path}") from None
    with f:
        # The kernel reads the rest of the file ahead while each piece (a MiB: the pieces
        # overlap best so) is hashed and staged.
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        _feed_reads(f, reader)


def _feed_reads(f: Any, reader: PortableReader) -> None:
    while piece := f.read(_READ):
        if not isinstance(piece, (bytes, bytearray, memoryview)):
            raise TypeError("import from a file opened in binary mode")
        reader.feed(piece)


async def _feed_pieces(src: AsyncIterable[bytes], reader: PortableReader) -> None:
    pending: list[bytes] = []
    size = 0
    async for piece in src:
        if not isinstance(piece, (bytes, bytearray, memoryview)):
            raise TypeError(f"an import stream yields bytes, not {type(piece).__name__}")
        pending.append(bytes(piece))
        size += len(piece)
        if size >= _FEED:
            await anyio.to_thread.run_sync(reader.feed, b"".join(pending))
            pending, size = [], 0
    if pending:
        await anyio.to_thread.run_sync(reader.feed, b"".join(pending))


def folder_taken(root: Path | None, name: str) -> bool:
    """Whether ``root`` has a folder for agent ``name`` (a warm, cold or refused cache)."""
    return root is not None and os.path.lexists(agent_dir(root, name))
