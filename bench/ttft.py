"""Time to first token of the default model when an agent comes back: cold (full prefill),
warm (its cache reloaded from disk, page cache dropped), warm after a prefetch hint, and
hot (cache in memory), at several context lengths, in one run; warm and hot again with
``attention="quantized"`` (turns attend over the stored cache, no float copy is made), and
one agent's decode tokens/s at that context in both attention modes.

Beside them, the floor and the research prototype's path, measured in the same run:
``floor_s`` is the warm file's bytes at the measured disk read rate plus one decode step
at that context; ``seed_path_s`` is mlx-lm's own reload of the same prompt's cache as a
``QuantizedKVCache`` (4-bit, group 64: ``save_prompt_cache``, page cache dropped,
``load_prompt_cache``, one step; the median of three reloads). ``hot_s`` is a hot
agent's turn as it runs by default (from its ready float copy); ``hot_stored_s`` the same
turn with ``ready_copies=False`` (dequantizing the stored cache); ``prefetched_ready_s`` a
turn after a prefetch hint that had the engine build the ready copy (the median of three
sessions); ``warm_load_gbps`` the warm read alone.
``warm_plain_s``: the warm turn with its working copy made by MLX's plain array ops
(``KVACTOR_FUSED=0``, spread over one MLX stream per core: ``kernels.workers``) instead of
the fused kernel (``kernels.fused``); ``warm_one_stream_s`` the plain ops on one MLX stream
(``KVACTOR_ARRAY_STREAMS=1`` too: the first way); ``warm_spread_vs_one_stream`` compares
the plain ops' two ways, and ``warm_fused_vs_plain`` the ratio (of the fused copy's
turn); ``fused_dequantize`` says whether the numba kernels ran (numba present and
compiled before the measured turns). ``warm_s`` attends over the
stored form in its first forward (``kernels.stored_attend``: no float copy before its
first token, none at all for this one-token turn); ``warm_copy_s`` is the same turn with
that off (``KVACTOR_STORED_FIRST=0``: the fused copy), ``warm_stored_vs_copy`` the
ratio. That copy fills beside the first forward (``kernels.beside``: the arrays made
first, ``warm_copy_dequantize_s``; filled in layer order on a thread of their own,
``warm_copy_fill_s``, of which the forward waited ``warm_copy_wait_s``);
``warm_first_s`` makes it whole before the forward (``KVACTOR_BESIDE=0`` too),
``warm_beside_vs_first`` the ratio. ``warm_s`` streams its cache in (a layer-streamed
load: the files read into the engine's arrays as its first forward runs);
``warm_whole_s`` reads it whole first (``KVACTOR_STREAM=0``), ``warm_streamed_vs_whole``
the ratio. The warm turn's parts: ``warm_stage_s`` (before the turn: the files opened and
checked, the arrays allocated), ``warm_read_verify_s`` (the read and its checksums,
beside the forward), of it ``warm_overlap_s`` beside the compute and ``warm_wait_s``
waited for, ``warm_dequantize_s``, ``warm_forward_s``, ``warm_other_s`` (actor hops,
queueing); ``warm_whole_read_verify_s`` the whole read's staging. Ratios of the medians:
``warm_vs_seed_path``, ``warm_vs_floor``, ``hot_stored_vs_warm``,
``prefetched_ready_vs_step``, ``hot_vs_step``; ``each_run`` lists those ratios and their
seconds run by run (a single turn swings between runs: the medians hide by how much).

    python bench/ttft.py [--contexts 1024 2048 4096] [--json PATH]

Every path is measured from the caller, to the first text piece of
``agent.stream_raw(prompt, max_tokens=1)``.
The disk's sequential read bandwidth is measured in the same run on fresh files: one of
256 MiB (``disk_read_gbps``, what ``floor_s`` uses) and, per context, one of the warm
file's size (``disk_read_same_size_gbps``): this disk's readahead ramps up over the first
tens of MB, so a 26 MB file is not read at the 256 MiB rate by any reader tried.
Before each measured read the file system's pending work is committed
(``drop_page_cache``): a journal commit left over from an unlink otherwise lands on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio
from _results import write_json  # bench/ is the script's folder: on sys.path

from kvactor.actors.warm._prefetch import Stage
from kvactor.kernels import fused

COLD, WARM, HOT = kvactor.Tier.COLD, kvactor.Tier.WARM, kvactor.Tier.HOT
TEXT = Path(__file__).with_name("data") / "fidelity.txt"


def drop_page_cache(folder: Path) -> bool:
    """Evict the folder's files from the page cache (no root needed for clean pages), then
    commit whatever the file system still owes the disk (``os.sync``), so that the read
    measured next starts on a quiet disk. Without the sync, the journal commit after an
    unlink (the disk-rate file's, on a file system mounted with ``discard``, as here: the
    freed blocks are discarded at that commit) landed on the first measured warm turn
    after it: its stage read 29-51 ms where the same 1K cache read in 11-14 (3 runs of 3
    on c0d2f9e), always the same way's first turn; with it, 15-17 ms."""
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
    os.sync()
    return True


