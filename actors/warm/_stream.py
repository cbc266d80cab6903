"""A warm cache streamed into the engine's arrays, a layer at a time (a layer-streamed load).

``plan_stream`` opens an agent's segment files and checks their headers and metadata as a
whole read does (``_read``), but reads none of their data. The engine then allocates the
arrays the cache will live in and hands their host views to :meth:`StreamedRead.start`:
the reader threads read each 1 MiB piece of each file straight into them (``os.preadv``,
scattered over the tensors the piece covers) and sum it as they go, the pieces in the
order of the layers they hold. A layer's bytes are there once every piece holding them
is (:meth:`StreamedRead.wait_layer`), so the engine's first forward runs layer l while
later layers are still on their way. A file's checksum (the tree of its pieces' sums,
``_checksum``) is known when its last piece lands: :meth:`StreamedRead.wait` says
whether every file matched, and the engine answers nothing before it has (a cache that
fails is dropped and its agent stages it again; the store then reads it whole, refuses it
with the reason, and the agent goes on cold).

The threads write bytes only, into memory the engine allocated and keeps: no MLX call
runs anywhere but on the engine's thread. Everything here blocks except ``start``.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..errors import CacheRejected, UnknownAgent
from ._checksum import PIECE, tree_checksum
from ._fileio import ShortRead, in_background
from ._manifest import CacheIdentity, CacheManifest, ExpectFn, SegmentKind, load_manifest
from ._paths import agent_dir
from ._read import _planned, _read_errors, open_segment

__all__ = ("StreamedRead", "plan_stream")

#: The dtypes a host view of an engine array can take (bfloat16 has none in numpy).
_STREAMED = frozenset({"uint8", "uint16", "uint32", "int32", "float16", "float32"})
_IOV_MAX = 512  # buffers per preadv call (Linux takes 1024)


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a file: its bytes ``[begin, end)``, the shape the cache keeps of it
    (a prefix along one axis where the cache uses fewer tokens than the file holds: then
    ``rows``, the rows of the axes before that one, each kept in part; 0 when it is kept
    whole), its dtype name and the layer it belongs to."""

    name: str
    layer: int
    begin: int
    end: int
    want: tuple[int, ...]
    rows: int
    dtype: str


