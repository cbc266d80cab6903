"""Portable agents on the default model: an agent that has read a 1K / 4K-token document
exported as one file and imported in another session, in one run, beside the floors.

Per context:

- ``export_bytes`` (the portable file) and ``export_vs_fp16_bytes`` (against the same
  tokens' K/V in fp16: target <= 0.30);
- ``export_s`` (``Agent.export`` to a path: the file written and fsynced) and
  ``import_s`` (``Session.import_agent`` from it, out of the page cache: read, staged,
  fsynced, verified as a warm load verifies a cache, moved into place, the agent
  spawned), each against the disk floor of the same bytes measured in the same round: a
  copy of the file to a new one with an fsync, its source in the page cache for the
  export (``export_floor_s``: the segments it reads were just written) and out of it for
  the import (``import_floor_s``: the faster of two copies, 4 MiB pieces read as asked,
  ``import_floor_plain_s``, and a MiB at a time with the whole file read ahead,
  ``import_floor_ahead_s``, as the import reads), each from a synced disk: targets
  ``export_vs_floor`` and ``import_vs_floor`` <= 1.5; beside them the import's own bound,
  ``import_durable_floor_s`` (the bytes written as two files fsynced at once, their
  folder fsynced, renamed, its parent fsynced: what a crash-safe import does on disk at
  the least) and ``import_vs_durable_floor``;
- ``first_token_after_import_s`` (the imported agent's next turn, to its first token, its
  files out of the page cache) against a warm resume of the source agent itself
  (``warm_resume_s``: released, page cache dropped, the same turn): target <= 1.2;
- ``identical``: the imported agent's greedy answer to the next turn equals the source's,
  over the API, the CLI (``kvactor export`` / ``kvactor import``) and HTTP (``GET`` /
  ``PUT /v1/agents/{id}/cache`` between two ``kvactor serve``);
- beside them, mlx-lm's ``save_prompt_cache`` of the same tokens' cache (fp16, as its
  users save it, and 4-bit): ``mlx_lm_bytes``, ``mlx_lm_save_s``, ``mlx_lm_q4_bytes``,
  ``mlx_lm_q4_save_s`` (it writes without an fsync).

Medians of ``--rounds`` rounds (after one that warms the sessions up), the export, import,
floors and resumes alternating in each.

    python bench/portable.py [--contexts 1024 4096] [--rounds 3] [--json PATH] [--quick]

``--quick`` runs on a tiny random model (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import anyio
from _carry_via import via_cli, via_http  # bench/ is the script's folder: on sys.path
from _results import figure_table, write_json
from ttft import drop_page_cache

from kvactor.actors.warm import read_header

TEXT = Path(__file__).with_name("data") / "fidelity.txt"
NEXT = "\n\nIn one sentence, what was that about?"
ANSWER = 12  # greedy tokens compared


def fp16_bytes(model: Any, tokens: int) -> int:
    """The bytes of ``tokens`` tokens' K and V in fp16, over the model's layers."""
    geometry = model.geometry or [
        [model.n_kv_heads, model.head_dim, model.head_dim, 0] for _ in range(model.n_layers)
    ]
    return tokens * sum(h * (k + v) * 2 for h, k, v, _ in (g for g in geometry if g))


def floor_s(src: Path, dst: Path, *, cold: bool = False, ahead: bool = False) -> float:
    """Read ``src`` whole and write it to ``dst`` with an fsync, from a synced disk: the
    disk floor of a copy. ``cold``: ``src`` out of the page cache first (as an import
    reads its file); else as it is (an export reads the segments a turn just wrote).
    ``ahead``: the kernel told to read the whole file ahead, and it copied a MiB at a
    time (the copy overlaps reading and writing: faster from a cold file), else 4 MiB
    pieces read as asked."""
    if cold:
        _uncache(src)
    os.sync()
    t0 = time.perf_counter()
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as out:
        if ahead:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        while piece := f.read(1 << 20 if ahead else 4 << 20):
            out.write(piece)
        os.fsync(out.fileno())
    elapsed = time.perf_counter() - t0
    dst.unlink()
    return elapsed


def durable_floor_s(src: Path, folder: Path, first: int) -> float:
    """The floor of a crash-safe import of ``src`` (out of the page cache, from a synced
    disk): read ahead a MiB at a time into two new files of a new folder (its first
    ``first`` bytes, as a manifest, and the rest), both fsynced at once (two threads),
    the folder fsynced, then renamed and its parent fsynced: what an import must do on
    disk at the least, without parsing, checking or summing a byte."""
    _uncache(src)
    os.sync()
    staging, done = folder / "staging", folder / "done"
    t0 = time.perf_counter()
    staging.mkdir(parents=True)
    with (
        open(src, "rb", buffering=0) as f,
        open(staging / "a", "wb", buffering=0) as a,
        open(staging / "b", "wb", buffering=0) as b,
        ThreadPoolExecutor(2) as pool,
    ):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        a.write(f.read(first))
        while piece := f.read(1 << 20):
            b.write(piece)
        list(pool.map(os.fsync, (a.fileno(), b.fileno())))
    _fsync_dir(staging)
    os.rename(staging, done)
    _fsync_dir(folder)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(folder)
    return elapsed


def _uncache(path: Path) -> None:
    """``path`` out of the page cache (its pages are clean: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def first_token_s(agent: Any, prompt: str) -> tuple[float, kvactor.Completion]:
    t0 = time.perf_counter()
    first = None
    async with agent.stream_raw(prompt, max_tokens=ANSWER) as pieces:
        async for _ in pieces:
            first = first or time.perf_counter()
    assert pieces.completion is not None
    return (first or time.perf_counter()) - t0, pieces.completion


def mlx_lm_save(model: Any, ids: list[int], root: Path) -> dict[str, float]:
    """mlx-lm's ``save_prompt_cache`` of the same tokens' cache, fp16 and 4-bit."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    cache = make_prompt_cache(model)
    for at in range(0, len(ids), 512):
        model(mx.array(ids[at : at + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out: dict[str, float] = {}
    for key, layers in (("mlx_lm", cache), ("mlx_lm_q4", None)):
        path = root / f"{key}.safetensors"
        if layers is None:
            layers = [c.to_quantized(group_size=64, bits=4) for c in cache]
            mx.eval([c.state for c in layers])
        t0 = time.perf_counter()
        save_prompt_cache(str(path), layers)
        out[f"{key}_save_s"] = time.perf_counter() - t0
        out[f"{key}_bytes"] = path.stat().st_size
        path.unlink()
    return out


def round_floors(path: Path, root: Path) -> dict[str, float]:
    """The floors of one round's file at ``path``, each the median of three: the export's
    (a copy from the page cache), the import's two copies (plain, read ahead) and the
    faster of them (``import_floor_s``), and the import's durable floor."""
    median = statistics.median
    scratch = root / "floor.bin"
    plain = median(floor_s(path, scratch, cold=True) for _ in range(3))
    ahead = median(floor_s(path, scratch, cold=True, ahead=True) for _ in range(3))
    manifest_bytes = read_header(path.read_bytes()[: 16 << 20]).files[0].size
    return {
        "export_floor_s": median(floor_s(path, scratch) for _ in range(3)),
        "import_floor_s": min(plain, ahead),
        "import_floor_plain_s": plain,
        "import_floor_ahead_s": ahead,
        "import_durable_floor_s": median(
            durable_floor_s(path, root / "durable", manifest_bytes) for _ in range(3)
        ),
    }


async def measure(n: int, text: str, root: Path, rounds: int, spec: Any) -> dict[str, Any]:
    a, b = root / f"a{n}", root / f"b{n}"
    each: dict[str, list[float]] = {}  # each counted round's figures, by key
    answers = []
    async with kvactor.open(spec, cache_dir=a) as kv, kvactor.open(spec, cache_dir=b) as kb:
        prompt = kv.tokenizer.decode(kv.tokenizer.encode(text)[:n])
        ids = kv.tokenizer.encode(prompt)
        model = kv.model
        agent = await kv.spawn_agent("doc")
        await agent.complete(prompt, max_tokens=1)
        source_answer = None
        # Each round: export, its floor, import, its floor, the two warm resumes. Round 0
        # warms both sessions up (the first turn of a session pays for MLX's first
        # allocations) and is not counted. Every timed step starts from a synced disk.
        for r in range(rounds + 1):
            path = root / f"doc{n}-{r}.kvagent"
            os.sync()
            t0 = time.perf_counter()
            info = await agent.export(path)
            figures = {"export_s": time.perf_counter() - t0, **round_floors(path, root)}
            if "doc" in kb.agents:
                await kb.forget("doc")  # a fresh import each round, not a replace
            drop_page_cache(root)
            os.sync()
            t0 = time.perf_counter()
            await kb.import_agent(path, "doc")
            figures["import_s"] = time.perf_counter() - t0
            # The source's own warm resume, and the imported agent's, the same way:
            # released, their files out of the page cache, the same next turn.
            resumed = []
            for session, folder in ((kv, a), (kb, b)):
                await session.release("doc")
                drop_page_cache(folder / "agents" / "doc")
                seconds, done = await first_token_s(await session.spawn_agent("doc"), prompt + NEXT)
                resumed.append((seconds, done.token_ids))
            # The source back to the state it was exported in (that turn is not in the file).
            agent = await kv.import_agent(path, "doc", replace=True)
            if r == 0:
                source_answer = resumed[0][1]
                continue
            figures["warm_resume_s"] = resumed[0][0]
            figures["first_token_after_import_s"] = resumed[1][0]
            for key, value in figures.items():
                each.setdefault(key, []).append(value)
            answers += [resumed[0][1], resumed[1][1]]
    identical_api = all(x == source_answer for x in answers)
    turn = (prompt + NEXT, ANSWER, source_answer)
    identical_cli = await via_cli(spec, a, root / f"cli{n}", "doc", turn)
    identical_http = await via_http(spec, a, root / f"http{n}", "doc", turn)
    median = statistics.median

    def ratio(top: str, bottom: str) -> float:  # the median of the rounds' ratios
        return median(t / b for t, b in zip(each[top], each[bottom], strict=True))

    result = {
        "tokens": info.tokens,
        "export_bytes": info.nbytes,
        "fp16_bytes": fp16_bytes(model, info.tokens),
        "export_vs_fp16_bytes": info.nbytes / fp16_bytes(model, info.tokens),
        **{key: median(values) for key, values in each.items()},
        "export_vs_floor": ratio("export_s", "export_floor_s"),
        "import_vs_floor": ratio("import_s", "import_floor_s"),
        "import_vs_durable_floor": ratio("import_s", "import_durable_floor_s"),
        "first_token_vs_warm_resume": ratio("first_token_after_import_s", "warm_resume_s"),
        "identical_api": identical_api,
        "identical_cli": identical_cli,
        "identical_http": identical_http,
        "identical": identical_api and identical_cli is not False and identical_http is not False,
        "rounds": rounds,
        "each_round": each,
    }
    result.update(await anyio.to_thread.run_sync(_mlx_lm, spec, ids, root))
    return result


def _mlx_lm(spec: Any, ids: list[int], root: Path) -> dict[str, float]:
    from kvactor.actors.models import load_model

    lm = spec() if callable(spec) else load_model(spec)
    return mlx_lm_save(lm.model, ids, root)


async def main(contexts: list[int], rounds: int, quick: bool) -> dict[str, Any]:
    spec: Any = None
    if quick:
        from kvactor.actors.models import make_tiny_model

        spec = functools.partial(make_tiny_model, 0, head_dim=64)
    text = TEXT.read_text()
    while len(text) < 6 * max(contexts):
        text += "\n\n" + text
    out: dict[str, Any] = {"contexts": {}, "quick": quick, "blas": kvactor.BLAS.name}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
        for n in contexts:
            out["contexts"][str(n)] = await measure(n, text, Path(tmp), rounds, spec)
    return out


def _table(out: dict[str, Any]) -> str:
    rows: list[tuple[object, object, object, object]] = []
    for n, r in out["contexts"].items():
        rows += [
            (f"{n}: export bytes", f"{r['export_bytes'] / 1e6:.2f} MB", "", ""),
            (
                f"{n}: export / fp16",
                f"{r['export_vs_fp16_bytes']:.3f}",
                "<= 0.30",
                r["export_vs_fp16_bytes"] <= 0.30,
            ),
            (
                f"{n}: export / floor",
                f"{r['export_vs_floor']:.2f}",
                "<= 1.5",
                r["export_vs_floor"] <= 1.5,
            ),
            (
                f"{n}: import / floor",
                f"{r['import_vs_floor']:.2f}",
                "<= 1.5",
                r["import_vs_floor"] <= 1.5,
            ),
            (
                f"{n}: import / durable floor (two files, fsynced, renamed)",
                f"{r['import_vs_durable_floor']:.2f}",
                "",
                "",
            ),
            (
                f"{n}: first token after import / warm resume",
                f"{r['first_token_vs_warm_resume']:.2f}",
                "<= 1.2",
                r["first_token_vs_warm_resume"] <= 1.2,
            ),
            (
                f"{n}: identical (API, CLI, HTTP)",
                f"{r['identical_api']}, {r['identical_cli']}, {r['identical_http']}",
                "true",
                r["identical"],
            ),
            (
                f"{n}: mlx-lm save_prompt_cache fp16 / Q4",
                f"{r['mlx_lm_bytes'] / 1e6:.2f} / {r['mlx_lm_q4_bytes'] / 1e6:.2f} MB, "
                f"{r['mlx_lm_save_s'] * 1e3:.1f} / {r['mlx_lm_q4_save_s'] * 1e3:.1f} ms",
                "",
                "",
            ),
        ]
    return figure_table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny random model")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    results = anyio.run(main, args.contexts, args.rounds, args.quick)
    print(_table(results))
    if args.json:
        write_json(args.json, results)
