"""A layer-streamed warm load: a staged cache's files read straight into the engine's
arrays as the turn's first forward runs, each layer waited for as it attends or is made
float, every checksum checked before anything of the turn is answered. Answers are a
whole read's; a cache that fails its checksum as it streams is dropped and its agent goes
on cold with the reason kept (real engine, tiny model, real MLX, real files, real reader
threads)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from _stored_ranges import stored_kv

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import read_cache
from kvactor.actors.warm._prefetch import PrefetchActor
from kvactor.actors.warm._protocol import Stream
from kvactor.actors.warm._stream import StreamedRead, plan_stream
from kvactor.kernels import fused
from kvactor.kernels.agent_cache import AgentKV, Unverified
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.memory import host_views
from kvactor.kernels.quantized_turn import QuantizedTurnCache

pytestmark = pytest.mark.one_backend  # the engine's turns, not the event loop

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert fused.wait(300), fused.unavailable()


@pytest.fixture(autouse=True)
def small_caches_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model's caches are a few KB: below the default size a stage streams from.
    monkeypatch.setattr(PrefetchActor, "stream_min_bytes", 0)
    monkeypatch.setattr(PrefetchActor, "stream_min_file_bytes", 0)


def tiny() -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64)


async def _cold(root: Path, prompt: str = PROMPT) -> Any:
    async with kvactor.open(tiny(), cache_dir=root) as kv:
        return await (await kv.spawn_agent("a")).complete(prompt, max_tokens=3)


async def _warm(
    root: Path, prompt: str, monkeypatch: pytest.MonkeyPatch, *, stream: bool, **options: Any
) -> Any:
    monkeypatch.setenv("KVACTOR_STREAM", "1" if stream else "0")
    try:
        async with kvactor.open(tiny(), cache_dir=root, **options) as kv:
            return await (await kv.spawn_agent("a")).complete(prompt, max_tokens=5)
    finally:
        monkeypatch.delenv("KVACTOR_STREAM")


@pytest.mark.parametrize("first", ["copy", "stored"])
@pytest.mark.parametrize("prompt", ["extends", "diverges"])
async def test_streamed_warm_turns_answer_as_whole_reads_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, prompt: str
) -> None:
    if first == "stored":  # the tiny caches are below the default threshold
        monkeypatch.setattr(FloatTurnCache, "stored_first_tokens", 1)
    # Extending the cache, or diverging inside its first range (cut as it lands).
    text = PROMPT + " And so" if prompt == "extends" else PROMPT[:100] + " Elsewhere"
    answers = []
    for stream in (True, False):
        root = tmp_path / str(stream)
        await _cold(root)
        done = await _warm(root, text, monkeypatch, stream=stream)
        assert done.path == "warm"
        assert (done.timings.stream_s > 0) == stream  # a whole read says 0
        assert done.timings.stream_wait_s <= done.timings.stream_s
        answers.append(done.token_ids)
    assert answers[0] == answers[1]


def _flip_last_byte(root: Path) -> Path:
    biggest = max((root / "agents" / "a").glob("seg-*"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[-1] ^= 0xFF  # a data byte: the header and size still check out
    biggest.write_bytes(bytes(data))
    return biggest


@pytest.mark.parametrize(("first", "delete"), [("copy", False), ("stored", False), ("copy", True)])
async def test_a_cache_failing_its_checksum_as_it_streams_goes_cold(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    first: str,
    delete: bool,
) -> None:
    if first == "stored":
        monkeypatch.setattr(FloatTurnCache, "stored_first_tokens", 1)
    text = PROMPT + " And so"
    fresh = await _cold(tmp_path / "fresh", text)  # what a cold turn answers
    bad = tmp_path / "bad"
    await _cold(bad)
    flipped = _flip_last_byte(bad)
    refused = flipped.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvactor"):
        done = await _warm(bad, text, monkeypatch, stream=True, delete_rejected=delete)
    # Dropped before anything was answered; staged again, the whole read refused it with
    # the reason, and the agent went on cold; its write set the refused copy aside (or,
    # with delete_rejected, the refusal deleted it).
    assert done.path == "cold" and done.saved
    assert done.token_ids[:3] == fresh.token_ids
    assert "checksum mismatch" in caplog.text and flipped.name in caplog.text
    aside = bad / "rejected" / "a" / flipped.name
    assert not aside.exists() if delete else aside.read_bytes() == refused


async def _identity(root: Path) -> tuple[Any, Any]:
    async with kvactor.open(tiny(), cache_dir=root) as kv:
        return kv.identity, kv.layout


def _host_arrays(read: StreamedRead) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [{n: np.empty(s, d) for n, (s, d) in t.items()} for *_, t in read.ranges()]


async def test_a_streamed_read_lands_what_a_whole_read_reads(tmp_path: Path) -> None:
    await _cold(tmp_path)
    identity, layout = await _identity(tmp_path)
    whole = read_cache(tmp_path, identity, layout, "a")
    read = plan_stream(tmp_path, identity, layout, "a")
    assert read is not None and read.nbytes == whole.nbytes
    arrays = _host_arrays(read)
    read.start(arrays)
    for layer in range(identity.n_layers):
        read.wait_layer(layer)
    assert read.wait() is None and read.settled and read.read_s > 0
    ranges = whole.ranges()
    assert [r[:2] for r in ranges] == [r[:2] for r in read.ranges()]
    for (_, _, want), got in zip(ranges, arrays, strict=True):
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


async def test_a_file_cut_short_while_it_streams_is_named(tmp_path: Path) -> None:
    await _cold(tmp_path)
    identity, layout = await _identity(tmp_path)
    read = plan_stream(tmp_path, identity, layout, "a")  # sizes checked: files open
    assert read is not None
    biggest = max((tmp_path / "agents" / "a").glob("seg-*"), key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)
    read.start(_host_arrays(read))
    why = read.wait()
    assert why is not None and biggest.name in why and "truncated" in why


def _segments_open(root: Path) -> int:
    """How many descriptors of this process are open on the agent's segment files (other
    threads' files come and go meanwhile: only these are counted)."""
    folder = str((root / "agents" / "a").resolve())
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += target.startswith(folder + "/seg-")
    return count