def disk_read_gbps(folder: Path, nbytes: int = 256 << 20, repeats: int = 1) -> float:
    """Sequential read of a fresh, uncached file of ``nbytes`` (8 MiB requests); the median
    of ``repeats`` reads, the page cache dropped before each."""
    folder = folder / "bandwidth"
    folder.mkdir(exist_ok=True)
    path = folder / "bandwidth.bin"
    with open(path, "wb") as f:
        for at in range(0, nbytes, 1 << 20):
            f.write(os.urandom(min(1 << 20, nbytes - at)))
        f.flush()
        os.fsync(f.fileno())
    times = []
    for _ in range(repeats):
        drop_page_cache(folder)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        times.append(time.perf_counter() - t0)
    path.unlink()
    folder.rmdir()
    return nbytes / statistics.median(times) / 1e9


async def timed(agent: kvactor.Agent, prompt: str) -> tuple[float, kvactor.Completion]:
    """Seconds to the first text piece (the turn's write to disk, which its Completion
    waits for, comes after), and the Completion."""
    t0 = time.perf_counter()
    first = None
    async with agent.stream_raw(prompt, max_tokens=1) as pieces:
        async for _ in pieces:
            first = first or time.perf_counter()
    assert pieces.completion is not None
    return (first or time.perf_counter()) - t0, pieces.completion


async def timed_hot(
    agent: kvactor.Agent, prompt: str, samples: int = 3
) -> tuple[float, kvactor.Completion]:
    """``timed`` of a hot agent, the median of a few turns in a row (each is short)."""
    runs = [await timed(agent, prompt) for _ in range(samples)]
    return statistics.median(s for s, _ in runs), runs[-1][1]


async def decode_rate(agent: kvactor.Agent, prompt: str, tokens: int = 17) -> float:
    """Decode tokens/s of one agent at this context (after its first token), from its
    second turn: a first turn whose first forward attended over the stored form (2K up)
    makes its float copy between its first and second token, which is not a step (until
    d24ebfb it was counted: one step at 4K read 157-159 ms where mlx-lm's took 119)."""
    await agent.complete(prompt, max_tokens=tokens)
    done = await agent.complete(prompt, max_tokens=tokens)
    return (done.timings.generated_tokens - 1) / done.timings.decode_s


async def warm_turn(
    root: Path, name: str, prompt: str, env: dict[str, str]
) -> tuple[float, kvactor.Completion]:
    """A warm turn in a new session, the page cache dropped, with ``env`` set meanwhile
    (its engine thread reads the settings)."""
    drop_page_cache(root / "agents" / name)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        async with kvactor.open(cache_dir=root) as kv:
            return await timed(await kv.spawn_agent(name), prompt)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


# Warm turns, each in a new session (nothing hot), page cache dropped: as it runs, with
# the plain array ops (KVACTOR_FUSED=0), and those on one MLX stream (the first way).
WAYS: dict[str, dict[str, str]] = {
    "warm": {},
    "whole": {"KVACTOR_STREAM": "0"},
    "copy": {"KVACTOR_STORED_FIRST": "0"},
    "first": {"KVACTOR_STORED_FIRST": "0", "KVACTOR_BESIDE": "0"},
    "plain": {"KVACTOR_FUSED": "0"},
    "one": {"KVACTOR_FUSED": "0", "KVACTOR_ARRAY_STREAMS": "1"},
}


