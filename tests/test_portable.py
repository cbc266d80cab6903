"""Portable agents (``Agent.export`` / ``Session.import_agent``): one verified file that
carries an agent's cache to another session, process or machine. Real engine, real
files, real actors; the fuzz runs over a real export."""

from __future__ import annotations

import functools
import io
import os
import random
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xxhash
from lively import lively

import kvactor
from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import MANIFEST, read_header
from kvactor.actors.warm._checksum import TreeHasher
from kvactor.actors.warm._manifest import CacheManifest, encode_manifest
from kvactor.kernels.qcodec import KVCodec

tiny = lively()  # greedy answers that depend on the whole context (tests/lively.py)
other = functools.partial(make_tiny_model, 1, head_dim=64)  # other weights
GREEDY = {"max_tokens": 6}
DOC = "Here is a long document that the agent reads once. " * 12


async def _reader(kv: kvactor.Session, name: str = "doc") -> kvactor.Agent:
    agent = await kv.spawn_agent(name, system="You read documents.")
    await agent.generate(DOC, **GREEDY)
    return agent


def _agents(root: Path) -> list[str]:
    folder = root / "agents"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _staged(root: Path) -> list[str]:
    folder = root / "incoming"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


async def test_an_imported_agent_resumes_warm_and_answers_as_its_source(tmp_path: Path) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        source = await _reader(kv)
        info = await source.export(tmp_path / "doc.kvagent")
        assert info.agent == "doc" and info.tokens > 100
        assert info.nbytes == (tmp_path / "doc.kvagent").stat().st_size > info.cache_bytes
        history = await source.history()
        expected = await source.generate("What did you read?", **GREEDY)
    data = (tmp_path / "doc.kvagent").read_bytes()

    async def pieces() -> AsyncIterator[bytes]:  # an HTTP body's pieces, of odd sizes
        for at in range(0, len(data), 7_777):
            yield data[at : at + 7_777]

    sources: dict[str, Any] = {
        "path": tmp_path / "doc.kvagent",
        "bytes": data,
        "file": io.BytesIO(data),
        "stream": pieces(),
    }
    async with kvactor.open(tiny, cache_dir=tmp_path / "b") as kv:
        for how, src in sources.items():
            agent = await kv.import_agent(src, f"doc-{how}")
            assert await agent.history() == history, how
            done = await agent.generate("What did you read?", **GREEDY)
            assert done.path == kvactor.Tier.WARM, how
            assert done.timings.reused_tokens == expected.timings.reused_tokens, how
            assert done.token_ids == expected.token_ids, how
        assert _staged(tmp_path / "b") == []


async def test_the_export_stands_alone_a_forks_shared_segments_included(tmp_path: Path) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        await _reader(kv, "src")
        fork = await kv.fork("src", "copy")
        await fork.generate("one more question", **GREEDY)
        await kv.forget("src")  # the fork's first segments are links to src's files
        buffer = io.BytesIO()
        await fork.export(buffer)
        expected = await fork.generate("and then?", **GREEDY)
    async with kvactor.open(tiny, cache_dir=tmp_path / "b") as kv:
        agent = await kv.import_agent(buffer.getvalue())
        assert agent.name == "copy"
        done = await agent.generate("and then?", **GREEDY)
        assert done.path == kvactor.Tier.WARM and done.token_ids == expected.token_ids


async def test_a_running_agent_is_exported_between_its_turns_and_replaced_atomically(
    tmp_path: Path,
) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        agent = await _reader(kv)
        first = await kv.export_stream("doc")
        assert first.header.agent == "doc" and first.header.messages == 3
        old = b"".join([piece async for piece in first])
        await agent.generate("a second turn", **GREEDY)
        new = io.BytesIO()
        await agent.export(new)
        # The older file replaces the running agent only when asked to.
        with pytest.raises(kvactor.AgentExists, match="already exists"):
            await kv.import_agent(old)
        back = await kv.import_agent(old, replace=True)
        assert len(await back.history()) == 3  # the older conversation, whole
        assert "doc" in kv.agents and _staged(tmp_path / "a") == []
        again = await kv.import_agent(new.getvalue(), replace=True)
        assert len(await again.history()) == 5


def _refused(kv: kvactor.Session, root: Path, name: str) -> None:
    assert name not in kv.agents
    assert name not in _agents(root)
    assert _staged(root) == []