async def test_a_read_never_started_closes_its_files(tmp_path: Path) -> None:
    await _cold(tmp_path)
    identity, layout = await _identity(tmp_path)
    files = len(list((tmp_path / "agents" / "a").glob("seg-*")))
    assert _segments_open(tmp_path) == 0
    read = plan_stream(tmp_path, identity, layout, "a")
    assert read is not None and _segments_open(tmp_path) == files
    read.close()
    assert _segments_open(tmp_path) == 0
    assert read.settled and read.wait() is not None
    with pytest.raises(ValueError, match="given up"):  # closed: it never starts
        read.start(_host_arrays(read))
    # Arrays it cannot write into whole: refused before anything is read, its files closed.
    other = plan_stream(tmp_path, identity, layout, "a")
    assert other is not None
    with pytest.raises(ValueError, match="writable C-contiguous"):
        other.start([{n: np.empty(s, d).T for n, (s, d) in t.items()} for *_, t in read.ranges()])
    assert _segments_open(tmp_path) == 0
    assert other.wait() == "never read" and not other.started
    other.wait_layer(0)  # wakes at once: nothing will land


class _Landing:
    """A streamed read's side as the engine sees it: which layers were waited for, in
    order, and whether the whole read was (its verdict: ``why``)."""

    def __init__(self, why: str | None = None) -> None:
        self.layers: list[int] = []
        self.waits = 0
        self.why = why

    def wait_layer(self, layer: int, *, counted: bool = True) -> None:
        self.layers.append(layer)

    def wait(self) -> str | None:
        self.waits += 1
        return self.why


def _stored_kv() -> tuple[Any, AgentKV]:
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    QuantizedTurnCache.prepare(lm.model)
    return lm, stored_kv(lm)


