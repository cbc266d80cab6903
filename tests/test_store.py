"""The warm tier: round trips, extension by segments, DIVERGE cuts, another process,
refusal of foreign and hostile files, agent ids, forget, orphans, disk full, the actor."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import safetensors.numpy
import xxhash

from kvactor.actors.enums import Tier
from kvactor.actors.errors import CacheRejected, InvalidAgentId, StoreWriteError, UnknownAgent
from kvactor.actors.warm import (
    CacheIdentity,
    Forget,
    ListAgents,
    StoreActor,
    _durable,
    agent_names,
    default_cache_dir,
    forget,
    list_agents,
    read_cache,
    read_manifest,
)
from kvactor.actors.warm import _store as store_module
from kvactor.actors.warm._checksum import body_checksum, file_checksum
from kvactor.actors.warm._manifest import Loaded
from kvactor.actors.warm._store import Append, Load, Manifest
from kvactor.actors.warm._write import append_cache
from kvactor.cli._inspect import format_table, inspect_rows
from kvactor.runtime import Runtime

L, H, D = 2, 2, 64  # layers, kv heads, head dim of the toy "model"
IDENTITY = CacheIdentity(
    model_fingerprint="sha256:0123456789abcdef",
    codec={"kind": "affine", "bits": 4, "group": 64, "rotate": False},
    n_layers=L,
    n_kv_heads=H,
    head_dim=D,
    vocab_size=1000,
)
Tensors = dict[str, np.ndarray[Any, Any]]


def expect(start: int, stop: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """4-bit packed, group 64: q uint32 (1, H, n, D/8), scales and biases float16."""
    n = stop - start
    if n == 0:
        return {}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for layer in range(L):
        for kind in "kv":
            out[f"{layer}.{kind}.q"] = ((1, H, n, D // 8), "uint32")
            out[f"{layer}.{kind}.s"] = ((1, H, n, D // 64), "float16")
            out[f"{layer}.{kind}.b"] = ((1, H, n, D // 64), "float16")
    return out


SINK = 4


def expect_sink(start: int, stop: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Like ``expect`` but the first SINK tokens of a cache are 8-bit ``sink.*`` parts:
    part names and sizes depend on the range, as in the real codec."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    sink = max(0, min(stop, SINK) - start)
    rest = stop - start - sink
    for layer in range(L):
        for kind in "kv":
            if sink:
                out[f"{layer}.{kind}.sink.q"] = ((1, H, sink, D // 4), "uint32")
                out[f"{layer}.{kind}.sink.s"] = ((1, H, sink, 1), "float16")
            if rest:
                out[f"{layer}.{kind}.q"] = ((1, H, rest, D // 8), "uint32")
                out[f"{layer}.{kind}.s"] = ((1, H, rest, 1), "float16")
    return out


def make(start: int, stop: int, seed: int, fn: Any = expect) -> Tensors:
    rng = np.random.default_rng(seed)
    out: Tensors = {}
    for name, (shape, dtype) in fn(start, stop).items():
        if dtype == "uint32":
            out[name] = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 1000 for i in range(n)]


def joined(loaded: Loaded) -> Tensors:
    """The loaded segments concatenated along the token axis."""
    return {
        name: np.concatenate([seg[name] for seg in loaded.segments], axis=2)
        for name in loaded.segments[0]
    }


def assert_same(a: Tensors, b: Tensors) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name], b[name])


def cut(t: Tensors, n: int) -> Tensors:
    return {name: a[:, :, :n] for name, a in t.items()}


def cat(*parts: Tensors) -> Tensors:
    return {name: np.concatenate([p[name] for p in parts], axis=2) for name in parts[0]}


def put(root: Path, agent: str, start: int, stop: int, seed: int, **kw: Any) -> Tensors:
    t = make(start, stop, seed)
    append_cache(root, IDENTITY, expect, agent, start, t, tokens(stop), **kw)
    return t


def folder(root: Path, agent: str) -> Path:
    return root / "agents" / agent


def files(root: Path, agent: str) -> list[str]:
    return sorted(os.listdir(folder(root, agent)))


# ------------------------------------------------------------------------ round trips
def test_round_trip(tmp_path: Path) -> None:
    t = make(0, 10, seed=1)
    info = append_cache(
        tmp_path,
        IDENTITY,
        expect,
        "planner",
        0,
        t,
        tokens(10),
        text="hello world",
        messages=[{"role": "user", "content": "hi"}],
        extra={"system": "You plan."},
    )
    assert (info.agent, info.tokens, info.segments, info.rejected) == ("planner", 10, 1, None)
    assert info.nbytes == sum(p.stat().st_size for p in folder(tmp_path, "planner").iterdir())
    loaded = read_cache(tmp_path, IDENTITY, expect, "planner")
    assert_same(loaded.segments[0], t)
    m = loaded.manifest
    assert (m.agent, m.n_tokens, m.token_ids, m.text) == ("planner", 10, tokens(10), "hello world")
    assert m.messages == [{"role": "user", "content": "hi"}]
    assert m.extra == {"system": "You plan."}
    assert m.created == m.updated
    assert [(s.file, s.start, s.stop, s.use) for s in m.segments] == [
        ("seg-1.safetensors", 0, 10, 10)
    ]
    assert loaded.ranges()[0][:2] == (0, 10)
    assert read_manifest(tmp_path, IDENTITY, "planner") == m
    # The manifest is JSON framed with its checksum and the segment a standard
    # safetensors file, summed whole.
    raw = (folder(tmp_path, "planner") / "manifest.json").read_bytes()
    framed = json.loads(raw)
    assert list(framed) == ["checksum", "manifest"]
    body = raw[raw.index(b'"manifest":') + len(b'"manifest":') : -1]
    assert framed["checksum"] == f"xxh3:{xxhash.xxh3_64_intdigest(body):016x}"
    assert framed["manifest"]["format_version"] == 3
    seg = folder(tmp_path, "planner") / "seg-1.safetensors"
    # The XXH3 of the XXH3s of its 1 MiB pieces (so that readers sum pieces in parallel).
    blob = seg.read_bytes()
    pieces = [
        xxhash.xxh3_64_intdigest(blob[i : i + (1 << 20)]) for i in range(0, len(blob), 1 << 20)
    ]
    tree = xxhash.xxh3_64_intdigest(b"".join(p.to_bytes(8, "little") for p in pieces))
    assert m.segments[0].checksum == f"xxh3t:{tree:016x}"
    assert_same(safetensors.numpy.load_file(str(seg)), t)
    with open(seg, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = header["__metadata__"]
    assert (meta["agent"], meta["start"], meta["stop"]) == ("planner", "0", "10")
    assert meta["model_fingerprint"] == IDENTITY.model_fingerprint
    assert "checksum" not in meta
    assert meta["format_version"] == "3"


def test_extend_writes_only_the_new_segment(tmp_path: Path) -> None:
    first = put(tmp_path, "a", 0, 10, seed=1)
    seg1 = folder(tmp_path, "a") / "seg-1.safetensors"
    before = seg1.stat()
    content = seg1.read_bytes()
    second = put(tmp_path, "a", 10, 13, seed=2)
    assert files(tmp_path, "a") == ["manifest.json", "seg-1.safetensors", "seg-2.safetensors"]
    after = seg1.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert seg1.read_bytes() == content
    # The new file holds 3 tokens: their tensor bytes plus a small header.
    new_bytes = sum(a.nbytes for a in second.values())
    size = (folder(tmp_path, "a") / "seg-2.safetensors").stat().st_size
    assert new_bytes < size < new_bytes + 4096
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert [(s.start, s.stop) for s in loaded.manifest.segments] == [(0, 10), (10, 13)]
    assert_same(joined(loaded), cat(first, second))
    assert loaded.manifest.created <= loaded.manifest.updated


def test_diverge_cuts_then_appends(tmp_path: Path) -> None:
    a = put(tmp_path, "a", 0, 10, seed=1)
    b = put(tmp_path, "a", 10, 20, seed=2)
    # DIVERGE at 15: the second segment is cut, the new one follows it.
    new = make(15, 18, seed=3)
    ids = [*tokens(15), 900, 901, 902]
    info = append_cache(tmp_path, IDENTITY, expect, "a", 15, new, ids)
    assert (info.tokens, info.segments) == (18, 3)
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    m = loaded.manifest
    assert [(s.start, s.stop, s.use) for s in m.segments] == [(0, 10, 10), (10, 20, 5), (15, 18, 3)]
    assert m.token_ids == ids
    assert_same(joined(loaded), cat(a, cut(b, 5), new))
    # Cut back to 4 tokens without new tensors: the dropped segments are removed.
    info = append_cache(tmp_path, IDENTITY, expect, "a", 4, {}, ids[:4], text="cut")
    assert (info.tokens, info.segments) == (4, 1)
    assert files(tmp_path, "a") == ["manifest.json", "seg-1.safetensors"]
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert loaded.manifest.text == "cut"
    assert_same(joined(loaded), cut(a, 4))
    # And extend again from there; a segment name is never used twice.
    c = put(tmp_path, "a", 4, 6, seed=4)
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert [s.file for s in loaded.manifest.segments] == ["seg-1.safetensors", "seg-4.safetensors"]
    assert_same(joined(loaded), cat(cut(a, 4), c))
    # Back to nothing.
    append_cache(tmp_path, IDENTITY, expect, "a", 0, {}, [])
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert (loaded.manifest.n_tokens, loaded.segments) == (0, [])
    assert files(tmp_path, "a") == ["manifest.json"]
    put(tmp_path, "a", 0, 2, seed=5)
    assert files(tmp_path, "a") == ["manifest.json", "seg-5.safetensors"]


def test_reads_while_one_writer_rewrites(tmp_path: Path) -> None:
    """Every read sees one committed state whole, even as a writer cuts and removes
    segments under it."""

    def data(start: int, stop: int) -> Tensors:
        return make(start, stop, seed=start * 1000 + stop)

    def write(start: int, stop: int) -> None:
        t = data(start, stop) if stop > start else {}
        append_cache(tmp_path, IDENTITY, expect, "a", start, t, tokens(stop))

    write(0, 5)
    done = threading.Event()

    def writer() -> None:
        try:
            for _ in range(25):
                write(0, 5)
                write(5, 9)
                write(3, 7)  # DIVERGE: cuts the second segment, drops nothing else
                write(0, 0)  # back to empty: every segment becomes an orphan
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    try:
        while not done.is_set() or reads == 0:
            loaded = read_cache(tmp_path, IDENTITY, expect, "a")
            reads += 1
            m = loaded.manifest
            assert m.token_ids == tokens(m.n_tokens)
            for entry, seg in zip(m.segments, loaded.segments, strict=True):
                assert_same(seg, cut(data(entry.start, entry.stop), entry.use))
    finally:
        thread.join()
    assert reads > 0


def test_cut_follows_range_dependent_parts(tmp_path: Path) -> None:
    whole = make(0, 8, seed=1, fn=expect_sink)
    append_cache(tmp_path, IDENTITY, expect_sink, "s", 0, whole, tokens(8))
    append_cache(tmp_path, IDENTITY, expect_sink, "s", 2, {}, tokens(2))
    loaded = read_cache(tmp_path, IDENTITY, expect_sink, "s")
    seg = loaded.segments[0]
    assert set(seg) == set(expect_sink(0, 2))
    for name, (shape, _) in expect_sink(0, 2).items():
        assert seg[name].shape == shape
        np.testing.assert_array_equal(seg[name], whole[name][:, :, : shape[2]])


def test_append_checks_its_arguments(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    with pytest.raises(ValueError, match="gap"):
        put(tmp_path, "a", 11, 12, seed=2)
    with pytest.raises(ValueError, match="differ"):
        append_cache(tmp_path, IDENTITY, expect, "a", 10, make(10, 11, 2), tokens(11, salt=1))
    with pytest.raises(ValueError, match=r"expected uint32\[1, 2, 2, 8\]"):
        append_cache(tmp_path, IDENTITY, expect, "a", 10, make(10, 11, 2), tokens(12))
    with pytest.raises(ValueError, match="do not match the codec"):
        append_cache(tmp_path, IDENTITY, expect, "a", 10, {"x": np.zeros(1)}, tokens(11))
    wrong = make(10, 11, 2)
    wrong["0.k.s"] = wrong["0.k.s"].astype(np.float32)
    with pytest.raises(ValueError, match=r"0\.k\.s"):
        append_cache(tmp_path, IDENTITY, expect, "a", 10, wrong, tokens(11))
    with pytest.raises(ValueError, match="start"):
        append_cache(tmp_path, IDENTITY, expect, "a", -1, {}, [])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1000\)"):
        append_cache(tmp_path, IDENTITY, expect, "a", 10, make(10, 11, 2), [*tokens(10), 1000])
    assert read_cache(tmp_path, IDENTITY, expect, "a").manifest.n_tokens == 10


def test_non_contiguous_arrays_are_stored(tmp_path: Path) -> None:
    t = make(0, 6, seed=1)
    strided = {name: np.concatenate([a, a], axis=2)[:, :, ::2] for name, a in t.items()}
    assert not strided["0.k.q"].flags.c_contiguous
    append_cache(tmp_path, IDENTITY, expect, "a", 0, strided, tokens(6))
    assert_same(read_cache(tmp_path, IDENTITY, expect, "a").segments[0], strided)


LOAD_ELSEWHERE = """
import sys, zlib
import kvactor
from kvactor.actors.warm import CacheIdentity, read_cache
L, H, D = 2, 2, 64
def expect(start, stop):
    n = stop - start
    out = {}
    for layer in range(L):
        for kind in "kv":
            out[f"{layer}.{kind}.q"] = ((1, H, n, D // 8), "uint32")
            out[f"{layer}.{kind}.s"] = ((1, H, n, D // 64), "float16")
            out[f"{layer}.{kind}.b"] = ((1, H, n, D // 64), "float16")
    return out
identity = CacheIdentity(
    model_fingerprint="sha256:0123456789abcdef",
    codec={"kind": "affine", "bits": 4, "group": 64, "rotate": False},
    n_layers=L, n_kv_heads=H, head_dim=D, vocab_size=1000,
)
loaded = read_cache(sys.argv[1], identity, expect, "planner")
crc = 0
for seg in loaded.segments:
    for name in sorted(seg):
        crc = zlib.crc32(seg[name].tobytes(), crc)
print(loaded.manifest.n_tokens, crc)
"""


def test_a_cache_saved_here_loads_in_another_process(tmp_path: Path) -> None:
    a = put(tmp_path, "planner", 0, 12, seed=1)
    b = put(tmp_path, "planner", 12, 20, seed=2)
    crc = 0
    for seg in (a, b):
        for name in sorted(seg):
            crc = zlib.crc32(seg[name].tobytes(), crc)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_ELSEWHERE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["20", str(crc)]


# --------------------------------------------------------------------------- refusals
def seg_path(root: Path, agent: str = "a", n: int = 1) -> Path:
    return folder(root, agent) / f"seg-{n}.safetensors"


def edit_manifest(root: Path, agent: str, change: Any) -> None:
    """Change the manifest's body and frame it with a matching checksum: a consistent
    edit, so that only what was changed can be what is refused."""
    path = folder(root, agent) / "manifest.json"
    data = json.loads(path.read_text())["manifest"]
    change(data)
    body = json.dumps(data).encode()
    path.write_bytes(b'{"checksum":"%s","manifest":%s}' % (body_checksum(body).encode(), body))


def replace_segment(root: Path, blob: bytes) -> None:
    """Replace seg-1 with ``blob``; the manifest's size and checksum follow so that only
    the crafted content can be what is refused."""
    seg_path(root).write_bytes(blob)

    def follow(m: dict[str, Any]) -> None:
        m["segments"][0]["nbytes"] = len(blob)
        m["segments"][0]["checksum"] = file_checksum([memoryview(blob)])

    edit_manifest(root, "a", follow)


def rewrite_segment(root: Path, header_bytes: bytes, data: bytes) -> None:
    """Replace seg-1 with a crafted header and data area (see ``replace_segment``)."""
    replace_segment(root, len(header_bytes).to_bytes(8, "little") + header_bytes + data)


def split_segment(root: Path) -> tuple[dict[str, Any], bytes]:
    raw = seg_path(root).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def hostile(kind: str) -> Any:
    def craft(root: Path) -> None:
        header, data = split_segment(root)
        names = sorted(k for k in header if k != "__metadata__")
        if kind == "huge header length":
            raw = bytearray(seg_path(root).read_bytes())
            raw[:8] = (1 << 40).to_bytes(8, "little")
            replace_segment(root, bytes(raw))
            return
        if kind == "header past the end":
            raw = bytearray(seg_path(root).read_bytes())
            raw[:8] = (len(raw)).to_bytes(8, "little")
            replace_segment(root, bytes(raw))
            return
        if kind == "bad json":
            rewrite_segment(root, b'{"__metadata__": {"a": ' + b" " * 8, data)
            return
        if kind == "deep json":
            rewrite_segment(root, b"[" * 100_000 + b"]" * 100_000, data)
            return
        if kind == "bad dtype":
            header[names[0]]["dtype"] = "BF16"
        elif kind == "offsets beyond file":
            begin, end = header[names[-1]]["data_offsets"]
            header[names[-1]]["data_offsets"] = [begin + 10**9, end + 10**9]
        elif kind == "overlapping offsets":
            first = min(names, key=lambda k: header[k]["data_offsets"][0])
            second = min(
                (k for k in names if k != first), key=lambda k: header[k]["data_offsets"][0]
            )
            width = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
            header[second]["data_offsets"] = [0, width]
        elif kind == "unexpected name":
            header["9.k.q"] = header.pop(names[0])
        elif kind == "wrong shape":
            shape = header["0.k.q"]["shape"]
            header["0.k.q"]["shape"] = [shape[0], shape[1], shape[2] * 2, shape[3] // 2]
        elif kind == "huge shape":
            header["0.k.q"]["shape"] = [2**62, 2**62]
        elif kind == "extra key":
            header["0.k.q"]["evil"] = 1
        elif kind in ("bool dim", "float dim"):  # equal to the int in Python: not allowed
            shape = header["0.k.q"]["shape"]
            assert shape[0] == 1
            header["0.k.q"]["shape"] = [True if kind == "bool dim" else 1.0, *shape[1:]]
        elif kind == "float offsets":
            header["0.k.q"]["data_offsets"] = [float(o) for o in header["0.k.q"]["data_offsets"]]
        rewrite_segment(root, json.dumps(header).encode(), data)

    return craft


def truncate(root: Path) -> None:
    path = seg_path(root)
    os.truncate(path, path.stat().st_size - 100)


def flip_byte(root: Path) -> None:
    path = seg_path(root)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40
    path.write_bytes(raw)


def bad_manifest(text: str, *, framed: bool = False) -> Any:
    """Write ``text`` as the manifest, bare or framed with its right checksum."""

    def craft(root: Path) -> None:
        raw = text.encode()
        if framed:
            raw = b'{"checksum":"%s","manifest":%s}' % (body_checksum(raw).encode(), raw)
        (folder(root, "a") / "manifest.json").write_bytes(raw)

    return craft


def altered_manifest(root: Path) -> None:
    path = folder(root, "a") / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"n_tokens":10', b'"n_tokens":11'))


def huge_manifest(root: Path) -> None:
    os.truncate(folder(root, "a") / "manifest.json", 40 << 20)


def broken_tiling(root: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["segments"][0]["start"] = 3

    edit_manifest(root, "a", change)


def escaping_segment_name(root: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["segments"][0]["file"] = "../b/seg-1.safetensors"

    edit_manifest(root, "a", change)


def other_format(root: Path) -> None:
    def change(m: dict[str, Any]) -> None:
        m["format_version"] = 99

    edit_manifest(root, "a", change)


def manifest_value(change: Any) -> Any:
    """A consistent edit of the manifest's body (see ``edit_manifest``)."""

    def craft(root: Path) -> None:
        edit_manifest(root, "a", change)

    return craft


def setting(*path: Any, value: Any) -> Any:
    def change(m: dict[str, Any]) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return manifest_value(change)


REFUSALS = {
    "truncated file": (truncate, "truncated"),
    "flipped byte": (flip_byte, "checksum mismatch"),
    "other format version": (other_format, "format version 99"),
    "manifest not json": (bad_manifest("{nope"), "malformed manifest"),
    "manifest wrong types": (
        bad_manifest('{"format_version": 3, "agent": 3}', framed=True),
        "malformed",
    ),
    "manifest of format 1": (
        bad_manifest('{"format_version": 1, "agent": "a"}'),
        "format version 1, this store reads 2 and 3",
    ),
    "manifest unframed": (bad_manifest('{"format_version": 2}'), "not framed"),
    "manifest altered": (altered_manifest, "manifest checksum mismatch"),
    "manifest too large": (huge_manifest, "exceeds"),
    "segments do not tile": (broken_tiling, "does not continue"),
    "token id past the vocabulary": (
        setting("token_ids", 2, value=1000),
        r"token id 1000 at 2 is outside the vocabulary \[0, 1000\)",
    ),
    "negative token id": (setting("token_ids", 5, value=-1), "token id -1 at 5 is outside"),
    "huge segment range": (setting("segments", 0, "stop", value=1 << 40), "does not continue"),
    "huge segment size": (setting("segments", 0, "nbytes", value=1 << 50), "bad size"),
    "segment numbered past the last": (
        setting("last_segment", value=0),
        "numbered past the last one",
    ),
    "negative time": (setting("created", value=-1.0), "created is not a finite time"),
    "segment name escapes": (escaping_segment_name, "bad or repeated segment file name"),
    "huge header length": (hostile("huge header length"), "exceeds"),
    "header past the end": (hostile("header past the end"), "past the end"),
    "bad json": (hostile("bad json"), "not valid JSON"),
    "deep json": (hostile("deep json"), "not valid JSON"),
    "bad dtype": (hostile("bad dtype"), "not allowed"),
    "offsets beyond file": (hostile("offsets beyond file"), "outside"),
    "overlapping offsets": (hostile("overlapping offsets"), "overlaps"),
    "unexpected name": (hostile("unexpected name"), "unexpected tensor"),
    "wrong shape": (hostile("wrong shape"), "expected uint32"),
    "huge shape": (hostile("huge shape"), "bad shape"),
    "extra key": (hostile("extra key"), "exactly dtype"),
    "bool dim": (hostile("bool dim"), "bad shape"),
    "float dim": (hostile("float dim"), "bad shape"),
    "float offsets": (hostile("float offsets"), "data offsets"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refuses_and_keeps(tmp_path: Path, case: str) -> None:
    craft, reason = REFUSALS[case]
    put(tmp_path, "a", 0, 10, seed=1)
    craft(tmp_path)
    before = {p.name: p.read_bytes() for p in folder(tmp_path, "a").iterdir()}
    with pytest.raises(CacheRejected, match=reason) as info:
        read_cache(tmp_path, IDENTITY, expect, "a")
    assert str(folder(tmp_path, "a")) in str(info.value)
    assert "kept" in str(info.value)
    after = {p.name: p.read_bytes() for p in folder(tmp_path, "a").iterdir()}
    assert after == before  # nothing touched, kept for inspection


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_fingerprint": "sha256:other"}, "made by model 'sha256:0123456789abcdef'"),
        ({"codec": {**IDENTITY.codec, "bits": 8}}, "codec"),
        ({"codec": {**IDENTITY.codec, "rotate": 0}}, "codec"),  # 0 == False, still other
        ({"format_version": 2}, "format version 3, this store reads 2"),
        ({"n_kv_heads": 3}, "kv heads"),
    ],
)
def test_refuses_other_identities(tmp_path: Path, change: dict[str, Any], reason: str) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    other = msgspec.structs.replace(IDENTITY, **change)
    with pytest.raises(CacheRejected, match=reason):
        read_cache(tmp_path, other, expect, "a")
    with pytest.raises(CacheRejected, match=reason):
        read_manifest(tmp_path, other, "a")
    assert read_cache(tmp_path, IDENTITY, expect, "a").manifest.n_tokens == 10


def _as_format_2(root: Path, agent: str) -> None:
    """Rewrite ``agent``'s cache as format 2 wrote it: segment headers saying version 2,
    CRC-32 checksums of the whole files and of the manifest's body."""
    path = folder(root, agent) / "manifest.json"
    data = json.loads(path.read_text())["manifest"]
    for entry in data["segments"]:
        seg = folder(root, agent) / entry["file"]
        raw = seg.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header["__metadata__"]["format_version"] = "2"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        blob = len(text).to_bytes(8, "little") + text + raw[8 + n :]
        seg.write_bytes(blob)
        entry["nbytes"], entry["checksum"] = len(blob), f"crc32:{zlib.crc32(blob):08x}"
    data["format_version"] = 2
    body = json.dumps(data).encode()
    path.write_bytes(b'{"checksum":"crc32:%08x","manifest":%s}' % (zlib.crc32(body), body))


def test_a_format_2_cache_loads_and_grows_in_format_3(tmp_path: Path) -> None:
    first = put(tmp_path, "a", 0, 10, seed=1)
    _as_format_2(tmp_path, "a")
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert loaded.manifest.format_version == 2 and loaded.manifest.n_tokens == 10
    assert_same(loaded.segments[0], first)
    second = put(tmp_path, "a", 10, 16, seed=2)  # a new turn: written in format 3
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert loaded.manifest.format_version == 3
    assert [s.checksum.split(":")[0] for s in loaded.manifest.segments] == ["crc32", "xxh3t"]
    assert_same(loaded.segments[0], first)
    assert_same(loaded.segments[1], second)
    # A format-2 segment whose bytes changed is still caught, by its own CRC-32.
    seg = seg_path(tmp_path)
    raw = bytearray(seg.read_bytes())
    raw[-1] ^= 1
    seg.write_bytes(bytes(raw))
    with pytest.raises(CacheRejected, match="checksum mismatch"):
        read_cache(tmp_path, IDENTITY, expect, "a")


def test_segment_metadata_must_match(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    header, data = split_segment(tmp_path)
    header["__metadata__"]["model_fingerprint"] = "sha256:other"
    rewrite_segment(tmp_path, json.dumps(header).encode(), data)
    with pytest.raises(CacheRejected, match="metadata model_fingerprint"):
        read_cache(tmp_path, IDENTITY, expect, "a")


def test_delete_rejected(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    flip_byte(tmp_path)
    with pytest.raises(CacheRejected, match="deleted"):
        read_cache(tmp_path, IDENTITY, expect, "a", delete_rejected=True)
    assert not folder(tmp_path, "a").exists()
    with pytest.raises(UnknownAgent):
        read_cache(tmp_path, IDENTITY, expect, "a")


def test_append_onto_a_refused_cache(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    flip_byte(tmp_path)
    refused = {p.name: p.read_bytes() for p in folder(tmp_path, "a").iterdir()}
    with pytest.raises(CacheRejected, match="checksum"):
        read_cache(tmp_path, IDENTITY, expect, "a")
    other = msgspec.structs.replace(IDENTITY, model_fingerprint="sha256:new")
    # Another model cannot extend it, only replace it from token 0.
    with pytest.raises(CacheRejected, match="append from token 0"):
        append_cache(tmp_path, other, expect, "a", 10, make(10, 11, 2), tokens(11))
    new = make(0, 5, seed=3)
    append_cache(tmp_path, other, expect, "a", 0, new, tokens(5))
    assert_same(read_cache(tmp_path, other, expect, "a").segments[0], new)
    # The refused copy was set aside, byte for byte.
    aside = tmp_path / "rejected" / "a"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == refused


def test_unknown_agent(tmp_path: Path) -> None:
    with pytest.raises(UnknownAgent, match="nobody"):
        read_cache(tmp_path, IDENTITY, expect, "nobody")
    assert read_manifest(tmp_path, IDENTITY, "nobody") is None
    assert list_agents(tmp_path) == []


HOSTILE_IDS = ["../x", "a/b", "", "x" * 200, "..", ".hidden", "a\x00b", "a\\b", "-x", 7]


@pytest.mark.parametrize("agent", HOSTILE_IDS)
def test_hostile_agent_ids_never_touch_the_disk(tmp_path: Path, agent: Any) -> None:
    root = tmp_path / "cache"
    calls = [
        lambda: append_cache(root, IDENTITY, expect, agent, 0, make(0, 1, 1), [1]),
        lambda: read_cache(root, IDENTITY, expect, agent),
        lambda: read_manifest(root, IDENTITY, agent),
        lambda: forget(root, agent),
    ]
    for call in calls:
        with pytest.raises(InvalidAgentId):
            call()
    assert not root.exists()


def test_symlinked_agent_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    put(outside, "a", 0, 3, seed=1)
    root = tmp_path / "cache"
    (root / "agents").mkdir(parents=True)
    (root / "agents" / "a").symlink_to(folder(outside, "a"))
    with pytest.raises(InvalidAgentId, match="outside"):
        read_cache(root, IDENTITY, expect, "a")
    with pytest.raises(InvalidAgentId, match="outside"):
        forget(root, "a")
    assert folder(outside, "a").is_dir()


# --------------------------------------------------------------- forget, orphans, crashes
def test_forget_removes_every_byte(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    put(tmp_path, "a", 10, 12, seed=2)
    other = msgspec.structs.replace(IDENTITY, model_fingerprint="sha256:new")
    # Another model refuses the cache and replaces it: the old copy is set aside.
    append_cache(tmp_path, other, expect, "a", 0, make(0, 3, 3), tokens(3))
    assert (tmp_path / "rejected" / "a" / "seg-2.safetensors").is_file()
    put(tmp_path, "b", 0, 4, seed=4)
    expected = sum(
        p.stat().st_size
        for base in (folder(tmp_path, "a"), tmp_path / "rejected" / "a")
        for p in base.iterdir()
    )
    assert forget(tmp_path, "a") == expected
    assert not folder(tmp_path, "a").exists()
    assert not (tmp_path / "rejected" / "a").exists()
    assert forget(tmp_path, "a") == 0
    assert forget(tmp_path, "never") == 0
    assert [i.agent for i in list_agents(tmp_path)] == ["b"]


def test_orphans_are_ignored_then_removed(tmp_path: Path) -> None:
    t = put(tmp_path, "a", 0, 10, seed=1)
    base = folder(tmp_path, "a")
    (base / "seg-7.safetensors").write_bytes(b"junk from a crash")
    (base / ".seg-8.safetensors.123-abcd.tmp").write_bytes(b"half written")
    (base / ".manifest.json.123-abcd.tmp").write_bytes(b"{")
    assert_same(read_cache(tmp_path, IDENTITY, expect, "a").segments[0], t)
    u = put(tmp_path, "a", 10, 11, seed=2)
    # The new segment skips the orphan's number, then the orphans go.
    assert files(tmp_path, "a") == ["manifest.json", "seg-1.safetensors", "seg-8.safetensors"]
    assert_same(joined(read_cache(tmp_path, IDENTITY, expect, "a")), cat(t, u))


class FailingOS:
    """The ``os`` module as the store sees it, but the disk fills up at the chosen call."""

    def __init__(self, fail: str, at: int) -> None:
        self.fail, self.at, self.calls = fail, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _maybe_fail(self, name: str) -> None:
        if name == self.fail:
            self.calls += 1
            if self.calls == self.at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, fd: int, data: Any) -> int:
        self._maybe_fail("write")
        return os.write(fd, data)

    def writev(self, fd: int, buffers: Any) -> int:
        # A short write, as writev may do: the first buffer and half of the second.
        self._maybe_fail("write")
        first, second = buffers[0], buffers[1]
        return os.writev(fd, [first, second[: len(second) // 2]])

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        os.fsync(fd)


@pytest.mark.parametrize(
    ("fail", "at", "orphan"),
    [
        ("write", 2, False),  # in the middle of the segment's tensor bytes
        ("fsync", 1, False),  # the segment's fsync
        ("fsync", 3, True),  # the manifest's fsync: a crash between segment and manifest
    ],
)
def test_disk_full_keeps_the_previous_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str, at: int, orphan: bool
) -> None:
    t = put(tmp_path, "a", 0, 10, seed=1)
    monkeypatch.setattr(_durable, "os", FailingOS(fail, at))
    with pytest.raises(StoreWriteError, match="ENOSPC") as info:
        put(tmp_path, "a", 10, 15, seed=2)
    assert isinstance(info.value.__cause__, OSError)
    assert not [n for n in files(tmp_path, "a") if n.endswith(".tmp")]
    assert ("seg-2.safetensors" in files(tmp_path, "a")) == orphan
    monkeypatch.undo()
    loaded = read_cache(tmp_path, IDENTITY, expect, "a")
    assert loaded.manifest.n_tokens == 10
    assert_same(loaded.segments[0], t)
    # The next append works and leaves no orphan behind.
    u = put(tmp_path, "a", 10, 12, seed=3)
    assert len(files(tmp_path, "a")) == 3
    assert_same(joined(read_cache(tmp_path, IDENTITY, expect, "a")), cat(t, u))


def test_list_agents_reports_refused_ones(tmp_path: Path) -> None:
    put(tmp_path, "good", 0, 10, seed=1)
    other = msgspec.structs.replace(IDENTITY, model_fingerprint="sha256:other")
    append_cache(tmp_path, other, expect, "foreign", 0, make(0, 3, 2), tokens(3))
    put(tmp_path, "short", 0, 5, seed=3)
    os.truncate(seg_path(tmp_path, "short"), 50)
    (tmp_path / "agents" / "orphaned").mkdir()
    (tmp_path / "agents" / "bad..id").mkdir()
    infos = {i.agent: i for i in list_agents(tmp_path, IDENTITY)}
    assert set(infos) == {"good", "foreign", "short", "orphaned", "bad..id"}
    assert infos["good"].rejected is None and infos["good"].tokens == 10
    assert "made by model 'sha256:other'" in str(infos["foreign"].rejected)
    assert "50 bytes" in str(infos["short"].rejected)
    assert "no manifest" in str(infos["orphaned"].rejected)
    assert "agent id" in str(infos["bad..id"].rejected)
    # Without an identity (the CLI) a foreign cache is listed as it is.
    assert {i.agent: i.rejected for i in list_agents(tmp_path)}["foreign"] is None
    # The names alone (one listing, no manifest read): every folder named by an agent id,
    # refused caches too; no hidden folder, no file.
    (tmp_path / "agents" / ".tmp-write").mkdir()
    (tmp_path / "agents" / "stray-file").write_bytes(b"")
    assert agent_names(tmp_path) == ["foreign", "good", "orphaned", "short"]
    assert agent_names(tmp_path / "nowhere") == []

    rows = inspect_rows(tmp_path, IDENTITY)
    assert [r["agent"] for r in rows] == sorted(infos)
    good = next(r for r in rows if r["agent"] == "good")
    assert good["tier"] is Tier.WARM and good["status"] == "ok" and good["tokens"] == 10
    assert good["bytes"] == infos["good"].nbytes
    assert good["codec"] == "bits=4,group=64,kind=affine,rotate=False"
    table = format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["AGENT", "TIER", "TOKENS"]
    assert "rejected: made by model" in table
    assert format_table([]) == "no warm caches"


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVACTOR_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("KVACTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvactor" / "agents-cache"


def test_public_names() -> None:
    assert isinstance(store_module.__all__, tuple)
    for name in store_module.__all__:
        assert hasattr(store_module, name), name


# ------------------------------------------------------------------------------ actor
async def test_actor_concurrent_appends_for_many_agents(tmp_path: Path) -> None:
    agents = [f"agent-{i}" for i in range(6)]
    sent: dict[str, Tensors] = {}

    async with Runtime() as rt:
        store = await rt.spawn(StoreActor, IDENTITY, expect, tmp_path, name="store")

        async def turns(i: int, agent: str) -> None:
            first = make(0, 8 + i, seed=i)
            await store.ask(Append(agent, 0, first, tokens(8 + i), text="one"))
            second = make(8 + i, 12 + i, seed=100 + i)
            info = await store.ask(
                Append(agent, 8 + i, second, tokens(12 + i), text="one two", extra={"i": i})
            )
            assert (info.tokens, info.segments) == (12 + i, 2)
            sent[agent] = cat(first, second)

        async with anyio.create_task_group() as tg:
            for i, agent in enumerate(agents):
                tg.start_soon(turns, i, agent)

        for i, agent in enumerate(agents):
            loaded = await store.ask(Load(agent))
            assert_same(joined(loaded), sent[agent])
            manifest = await store.ask(Manifest(agent))
            assert (manifest.text, manifest.extra, manifest.n_tokens) == (
                "one two",
                {"i": i},
                12 + i,
            )
        infos = await store.ask(ListAgents())
        assert [(i.agent, i.rejected) for i in infos] == [(a, None) for a in agents]


async def test_actor_manifest_refusals_and_forget(tmp_path: Path) -> None:
    async with Runtime() as rt:
        store = await rt.spawn(StoreActor, IDENTITY, expect, tmp_path)
        assert await store.ask(Manifest("a")) is None
        with pytest.raises(UnknownAgent):
            await store.ask(Load("a"))
        with pytest.raises(InvalidAgentId):
            await store.ask(Load("../etc"))
        with pytest.raises(InvalidAgentId):
            await store.ask(Append("a/b", 0, {}, []))
        t = make(0, 10, seed=1)
        await store.ask(Append("a", 0, t, tokens(10), text="hi"))
        assert (await store.ask(Manifest("a"))).text == "hi"
        await store.ask(Append("b", 0, make(0, 4, seed=2), tokens(4)))
        flip_byte(tmp_path)  # corrupts a's segment: only a full Load can see it
        assert [i.rejected for i in await store.ask(ListAgents())] == [None, None]
        with pytest.raises(CacheRejected, match="checksum"):
            await store.ask(Load("a"))
        infos = {i.agent: i for i in await store.ask(ListAgents())}
        assert "checksum mismatch" in str(infos["a"].rejected)
        assert infos["b"].rejected is None
        on_disk = sum(p.stat().st_size for p in folder(tmp_path, "a").iterdir())
        assert (await store.ask(Forget("a"))).freed == on_disk
        assert (await store.ask(Forget("a"))).freed == 0
        assert await store.ask(Manifest("a")) is None
        assert [i.agent for i in await store.ask(ListAgents())] == ["b"]
        with pytest.raises(TypeError):
            await store.ask(object())


async def test_actor_keeps_only_its_last_manifests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that read more manifests than ``manifests_kept`` (every spawned agent's, idle
    or not) keeps the last ones only and reads the others again: a rewrite behind its back,
    never done in use, shows which it held."""
    monkeypatch.setattr(StoreActor, "manifests_kept", 3)
    for i in range(5):
        put(tmp_path, f"a{i}", 0, 4, seed=i, text=f"old{i}")
    async with Runtime() as rt:
        store = await rt.spawn(StoreActor, IDENTITY, expect, tmp_path)
        for i in range(5):
            assert (await store.ask(Manifest(f"a{i}"))).text == f"old{i}"
        for i in range(5):
            append_cache(tmp_path, IDENTITY, expect, f"a{i}", 4, {}, tokens(4), text=f"new{i}")
        texts = [(await store.ask(Manifest(f"a{i}"))).text for i in reversed(range(5))]
        assert texts == ["old4", "old3", "old2", "new1", "new0"]


async def test_actor_deletes_rejected_when_asked(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    truncate(tmp_path)
    async with Runtime() as rt:
        store = await rt.spawn(StoreActor, IDENTITY, expect, tmp_path, delete_rejected=True)
        with pytest.raises(CacheRejected, match=r"truncated.*deleted"):
            await store.ask(Load("a"))
        assert not folder(tmp_path, "a").exists()
        assert await store.ask(ListAgents()) == []


async def test_actor_sets_aside_a_cache_it_refused_when_rewritten(tmp_path: Path) -> None:
    put(tmp_path, "a", 0, 10, seed=1)
    flip_byte(tmp_path)  # the manifest stays sound: only Load can refuse this cache
    refused = {p.name: p.read_bytes() for p in folder(tmp_path, "a").iterdir()}
    async with Runtime() as rt:
        store = await rt.spawn(StoreActor, IDENTITY, expect, tmp_path)
        with pytest.raises(CacheRejected, match="checksum"):
            await store.ask(Load("a"))
        with pytest.raises(CacheRejected, match="cannot extend a refused cache"):
            await store.ask(Append("a", 10, make(10, 11, seed=2), tokens(11)))
        new = make(0, 5, seed=3)
        await store.ask(Append("a", 0, new, tokens(5)))
        assert_same(joined(await store.ask(Load("a"))), new)
        assert [(i.agent, i.rejected) for i in await store.ask(ListAgents())] == [("a", None)]
    aside = tmp_path / "rejected" / "a"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == refused
