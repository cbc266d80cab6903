"""The warm tier under a disk limit (issue 39), write-through: N agents take turns of a
few hundred new tokens, in a seeded random interleaving, over contexts growing to 2K+
tokens, under a disk limit of 25% of what they store unbounded and a small hot budget.

Phases, one process, one run (``deterministic=True`` throughout, greedy; the same small
hot budget in every phase: ``--concurrency`` turns' working room plus ``--hot-agents``
agents' stored caches at the longest context):

1. **unbounded**: the trace with ``disk_limit=None`` in its own cache directory: what the
   agents store at the end (``unbounded_bytes``; the limit is ``--limit-share`` of it),
   the reference answers, the tokens each turn added to its agent's cache, and the bytes
   written (``written_bytes``, manifests and headers included: the store's own count,
   ``StoreStats.bytes_written``, or where it says 0 the process's write syscalls during
   the turns, ``/proc/self/io``; both are in the JSON, with the new files seen after each
   turn). ``write_amplification = written_bytes / new_kv_bytes``, ``new_kv_bytes`` being
   the stored tensor bytes of the tokens the turns added (per token: the tensors of the
   directory's segment files, headers excluded, over their tokens).
2. **mlx-lm**: each agent's cache trajectory of phase 1 replayed into mlx-lm's
   ``QuantizedKVCache`` (group 64, 4 bits, fp16 scales: between kvactor's 5-bit keys and
   3-bit values), the whole file rewritten with ``save_prompt_cache`` after every turn as
   mlx-lm's users do: ``mlx_lm_write_amplification`` = sum of the file's size after each
   turn / sum of the new tokens' bytes in that format. Real files of zeros of the model's
   cache shapes (a file's size does not depend on the values); the full mode replays a
   sample of agents (``--mlx-agents``, in the output).
3. **limited**: the same trace under ``disk_limit`` in a fresh directory; the directory's
   real bytes (every regular file under ``agents/``, a hard-linked file once) sampled by a
   process of its own every ``--sample-ms`` and by the bench after every turn:
   ``warm_peak_bytes``, ``over_limit_samples`` (target 0; the gaps between samples are
   reported); ``demoted_cold``; ``re_prefilled_tokens`` (prefilled beyond phase 1's same
   turn); ``answers_identical`` with phase 1 (each diverging agent's first differing
   turn, by path); ``write_amplification_limited`` (a cold agent writes its whole cache
   again when it comes back, and so does a hot one whose warm copy went cold).
4. **restart**: phase 3's directory opened again under ``--restart-share`` of the limit:
   its bytes at once, before any turn (``restart_over_limit``: bytes over, target 0), and
   one turn of an agent that went cold, against the same turn resumed from phase 1's
   directory and against a new agent prefilling the same conversation.
5. **write-back**: the trace under phase 3's disk limit and a roomier hot budget, one
   that holds ``--back-hot-share`` of the agents (so that an agent runs several turns
   between leaving the hot tier: ``write_back_avg_turns_between_leaving_hot``), four
   times: write-through, write-back under a write budget that never binds, write-back
   under ``--back-budget-share`` of what write-through wrote, and write-through again
   (TTFT is taken against the mean of the two; their ratio is the machine's noise). The
   bytes each wrote from open to the end of close (write syscalls: write-back writes what
   is still hot at close), ``write_back_written_vs_through``, ``write_back_ttft_vs_through``
   (summed TTFT, and a turn's median ratio), the floor of any write-back that keeps every
   cache (``write_back_floor_vs_through``: each new token's tensor bytes once), the
   tokens not on disk at close, and whether the answers equal write-through's.
   ``--write-back-only`` runs the probe, phase 1 (for the limit) and this phase;
   ``--no-write-back`` leaves it out (phases 1-4: the limit's figures alone).

    python bench/warm_limits.py [--quick] [--model PATH] [--agents 200] [--turns 8]
        [--words 190 230] [--max-tokens 32] [--concurrency 4] [--hot-agents 4]
        [--back-hot-share 0.6] [--back-budget-share 0.25] [--write-back-only | --no-write-back]
        [--seed 0] [--mlx-agents 16] [--dir DIR [--stop-after-unbounded | --resume]]
        [--json PATH]

``--quick`` (about a minute): the tiny random-weight llama with its layers scaled up so
that greedy answers depend on the whole context (as tests/lively.py does), 40 agents of 6
turns, contexts of ~1K tokens. The full mode (the default model, 200 agents of 8 turns of
~270 new tokens, contexts to ~2.2K) takes hours on a 2-core CPU (phase 1 alone, of 7
turns: 93 minutes), most of it phase 3's re-prefills; each phase prints its progress and
ETA to stderr. It can take two sittings: ``--dir DIR
--stop-after-unbounded`` runs the probe and phase 1 and keeps them in DIR (phase 1's
figures in ``unbounded.json``); the same options with ``--resume`` instead go on from
there. Phase 4 takes a turn in phase 1's directory, so it removes the checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
import mlx.core as mx
import msgspec
from _results import figure_table, write_json  # bench/ is the script's folder: on sys.path
from _warm_trace import (
    EXTRA,
    WORDS,
    DiskSampler,
    Trace,
    agents_bytes,
    lively_tiny,
    make_trace,
    replay,
    sampled,
)
from mlx.utils import tree_flatten
from mlx_lm.models.cache import QuantizedKVCache, save_prompt_cache

from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.enums import Tier
from kvactor.actors.warm import list_agents
from kvactor.kernels.geometry import CacheGeometry

MLX_LM_BITS = 4
MLX_LM_GROUP = 64
TARGET_AMPLIFICATION = 1.25


# -------------------------------------------------------------------------- the phases
@dataclass(frozen=True)
class Config:
    quick: bool = False
    model: str | None = None
    agents: int = 200
    turns: int = 8  # 7 turns of these sizes end at 1,938 tokens: short of the 2K asked
    words: tuple[int, int] = (190, 230)
    max_tokens: int = 32
    concurrency: int = 4
    hot_agents: int = 4
    limit_share: float = 0.25
    restart_share: float = 0.5
    back_hot_share: float = 0.6  # phase 5: agents the hot budget holds, a share of them
    back_budget_share: float = 0.25  # phase 5: a write budget, a share of write-through's
    write_back_only: bool = False  # phase 5 alone (the probe first)
    no_write_back: bool = False  # phases 1-4 only
    sample_ms: float = 10.0
    mlx_agents: int = 16  # 0: every agent
    seed: int = 0
    workdir: str | None = None
    resume: bool = False  # phase 1 from the work directory's checkpoint
    stop_after_unbounded: bool = False  # the probe and phase 1 only, checkpointed

    def model_spec(self) -> Any:
        return functools.partial(lively_tiny, 0) if self.quick else self.model


QUICK = Config(
    quick=True, agents=40, turns=6, words=(14, 22), max_tokens=16, concurrency=2, mlx_agents=0
)


async def probe(cfg: Config, trace: Trace, root: Path) -> dict[str, Any]:
    """The model's cache geometry, its name, what a stored token costs in the hot tier,
    the longest context the trace reaches, and the small hot budget from them: room for
    ``cfg.concurrency`` turns at that length plus ``cfg.hot_agents`` agents' caches."""
    async with kvactor.open(cfg.model_spec(), cache_dir=root, disk_limit=None) as kv:
        assert kv.identity is not None
        layers = kv.identity.layer_geometry()
        geometry = CacheGeometry.from_description(layers, kv.model.states)
        per_agent: dict[str, list[str]] = {n: [s] for n, s in trace.systems.items()}
        for turn in trace.turns:
            per_agent[turn.agent].append(turn.text)
        text_tokens = max(len(kv.tokenizer.encode("\n".join(t))) for t in per_agent.values())
        longest = text_tokens + cfg.turns * (cfg.max_tokens + 16)  # answers and template
        agent = await kv.spawn_agent("probe", system="You help.")
        await agent.generate(" ".join(WORDS[:40]), max_tokens=4)
        info = await kv.cache_info("probe")  # with its float ready copy
        stored = (await kv.warm_agents())[0]  # quantized: what an idle hot agent keeps
        name = kv.model.name
    reserve = turn_reserve_bytes(geometry, longest + cfg.max_tokens)
    per_token = stored.nbytes / stored.tokens
    budget = cfg.concurrency * reserve + int(cfg.hot_agents * per_token * longest)
    return {
        "model": name,
        "layers": layers,
        "longest_tokens_estimate": longest,
        "hot_bytes_per_token_ready": round(info.nbytes / info.tokens, 1),
        "stored_bytes_per_token": round(per_token, 1),
        "turn_reserve_bytes": reserve,
        "budget_bytes": budget,
    }