async def test_what_cannot_be_trusted_is_refused_with_a_reason(tmp_path: Path) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        data = (await _export(kv)).getvalue()
    async with kvactor.open(other, cache_dir=tmp_path / "o") as kv:
        foreign = (await _export(kv)).getvalue()
    async with kvactor.open(tiny, cache_dir=tmp_path / "c", codec=KVCodec(bits=4)) as kv:
        recoded = (await _export(kv)).getvalue()
    header = read_header(data)
    seg = header.files[-1]
    cases = {
        "another model": (foreign, "another model"),
        "another codec": (recoded, "codec"),
        "a newer format": (_reframed(data, portable_version=2), "newer kvactor"),
        "a newer cache format": (_reframed(data, cache_format=9), "upgrade kvactor"),
        "a header that lies about a size": (
            _reframed(data, files=[*header.files[:-1], _resized(seg, seg.size + 10)]),
            "truncated|checksum",
        ),
        "a header that says less": (
            _reframed(data, files=[*header.files[:-1], _resized(seg, seg.size - 10)]),
            "checksum|after the end",
        ),
        "a hostile file name": (
            _reframed(data, files=[*header.files[:-1], _renamed(seg, "../../x")]),
            "not a cache file",
        ),
        "a huge size": (
            _reframed(data, files=[*header.files[:-1], _resized(seg, 1 << 50)]),
            "more than this import takes",
        ),
        "a segment that lies, every checksum made right": (_lying_segment(data), "metadata"),
        "a manifest naming a file it lacks": (_without_a_segment(data), "does not hold"),
        "truncated": (data[:-100], "truncated"),
        "altered": (_flipped(data, len(data) // 2), "checksum"),
        "bytes after its end": (data + b"\0", "after the end"),
        "not an agent file": (b"PK\3\4" + data[4:], "not a kvactor agent file"),
    }
    async with kvactor.open(tiny, cache_dir=tmp_path / "b") as kv:
        for _what, (bad, reason) in cases.items():
            with pytest.raises(kvactor.CacheRejected, match=reason):
                await kv.import_agent(bad)
            _refused(kv, tmp_path / "b", "doc")
        with pytest.raises(kvactor.CacheTooLarge):  # its own kind: a 413 over HTTP
            await kv.import_agent(cases["a huge size"][0])
        with pytest.raises(kvactor.InvalidAgentId):
            await kv.import_agent(data, "../doc")
        # The sound file still goes in; its name is then taken.
        await kv.import_agent(data)
        with pytest.raises(kvactor.AgentExists, match="already exists"):
            await kv.import_agent(data)
    # On disk only (not running): the name is taken all the same.
    async with kvactor.open(tiny, cache_dir=tmp_path / "b") as kv:
        with pytest.raises(kvactor.AgentExists, match="already exists"):
            await kv.import_agent(data)
        assert "doc" not in kv.agents


async def test_an_import_past_the_disk_limit_or_hot_budget_is_refused(tmp_path: Path) -> None:
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        data = (await _export(kv)).getvalue()
    size = read_header(data).nbytes
    async with kvactor.open(tiny, cache_dir=tmp_path / "d", disk_limit=size // 2) as kv:
        with pytest.raises(kvactor.CacheRejected, match="disk limit"):
            await kv.import_agent(data)
        _refused(kv, tmp_path / "d", "doc")
    async with kvactor.open(tiny, cache_dir=tmp_path / "m", budget_bytes=size // 4) as kv:
        with pytest.raises(kvactor.CacheRejected, match="hot budget"):
            await kv.import_agent(data)
        _refused(kv, tmp_path / "m", "doc")
    # Under a limit with room once another agent goes cold: that one goes cold.
    async with kvactor.open(tiny, cache_dir=tmp_path / "e", disk_limit=int(size * 1.6)) as kv:
        await _reader(kv, "resident")
        await kv.import_agent(data)
        stats = await kv.stats()
        assert stats.warm_limit_bytes is not None
        assert stats.warm_bytes <= stats.warm_limit_bytes
        assert stats.demoted_warm_to_cold == 1


async def test_fuzz_truncations_and_flips_never_leave_a_partial_agent(tmp_path: Path) -> None:
    """Every byte of the file is under a checksum: each flip and each cut is refused,
    never a crash, never a partial agent or a staging folder left."""
    async with kvactor.open(tiny, cache_dir=tmp_path / "a") as kv:
        data = (await _export(kv)).getvalue()
    rng = random.Random(42)
    root = tmp_path / "b"
    async with kvactor.open(tiny, cache_dir=root) as kv:
        (length,) = struct.unpack("<I", data[14:18])
        spots = [rng.randrange(len(data)) for _ in range(30)]
        spots += [rng.randrange(18 + length + 8) for _ in range(10)]  # magic and header
        spots += [len(data) - 1 - i for i in range(4)]  # the whole file's sum
        for at in spots:
            with pytest.raises(kvactor.CacheRejected):
                await kv.import_agent(_flipped(data, at, rng.randrange(1, 256)))
            _refused(kv, root, "doc")
        for cut in [rng.randrange(len(data)) for _ in range(20)] + [0, 1, len(data) - 1]:
            with pytest.raises(kvactor.CacheRejected):
                await kv.import_agent(data[:cut])
            _refused(kv, root, "doc")
        await kv.import_agent(data)  # after all that, the sound file
        assert _agents(root) == ["doc"]


async def test_a_crash_during_a_replace_is_finished_at_the_next_open(tmp_path: Path) -> None:
    """kill -9 between the two renames of a replace (the old folder set aside, the new one
    verified and staged): the next open moves the new one in. A staging folder that was
    not verified yet is removed, and the agent there stays as it was."""
    root = tmp_path / "a"
    async with kvactor.open(tiny, cache_dir=root) as kv:
        agent = await _reader(kv)
        old = (await _export(kv, agent)).getvalue()
        await agent.generate("a second turn", **GREEDY)
    from kvactor.actors.session._carry import stage_import  # the steps of an import

    async with kvactor.open(tiny, cache_dir=root) as kv:
        part = kv._models.first  # looking inside: the session's model part
        staged = await stage_import(part, old, None, taken=lambda _: False, usage=None, budget=None)
        unverified = await stage_import(
            part, old, None, taken=lambda _: False, usage=None, budget=None
        )
        # Not verified yet: its folder not renamed ready (what mark_ready does last).
        os.rename(unverified.staging, unverified.staging.with_name("import-unverified"))
        os.rename(root / "agents" / "doc", staged.staging / "replaced")  # then the crash
    async with kvactor.open(tiny, cache_dir=root) as kv:
        assert _staged(root) == []
        back = await kv.spawn_agent("doc")
        assert len(await back.history()) == 3  # the imported (older) conversation
        done = await back.generate("What did you read?", **GREEDY)
        assert done.path == kvactor.Tier.WARM


# ----------------------------------------------------------------------------- helpers
async def _export(kv: kvactor.Session, agent: kvactor.Agent | None = None) -> io.BytesIO:
    agent = agent or await _reader(kv)
    out = io.BytesIO()
    await agent.export(out)
    return out


def _flipped(data: bytes, at: int, bits: int = 1) -> bytes:
    out = bytearray(data)
    out[at] ^= bits
    return bytes(out)


def _resized(file: object, size: int) -> object:
    return msgspec.structs.replace(file, size=size)  # type: ignore[type-var]


def _renamed(file: object, name: str) -> object:
    return msgspec.structs.replace(file, name=name)  # type: ignore[type-var]


def _reframed(data: bytes, **changes: object) -> bytes:
    """``data`` with its header changed and every checksum made right again: what a
    hostile writer can make."""
    header = read_header(data)
    start = len(b"kvactor-agent\n") + 4
    (length,) = struct.unpack("<I", data[len(b"kvactor-agent\n") : start])
    rest = data[start + length + 8 : -8]
    body = msgspec.json.encode(msgspec.structs.replace(header, **changes))
    if "portable_version" in changes:  # a field this kvactor does not know yet, too
        body = body[:-1] + b',"future":{"x":1}}'
    framed = b"kvactor-agent\n" + struct.pack("<I", len(body)) + body
    framed += struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + rest
    return framed + struct.pack("<Q", xxhash.xxh3_64_intdigest(framed))


def _lying_segment(data: bytes) -> bytes:
    """``data`` with its last segment's header saying another agent wrote it, and every
    checksum that covers it (the manifest's entry, the manifest's own, the file's, the
    whole file's) made right: only the header check can refuse it."""
    files = _files_of(data)
    seg = read_header(data).files[-1].name
    head = files[seg][:4096]
    assert b'"doc"' in head
    files[seg] = files[seg].replace(b'"doc"', b'"dog"', 1)
    hasher = TreeHasher()
    hasher.update(files[seg])
    raw = files[MANIFEST]
    body = raw[raw.index(b',"manifest":') + len(b',"manifest":') : -1]
    manifest = msgspec.json.decode(body, type=CacheManifest)
    entries = [
        msgspec.structs.replace(e, checksum=hasher.checksum()) if e.file == seg else e
        for e in manifest.segments
    ]
    files[MANIFEST] = encode_manifest(msgspec.structs.replace(manifest, segments=entries))
    return _rebuilt(data, files)


def _files_of(data: bytes) -> dict[str, bytes]:
    """Each file of an export, by name, in its order."""
    header = read_header(data)
    (length,) = struct.unpack("<I", data[14:18])
    at = 18 + length + 8
    files: dict[str, bytes] = {}
    for f in header.files:
        files[f.name] = data[at : at + f.size]
        at += f.size
    return files


def _rebuilt(data: bytes, files: dict[str, bytes]) -> bytes:
    """``data`` holding ``files`` (a subset of its own, changed or not), every checksum
    that covers them made right."""
    listed = []
    for f in read_header(data).files:
        if f.name in files:
            summed = TreeHasher()
            summed.update(files[f.name])
            listed.append(
                msgspec.structs.replace(f, size=len(files[f.name]), checksum=summed.checksum())
            )
    whole = _reframed(data, files=listed)
    (length,) = struct.unpack("<I", whole[14:18])
    start = 18 + length + 8
    framed = whole[:start] + b"".join(files[f.name] for f in listed)
    return framed + struct.pack("<Q", xxhash.xxh3_64_intdigest(framed))


def _without_a_segment(data: bytes) -> bytes:
    """``data`` without the last segment its manifest names, every checksum made right."""
    files = _files_of(data)
    del files[read_header(data).files[-1].name]
    return _rebuilt(data, files)