async def warm_ways(
    root: Path, name: str, prompt: str
) -> dict[str, list[tuple[float, kvactor.Completion]]]:
    """``warm_turn`` of each of ``WAYS`` twice, in turn order then reversed (a process's
    sessions differ with what ran before them: its first new session faults its memory in
    fresh), after one warm turn not measured: the process's first warm session faults the
    float copy's memory in fresh, which would fall on whichever way came first (1K, 3 runs
    on 673653e: 130 ms for the first way, 108-109 for the same turn in the ways after it)."""
    turns: dict[str, list[tuple[float, kvactor.Completion]]] = {way: [] for way in WAYS}
    await warm_turn(root, name, prompt, {})
    for way in [*WAYS, *reversed(WAYS)]:
        turns[way].append(await warm_turn(root, name, prompt, WAYS[way]))
    return turns


async def whole_read_gbps(root: Path, name: str) -> float:
    """The rate of a stage's read alone, read whole (``KVACTOR_STREAM=0``: its read_s),
    in a new session; the caller drops the page cache first."""
    os.environ["KVACTOR_STREAM"] = "0"
    try:
        async with kvactor.open(cache_dir=root) as kv:
            agent = await kv.spawn_agent(name)
            staged = await kv.prefetcher.ask(Stage(agent.name), timeout=None)  # type: ignore[union-attr]
            return float(staged.nbytes / staged.read_s / 1e9)
    finally:
        del os.environ["KVACTOR_STREAM"]


async def prefetched_turn(
    root: Path, name: str, prompt: str
) -> tuple[float, float, kvactor.Completion]:
    """A turn after a prefetch hint staged its cache (no ready copy), page cache dropped:
    the seconds the staging took, then ``timed``."""
    drop_page_cache(root / "agents" / name)
    async with kvactor.open(cache_dir=root, ready_copies=False) as kv:
        agent = await kv.spawn_agent(name)
        t0 = time.perf_counter()
        await kv.prefetch(agent.name)
        while (await kv.stats()).installs == 0:
            await anyio.sleep(0.001)
        staged_s = time.perf_counter() - t0
        seconds, turn = await timed(agent, prompt)
    return staged_s, seconds, turn


async def prefetched_ready_turn(
    root: Path, name: str, prompt: str
) -> tuple[float, kvactor.Completion]:
    """A turn in a new session after a prefetch made its agent's float copy ready (the
    page cache dropped first): ``timed``, and the turn's Completion."""
    drop_page_cache(root / "agents" / name)
    async with kvactor.open(cache_dir=root) as kv:
        agent = await kv.spawn_agent(name)
        await kv.prefetch(agent.name)
        while (await kv.stats()).ready_agents == 0:
            await anyio.sleep(0.001)
        turn = await timed(agent, prompt)
        assert (await kv.stats()).ready_turns == 1
    return turn