def tensor_bytes(path: Path) -> int:
    """The tensors' bytes of a safetensors file (its header excluded)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )


def stored_bytes_per_token(root: Path) -> tuple[float, int]:
    """(tensor bytes per token over every segment of every agent's manifest, segments)."""
    data = tokens = segments = 0
    for info in list_agents(root):
        raw = json.loads((root / "agents" / info.agent / "manifest.json").read_bytes())
        for seg in raw["manifest"]["segments"]:
            data += tensor_bytes(root / "agents" / info.agent / seg["file"])
            tokens += seg["stop"] - seg["start"]
            segments += 1
    return data / max(tokens, 1), segments


def wchar() -> int:
    """The bytes this process has handed to write syscalls so far (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        return 0


def written_figures(
    tag: str, store: int, syscalls: int, seen: int, new_kv: float
) -> dict[str, Any]:
    """A phase's bytes written, three ways: the store's count (StoreStats.bytes_written);
    the write syscalls of the process during the turns (/proc/self/io: the store's files
    plus a few lines of progress); the files seen to appear in the agents' folders after
    each turn (a lower bound: a manifest that a later append of the same turn replaced is
    not seen). ``written_bytes{tag}`` is the store's count, or where it is 0 the
    syscalls'; its amplification is over ``new_kv``."""
    written, source = (store, "store") if store else (syscalls, "write syscalls")
    return {
        f"written_bytes{tag}": written,
        f"written_bytes{tag}_source": source,
        f"written_bytes{tag}_store": store,
        f"written_bytes{tag}_syscalls": syscalls,
        f"written_bytes{tag}_files_seen": seen,
        f"write_amplification{tag}": round(written / new_kv, 4),
    }


def options(root: Path, limit: int | None, budget: int) -> dict[str, Any]:
    """``kvactor.open``'s keywords of every phase but the model."""
    return {"cache_dir": root, "disk_limit": limit, "budget_bytes": budget, "deterministic": True}


async def phase_unbounded(cfg: Config, trace: Trace, root: Path, budget: int) -> dict[str, Any]:
    """Phase 1: the trace without a disk limit (under the small hot budget)."""
    began = time.perf_counter()
    opts = options(root, None, budget)
    async with kvactor.open(cfg.model_spec(), **opts) as kv:
        before = wchar()
        records, fallbacks, seen = await replay(kv, root, trace, cfg, "1 unbounded", None)
        syscalls = wchar() - before
        warm = await kv.warm_stats()
        stats = await kv.stats()
    per_token, segments = stored_bytes_per_token(root)
    unbounded = agents_bytes(root)
    finals = [w.tokens for w in list_agents(root)]
    new_tokens = sum(r["added"] for r in records)
    new_kv = per_token * new_tokens
    return {
        "records": records,
        "unbounded_bytes": unbounded,
        "store_disk_bytes": warm.disk_bytes,
        "kv_bytes_per_token": round(per_token, 2),
        "segments": segments,
        "new_tokens": new_tokens,
        "new_kv_bytes": int(new_kv),
        **written_figures("", warm.bytes_written, syscalls, seen, new_kv),
        "writes": warm.writes,
        "added_from_manifest": fallbacks,
        "ctx_tokens_max": max(r["prompt"] + r["generated"] for r in records),
        "ctx_tokens_final_mean": round(sum(finals) / max(len(finals), 1), 1),
        "save_errors": sum(r["save_error"] is not None for r in records),
        "hot_peak_bytes": stats.peak_bytes,
        "demoted_warm": stats.demoted_warm,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def trajectories(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Per agent, per turn in order: (tokens its cache kept, tokens the turn added)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for r in records:
        out.setdefault(r["agent"], []).append((r["reused"], r["added"]))
    return out


def zeros(heads: int, tokens: int, key_dim: int, value_dim: int) -> tuple[mx.array, mx.array]:
    """fp16 keys and values of ``tokens`` tokens, as a layer's cache takes them."""
    return (
        mx.zeros((1, heads, tokens, key_dim), mx.float16),
        mx.zeros((1, heads, tokens, value_dim), mx.float16),
    )


def mlx_lm_amplification(
    layers: list[list[int]], paths: dict[str, list[tuple[int, int]]], sample: int, tmp: Path
) -> dict[str, Any]:
    """What mlx-lm's ``save_prompt_cache`` writes when each agent's whole prompt cache
    (QuantizedKVCache per layer) is saved after every turn, over the new tokens' bytes in
    that format; ``sample`` agents (0: all), evenly spread."""
    began = time.perf_counter()
    names = sorted(paths)
    if sample and sample < len(names):
        names = names[:: len(names) // sample][:sample]
    geometry = [(h, k, v) for h, k, v, _ in layers]
    full = [QuantizedKVCache(MLX_LM_GROUP, MLX_LM_BITS) for _ in geometry]
    for cache, (h, k, v) in zip(full, geometry, strict=True):
        cache.update_and_fetch(*zeros(h, 256, k, v))  # 256 tokens: its buffer, no padding
    arrays: Any = tree_flatten([c.state[:2] for c in full])
    per_token = sum(x.nbytes for _, x in arrays) / 256
    written = new_tokens = 0
    for n, name in enumerate(names):
        caches = [QuantizedKVCache(MLX_LM_GROUP, MLX_LM_BITS) for _ in geometry]
        path = tmp / f"mlx-lm-{n}.safetensors"
        for reused, added in paths[name]:
            # mlx-lm keeps the prefix its own cache holds (kvactor's may have come from
            # another agent's shared prefix) and appends the rest of the turn's tokens.
            kept = min(reused, caches[0].offset)
            grown = reused + added - kept
            for cache, (h, k, v) in zip(caches, geometry, strict=True):
                cache.trim(cache.offset - kept)
                cache.update_and_fetch(*zeros(h, grown, k, v))
            save_prompt_cache(str(path), caches)
            written += path.stat().st_size
            new_tokens += grown
        path.unlink()
    new_bytes = per_token * new_tokens
    return {
        "mlx_lm_write_amplification": round(written / new_bytes, 4),
        "mlx_lm_written_bytes": written,
        "mlx_lm_new_kv_bytes": int(new_bytes),
        "mlx_lm_agents": len(names),
        "mlx_lm_format": f"QuantizedKVCache(group_size={MLX_LM_GROUP}, bits={MLX_LM_BITS}), "
        "fp16 scales, save_prompt_cache after every turn (its state: the buffer, grown in "
        "steps of 256 tokens, as mlx-lm saves it); one update per turn, zeros",
        "mlx_lm_wall_s": round(time.perf_counter() - began, 1),
    }


def leaving_hot(records: list[dict[str, Any]]) -> float | None:
    """Turns an agent runs per stay in the hot tier: its turns after its first, over how
    many of them found their cache elsewhere (warm or cold: it had left the hot tier)."""
    later = [r for r in records if r["index"] > 0]
    left = sum(r["path"] != Tier.HOT.value for r in later)
    return round(len(later) / left, 3) if left else None


async def phase_limited(
    cfg: Config, trace: Trace, root: Path, budget: int, limit: int, ref: dict[str, Any]
) -> dict[str, Any]:
    """Phase 3: the trace under ``limit``, the directory sampled throughout."""
    began = time.perf_counter()
    sampler = DiskSampler(root, limit, cfg.sample_ms / 1000)
    opts = options(root, limit, budget)
    async with kvactor.open(cfg.model_spec(), **opts) as kv:
        before = wchar()
        records, _, seen = await sampled(
            sampler, lambda: replay(kv, root, trace, cfg, "3 limited", sampler)
        )
        syscalls = wchar() - before
        warm = await kv.warm_stats()
        stats = await kv.stats()
    pairs = list(zip(records, ref["records"], strict=True))
    mismatched = [
        (r["agent"], r["index"], r["path"]) for r, o in pairs if r["tokens"] != o["tokens"]
    ]
    firsts: dict[str, str] = {}
    for agent, _, path in mismatched:
        firsts.setdefault(agent, path)
    errors = [r["save_error"] for r in records if r["save_error"] is not None]
    return {
        "records": records,
        "sampler": sampler.figures(),
        "warm_peak_bytes": sampler.peak,
        "over_limit_samples": len(sampler.over),
        "store_disk_peak_bytes": warm.disk_peak_bytes,
        "store_disk_limit_bytes": warm.disk_limit_bytes,
        "demoted_cold": warm.demoted_cold,
        "expired": warm.expired,
        "cold_turns": sum(r["path"] == Tier.COLD.value and r["index"] > 0 for r in records),
        "warm_turns": sum(r["path"] == Tier.WARM.value for r in records),
        "re_prefilled_tokens": sum(max(r["prefilled"] - o["prefilled"], 0) for r, o in pairs),
        **written_figures("_limited", warm.bytes_written, syscalls, seen, ref["new_kv_bytes"]),
        "answers_identical": not mismatched,
        "answer_mismatches": len(mismatched),
        "mismatch_examples": mismatched[:8],
        # Each diverging agent's first differing turn, by path (cold: a re-prefill).
        "first_mismatch_paths": {p: list(firsts.values()).count(p) for p in set(firsts.values())},
        "save_errors": len(errors),
        "save_error_examples": sorted(set(errors))[:4],
        "hot_peak_bytes": stats.peak_bytes,
        "stats": msgspec.to_builtins(stats),
        "wall_s": round(time.perf_counter() - began, 1),
    }


async def resumed_turn(
    cfg: Config, root: Path, agent: str, system: str, limit: int | None, budget: int
) -> kvactor.Completion:
    opts = options(root, limit, budget)
    async with kvactor.open(cfg.model_spec(), **opts) as kv:
        handle = await kv.spawn_agent(agent, system=system)
        return await handle.generate(EXTRA, max_tokens=cfg.max_tokens)


async def phase_restart(
    cfg: Config, trace: Trace, roots: tuple[Path, Path], budget: int, limit: int
) -> dict[str, Any]:
    """Phase 4: the limited directory opened under a lower limit: its bytes before any
    turn, then one turn of an agent that is cold there, against the same turn resumed
    from the unbounded directory and against a new agent prefilling the same conversation
    (what a cold turn promises; no shared prefixes, so that it prefills all of it)."""
    began = time.perf_counter()
    unbounded, root = roots
    lower = int(limit * cfg.restart_share)
    sampler = DiskSampler(root, lower, cfg.sample_ms / 1000)
    opts = options(root, lower, budget)
    async with kvactor.open(cfg.model_spec(), share_prefixes=False, **opts) as kv:
        at_open = await sampler.sample()  # at once, before any turn
        warm = await kv.warm_stats()
        cold = sorted(w.agent for w in await kv.warm_agents() if w.tokens == 0 and not w.rejected)
        agent = cold[0] if cold else sorted(trace.systems)[0]
        handle = await kv.spawn_agent(agent, system=trace.systems[agent])
        done = await sampled(sampler, lambda: handle.generate(EXTRA, max_tokens=cfg.max_tokens))
        await sampler.sample()
        fresh = await kv.spawn_agent("fresh-prefill")
        asked = (await handle.history())[:-1]
        again = await sampled(sampler, lambda: fresh.chat(asked, max_tokens=cfg.max_tokens))
        await sampler.sample()
    other = await resumed_turn(cfg, unbounded, agent, trace.systems[agent], None, budget)
    return {
        "restart_limit_bytes": lower,
        "restart_bytes_at_open": at_open,
        "restart_over_limit": max(at_open - lower, 0),
        "restart_over_limit_samples": len(sampler.over),
        "restart_peak_bytes": sampler.peak,
        "restart_demoted_cold": warm.demoted_cold,
        "restart_store_disk_bytes": warm.disk_bytes,
        "restart_cold_agents": len(cold),
        "restart_turn_agent": agent,
        "restart_turn_path": done.path.value,
        "restart_turn_ok": bool(done.token_ids) and done.saved,
        "restart_turn_save_error": done.save_error,
        "restart_turn_identical": done.token_ids == other.token_ids,
        "restart_turn_equals_fresh_prefill": done.token_ids == again.token_ids,
        "restart_turn_unbounded_path": other.path.value,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def drop(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def by_path(records: list[dict[str, Any]], key: str | None) -> dict[str, float]:
    """Per path (hot, warm, cold), the sum of ``key`` over its turns (None: the count)."""
    out: dict[str, float] = {}
    for r in records:
        out[r["path"]] = out.get(r["path"], 0) + (1 if key is None else r[key])
    return {k: round(v, 3) for k, v in sorted(out.items())}


def unwritten_at_close(root: Path, records: list[dict[str, Any]]) -> tuple[int, int]:
    """After a session's close: (agents whose last cache is not all on disk, the tokens
    missing): what a next session prefills again before their first turn can start."""
    final: dict[str, int] = {}
    for r in records:
        final[r["agent"]] = r["reused"] + r["added"]
    on_disk = {w.agent: w.tokens for w in list_agents(root)}
    short = {a: n - on_disk.get(a, 0) for a, n in final.items() if on_disk.get(a, 0) < n}
    return len(short), sum(short.values())


async def through_or_back(
    cfg: Config, trace: Trace, root: Path, hot: tuple[int, int | None], write_budget: int | None
) -> dict[str, Any]:
    """The trace under ``hot`` (the hot budget, the disk limit), write-through
    (``write_budget`` None) or write-back: its records, the bytes written from open to
    the end of close (write syscalls: a write-back writes what is still hot at close),
    what a next session would find missing, and the counts."""
    began = time.perf_counter()
    opts = options(root, hot[1], hot[0])
    label = "5 write-through" if write_budget is None else f"5 write-back {root.name}"
    if write_budget is not None:
        opts["write_budget"] = write_budget
    before = wchar()
    async with kvactor.open(cfg.model_spec(), **opts) as kv:
        records, _, _ = await replay(kv, root, trace, cfg, label, None)
        stats = await kv.stats()
    written = wchar() - before
    agents, tokens = unwritten_at_close(root, records)
    return {
        "records": records,
        "written_bytes": written,
        "ttft_s": sum(r["ttft_s"] for r in records),
        "ttft_s_by_path": by_path(records, "ttft_s"),
        "turns_by_path": by_path(records, None),
        "avg_turns_between_leaving_hot": leaving_hot(records),
        "cold_turns": sum(r["path"] == Tier.COLD.value and r["index"] > 0 for r in records),
        "prefilled_tokens": sum(r["prefilled"] for r in records),
        "demoted_warm": stats.demoted_warm,
        "demoted_cold": stats.demoted_cold,
        "demoted_warm_to_cold": stats.demoted_warm_to_cold,
        "written_back": stats.written_back,
        "written_back_bytes": stats.written_back_bytes,
        "write_back_refused": stats.write_back_refused,
        "unwritten_agents_at_close": agents,
        "unwritten_tokens_at_close": tokens,
        "save_errors": sum(r["save_error"] is not None for r in records),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def versus(run: dict[str, Any], through: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """A write-back run against write-through (run twice, first and last: TTFT against
    their mean): bytes, summed TTFT and the median of the turns' TTFT ratios (less noisy
    than the sum on a busy machine), same answers (as the first)."""
    pairs = list(zip(run["records"], through["records"], strict=True))
    twice = zip(through["records"], again["records"], strict=True)
    mean = [(o["ttft_s"] + a["ttft_s"]) / 2 for o, a in twice]
    ratios = sorted(r["ttft_s"] / m for (r, _), m in zip(pairs, mean, strict=True) if m > 0)
    return {
        "written_vs_through": round(run["written_bytes"] / through["written_bytes"], 4),
        "ttft_vs_through": round(2 * run["ttft_s"] / (through["ttft_s"] + again["ttft_s"]), 4),
        "ttft_turn_median_vs_through": round(ratios[len(ratios) // 2], 4) if ratios else None,
        "answers_identical": all(r["tokens"] == o["tokens"] for r, o in pairs),
        "answer_mismatches": sum(r["tokens"] != o["tokens"] for r, o in pairs),
    }


async def phase_write_back(
    cfg: Config, trace: Trace, work: Path, sizes: dict[str, Any], bounds: tuple[int | None, int]
) -> dict[str, Any]:
    """Phase 5: the trace under phase 3's disk limit and a hot budget that holds
    ``back_hot_share`` of the agents (so that an agent runs several turns between leaving
    the hot tier): write-through, then write-back with a write budget that never binds,
    then write-back with ``back_budget_share`` of what write-through wrote, then
    write-through again (TTFT is taken against the two write-through runs' mean; their
    ratio is the machine's noise, ``write_through_ttft_repeat_ratio``). ``bounds``:
    the disk limit, and the new tokens' stored bytes (phase 1's ``new_kv_bytes``): the
    floor of any write-back that keeps every cache, writing each token once."""
    limit, new_kv = bounds
    hot = max(cfg.hot_agents, round(cfg.back_hot_share * cfg.agents))
    per_token, longest = sizes["stored_bytes_per_token"], sizes["longest_tokens_estimate"]
    budget = cfg.concurrency * sizes["turn_reserve_bytes"] + int(hot * per_token * longest)
    through = await through_or_back(cfg, trace, work / "through", (budget, limit), None)
    back = await through_or_back(cfg, trace, work / "back", (budget, limit), 1 << 50)
    spend = int(through["written_bytes"] * cfg.back_budget_share)
    short = await through_or_back(cfg, trace, work / "budgeted", (budget, limit), spend)
    again = await through_or_back(cfg, trace, work / "through-again", (budget, limit), None)
    runs = {"through": through, "back": back, "budgeted": short, "through_again": again}
    out = {
        "write_back_hot_budget_bytes": budget,
        "write_back_hot_agents": hot,
        "write_back_disk_limit_bytes": limit,
        "write_back_avg_turns_between_leaving_hot": back["avg_turns_between_leaving_hot"],
        "write_through_written_bytes": through["written_bytes"],
        "write_back_written_bytes": back["written_bytes"],
        "write_back_floor_vs_through": round(new_kv / through["written_bytes"], 4),
        "write_back_budget_bytes": spend,
    }
    # The noise: the same write-through run again, last (the machine drifts over minutes).
    out["write_through_ttft_repeat_ratio"] = round(again["ttft_s"] / through["ttft_s"], 4)
    out.update((f"write_back_{k}", v) for k, v in versus(back, through, again).items())
    out.update((f"write_back_budgeted_{k}", v) for k, v in versus(short, through, again).items())
    out["write_back_budgeted_unwritten_tokens_at_close"] = short["unwritten_tokens_at_close"]
    out["write_back_runs"] = {k: drop(r, "records") for k, r in runs.items()}
    return out


# ----------------------------------------------------------------------- the checkpoint
CHECKPOINT = "unbounded.json"
# What phase 1 depends on: a checkpoint serves a run whose settings agree on these.
PHASE_ONE_KEYS = (
    "quick", "model", "agents", "turns", "words", "max_tokens", "concurrency", "hot_agents", "seed"
)  # fmt: skip


def phase_one_settings(cfg: Config) -> dict[str, Any]:
    return {
        k: list(v) if k == "words" else v for k, v in asdict(cfg).items() if k in PHASE_ONE_KEYS
    }


def save_checkpoint(work: Path, cfg: Config, sizes: dict[str, Any], one: dict[str, Any]) -> None:
    """The probe's sizes and phase 1's figures beside its directory, so that a later run
    (``--resume``) starts at phase 2: the full mode takes longer than one sitting. Written
    whole or not at all."""
    body = {"settings": phase_one_settings(cfg), "sizes": sizes, "unbounded": one}
    part = work / (CHECKPOINT + ".part")
    part.write_text(json.dumps(body))
    part.replace(work / CHECKPOINT)


def load_checkpoint(work: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--resume``: the sizes and phase 1's figures a run with the same settings kept in
    ``work``; a clear error where there are none or they were made otherwise."""
    path = work / CHECKPOINT
    if not path.is_file() or not (work / "unbounded").is_dir():
        raise SystemExit(
            f"--resume: no finished phase 1 in {work} (it keeps {CHECKPOINT} and unbounded/; "
            "phase 4 changes that directory and removes the checkpoint)"
        )
    body = json.loads(path.read_text())
    want = phase_one_settings(cfg)
    other = {k: v for k, v in body["settings"].items() if want.get(k) != v}
    if other:
        mine = {k: want.get(k) for k in other}
        raise SystemExit(f"--resume: {path} was made with {other}, this run asks {mine}")
    return body["sizes"], body["unbounded"]


async def unbounded_first(
    cfg: Config, trace: Trace, work: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The probe and phase 1, or their checkpoint (``--resume``); checkpointed when the
    work directory is kept."""
    if cfg.resume:
        sizes, one = load_checkpoint(work, cfg)
        print(f"[1 unbounded] from {work / CHECKPOINT}", file=sys.stderr, flush=True)
        return sizes, one
    (work / CHECKPOINT).unlink(missing_ok=True)
    for old in ("probe", "unbounded"):
        shutil.rmtree(work / old, ignore_errors=True)
    sizes = await probe(cfg, trace, work / "probe")
    one = await phase_unbounded(cfg, trace, work / "unbounded", sizes["budget_bytes"])
    if cfg.workdir:
        save_checkpoint(work, cfg, sizes, one)
    return sizes, one


# --------------------------------------------------------------------------- the whole
async def run(cfg: Config) -> dict[str, Any]:
    """Every phase in a work directory (``cfg.workdir``, else a temporary one, removed)."""
    began = time.perf_counter()
    trace = make_trace(cfg.agents, cfg.turns, cfg.words, cfg.seed)
    work = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="warm-limits-"))
    work.mkdir(parents=True, exist_ok=True)
    roots = (work / "unbounded", work / "limited")
    for old in (roots[1], work / "mlx-lm", work / "write-back"):
        shutil.rmtree(old, ignore_errors=True)
    try:
        sizes, one = await unbounded_first(cfg, trace, work)
        shown = {k: v for k, v in sizes.items() if k != "layers"}
        print(f"[probe] {shown}", file=sys.stderr, flush=True)
        if cfg.stop_after_unbounded:
            return {"settings": phase_one_settings(cfg), "unbounded": drop(one, "records")}
        budget = sizes["budget_bytes"]
        limit = int(one["unbounded_bytes"] * cfg.limit_share)
        bounds = (limit, one["new_kv_bytes"])
        if cfg.write_back_only:
            alone = await phase_write_back(cfg, trace, work / "write-back", sizes, bounds)
            return only_write_back(cfg, trace, shown, alone, time.perf_counter() - began)
        (work / "mlx-lm").mkdir()
        print(f"[2 mlx-lm] {cfg.mlx_agents or cfg.agents} agents ...", file=sys.stderr)
        mlx = mlx_lm_amplification(
            sizes["layers"], trajectories(one["records"]), cfg.mlx_agents, work / "mlx-lm"
        )
        three = await phase_limited(cfg, trace, roots[1], budget, limit, one)
        print("[4 restart] ...", file=sys.stderr, flush=True)
        (work / CHECKPOINT).unlink(missing_ok=True)  # phase 4 takes a turn in unbounded/
        four = await phase_restart(cfg, trace, roots, budget, limit)
        five: dict[str, Any] | None = None
        if not cfg.no_write_back:
            print("[5 write-back] ...", file=sys.stderr, flush=True)
            five = await phase_write_back(cfg, trace, work / "write-back", sizes, bounds)
    finally:
        if not cfg.workdir:
            shutil.rmtree(work, ignore_errors=True)
    out = summary(cfg, trace, sizes, one, mlx, three, four, time.perf_counter() - began)
    if five is None:
        return out
    out.update((k, v) for k, v in five.items() if k != "write_back_runs")
    out["write_back"] = five["write_back_runs"]
    out["wall_s"]["write_back"] = round(
        sum(r["wall_s"] for r in five["write_back_runs"].values()), 1
    )
    out["wall_s"]["total"] = out["wall_s"].pop("total")
    out["targets"]["write_back_written_vs_through <= 0.5"] = (
        five["write_back_written_vs_through"] <= 0.5
    )
    out["targets"]["write_back_ttft_vs_through <= 1.05"] = (
        five["write_back_ttft_vs_through"] <= 1.05
    )
    turns = five["write_back_avg_turns_between_leaving_hot"]  # None: none left, came back
    out["targets"]["write_back_avg_turns_between_leaving_hot >= 3"] = turns is None or turns >= 3
    return out


def only_write_back(
    cfg: Config, trace: Trace, shown: dict[str, Any], five: dict[str, Any], wall: float
) -> dict[str, Any]:
    """``--write-back-only``'s figures: phase 5's, flat, with its runs below them."""
    out = {
        "model": shown["model"],
        "quick": cfg.quick,
        "agents": cfg.agents,
        "turns": len(trace.turns),
        "turns_per_agent": cfg.turns,
        **{k: v for k, v in five.items() if k != "write_back_runs"},
        "write_back": five["write_back_runs"],
        "wall_s": {"total": round(wall, 1)},
        "config": {**asdict(cfg), "words": list(cfg.words)},
        "probe": shown,
    }
    return out


def summary(
    cfg: Config,
    trace: Trace,
    sizes: dict[str, Any],
    one: dict[str, Any],
    mlx: dict[str, Any],
    three: dict[str, Any],
    four: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    """The figures, flat (the issue's names), with each phase's details below them."""
    out: dict[str, Any] = {
        "model": sizes["model"],
        "quick": cfg.quick,
        "agents": cfg.agents,
        "turns": len(trace.turns),
        "turns_per_agent": cfg.turns,
        "seed": cfg.seed,
        "concurrency": cfg.concurrency,
        "max_tokens": cfg.max_tokens,
        "ctx_tokens_max": one["ctx_tokens_max"],
        "ctx_tokens_final_mean": one["ctx_tokens_final_mean"],
        "budget_bytes": sizes["budget_bytes"],
        "unbounded_bytes": one["unbounded_bytes"],
        "disk_limit_bytes": int(one["unbounded_bytes"] * cfg.limit_share),
        **{k: three[k] for k in ("warm_peak_bytes", "over_limit_samples", "demoted_cold")},
        "re_prefilled_tokens": three["re_prefilled_tokens"],
        "new_kv_bytes": one["new_kv_bytes"],
        **{k: v for k, v in one.items() if k.startswith(("written_bytes", "write_amp"))},
        **{k: v for k, v in three.items() if k.startswith(("written_bytes", "write_amp"))},
        **{k: v for k, v in mlx.items() if k != "mlx_lm_wall_s"},
        **{k: four[k] for k in four if k != "wall_s"},
        "answers_identical": three["answers_identical"],
        "answer_mismatches": three["answer_mismatches"],
        "mismatch_examples": three["mismatch_examples"],
        "first_mismatch_paths": three["first_mismatch_paths"],
        "save_errors_unbounded": one["save_errors"],
        "save_errors_limited": three["save_errors"],
        "save_error_examples": three["save_error_examples"],
        "avg_turns_between_leaving_hot": leaving_hot(one["records"]),
        "avg_turns_between_leaving_hot_limited": leaving_hot(three["records"]),
        "wall_s": {
            "unbounded": one["wall_s"],
            "mlx_lm": mlx["mlx_lm_wall_s"],
            "limited": three["wall_s"],
            "restart": four["wall_s"],
            "total": round(wall, 1),
        },
        "config": {**asdict(cfg), "words": list(cfg.words)},
        "probe": {k: v for k, v in sizes.items() if k != "layers"},
        "unbounded": {k: v for k, v in one.items() if k != "records"},
        "limited": {k: v for k, v in three.items() if k != "records"},
    }
    out["targets"] = {
        "over_limit_samples == 0": out["over_limit_samples"] == 0,
        "restart_over_limit == 0": out["restart_over_limit"] == 0,
        f"write_amplification <= {TARGET_AMPLIFICATION}": out["write_amplification"]
        <= TARGET_AMPLIFICATION,
        "answers_identical": out["answers_identical"],
    }
    return out


def mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def written_row(r: dict[str, Any], tag: str) -> tuple[str, str, str, str]:
    """The bytes a phase wrote: the store's count / the write syscalls / the new files
    seen; the store's count should be the syscalls' less a few lines of progress."""
    store, calls = r[f"written_bytes{tag}_store"], r[f"written_bytes{tag}_syscalls"]
    return (
        f"written_bytes{tag} (store / write syscalls / new files seen)",
        f"{mib(store)} / {mib(calls)} / {mib(r[f'written_bytes{tag}_files_seen'])}",
        "store ~ syscalls",
        "met" if abs(store - calls) <= max(calls // 100, 64 << 10) else "**not met**",
    )


def write_back_rows(r: dict[str, Any]) -> list[tuple[str, Any, str, str]]:
    """Phase 5's figures: write-back against write-through, under the disk limit, on a
    roomier hot tier."""
    ok = {True: "met", False: "**not met**"}
    runs = r["write_back"]
    turns = r["write_back_avg_turns_between_leaving_hot"]  # None: none left and came back
    ratio, ttft = r["write_back_written_vs_through"], r["write_back_ttft_vs_through"]
    cold = " / ".join(str(runs[k]["cold_turns"]) for k in ("through", "back", "budgeted"))
    unwritten = " / ".join(
        str(runs[k]["unwritten_tokens_at_close"]) for k in ("through", "back", "budgeted")
    )
    return [
        (
            "write-back: hot budget (agents) / turns between leaving hot",
            f"{mib(r['write_back_hot_budget_bytes'])} ({r['write_back_hot_agents']}) / "
            f"{'all (none left and came back)' if turns is None else turns} "
            f"(write-through: {runs['through']['avg_turns_between_leaving_hot']})",
            ">= 3 turns",
            ok[turns is None or turns >= 3],
        ),
        (
            "written, open to close: write-through / write-back",
            f"{mib(r['write_through_written_bytes'])} / {mib(r['write_back_written_bytes'])}",
            "",
            "",
        ),
        ("write_back_written_vs_through", ratio, "<= 0.5", ok[ratio <= 0.5]),
        ("  the floor: new_kv / write-through's", r["write_back_floor_vs_through"], "", ""),
        (
            "write_back_ttft_vs_through: summed (a turn's median)",
            f"{ttft} ({r['write_back_ttft_turn_median_vs_through']})",
            "<= 1.05",
            ok[ttft <= 1.05],
        ),
        (
            "write-back answers identical (turns differing)",
            f"{r['write_back_answers_identical']} ({r['write_back_answer_mismatches']})",
            "",
            "",
        ),
        ("cold turns: through / back / budgeted", cold, "", ""),
        (
            "noise: write-through's summed TTFT, run again last / first",
            r["write_through_ttft_repeat_ratio"],
            "",
            "",
        ),
        (
            f"budgeted ({mib(r['write_back_budget_bytes'])}): written / summed TTFT vs through",
            f"{r['write_back_budgeted_written_vs_through']} / "
            f"{r['write_back_budgeted_ttft_vs_through']}",
            "",
            "",
        ),
        ("tokens not on disk at close: through / back / budgeted", unwritten, "", ""),
    ]


def table(r: dict[str, Any]) -> str:
    """The figures as a markdown table, with the issue's targets."""
    ok = {True: "met", False: "**not met**"}
    s = r["limited"]["sampler"]
    gap = s["sample_gap_max_ms"]
    rows = [
        ("model", r["model"], "", ""),
        ("agents / turns", f"{r['agents']} / {r['turns']} (x{r['turns_per_agent']})", "", ""),
        (
            "context tokens: max / final mean",
            f"{r['ctx_tokens_max']} / {r['ctx_tokens_final_mean']}",
            ">= 2048 (full mode)",
            "",
        ),
        ("hot budget_bytes", mib(r["budget_bytes"]), "", ""),
        ("unbounded warm tier (phase 1)", mib(r["unbounded_bytes"]), "", ""),
        ("disk_limit_bytes", f"{mib(r['disk_limit_bytes'])} ({r['disk_limit_bytes']})", "", ""),
        (
            "warm_peak_bytes (sampled)",
            f"{mib(r['warm_peak_bytes'])} ({r['warm_peak_bytes']})",
            "<= limit",
            ok[r["warm_peak_bytes"] <= r["disk_limit_bytes"]],
        ),
        (
            "over_limit_samples",
            f"{r['over_limit_samples']} of {s['samples']}",
            "0",
            ok[r["over_limit_samples"] == 0],
        ),
        (
            "sample gap mean / p99 / max",
            f"{s['sample_gap_mean_ms']} / {s['sample_gap_p99_ms']} / {gap} ms "
            f"({s['sample_gaps_over_50ms']} of {s['samples']} over 50 ms)",
            "<= 50 ms",
            ok[gap <= 50],
        ),
        ("event loop blocked, longest (limited phase)", f"{s['event_loop_lag_max_ms']} ms", "", ""),
        ("the store's own disk_peak_bytes", r["limited"]["store_disk_peak_bytes"], "", ""),
        ("demoted_cold", r["demoted_cold"], "", ""),
        ("cold turns (not first turns)", r["limited"]["cold_turns"], "", ""),
        ("re_prefilled_tokens", r["re_prefilled_tokens"], "", ""),
        ("new_kv_bytes", mib(r["new_kv_bytes"]), "", ""),
        written_row(r, ""),
        (
            "write_amplification (write-through)",
            r["write_amplification"],
            f"<= {TARGET_AMPLIFICATION}",
            ok[r["write_amplification"] <= TARGET_AMPLIFICATION],
        ),
        written_row(r, "_limited"),
        ("write_amplification_limited", r["write_amplification_limited"], "", ""),
        (
            "mlx_lm_write_amplification",
            f"{r['mlx_lm_write_amplification']} ({r['mlx_lm_agents']} agents)",
            "",
            "",
        ),
        (
            "answers_identical (mismatches)",
            f"{r['answers_identical']} ({r['answer_mismatches']} turns; each diverging "
            f"agent's first, by path: {r['first_mismatch_paths']})",
            "True",
            ok[r["answers_identical"]],
        ),
        (
            "save errors: unbounded / limited",
            f"{r['save_errors_unbounded']} / {r['save_errors_limited']}",
            "0 / 0",
            "",
        ),
        ("restart limit", mib(r["restart_limit_bytes"]), "", ""),
        ("restart bytes at open", mib(r["restart_bytes_at_open"]), "", ""),
        ("restart_over_limit", r["restart_over_limit"], "0", ok[r["restart_over_limit"] == 0]),
        ("restart: demoted cold at open", r["restart_demoted_cold"], "", ""),
        (
            "restart: a cold agent's turn",
            f"{r['restart_turn_path']}, ok "
            f"{r['restart_turn_ok']}, same as resumed {r['restart_turn_identical']}, "
            f"same as a new agent's prefill {r['restart_turn_equals_fresh_prefill']}",
            "",
            "",
        ),
        ("avg_turns_between_leaving_hot", r["avg_turns_between_leaving_hot"], "", ""),
        *(write_back_rows(r) if "write_back" in r else []),
        (
            "wall s: unbounded / mlx-lm / limited / restart / total",
            " / ".join(str(v) for v in r["wall_s"].values()),
            "",
            "",
        ),
    ]
    return figure_table(rows)


def parse(argv: list[str] | None = None) -> tuple[Config, str | None]:
    """The configuration the command line asks for, and its ``--json`` path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, small sizes")
    parser.add_argument("--model", default=None)
    parser.add_argument("--agents", type=int)
    parser.add_argument("--turns", type=int, help="turns per agent")
    parser.add_argument("--words", type=int, nargs=2, help="new words per turn: min max")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--hot-agents", type=int, help="agents the hot budget holds")
    parser.add_argument("--limit-share", type=float)
    parser.add_argument("--restart-share", type=float)
    parser.add_argument("--back-hot-share", type=float, help="phase 5: agents hot, a share")
    parser.add_argument("--back-budget-share", type=float, help="phase 5: a write budget")
    parser.add_argument("--write-back-only", action="store_true", help="phase 5 alone")
    parser.add_argument("--no-write-back", action="store_true", help="phases 1-4 only")
    parser.add_argument("--sample-ms", type=float)
    parser.add_argument("--mlx-agents", type=int, help="agents replayed for mlx-lm (0: all)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dir", dest="workdir", help="keep the cache directories here")
    parser.add_argument(
        "--stop-after-unbounded",
        action="store_true",
        help="the probe and phase 1 only, checkpointed in --dir for a later --resume",
    )
    parser.add_argument(
        "--resume", action="store_true", help="phase 1 from --dir's checkpoint, then the rest"
    )
    parser.add_argument("--json", metavar="PATH")
    args = vars(parser.parse_args(argv))
    json_path = args.pop("json")
    base = QUICK if args.pop("quick") else Config()
    given: dict[str, Any] = {k: v for k, v in args.items() if v is not None}
    if "words" in given:
        given["words"] = tuple(given["words"])
    cfg = replace(base, **given)
    if cfg.quick and cfg.model:
        parser.error("--quick runs the tiny model: no --model")
    if (cfg.resume or cfg.stop_after_unbounded) and not cfg.workdir:
        parser.error("--resume and --stop-after-unbounded keep phase 1 in --dir DIR")
    if cfg.resume and cfg.stop_after_unbounded:
        parser.error("--resume starts after what --stop-after-unbounded runs")
    return cfg, json_path


if __name__ == "__main__":
    config, json_path = parse()
    result = anyio.run(run, config)
    if config.stop_after_unbounded:
        print(json.dumps(result["unbounded"], indent=1))
        print(f"phase 1 kept in {config.workdir}: go on with the same options and --resume")
    elif config.write_back_only:
        print(figure_table([("model", result["model"], "", ""), *write_back_rows(result)]))
    else:
        print(table(result))
    if json_path:
        write_json(json_path, result)
