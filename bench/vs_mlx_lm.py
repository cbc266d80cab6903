"""Our warm tier vs mlx-lm's prompt-cache files, on the same 4K-token Q4 cache of the
default model's shape (30 layers, 3 KV heads, head_dim 64), in one run:

- save + load time: ours (one safetensors segment + manifest, fsync'd, verified on load,
  turned into MLX arrays) vs mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` of
  the same cache as its ``QuantizedKVCache`` (4-bit, group 64, fp16 scales: the same
  bytes as ours), arrays evaluated; medians of ``--rounds`` rounds that alternate the two;
- the bytes written when the warm cache is extended by 256 tokens and saved again, vs a
  full rewrite (what mlx-lm's single file needs);
- the floors any durable store meets on this disk, in the same run: writing a file of
  our segment's size plus one fsync (``write_floor_s``), reading it with the page cache
  dropped (``read_floor_s``: the faster of one sequential read and 8 parallel ones); the
  checksum's rate, the fsyncs a commit makes, and, in a session on a random model of the
  default model's cache shape, the time from a turn's last token to its Completion
  (``completion_after_last_token_s``: a 4K first turn, whose tokens the engine
  quantizes then; ``completion_after_last_token_extend_s``: a 32-token turn after it).

    python bench/vs_mlx_lm.py [--tokens 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kvactor

# isort: split
import anyio
import mlx.core as mx
import numpy as np
from _results import write_json  # bench/ is the script's folder: on sys.path
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from kvactor.actors.models import make_tiny_model
from kvactor.actors.warm import CacheIdentity, _durable, read_cache
from kvactor.actors.warm._checksum import file_checksum
from kvactor.actors.warm._write import append_cache
from kvactor.kernels.agent_cache import AgentKV
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC
from kvactor.kernels.stored import StoredRange, segment_layout

LAYERS, HEADS, DIM = 30, 3, 64


def drop(path: Path) -> None:
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def float_working(kv: list[tuple[mx.array, mx.array]], n: int) -> FloatTurnCache:
    """A one-row float working cache holding the first ``n`` tokens of every layer."""
    layers = []
    for k, v in kv:
        c = KVCache()
        c.state = (k[:, :, :n], v[:, :, :n], n)
        layers.append(c)
    return FloatTurnCache(layers)


def write_floor(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it: what any durable save costs."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = data.data
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_floor(path: Path) -> float:
    """Seconds to read ``path`` with the page cache dropped: the faster of one sequential
    read and 8 threads reading 1 MiB pieces (no checksum, no parsing)."""
    size = path.stat().st_size
    best = float("inf")
    for parallel in (False, True):
        drop(path)
        buffer = bytearray(size)
        view = memoryview(buffer)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            if parallel:
                spans = [(a, min(a + (1 << 20), size)) for a in range(0, size, 1 << 20)]
                with ThreadPoolExecutor(8) as pool:
                    piece = functools.partial(_read_piece, fd, view)
                    list(pool.map(piece, spans))
            else:
                got = 0
                while got < size:
                    got += os.readv(fd, [view[got:]])
        finally:
            os.close(fd)
        best = min(best, time.perf_counter() - t0)
    return best


def _read_piece(fd: int, view: memoryview, span: tuple[int, int]) -> int:
    return os.preadv(fd, [view[span[0] : span[1]]], span[0])


def checksum_gbps(nbytes: int) -> float:
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        file_checksum([data.data])
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


async def completion_after_last_token(n: int, root: Path) -> tuple[float, float, float]:
    """(first turn, its write alone, an extending turn): seconds from the last token to
    the Completion, in a session on a random model of the default model's cache shape."""
    model = functools.partial(
        make_tiny_model, 0, num_hidden_layers=LAYERS, num_key_value_heads=HEADS,
        num_attention_heads=HEADS, head_dim=DIM, hidden_size=HEADS * DIM,
        intermediate_size=256, max_position_embeddings=2 * n,
    )  # fmt: skip
    async with kvactor.open(model, cache_dir=root) as session:
        agent = await session.spawn_agent("turns")
        first = await agent.complete("x " * (n // 2), max_tokens=2)
        again = await agent.complete("x " * (n // 2) + "y" * 64, max_tokens=32)
    return first.timings.save_s, first.timings.write_s, again.timings.save_s


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _save_and_load(
    root: Path,
    identity: CacheIdentity,
    geometry: CacheGeometry,
    first: Any,
    tokens: list[int],
    theirs: list[Any],
    rounds: int,
) -> dict[str, list[float]]:
    """``rounds`` saves and loads of our cache (``first``, the stored range of ``tokens``)
    and of mlx-lm's (``theirs``), each load from a dropped page cache: seconds of each."""
    expect = segment_layout(DEFAULT_CODEC, geometry)
    rows: dict[str, list[float]] = {
        k: [] for k in ("ours_save", "ours_load", "mlx_save", "mlx_save_fsync", "mlx_load")
    }
    for r in range(rounds):
        agent = f"bench-{r}"
        t0 = time.perf_counter()
        append_cache(root, identity, expect, agent, 0, first.to_numpy(), tokens)
        rows["ours_save"].append(time.perf_counter() - t0)
        drop(root / "agents" / agent)
        t0 = time.perf_counter()
        loaded = read_cache(root, identity, expect, agent)
        ranges = [StoredRange.from_numpy(s, e, geometry, t) for s, e, t in loaded.ranges()]
        mx.eval([a for rg in ranges for k, v in rg.layers for a in (*k.values(), *v.values())])
        rows["ours_load"].append(time.perf_counter() - t0)

        path = root / f"mlx-{r}.safetensors"
        t0 = time.perf_counter()
        save_prompt_cache(str(path), theirs)
        rows["mlx_save"].append(time.perf_counter() - t0)
        # mlx-lm does not fsync. Timed separately: the same durability as ours costs
        # this much more; dirty pages also cannot be dropped, so its load needs it.
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        rows["mlx_save_fsync"].append(time.perf_counter() - t0)
        drop(path)
        t0 = time.perf_counter()
        back = load_prompt_cache(str(path))
        mx.eval([c.state for c in back])
        rows["mlx_load"].append(time.perf_counter() - t0)
    return rows


def main(n: int, extend: int, rounds: int) -> dict[str, Any]:
    mx.random.seed(0)
    kv_full = [
        (
            mx.random.normal((1, HEADS, n + extend, DIM)),
            mx.random.normal((1, HEADS, n + extend, DIM)),
        )
        for _ in range(LAYERS)
    ]
    mx.eval(kv_full)
    geometry = CacheGeometry.uniform(LAYERS, HEADS, DIM)
    ours = AgentKV(DEFAULT_CODEC, geometry)
    ours.tokens = list(range(n))
    ours.work = float_working(kv_full, n)
    first = ours.deactivate()
    assert first is not None
    theirs = []
    for k, v in kv_full:
        # From fp16, as a model running in fp16 makes it: scales and biases in fp16, so its
        # file holds as many bytes as ours (from fp32 its scales would be fp32, 11% more).
        c = KVCache()
        c.state = (k[:, :, :n].astype(mx.float16), v[:, :, :n].astype(mx.float16), n)
        theirs.append(c.to_quantized(group_size=64, bits=4))
    mx.eval([c.state for c in theirs])
    identity = CacheIdentity(
        model_fingerprint="bench",
        codec=DEFAULT_CODEC.describe(),
        n_layers=LAYERS,
        n_kv_heads=HEADS,
        head_dim=DIM,
        vocab_size=1 << 20,  # above every id here: tokens are list(range(n))
    )
    expect = segment_layout(DEFAULT_CODEC, geometry)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
        root = Path(tmp)
        rows = _save_and_load(root, identity, geometry, first, ours.tokens, theirs, rounds)
        ours_bytes = folder_bytes(root / "agents" / "bench-0")
        mlx_bytes = (root / "mlx-0.safetensors").stat().st_size

        # Extend by `extend` tokens: only a new segment and the manifest are written.
        ours.work = float_working(kv_full, n + extend)
        ours.tokens = list(range(n + extend))
        new = ours.deactivate()
        assert new is not None and new.start == n
        manifest = root / "agents" / "bench-0" / "manifest.json"
        synced = _durable.fsyncs
        append_cache(root, identity, expect, "bench-0", n, new.to_numpy(), ours.tokens)
        fsyncs = _durable.fsyncs - synced
        seg_new = max((root / "agents" / "bench-0").glob("seg-*"), key=lambda p: p.stat().st_mtime)
        extend_written = seg_new.stat().st_size + manifest.stat().st_size
        full = folder_bytes(root / "agents" / "bench-0")
        seg = max((root / "agents" / "bench-1").glob("seg-*"), key=lambda p: p.stat().st_size)
        seg_bytes = seg.stat().st_size
        floor = root / "floor.bin"
        writes, reads = [], []
        for _ in range(rounds):
            writes.append(write_floor(floor, seg_bytes))
            reads.append(read_floor(floor))
        after = anyio.run(completion_after_last_token, n, root / "session")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "tokens": n,
        "ours_s": med["ours_save"] + med["ours_load"],
        "mlx_lm_s": med["mlx_save"] + med["mlx_load"],
        "ours_save_s": med["ours_save"],
        "ours_load_s": med["ours_load"],
        "mlx_lm_save_s": med["mlx_save"],
        "mlx_lm_save_fsync_s": med["mlx_save_fsync"],
        "mlx_lm_durable_s": med["mlx_save_fsync"] + med["mlx_load"],
        "mlx_lm_load_s": med["mlx_load"],
        "ours_bytes": ours_bytes,
        "mlx_lm_bytes": mlx_bytes,
        "extend_tokens": extend,
        "extend_bytes_written": extend_written,
        "full_bytes": full,
        "extend_fraction": extend_written / full,
        "codec": DEFAULT_CODEC.name,
        "write_floor_s": statistics.median(writes),
        "read_floor_s": statistics.median(reads),
        "save_vs_write_floor": med["ours_save"] / statistics.median(writes),
        "load_vs_read_floor": med["ours_load"] / statistics.median(reads),
        "mlx_lm_durable_vs_ours": (med["mlx_save_fsync"] + med["mlx_load"])
        / (med["ours_save"] + med["ours_load"]),
        "checksum_gbps": checksum_gbps(seg_bytes),
        "fsyncs_per_commit": fsyncs,
        "completion_after_last_token_s": after[0],
        "completion_write_s": after[1],
        "completion_after_last_token_extend_s": after[2],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--extend", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    r = main(args.tokens, args.extend, args.rounds)
    print(f"{r['tokens']}-token Q4 cache ({r['codec']} ours; mlx-lm QuantizedKVCache 4-bit g64)\n")
    print("| | save | load (page cache dropped) | save + load | file bytes |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| kvactor warm tier (fsync'd, verified) | {r['ours_save_s'] * 1e3:.1f} ms "
        f"| {r['ours_load_s'] * 1e3:.1f} ms | {r['ours_s'] * 1e3:.1f} ms | {r['ours_bytes']:,} |"
    )
    print(
        f"| mlx-lm save/load_prompt_cache (save not fsync'd) | {r['mlx_lm_save_s'] * 1e3:.1f} ms "
        f"| {r['mlx_lm_load_s'] * 1e3:.1f} ms | {r['mlx_lm_s'] * 1e3:.1f} ms "
        f"| {r['mlx_lm_bytes']:,} |"
    )
    print(
        f"| mlx-lm, save + fsync (our durability) | {r['mlx_lm_save_fsync_s'] * 1e3:.1f} ms "
        f"| {r['mlx_lm_load_s'] * 1e3:.1f} ms | {r['mlx_lm_durable_s'] * 1e3:.1f} ms "
        f"| {r['mlx_lm_bytes']:,} |"
    )
    print(
        f"\nextend by {r['extend_tokens']} tokens: {r['extend_bytes_written']:,} bytes written "
        f"= {r['extend_fraction']:.1%} of a full write ({r['full_bytes']:,} bytes)"
    )
    print(
        f"floors: write + fsync {r['write_floor_s'] * 1e3:.1f} ms (ours "
        f"{r['save_vs_write_floor']:.2f}x), read {r['read_floor_s'] * 1e3:.1f} ms (ours "
        f"{r['load_vs_read_floor']:.2f}x); mlx-lm durable / ours "
        f"{r['mlx_lm_durable_vs_ours']:.2f}; checksum {r['checksum_gbps']:.1f} GB/s; "
        f"{r['fsyncs_per_commit']} fsyncs per commit"
    )
    print(
        f"last token -> Completion: {r['completion_after_last_token_s'] * 1e3:.0f} ms for a "
        f"{r['tokens']}-token first turn (its write {r['completion_write_s'] * 1e3:.0f} ms), "
        f"{r['completion_after_last_token_extend_s'] * 1e3:.0f} ms for a 32-token turn"
    )
    if args.json:
        write_json(args.json, r)