async def measure(n: int, text: str, root: Path) -> dict[str, Any]:
    async with kvactor.open(cache_dir=root) as kv:
        # At the model's whole length: room kept for the tokens the turns decode.
        n = min(n, kv.model.context_length - 64)
        prompt = kv.tokenizer.decode(kv.tokenizer.encode(text)[:n])
        agent = await kv.spawn_agent(f"ttft-{n}")
        cold_s, cold = await timed(agent, prompt)
        hot_s, hot = await timed_hot(agent, prompt)  # from the ready copy the cold turn left
    async with kvactor.open(cache_dir=root, ready_copies=False) as kv:
        agent = await kv.spawn_agent(f"ttft-{n}")
        await timed(agent, prompt)  # warm: staged from the page cache
        hot_stored_s, hot_stored = await timed_hot(agent, prompt)
    folder = root / "agents" / f"ttft-{n}"
    file_bytes = sum(p.stat().st_size for p in folder.glob("seg-*"))
    same_size_gbps = disk_read_gbps(root, file_bytes, repeats=3)
    turns = await warm_ways(root, f"ttft-{n}", prompt)
    warm_s, warm_whole_s, warm_copy_s, warm_first_s, warm_plain_s, warm_one_s = (
        statistics.fmean(s for s, _ in turns[w]) for w in WAYS
    )

    def mean(way: str, part: Callable[[Any], float]) -> float:
        return statistics.fmean(part(c.timings) for _, c in turns[way])

    dropped = drop_page_cache(folder)
    warm_load_gbps = await whole_read_gbps(root, f"ttft-{n}")
    staged_s, prefetched_s, prefetched = await prefetched_turn(root, f"ttft-{n}", prompt)
    readies = [await prefetched_ready_turn(root, f"ttft-{n}", prompt) for _ in range(3)]
    prefetched_ready_s = statistics.median(s for s, _ in readies)
    prefetched_ready = readies[-1][1]
    # The same warm cache, read by turns that attend over it quantized (no float copy).
    drop_page_cache(folder)
    async with kvactor.open(cache_dir=root, attention="quantized") as kv:
        agent = await kv.spawn_agent(f"ttft-{n}")
        warm_q_s, warm_q = await timed(agent, prompt)
        hot_q_s, hot_q = await timed_hot(agent, prompt)
        decode_q = await decode_rate(agent, prompt)
    async with kvactor.open(cache_dir=root, attention="dequantized") as kv:
        decode_d = await decode_rate(await kv.spawn_agent(f"ttft-{n}"), prompt)
    warms = [c for way in WAYS for _, c in turns[way]]
    paths = (cold, hot, hot_stored, prefetched, prefetched_ready, warm_q, hot_q, *warms)
    want = (COLD, HOT, HOT, HOT, HOT, WARM, HOT, *(WARM for _ in warms))
    assert tuple(d.path for d in paths) == want, [d.path for d in paths]
    answers = {d.token_ids[0] for d in paths}
    assert len(answers) == 1, answers  # every path gives the same greedy token
    seed_s, mlx_step_s = seed_path_s(prompt, root)
    return {
        # A warm turn's parts: its staging (streamed: the files opened, their headers
        # checked, the arrays allocated; read whole: the read too), the read and its
        # checksums (streamed: beside the working copy and the forward, which wait for
        # each layer's bytes: ``warm_wait_s``), the working copy, the forward of the new
        # tokens and the first step; ``warm_overlap_s`` the read's seconds that ran
        # beside them.
        "warm_stage_s": mean("warm", lambda t: t.load_s),
        "warm_read_verify_s": mean("warm", lambda t: t.stream_s or t.load_s),
        "warm_wait_s": mean("warm", lambda t: t.stream_wait_s),
        "warm_dequantize_s": mean("warm", lambda t: t.dequantize_s),
        "warm_forward_s": mean("warm", lambda t: t.prefill_s - t.dequantize_s),
        "warm_other_s": warm_s - mean("warm", lambda t: t.load_s + t.prefill_s),
        "warm_overlap_s": mean("warm", lambda t: t.stream_s - t.stream_wait_s),
        "warm_whole_s": warm_whole_s,
        "warm_whole_read_verify_s": mean("whole", lambda t: t.load_s),
        "warm_copy_s": warm_copy_s,
        "warm_copy_dequantize_s": mean("copy", lambda t: t.dequantize_s),
        "warm_copy_fill_s": mean("copy", lambda t: t.copy_s),
        "warm_copy_wait_s": mean("copy", lambda t: t.copy_wait_s),
        "warm_first_s": warm_first_s,
        "warm_first_dequantize_s": mean("first", lambda t: t.dequantize_s),
        "warm_one_stream_s": warm_one_s,
        "warm_one_stream_dequantize_s": mean("one", lambda t: t.dequantize_s),
        "warm_plain_s": warm_plain_s,
        "warm_plain_dequantize_s": mean("plain", lambda t: t.dequantize_s),
        "tokens": cold.timings.prompt_tokens,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "warm_prefetched_s": prefetched_s,
        "prefetch_stage_s": staged_s,
        "hot_s": hot_s,
        "hot_ready_s": hot_s,
        "hot_stored_s": hot_stored_s,
        "prefetched_ready_s": prefetched_ready_s,
        "warm_quantized_s": warm_q_s,
        "hot_quantized_s": hot_q_s,
        "decode_tok_s": decode_d,
        "decode_quantized_tok_s": decode_q,
        "decode_step_s": 1 / decode_d,
        "seed_path_s": seed_s,
        "mlx_lm_decode_step_s": mlx_step_s,
        "warm_load_gbps": warm_load_gbps,
        "disk_read_same_size_gbps": same_size_gbps,
        "file_bytes": file_bytes,
        "page_cache_dropped": dropped,
    }