@dataclass
class _File:
    """One segment file being read: its descriptor (closed when its last piece lands),
    its tokens kept, its tensors in file order, its pieces' sums as they come."""

    name: str
    fd: int
    size: int
    checksum: str
    start: int
    stop: int
    data_start: int
    tensors: list[_Tensor]
    digests: list[int] = field(default_factory=list)
    left: int = 0
    views: Mapping[str, np.ndarray[Any, Any]] = field(default_factory=dict)  # while it reads
    begins: list[int] = field(default_factory=list)  # the tensors' offsets, for bisect

    def pieces(self) -> int:
        return max(-(-self.size // PIECE), 1)


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _cut_axis(shape: tuple[int, ...], want: tuple[int, ...]) -> int | None:
    """The one axis along which ``want`` is a prefix of ``shape`` (-1: the same shape);
    None where it is not a prefix along one axis."""
    if shape == want:
        return -1
    if len(shape) != len(want) or any(w > s for w, s in zip(want, shape, strict=True)):
        return None
    cut = [i for i, (w, s) in enumerate(zip(want, shape, strict=True)) if w != s]
    return -1 if not cut else cut[0] if len(cut) == 1 else None


def plan_stream(
    root: str | os.PathLike[str], identity: CacheIdentity, expect: ExpectFn, agent: str
) -> StreamedRead | None:
    """The agent's warm cache ready to stream (its files open, their headers and metadata
    checked); None where it cannot stream: a sliding-window or recurrent model's cache
    (window and state files), format-2 files (one CRC over the whole file), a dtype
    with no host view, a file cut along more than one axis. Raises UnknownAgent,
    CacheRejected (a header, size or metadata check failed: the caller reads it whole to
    refuse it with the reason) and FileNotFoundError."""
    folder = agent_dir(root, agent)
    loaded = load_manifest(folder, identity, agent)
    if loaded is None:
        raise UnknownAgent(f"agent {agent!r} has no warm cache under {root}")
    manifest = loaded[0]
    if manifest.window_segments or manifest.state_segments:
        return None
    files: list[_File] = []
    try:
        for kind, entry, path, layout in _planned(folder, manifest, identity, expect):
            if kind != SegmentKind.SEGMENT or not entry.checksum.startswith("xxh3t:"):
                raise _NotStreamed
            expected = layout(entry.start, entry.stop)
            kept = layout(entry.start, entry.start + entry.use)
            if not _STREAMED.issuperset({dtype for _, dtype in expected.values()}):
                raise _NotStreamed
            fd, parsed = open_segment(
                path, entry, expected, identity, agent, manifest.format_version
            )
            file = _File(
                name=entry.file,
                fd=fd,
                size=entry.nbytes,
                checksum=entry.checksum,
                start=entry.start,
                stop=entry.start + entry.use,
                data_start=parsed.spans[0][0] if parsed.spans else entry.nbytes,
                tensors=[],
            )
            files.append(file)
            for begin, end, name, _, shape in parsed.spans:
                want, dtype = kept[name]  # the header's dtype: checked to be this one
                axis = _cut_axis(shape, want)
                if axis is None:
                    raise _NotStreamed
                rows = math.prod(shape[:axis]) if axis >= 0 else 0
                file.tensors.append(_Tensor(name, _layer_of(name), begin, end, want, rows, dtype))
    except _NotStreamed:
        _close(files)
        return None
    except BaseException:
        _close(files)
        raise
    return StreamedRead(agent, manifest, files, identity.n_layers)


class _NotStreamed(Exception):
    """This cache is read whole (``plan_stream`` says None)."""


def _close(files: Sequence[_File]) -> None:
    for file in files:
        if file.fd >= 0:
            fd, file.fd = file.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)


class StreamedRead:
    """An agent's warm cache on its way into the engine's arrays (``plan_stream``)."""

    def __init__(self, agent: str, manifest: CacheManifest, files: list[_File], layers: int):
        self.agent = agent
        self.manifest = manifest
        self._files = files
        self._lock = threading.Lock()
        self._pending = [0] * layers  # pieces each layer waits for
        self._layers = [threading.Event() for _ in range(layers)]
        self._done = threading.Event()
        self._error: str | None = None
        self._left = 0
        self._started = self._ended = 0.0
        self._closed = False  # given up before it started (close)
        self.waited_s = 0.0  # how long the engine's thread waited for bytes

    # -- what it holds ------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """The bytes of its files (what it reads)."""
        return sum(f.size for f in self._files)

    def ranges(self) -> list[tuple[int, int, dict[str, tuple[tuple[int, ...], str]]]]:
        """``(start, stop, {tensor: (shape, dtype)})`` of each range it fills, in token
        order: the arrays the engine allocates for :meth:`start`."""
        return [
            (f.start, f.stop, {t.name: (t.want, t.dtype) for t in f.tensors}) for f in self._files
        ]

    @property
    def read_s(self) -> float:
        """Seconds from :meth:`start` to its last piece (0 while it reads)."""
        return self._ended - self._started if self._ended else 0.0

    # -- reading ------------------------------------------------------------------------
    def start(self, arrays: Sequence[Mapping[str, np.ndarray[Any, Any]]]) -> None:
        """Read the files into ``arrays`` (per range of :meth:`ranges`, host views of the
        engine's arrays of those shapes, C-contiguous, writable), in the background, the
        earliest layers first (each reader thread works out where its piece goes). Raises
        ValueError (nothing read) for arrays of other shapes, or once :meth:`close`d (a
        stage given up: its files are closed)."""
        with self._lock:
            if self._closed:
                raise ValueError("this read was given up before it started")
            try:
                for file, views in zip(self._files, arrays, strict=True):
                    _check_views(file, views)
            except ValueError:
                self._give_up()
                raise
            self._started = time.perf_counter()
        order = []
        for i, (file, views) in enumerate(zip(self._files, arrays, strict=True)):
            file.views = views
            file.begins = [t.begin for t in file.tensors]
            file.digests = [0] * file.pieces()
            file.left = file.pieces()
            for p in range(file.pieces()):
                tensors = _overlapping(file, p * PIECE, (p + 1) * PIECE)
                layers = {t.layer for t in tensors}
                for layer in layers:
                    self._pending[layer] += 1
                order.append((min(layers, default=-1), i, p, (i, p, tensors, layers)))
        for pending, event in zip(self._pending, self._layers, strict=True):
            if not pending:
                event.set()
        self._left = len(order)
        if not order:
            self._finish()
        for *_, job in sorted(order, key=lambda o: o[:3]):
            in_background(self._read_piece, job)

    def _read_piece(self, job: tuple[int, int, list[_Tensor], set[int]]) -> None:
        i, p, tensors, layers = job
        file = self._files[i]
        digest = 0
        try:
            if self._error is None:
                buffers = _buffers(file, p * PIECE, min((p + 1) * PIECE, file.size), tensors)
                refuse = functools.partial(_refused, file.name)
                with _read_errors(refuse, file.size):
                    _read_into(file.fd, buffers, p * PIECE)
                hasher = xxhash.xxh3_64()
                for buffer in buffers:
                    hasher.update(buffer)
                digest = hasher.intdigest()
        except CacheRejected as exc:
            self._fail(exc.reason)
        except BaseException as exc:  # a reader thread must always count its piece down
            self._fail(f"{file.name}: {exc!r}")
        finally:
            self._landed(file, p, digest, layers)

    def _landed(self, file: _File, p: int, digest: int, layers: set[int]) -> None:
        with self._lock:
            file.digests[p] = digest
            file.left -= 1
            try:
                if not file.left:
                    _close([file])
                    if self._error is None:
                        found = tree_checksum(file.digests)
                        if found != file.checksum:
                            self._error = (
                                f"{file.name}: checksum mismatch: the file has {found}, "
                                f"manifest says {file.checksum}"
                            )
            finally:  # whatever happened, its layers and the read are counted down
                self._count_down(layers)

    def _count_down(self, layers: set[int]) -> None:
        """One piece in (with the lock held): its layers' counts and the read's."""
        for layer in layers:
            self._pending[layer] -= 1
            if not self._pending[layer]:
                self._layers[layer].set()
        self._left -= 1
        if not self._left:
            self._finish()

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._error = self._error or reason

    def _finish(self) -> None:
        self._ended = time.perf_counter()
        for file in self._files:
            file.views = {}  # the engine's arrays: not kept past the read
        self._done.set()

    # -- waiting ------------------------------------------------------------------------
    def wait_layer(self, layer: int, *, counted: bool = True) -> None:
        """Block until entry ``layer``'s bytes are all in (or the read failed: then
        :meth:`wait` says why; they are not to be trusted before it says None). The
        engine's waits are ``counted`` in :attr:`waited_s`, not another thread's."""
        event = self._layers[layer]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            if counted:
                self.waited_s += time.perf_counter() - t0

    def wait(self) -> str | None:
        """Block until every piece is in: None when every file matched its checksum, else
        why the cache cannot be trusted."""
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            self.waited_s += time.perf_counter() - t0
        return self._error

    @property
    def started(self) -> bool:
        """Whether :meth:`start` began reading."""
        return bool(self._started)

    @property
    def settled(self) -> bool:
        """Whether every piece is in (:meth:`wait` answers at once)."""
        return self._done.is_set()

    def close(self) -> None:
        """Close its files when it will never :meth:`start` (a staging that failed or was
        abandoned; :meth:`start` refuses from then on); nothing once it started (its files
        close as their last pieces land)."""
        with self._lock:
            if not (self._started or self._closed):
                self._give_up()

    def _give_up(self) -> None:
        """Never to start (with the lock held): its files closed, every waiter woken, and
        :meth:`wait` says so."""
        self._closed = True
        _close(self._files)
        self._error = self._error or "never read"
        for event in self._layers:
            event.set()
        self._done.set()


def _refused(file: str, reason: str) -> CacheRejected:
    return CacheRejected(f"{file}: {reason}", file)


def _check_views(file: _File, views: Mapping[str, np.ndarray[Any, Any]]) -> None:
    """Raise ValueError unless each of the file's tensors has a view it can write whole."""
    for t in file.tensors:
        view = views[t.name]
        if view.shape != t.want or not (view.flags.c_contiguous and view.flags.writeable):
            raise ValueError(f"{t.name}: a writable C-contiguous {t.want} array is needed")


def _overlapping(file: _File, a: int, b: int) -> list[_Tensor]:
    """The file's tensors with bytes in ``[a, b)``, in file order."""
    first = max(bisect.bisect_right(file.begins, a) - 1, 0)
    out = []
    for t in file.tensors[first:]:
        if t.begin >= b:
            break
        if t.end > a:
            out.append(t)
    return out


def _buffers(file: _File, a: int, b: int, tensors: list[_Tensor]) -> list[memoryview]:
    """Where bytes ``[a, b)`` of the file (``tensors``: those with bytes there,
    ``_overlapping``) go, in order: slices of the engine's views, and
    a scratch buffer of their own for bytes read only to be summed (the header; the
    tokens of a tensor past those the cache uses, a row of the axes before the cut)."""
    runs: list[tuple[int, int, memoryview | None]] = [(0, file.data_start, None)]
    for t in tensors:
        out = file.views[t.name].reshape(-1).view(np.uint8).data
        if not t.rows:
            runs.append((t.begin, t.end - t.begin, out))
            continue
        row = (t.end - t.begin) // t.rows  # bytes of one row in the file
        keep = out.nbytes // t.rows
        for r in range(t.rows):
            runs.append((t.begin + r * row, keep, out[r * keep : (r + 1) * keep]))
            runs.append((t.begin + r * row + keep, row - keep, None))
    parts: list[tuple[int, int, memoryview | None]] = []
    for at, length, dest in runs:
        lo, hi = max(a, at), min(b, at + length)
        if hi > lo:
            parts.append((lo - at, hi - at, dest))
    scratch = memoryview(bytearray(sum(hi - lo for lo, hi, dest in parts if dest is None)))
    buffers, used = [], 0
    for lo, hi, dest in parts:
        if dest is None:
            buffers.append(scratch[used : used + hi - lo])
            used += hi - lo
        else:
            buffers.append(dest[lo:hi])
    return buffers


def _read_into(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Fill ``buffers`` in order from ``offset`` (a short read continues where it ended).
    Raises ShortRead at the end of the file."""
    at, first = offset, 0
    todo = list(buffers)
    while first < len(todo):
        n = os.preadv(fd, todo[first : first + _IOV_MAX], at)
        if not n:
            raise ShortRead(at)
        at += n
        while first < len(todo) and n >= todo[first].nbytes:
            n -= todo[first].nbytes
            first += 1
        if n:
            todo[first] = todo[first][n:]
