"""``bench/cluster.py --routing``: where a cluster places agents that share prefixes.

A local Ray cluster of ``--hosts`` (3) hosts on 127.0.0.1 (this machine's CPUs shared
among them), a seeded trace of ``--teams`` (6) teams of ``--per-team`` (8) agents, each team
sharing a system prompt of ``--prompt-tokens`` (1,200) tokens (its own opening line, then
a part of ``bench/data/fidelity.txt`` of its own), arriving interleaved in a seeded random
order; each agent is spawned and takes its first turn as it arrives, then every agent takes
a second turn in the same order (one turn at a time: TTFT is each turn's own). The same
trace under four placements, each on a fresh cluster:

- ``round_robin`` (``kvactor.RoundRobin``), ``most_free_budget`` (``kvactor.MostFreeBudget``),
  ``cache_aware`` (``kvactor.CacheAware``, the default);
- ``ideal``: each team pinned to one host (team t on host t mod hosts): every team
  prefills its prompt once, and the hosts hold equal numbers of teams.

Per policy: ``prefix_hit_rate`` (reused prompt tokens over prompt tokens, every turn),
``prefilled_tokens``, ``summed_ttft_s`` (the turns' own ``Timings.ttft_s``),
``max_host_load_share`` (the most agents on one host over all agents), ``agents_per_host``.
Top level: ``prefilled_vs_ideal`` and ``ttft_vs_round_robin`` of cache_aware, and
``identical`` (every turn's greedy tokens equal under every policy). The tiny model
(``--model tiny``, hit rates in seconds) or the default model (``--model default``: TTFT).
The server's anonymous conversations are not in the trace: ``kvactor serve`` does not run
on a cluster yet.
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from typing import Any

import kvactor
from kvactor.actors.models import make_tiny_model

POLICIES = ("round_robin", "most_free_budget", "cache_aware", "ideal")
TEXT = Path(__file__).with_name("data") / "fidelity.txt"
QUESTIONS = ("What should we check first?", "And after that?")


def _model(name: str) -> Any:
    return functools.partial(make_tiny_model, 0, head_dim=64) if name == "tiny" else None


def team_prompts(tokenizer: Any, teams: int, tokens: int) -> list[str]:
    """One system prompt per team, about ``tokens`` tokens long, each different from its
    first words on."""
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    while len(ids) < tokens * (teams + 1):
        ids = ids + ids
    prompts = []
    for t in range(teams):
        part = tokenizer.decode(ids[t * tokens : (t + 1) * tokens - 20])
        prompts.append(f"You are a member of team {t}. Work from this brief.\n{part}")
    return prompts


def arrivals(teams: int, per_team: int, seed: int) -> list[tuple[int, int]]:
    """(team, member) in a seeded random interleaving of the teams."""
    order = [(t, i) for t in range(teams) for i in range(per_team)]
    random.Random(seed).shuffle(order)
    # Members of a team arrive in their own order (member 0 first), teams interleaved.
    seen: dict[int, int] = {}
    out = []
    for t, _ in order:
        out.append((t, seen.get(t, 0)))
        seen[t] = seen.get(t, 0) + 1
    return out


def placement(name: str) -> Any:
    return {
        "round_robin": kvactor.RoundRobin(),
        "most_free_budget": kvactor.MostFreeBudget(),
        "cache_aware": kvactor.CacheAware(),
        "ideal": None,
    }[name]


async def run_policy(
    policy: str, root: Path, args: Any, prompts: list[str], order: list[tuple[int, int]]
) -> dict[str, Any]:
    """The trace under ``policy`` on a fresh local cluster."""
    began = time.perf_counter()
    chosen = placement(policy)
    async with kvactor.open(
        _model(args.model),
        cluster="local",
        cache_dir=root / policy,
        hosts_per_node=args.hosts,
        ray_options={"num_cpus": args.hosts},
        **({"placement": chosen} if chosen is not None else {}),
    ) as kv:
        turns: dict[str, list[Any]] = {}
        where: dict[str, str] = {}
        for question in QUESTIONS:
            for team, member in order:
                name = f"t{team}-a{member}"
                if name not in where:
                    host = f"h{team % args.hosts}" if policy == "ideal" else None
                    agent = await kv.spawn_agent(name, system=prompts[team], host=host)
                    where[name] = agent.host
                done = await kv.agent(name).generate(question, max_tokens=args.max_tokens)
                turns.setdefault(name, []).append(done)
    done_all = [d for ds in turns.values() for d in ds]
    prompt = sum(d.timings.prompt_tokens for d in done_all)
    reused = sum(d.timings.reused_tokens for d in done_all)
    counts: dict[str, int] = {}
    for host in where.values():
        counts[host] = counts.get(host, 0) + 1
    return {
        "prefix_hit_rate": reused / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "prefilled_tokens": sum(d.timings.prefilled_tokens for d in done_all),
        "summed_ttft_s": sum(d.timings.ttft_s for d in done_all),
        "first_turn_ttft_s": sum(ds[0].timings.ttft_s for ds in turns.values()),
        "max_host_load_share": max(counts.values()) / len(where),
        "agents_per_host": dict(sorted(counts.items())),
        "teams_split": sum(
            len({where[f"t{t}-a{i}"] for i in range(args.per_team)}) > 1 for t in range(args.teams)
        ),
        "wall_s": time.perf_counter() - began,
        "tokens": {name: [d.token_ids for d in ds] for name, ds in sorted(turns.items())},
    }


async def routing(args: Any, root: Path) -> dict[str, Any]:
    """Every policy on the same trace, then the ratios (see the module doc)."""
    async with kvactor.open(_model(args.model), cache_dir=root / "probe") as probe:
        prompts = team_prompts(probe.tokenizer, args.teams, args.prompt_tokens)
        prompt_tokens = [len(probe.tokenizer.encode(p)) for p in prompts]
    order = arrivals(args.teams, args.per_team, args.seed)
    results: dict[str, Any] = {}
    for policy in POLICIES:
        results[policy] = await run_policy(policy, root, args, prompts, order)
        r = results[policy]
        print(
            f"{policy}: hit rate {r['prefix_hit_rate']:.3f}, prefilled {r['prefilled_tokens']}, "
            f"TTFT {r['summed_ttft_s']:.2f} s, max load share {r['max_host_load_share']:.3f} "
            f"({r['wall_s']:.0f} s)",
            flush=True,
        )
    tokens = [results[p].pop("tokens") for p in POLICIES]
    aware, ideal, robin = results["cache_aware"], results["ideal"], results["round_robin"]
    return {
        "model": args.model,
        "hosts": args.hosts,
        "teams": args.teams,
        "per_team": args.per_team,
        "agents": args.teams * args.per_team,
        "team_prompt_tokens": prompt_tokens,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "policies": results,
        "prefilled_vs_ideal": aware["prefilled_tokens"] / ideal["prefilled_tokens"],
        "ttft_vs_round_robin": aware["summed_ttft_s"] / robin["summed_ttft_s"],
        "max_host_load_share": aware["max_host_load_share"],
        "identical": all(t == tokens[0] for t in tokens),
        "blas": kvactor.BLAS.name,
    }


def report(out: dict[str, Any]) -> None:
    print()
    print(
        f"{out['agents']} agents in {out['teams']} teams on {out['hosts']} hosts, "
        f"model {out['model']}, team prompts {min(out['team_prompt_tokens'])}-"
        f"{max(out['team_prompt_tokens'])} tokens"
    )
    print(
        "| policy | prefix_hit_rate | prefilled_tokens | summed_ttft_s | max_host_load_share "
        "| teams split |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in out["policies"].items():
        print(
            f"| {name} | {r['prefix_hit_rate']:.3f} | {r['prefilled_tokens']} "
            f"| {r['summed_ttft_s']:.2f} | {r['max_host_load_share']:.3f} | {r['teams_split']} |"
        )
    checks = (
        ("cache_aware prefilled_tokens / ideal", out["prefilled_vs_ideal"], "<= 1.1", 1.1),
        ("cache_aware summed_ttft_s / round_robin", out["ttft_vs_round_robin"], "<= 0.6", 0.6),
        ("cache_aware max_host_load_share", out["max_host_load_share"], "<= 0.45", 0.45),
    )
    print()
    print("| figure | value | target | |")
    print("|---|---:|---|---|")
    for what, value, target, bound in checks:
        print(f"| {what} | {value:.3f} | {target} | {'met' if value <= bound else 'not met'} |")
    print(f"| greedy answers identical across policies | {out['identical']} | True | |")