@pytest.mark.parametrize("first", ["copy", "stored"])
def test_the_first_forward_waits_for_each_layer_as_it_reaches_it(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    monkeypatch.setattr(FloatTurnCache, "stored_first_tokens", 1)
    lm, kv = _stored_kv()
    kv.landing = landing = _Landing()
    work = kv.activate_stored() if first == "stored" else kv.activate()
    if first == "copy":  # the copy made a group of layers at a time, as they landed
        assert landing.layers == list(range(lm.n_layers))
    lm.model(mx.array([[11, 12, 13]]), cache=work.layers)
    # Each layer waited for once, in order, before it attended; the whole read (its
    # checksums) was left to the engine, which settles before answering.
    assert landing.layers == list(range(lm.n_layers)) and landing.waits == 0
    kv.settle()
    assert landing.waits == 1 and kv.landing is None


def test_a_failed_read_leaves_nothing_to_use() -> None:
    _, kv = _stored_kv()
    kv.landing = _Landing("seg-1.safetensors: checksum mismatch")
    with pytest.raises(Unverified, match="checksum mismatch"):
        kv.settle()
    # Whatever else reads the stored arrays waits for the whole read first, and refuses.
    with pytest.raises(Unverified, match="checksum mismatch"):
        kv.fork(AgentKV(kv.codec, kv.geometry))
    with pytest.raises(Unverified, match="checksum mismatch"):
        kv.share_into(AgentKV(kv.codec, kv.geometry), kv.boundaries()[0])
    with pytest.raises(Unverified, match="checksum mismatch"):
        kv.ranges_from(0)
    assert kv.landing is not None


async def test_a_read_the_engine_never_took_is_closed_by_the_next_stream(
    tmp_path: Path,
) -> None:
    await _cold(tmp_path)
    async with kvactor.open(tiny(), cache_dir=tmp_path) as kv:
        assert kv.store is not None
        files = len(list((tmp_path / "agents" / "a").glob("seg-*")))
        abandoned = await kv.store.ask(Stream("a"))  # a stage that ended before installing
        assert isinstance(abandoned, StreamedRead) and not abandoned.started
        assert _segments_open(tmp_path) == files
        again = await kv.store.ask(Stream("a"))  # streams again: not read whole
        assert isinstance(again, StreamedRead)
        assert abandoned.settled and abandoned.wait() == "never read"
        assert _segments_open(tmp_path) == files  # the new read's only
        again.close()
        assert _segments_open(tmp_path) == 0


def test_here_an_arrays_host_view_is_its_memory() -> None:
    # What a streamed load relies on (kernels.memory.host_views): bytes written through
    # the host view are the array's, as MLX then reads them.
    assert host_views()
    array = mx.array(np.zeros(4, np.uint32))
    view = np.array(array, copy=False)
    assert view.flags.writeable and view.flags.c_contiguous
    view[1] = 7
    assert (array + 1).tolist() == [1, 8, 1, 1]


async def test_a_cache_below_the_streaming_size_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _cold(tmp_path)
    size = sum(p.stat().st_size for p in (tmp_path / "agents" / "a").glob("seg-*"))
    monkeypatch.setattr(PrefetchActor, "stream_min_bytes", size + 1)
    done = await _warm(tmp_path, PROMPT + " And so", monkeypatch, stream=True)
    assert done.path == "warm" and done.timings.stream_s == 0 and done.timings.load_s > 0


async def test_a_cache_in_many_small_files_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = tmp_path / "built"
    for turn in range(3):  # a session each: a segment file per departure
        async with kvactor.open(tiny(), cache_dir=built) as kv:
            await (await kv.spawn_agent("a")).generate(f"Turn {turn}: {PROMPT}", max_tokens=3)
    files = list((built / "agents" / "a").glob("seg-*"))
    per_file = sum(p.stat().st_size for p in files) // len(files)
    assert len(files) >= 3
    monkeypatch.setenv("KVACTOR_STREAM", "1")
    answers = []
    for least, streams in ((per_file + 1, False), (per_file - 1, True)):
        monkeypatch.setattr(PrefetchActor, "stream_min_file_bytes", least)
        root = tmp_path / str(least)
        shutil.copytree(built, root)  # the same cache each time (a turn writes its own)
        async with kvactor.open(tiny(), cache_dir=root) as kv:
            done = await (await kv.spawn_agent("a")).generate("And so", max_tokens=5)
        assert done.path == "warm" and (done.timings.stream_s > 0) == streams
        assert done.timings.load_s > 0
        answers.append(done.token_ids)
    assert answers[0] == answers[1]
