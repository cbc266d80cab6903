"""Engine hosts on a local Ray cluster (``kvactor.open(..., cluster="local")``) against the
in-process engine, on the default model, in one run: decode throughput on one vs two
hosts, moving a long agent between hosts, and what a turn through a host costs.

Two local clusters on 127.0.0.1, one after the other (each started and stopped here), of
this machine's 2 CPUs: one engine host with both (``hosts_per_node=1``), then two hosts
``h0`` and ``h1`` with one CPU each (``hosts_per_node=2``: two one-core "nodes"; Ray sets
each host's OMP_NUM_THREADS to its CPUs, and OpenBLAS obeys it). Each host is its own
process with its own model and warm tier. An in-process session runs beside the first
cluster. Greedy throughout.

- ``tok_s``: ``--agents`` (16) agents, each continuing a short raw prompt that counts, all
  at once, ``--tokens`` (64) tokens each: the tokens generated over the wall time (their
  ~15-token prefills included), with every agent on
  ``h0`` (``"1"``) and with them split over ``h0`` and ``h1`` (``"2"``), hosts of one CPU.
  ``--runs`` (3) runs, the sides alternating, fresh agents each time; medians.
  ``tok_s_one_host_both_cpus``: the same on the one host with both CPUs. Hosts batch up
  to ``--max-batch`` (16) agents in one forward, so one host decodes all of them at once.
- ``migrate_s``: an agent with a ``--context`` (4096) token system prompt and one turn on
  ``h0`` is moved to ``h1`` (``kv.place``: the old host saves and releases it, its files go
  host to host through Ray's object store, the new host verifies and adopts them);
  ``migrate_bytes`` what moved. ``warm_reload_s``: its next turn's time to first token on
  ``h1``, a warm resume (its cache read from the files, page-cached as they were just
  written); ``hot_s`` the same turn's of a twin (same prompt and turns) that stayed hot
  on ``h0``; ``migration_identical``: both answer the same greedy tokens.
- ``host_overhead``: an agent on the host with both CPUs and one in this process, turns of
  ``--overhead-tokens`` (32) tokens one after the other, alternating (``--overhead-turns``,
  8, each); the median wall time of a turn (``generate``) through the host over the
  in-process one, less one (target <= 0.10). ``stream_overhead``: the same of streamed
  turns (every text piece one item through Ray), alternating with those.
  ``overhead_identical``: both sides generated the same tokens, turn for turn.
- ``replica_turn_s``: the wall times of three turns (the first: the ``--context`` prompt,
  8 tokens; then two of 16 tokens) of an agent on ``h0``, without (``"1"``) and with
  (``"2"``, a third cluster, ``replicas=2``) a replica kept on ``h1``: each turn's new warm
  files sent, verified there and swapped in before the turn returns.

    python bench/cluster.py [--agents 16] [--tokens 64] [--runs 3] [--context 4096]
        [--json PATH]

``--routing`` measures placement instead (issue 43: round robin, most free budget,
cache-aware and an ideal assignment on a trace of teams sharing system prompts; see
``bench/_routing.py``):

    python bench/cluster.py --routing [--http] [--model tiny|default] [--hosts 3] [--teams 6]
        [--per-team 8] [--prompt-tokens 1200] [--max-tokens 8] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS before mlx.core

# isort: split
import _routing
import anyio
from _results import write_json  # bench/ is the script's folder: on sys.path

TEXT = Path(__file__).with_name("data") / "fidelity.txt"
SYSTEM = "You are a helpful assistant. Answer plainly."
COUNT = "Count from 1 to 200, numbers separated by commas, nothing else."


async def timed(agent: Any, text: str, max_tokens: int) -> tuple[float, float, Any]:
    """Seconds to the first text piece and to the end of the turn, and the Completion."""
    t0 = time.perf_counter()
    first = None
    async with agent.stream(text, max_tokens=max_tokens) as pieces:
        async for _ in pieces:
            first = first or time.perf_counter()
    end = time.perf_counter()
    assert pieces.completion is not None
    return (first or end) - t0, end - t0, pieces.completion


async def throughput(
    kv: Any, hosts: list[str], tag: str, agents: int, tokens: int
) -> tuple[float, int]:
    """Generated tokens/s of a turn of ``agents`` agents at once, spread over ``hosts``,
    and the tokens generated. Each agent continues a raw prompt that counts (nothing
    makes a model stop there), so each decodes all ``tokens``."""
    names = [f"{tag}-{i}" for i in range(agents)]
    for i, name in enumerate(names):
        await kv.spawn_agent(name, host=hosts[i % len(hosts)])
    generated: list[int] = []

    async def turn(name: str, prompt: str, max_tokens: int) -> None:
        done = await kv.agent(name).complete(prompt, max_tokens=max_tokens)
        generated.append(done.timings.generated_tokens)

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, name in enumerate(names):
            tg.start_soon(turn, name, f"Agent {i} counts: 1, 2, 3, 4, 5,", tokens)
    wall = time.perf_counter() - began
    for name in names:
        await kv.forget(name)
    return sum(generated) / wall, sum(generated)


async def migration(kv: Any, document: str) -> dict[str, Any]:
    moving = await kv.spawn_agent("long", system=document, host="h0")
    twin = await kv.spawn_agent("twin", system=document, host="h0")
    question = "In one sentence: what is this text about?"
    for agent in (moving, twin):
        await agent.generate(question, max_tokens=8)
    began = time.perf_counter()
    moved = await kv.place("long", "h1")
    migrate_s = time.perf_counter() - began
    assert moved is not None and kv.agent("long").host == "h1"
    follow = "Name one detail it gives."
    warm_s, _, after = await timed(moving, follow, 16)
    hot_s, _, kept = await timed(twin, follow, 16)
    assert after.path == kvactor.Tier.WARM, after.path
    return {
        "migrate_s": migrate_s,
        "migrate_host_s": moved.seconds,
        "migrate_bytes": moved.nbytes,
        "warm_reload_s": warm_s,
        "warm_reload_load_s": after.timings.load_s,
        "hot_s": hot_s,
        "context_tokens": after.timings.reused_tokens,
        "migration_identical": after.token_ids == kept.token_ids,
    }


async def turn_walls(kv: Any, document: str) -> list[float]:
    """Wall times of three turns of a new agent with ``document`` as its system prompt on
    ``h0``: the first (its whole cache new), then two short ones."""
    agent = await kv.spawn_agent("copied", system=document, host="h0")
    walls = []
    for text, tokens in (("Summarize it in a sentence.", 8), ("One detail?", 16), ("Another?", 16)):
        began = time.perf_counter()
        await agent.generate(text, max_tokens=tokens)
        walls.append(time.perf_counter() - began)
    await kv.forget("copied")
    return walls


async def overhead(kv: Any, local: Any, turns: int, tokens: int) -> dict[str, Any]:
    remote = await kv.spawn_agent("over", system=SYSTEM, host="h0")
    here = await local.spawn_agent("over", system=SYSTEM)
    await remote.generate("Hello.", max_tokens=4)  # first turns: prefill and warm-up
    await here.generate("Hello.", max_tokens=4)
    walls: dict[str, list[float]] = {"host": [], "local": [], "host_stream": [], "local_stream": []}
    identical = True
    for i in range(turns):
        text = f"Turn {i}. {COUNT}"
        done = []
        for side, agent in (("host", remote), ("local", here)):
            began = time.perf_counter()
            done.append(await agent.generate(text, max_tokens=tokens))
            walls[side].append(time.perf_counter() - began)
        for side, agent in (("host_stream", remote), ("local_stream", here)):
            _, wall, completion = await timed(agent, f"Again: {text}", tokens)
            walls[side].append(wall)
            done.append(completion)
        identical &= done[0].token_ids == done[1].token_ids
        identical &= done[2].token_ids == done[3].token_ids
    med = {side: statistics.median(w) for side, w in walls.items()}
    return {
        "host_turn_s": med["host"],
        "local_turn_s": med["local"],
        "host_overhead": med["host"] / med["local"] - 1,
        "host_stream_s": med["host_stream"],
        "local_stream_s": med["local_stream"],
        "stream_overhead": med["host_stream"] / med["local_stream"] - 1,
        "overhead_tokens": tokens,
        "overhead_identical": identical,
    }


def cluster(root: Path, hosts_per_node: int, options: dict[str, Any]) -> Any:
    """A local cluster of this machine's 2 CPUs with ``hosts_per_node`` hosts: Ray gives
    each host its share of the CPUs (and sets its OMP_NUM_THREADS, which OpenBLAS obeys)."""
    return kvactor.open(
        cluster="local",
        cache_dir=root / f"cluster-{hosts_per_node}-{options.get('replicas', 1)}",
        hosts_per_node=hosts_per_node,
        ray_options={"num_cpus": 2},
        **options,
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
        root = Path(tmp)
        options = {"max_batch": args.max_batch}
        async with kvactor.open(cache_dir=root / "local", **options) as local:
            # One host with the whole machine, as the in-process engine has it.
            async with cluster(root, 1, options) as kv:
                over = await overhead(kv, local, args.overhead_turns, args.overhead_tokens)
                print(f"turn through a host: {over['host_overhead']:+.1%}", flush=True)
                whole = [
                    (await throughput(kv, ["h0"], f"w{run}", args.agents, args.tokens))[0]
                    for run in range(args.runs)
                ]
                print(f"one host, both CPUs: {statistics.median(whole):.1f} tok/s", flush=True)
            ids = local.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
            while len(ids) < args.context:
                ids = ids + ids
            document = local.tokenizer.decode(ids[: args.context - 40])  # with the template
        # Two hosts of one CPU each (two one-core nodes): all agents on one, or on both.
        async with cluster(root, 2, options) as kv:
            plain = await turn_walls(kv, document)
            rates: dict[str, list[float]] = {"1": [], "2": []}
            counts: dict[str, list[int]] = {"1": [], "2": []}
            for run in range(args.runs):
                for n, hosts in (("1", ["h0"]), ("2", ["h0", "h1"])):
                    # The same agent names on both sides: the same prompts and answers.
                    rate, count = await throughput(kv, hosts, f"r{run}", args.agents, args.tokens)
                    rates[n].append(rate)
                    counts[n].append(count)
                    print(
                        f"run {run}: {n} one-CPU host(s): {rate:.1f} tok/s ({count} tokens)",
                        flush=True,
                    )
            moved = await migration(kv, document)
            print(f"migrated {moved['migrate_bytes'] / 1e6:.1f} MB in {moved['migrate_s']:.2f} s")
        async with cluster(root, 2, {**options, "replicas": 2}) as kv:
            copied = await turn_walls(kv, document)
            print(f"turns with a replica: {copied} s, without: {plain} s", flush=True)
    return {
        "tok_s": {n: statistics.median(r) for n, r in rates.items()},
        "tok_s_runs": rates,
        "tokens_generated_runs": counts,
        "tok_s_one_host_both_cpus": statistics.median(whole),
        **moved,
        **over,
        "replica_turn_s": {"1": plain, "2": copied},
        "agents": args.agents,
        "tokens": args.tokens,
        "max_batch": args.max_batch,
        "cpus": os.cpu_count(),
        "blas": kvactor.BLAS.name,
    }


def report(out: dict[str, Any]) -> None:
    one, two = out["tok_s"]["1"], out["tok_s"]["2"]
    print()
    print("| measure | value |")
    print("|---|---:|")
    whole = out["tok_s_one_host_both_cpus"]
    print(f"| decode, {out['agents']} agents on 1 host of 1 CPU | {one:.1f} tok/s |")
    print(
        f"| decode, {out['agents']} agents on 2 hosts of 1 CPU | {two:.1f} tok/s "
        f"({two / one:.2f}x) |"
    )
    print(f"| decode, {out['agents']} agents on 1 host of 2 CPUs | {whole:.1f} tok/s |")
    print(
        f"| migrate a {out['context_tokens']}-token agent "
        f"({out['migrate_bytes'] / 1e6:.1f} MB) | {out['migrate_s'] * 1e3:.0f} ms |"
    )
    print(f"| its next turn, warm on the new host (TTFT) | {out['warm_reload_s'] * 1e3:.0f} ms |")
    print(f"| the same turn of a twin kept hot (TTFT) | {out['hot_s'] * 1e3:.0f} ms |")
    print(f"| migration keeps greedy output | {out['migration_identical']} |")
    one, two = out["replica_turn_s"]["1"], out["replica_turn_s"]["2"]
    print(
        f"| turns of a {out['context_tokens']}-token agent, replicas=1 / replicas=2 "
        f"| {' '.join(f'{a * 1e3:.0f}/{b * 1e3:.0f}' for a, b in zip(one, two, strict=True))} ms |"
    )
    print(
        f"| turn of {out['overhead_tokens']} tokens: host / in-process "
        f"| {out['host_turn_s'] * 1e3:.0f} / {out['local_turn_s'] * 1e3:.0f} ms "
        f"({out['host_overhead']:+.1%}) |"
    )
    print(
        f"| the same, streamed: host / in-process "
        f"| {out['host_stream_s'] * 1e3:.0f} / {out['local_stream_s'] * 1e3:.0f} ms "
        f"({out['stream_overhead']:+.1%}) |"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--overhead-turns", type=int, default=8)
    parser.add_argument("--overhead-tokens", type=int, default=32)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--routing", action="store_true", help="placement policies (issue 43)")
    parser.add_argument(
        "--http", action="store_true", help="--routing through the server's app, anonymously"
    )
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--teams", type=int, default=6)
    parser.add_argument("--per-team", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.routing:

        async def routed() -> dict[str, Any]:
            with tempfile.TemporaryDirectory(dir=os.environ.get("KVACTOR_BENCH_DIR")) as tmp:
                return await _routing.routing(args, Path(tmp))

        out = anyio.run(routed)
        _routing.report(out)
    else:
        out = anyio.run(main, args)
        report(out)
    if args.json:
        write_json(args.json, out)