SEED_LOADS = 3  #: reloads of the research's path per context and run (their median)


def seed_path_s(prompt: str, root: Path) -> tuple[float, float]:
    """The research prototype's reload, on the same model and prompt: mlx-lm's
    ``QuantizedKVCache`` (4-bit, group 64) saved, page cache dropped, loaded with
    ``load_prompt_cache``, then one step that picks the next token: the median of
    ``SEED_LOADS`` such reloads (one alone swung 117-168 ms at 1K between runs). Also
    the seconds of one decode step of mlx-lm's own loop (``generate_step`` over its
    float ``KVCache``) at this context, for the decode comparison."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    from kvactor.actors.models import load_model

    lm = load_model(None)
    ids = lm.tokenizer.encode(prompt)
    cache = make_prompt_cache(lm.model)
    for at in range(0, len(ids) - 1, 512):
        lm.model(mx.array(ids[at : min(at + 512, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    path = root / "seed-path.safetensors"
    save_prompt_cache(str(path), [c.to_quantized(group_size=64, bits=4) for c in cache])
    loads = []
    for _ in range(SEED_LOADS):
        drop_page_cache(root)
        t0 = time.perf_counter()
        loaded = load_prompt_cache(str(path))
        logits = lm.model(mx.array([ids[-1:]]), cache=loaded)
        mx.eval(mx.argmax(logits[0, -1]))
        loads.append(time.perf_counter() - t0)
        del loaded, logits
    path.unlink()
    # mlx-lm's decode loop over the float cache: the time per token after the first.
    steps = generate_step(mx.array(ids[-1:]), lm.model, max_tokens=17, prompt_cache=cache)
    next(steps)
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    return statistics.median(loads), (time.perf_counter() - t0) / n


EACH_RUN = (
    "warm_s", "seed_path_s", "floor_s", "hot_s", "hot_stored_s", "prefetched_ready_s",
    "decode_step_s", "mlx_lm_decode_step_s", "warm_vs_seed_path", "warm_vs_floor",
    "hot_stored_vs_warm", "prefetched_ready_vs_step", "hot_vs_step",
)  # fmt: skip
"""The keys each context's ``each_run`` lists run by run (the rest are medians only)."""


def ratios(r: dict[str, Any]) -> dict[str, float]:
    """The targets' ratios and the ways' comparisons of one run's (or the medians') keys."""
    return {
        "warm_vs_seed_path": r["warm_s"] / r["seed_path_s"],
        "warm_vs_floor": r["warm_s"] / r["floor_s"],
        "hot_stored_vs_warm": r["hot_stored_s"] / r["warm_s"],
        "prefetched_ready_vs_step": r["prefetched_ready_s"] / r["decode_step_s"],
        "hot_vs_step": r["hot_s"] / r["decode_step_s"],
        "warm_spread_vs_one_stream": r["warm_plain_s"] / r["warm_one_stream_s"],
        "warm_fused_vs_plain": r["warm_copy_s"] / r["warm_plain_s"],
        "warm_stored_vs_copy": r["warm_s"] / r["warm_copy_s"],
        "warm_beside_vs_first": r["warm_copy_s"] / r["warm_first_s"],
        "warm_streamed_vs_whole": r["warm_s"] / r["warm_whole_s"],
    }


