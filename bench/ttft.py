"""Time to first token of the default model when an agent comes back: cold (full prefill),
warm (its cache reloaded from disk, page cache dropped), warm after a prefetch hint, and
hot (cache in memory), at several context lengths, in one run; warm and hot again with
``attention="quantized"`` (turns attend over the stored cache, no float copy is made), and
one agent's decode tokens/s at that context in both attention modes.

    python bench/ttft.py [--contexts 1024 2048 4096] [--json PATH]

Every path is measured from the caller: ``await agent.complete(prompt, max_tokens=1)``.
The disk's sequential read bandwidth is measured in the same run on a fresh file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio

COLD, WARM, HOT = kvactor.Tier.COLD, kvactor.Tier.WARM, kvactor.Tier.HOT
TEXT = Path(__file__).with_name("data") / "fidelity.txt"


def drop_page_cache(folder: Path) -> bool:
    """Evict the folder's files from the page cache (no root needed for clean pages)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def disk_read_gbps(folder: Path, nbytes: int = 256 << 20) -> float:
    """Sequential read of a fresh, uncached file."""
    path = folder / "bandwidth.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache(folder)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    elapsed = time.perf_counter() - t0
    path.unlink()
    return nbytes / elapsed / 1e9


async def timed(agent: kvactor.Agent, prompt: str) -> tuple[float, kvactor.Completion]:
    t0 = time.perf_counter()
    done = await agent.complete(prompt, max_tokens=1)
    return time.perf_counter() - t0, done


async def decode_rate(agent: kvactor.Agent, prompt: str, tokens: int = 17) -> float:
    """Decode tokens/s of one agent at this context (after its first token)."""
    done = await agent.complete(prompt, max_tokens=tokens)
    return (done.timings.generated_tokens - 1) / done.timings.decode_s


async def measure(n: int, text: str, root: Path) -> dict[str, Any]:
    async with kvactor.open(cache_dir=root) as kv:
        prompt = kv.tokenizer.decode(kv.tokenizer.encode(text)[:n])
        agent = await kv.spawn_agent(f"ttft-{n}")
        cold_s, cold = await timed(agent, prompt)
        await agent.state()  # the warm copy is written before going on
        hot_s, hot = await timed(agent, prompt)
        await agent.state()
    folder = root / "agents" / f"ttft-{n}"
    file_bytes = sum(p.stat().st_size for p in folder.glob("seg-*"))
    dropped = drop_page_cache(folder)
    async with kvactor.open(cache_dir=root) as kv:  # a new session: nothing is hot
        agent = await kv.spawn_agent(f"ttft-{n}")
        warm_s, warm = await timed(agent, prompt)
        await agent.state()
    drop_page_cache(folder)
    async with kvactor.open(cache_dir=root) as kv:
        agent = await kv.spawn_agent(f"ttft-{n}")
        t0 = time.perf_counter()
        await kv.prefetch(agent.name)
        while (await kv.stats()).installs == 0:
            await anyio.sleep(0.001)
        staged_s = time.perf_counter() - t0
        prefetched_s, prefetched = await timed(agent, prompt)
    # The same warm cache, read by turns that attend over it quantized (no float copy).
    drop_page_cache(folder)
    async with kvactor.open(cache_dir=root, attention="quantized") as kv:
        agent = await kv.spawn_agent(f"ttft-{n}")
        warm_q_s, warm_q = await timed(agent, prompt)
        await agent.state()
        hot_q_s, hot_q = await timed(agent, prompt)
        decode_q = await decode_rate(agent, prompt)
    async with kvactor.open(cache_dir=root, attention="dequantized") as kv:
        decode_d = await decode_rate(await kv.spawn_agent(f"ttft-{n}"), prompt)
    paths = (cold.path, warm.path, hot.path, prefetched.path, warm_q.path, hot_q.path)
    assert paths == (COLD, WARM, HOT, HOT, WARM, HOT), paths
    return {
        "tokens": cold.timings.prompt_tokens,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "warm_prefetched_s": prefetched_s,
        "prefetch_stage_s": staged_s,
        "hot_s": hot_s,
        "warm_quantized_s": warm_q_s,
        "hot_quantized_s": hot_q_s,
        "decode_tok_s": decode_d,
        "decode_quantized_tok_s": decode_q,
        "file_bytes": file_bytes,
        "page_cache_dropped": dropped,
    }


async def main(contexts: list[int]) -> dict[str, Any]:
    text = TEXT.read_text()
    while len(text) < 6 * max(contexts):  # ~4 characters a token: repeat for long contexts
        text += "\n\n" + text
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
        root = Path(tmp)
        gbps = disk_read_gbps(root)
        results = {str(n): await measure(n, text, root) for n in contexts}
    for r in results.values():
        r["disk_read_gbps"] = gbps
    return {"contexts": results, "blas": kvactor.BLAS.name}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    out = anyio.run(main, args.contexts)
    print(
        "| context | cold (prefill) | warm (disk) | warm, prefetched | hot | cold / warm "
        "| warm, quantized attention | hot, quantized attention | decode tok/s "
        "| decode tok/s, quantized attention | file | disk read |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in out["contexts"].items():
        print(
            f"| {n} | {r['cold_s']:.2f} s | {r['warm_s'] * 1e3:.0f} ms "
            f"| {r['warm_prefetched_s'] * 1e3:.0f} ms | {r['hot_s'] * 1e3:.0f} ms "
            f"| {r['cold_s'] / r['warm_s']:.0f}x | {r['warm_quantized_s'] * 1e3:.0f} ms "
            f"| {r['hot_quantized_s'] * 1e3:.0f} ms | {r['decode_tok_s']:.1f} "
            f"| {r['decode_quantized_tok_s']:.1f} | {r['file_bytes'] / 1e6:.1f} MB "
            f"| {r['disk_read_gbps']:.2f} GB/s |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