async def main(contexts: list[int], runs: int) -> dict[str, Any]:
    text = TEXT.read_text()
    while len(text) < 6 * max(contexts):  # ~4 characters a token: repeat for long contexts
        text += "\n\n" + text
    trials: dict[str, list[dict[str, Any]]] = {str(n): [] for n in contexts}
    rates = []
    fused.wait(300)  # the kernel compiles on a thread of its own: ready before any turn
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
            root = Path(tmp)
            gbps = disk_read_gbps(root)
            rates.append(gbps)
            for n in contexts:
                r = await measure(n, text, root)
                r["disk_read_gbps"] = gbps
                r["floor_s"] = r["file_bytes"] / (gbps * 1e9) + r["decode_step_s"]
                trials[str(n)].append(r)
    # Medians of the runs, key by key (each run's ratios come from one session of it).
    results = {
        n: {k: statistics.median(t[k] for t in ts) for k in ts[0] if not isinstance(ts[0][k], bool)}
        | {"page_cache_dropped": all(t["page_cache_dropped"] for t in ts), "runs": len(ts)}
        for n, ts in trials.items()
    }
    for key, r in results.items():  # the issues' targets, as ratios of the medians
        r.update(ratios(r))
        # And each run's own, beside its seconds: a single turn swings between runs.
        each = [t | ratios(t) for t in trials[key]]
        r["each_run"] = {k: [t[k] for t in each] for k in EACH_RUN}
    return {
        "fused_dequantize": fused.ready(),
        "contexts": results,
        "disk_read_gbps": statistics.median(rates),
        "runs": runs,
        "blas": kvactor.BLAS.name,
    }


def table(header: list[str], rows: list[list[str]]) -> None:
    """Print a markdown table, its columns right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|---:" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--runs", type=int, default=1, help="medians of this many runs")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    out = anyio.run(main, args.contexts, args.runs)
    rows = out["contexts"].items()
    ms = {n: {k: f"{v * 1e3:.0f} ms" for k, v in r.items() if k.endswith("_s")} for n, r in rows}
    table(
        ["context", "cold (prefill)", "warm (disk)", "warm, prefetched", "prefetched to ready",
         "hot (ready copy)", "hot, from stored", "hot, quantized attention",
         "warm, quantized attention", "one decode step", "mlx-lm decode step", "floor",
         "mlx-lm Q4 reload + step", "warm load", "disk read, same size", "disk read, 256 MiB"],
        [
            [n, f"{r['cold_s']:.2f} s", *(ms[n][k] for k in (
                "warm_s", "warm_prefetched_s", "prefetched_ready_s", "hot_s", "hot_stored_s",
                "hot_quantized_s", "warm_quantized_s", "decode_step_s", "mlx_lm_decode_step_s",
                "floor_s", "seed_path_s")),
             *(f"{r[k]:.2f} GB/s" for k in (
                "warm_load_gbps", "disk_read_same_size_gbps", "disk_read_gbps"))]
            for n, r in rows
        ],
    )  # fmt: skip
    print()
    table(
        ["context", "warm vs seed path", "warm vs floor", "hot from stored vs warm",
         "prefetched to ready vs step", "hot vs step", "warm, read whole first",
         "streamed vs whole", "warm, fused copy", "stored vs copy", "warm, copy made first",
         "beside vs first", "warm, one stream", "spread vs one", "warm, plain ops",
         "fused vs plain", "stage", "read + verify", "of it beside", "waited",
         "read whole", "dequantize", "dequantize, fused copy", "fused copy filled beside",
         "of it waited", "dequantize, copy made first", "dequantize, plain", "forward",
         "other"],
        [
            [n, *(f"{r[k]:.2f}x" for k in (
                "warm_vs_seed_path", "warm_vs_floor", "hot_stored_vs_warm",
                "prefetched_ready_vs_step", "hot_vs_step")),
             ms[n]["warm_whole_s"], f"{r['warm_streamed_vs_whole']:.2f}x",
             ms[n]["warm_copy_s"], f"{r['warm_stored_vs_copy']:.2f}x",
             ms[n]["warm_first_s"], f"{r['warm_beside_vs_first']:.2f}x",
             ms[n]["warm_one_stream_s"], f"{r['warm_spread_vs_one_stream']:.2f}x",
             ms[n]["warm_plain_s"], f"{r['warm_fused_vs_plain']:.2f}x",
             *(ms[n][k] for k in (
                "warm_stage_s", "warm_read_verify_s", "warm_overlap_s", "warm_wait_s",
                "warm_whole_read_verify_s", "warm_dequantize_s", "warm_copy_dequantize_s",
                "warm_copy_fill_s", "warm_copy_wait_s", "warm_first_dequantize_s",
                "warm_plain_dequantize_s",
                "warm_forward_s", "warm_other_s"))]
            for n, r in rows
        ],
    )  # fmt: skip
    if args.json:
        write_json(args.json, out)
