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

With ``--http`` the trace goes through ``kvactor serve``'s app over the cluster
(``ServedCluster``, served on 127.0.0.1) as anonymous chat conversations: no agent id,
each agent's conversation its team's system prompt and its questions (each member asks as
itself, so no two conversations are alike), placed by the server's routing; ``ideal`` is
then a placement that pins each team's first prompt block to the next host in turn.
Each conversation must keep its agent (``conversations_kept``).

Per policy: ``prefix_hit_rate`` (reused prompt tokens over prompt tokens, every turn),
``prefilled_tokens``, ``summed_ttft_s`` (the turns' own ``Timings.ttft_s``),
``max_host_load_share`` (the most agents on one host over all agents), ``agents_per_host``.
Top level: ``prefilled_vs_ideal`` and ``ttft_vs_round_robin`` of cache_aware, and
``identical`` (every turn's greedy tokens equal under every policy). The tiny model
(``--model tiny``, hit rates in seconds) or the default model (``--model default``: TTFT).
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Turn:
    """What one turn of the trace reports, by the API or over HTTP."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    ttft_s: float
    answer: Any  # greedy tokens (the API) or text (HTTP): compared across policies

    @classmethod
    def of(cls, done: Any) -> Turn:
        t = done.timings
        return cls(t.prompt_tokens, t.reused_tokens, t.prefilled_tokens, t.ttft_s, done.token_ids)


class PinTeams:
    """``ideal`` over HTTP, where no request names a host: a prompt's first block (its
    team's opening) pinned to the next host in turn when first seen."""

    def __init__(self) -> None:
        self._pinned: dict[int, str] = {}

    def choose(self, agent: str, hosts: Any) -> str:
        return str(kvactor.MostFreeBudget().choose(agent, hosts))

    def choose_prefix(self, agent: str, hosts: Any, blocks: Any, held: Any) -> str:
        if not blocks:
            return self.choose(agent, hosts)
        names = sorted(h.name for h in hosts)
        return self._pinned.setdefault(blocks[0], names[len(self._pinned) % len(names)])


def _open(policy: str, root: Path, args: Any, chosen: Any) -> Any:
    return kvactor.open(
        _model(args.model),
        cluster="local",
        cache_dir=root / policy,
        hosts_per_node=args.hosts,
        ray_options={"num_cpus": args.hosts},
        **({"placement": chosen} if chosen is not None else {}),
    )


async def run_policy(
    policy: str, root: Path, args: Any, prompts: list[str], order: list[tuple[int, int]]
) -> dict[str, Any]:
    """The trace under ``policy`` on a fresh local cluster, by the API."""
    began = time.perf_counter()
    async with _open(policy, root, args, placement(policy)) as kv:
        turns: dict[str, list[Turn]] = {}
        where: dict[str, str] = {}
        for question in QUESTIONS:
            for team, member in order:
                name = f"t{team}-a{member}"
                if name not in where:
                    host = f"h{team % args.hosts}" if policy == "ideal" else None
                    agent = await kv.spawn_agent(name, system=prompts[team], host=host)
                    where[name] = agent.host
                done = await kv.agent(name).generate(question, max_tokens=args.max_tokens)
                turns.setdefault(name, []).append(Turn.of(done))
    return _summary(turns, where, args, time.perf_counter() - began)


async def run_policy_http(
    policy: str, root: Path, args: Any, prompts: list[str], order: list[tuple[int, int]]
) -> dict[str, Any]:
    """The trace under ``policy`` as anonymous conversations to the server's app over a
    fresh local cluster (see the module doc)."""
    import httpx
    from _serving import served

    from kvactor.actors.cluster import ServedCluster
    from kvactor.server._app import create_app

    began = time.perf_counter()
    chosen = PinTeams() if policy == "ideal" else placement(policy)
    turns: dict[str, list[Turn]] = {}
    agent_of: dict[str, set[str]] = {}  # conversation -> the server agents that ran it
    async with _open(policy, root, args, chosen) as kv:
        app = create_app(await ServedCluster.over(kv), max_anonymous=len(order) + 8)
        async with served(app) as base, httpx.AsyncClient(base_url=base, timeout=900) as http:
            chats: dict[str, list[dict[str, str]]] = {}
            for question in QUESTIONS:
                for team, member in order:
                    name = f"t{team}-a{member}"
                    chat = chats.setdefault(name, [{"role": "system", "content": prompts[team]}])
                    chat.append({"role": "user", "content": f"I am member {member}. {question}"})
                    body = {"model": "m", "messages": chat, "max_tokens": args.max_tokens}
                    got = await http.post("/v1/chat/completions", json={**body, "temperature": 0})
                    got.raise_for_status()
                    reply = got.json()
                    text = reply["choices"][0]["message"]["content"] or ""
                    chat.append({"role": "assistant", "content": text})
                    info, usage = reply["kvactor"], reply["usage"]
                    agent_of.setdefault(name, set()).add(info["agent"])
                    prompt, reused = usage["prompt_tokens"], info["reused_tokens"]
                    turn = Turn(prompt, reused, prompt - reused, info["ttft_s"], text)
                    turns.setdefault(name, []).append(turn)
            rows = (await http.get("/v1/agents")).json()["data"]
    host_of = {row["id"]: row["host"] for row in rows}
    where = {name: host_of[min(agents)] for name, agents in agent_of.items()}
    out = _summary(turns, where, args, time.perf_counter() - began)
    out["conversations_kept"] = sum(len(a) == 1 for a in agent_of.values()) / len(agent_of)
    return out


def _summary(
    turns: dict[str, list[Turn]], where: dict[str, str], args: Any, wall_s: float
) -> dict[str, Any]:
    """A policy's figures from its turns (by agent) and each agent's host."""
    done_all = [d for ds in turns.values() for d in ds]
    prompt = sum(d.prompt_tokens for d in done_all)
    reused = sum(d.reused_tokens for d in done_all)
    counts: dict[str, int] = {}
    for host in where.values():
        counts[host] = counts.get(host, 0) + 1
    return {
        "prefix_hit_rate": reused / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "prefilled_tokens": sum(d.prefilled_tokens for d in done_all),
        "summed_ttft_s": sum(d.ttft_s for d in done_all),
        "first_turn_ttft_s": sum(ds[0].ttft_s for ds in turns.values()),
        "max_host_load_share": max(counts.values()) / len(where),
        "agents_per_host": dict(sorted(counts.items())),
        "teams_split": sum(
            len({where[f"t{t}-a{i}"] for i in range(args.per_team)}) > 1 for t in range(args.teams)
        ),
        "wall_s": wall_s,
        "tokens": {name: [d.answer for d in ds] for name, ds in sorted(turns.items())},
    }


async def routing(args: Any, root: Path) -> dict[str, Any]:
    """Every policy on the same trace, then the ratios (see the module doc)."""
    async with kvactor.open(_model(args.model), cache_dir=root / "probe") as probe:
        prompts = team_prompts(probe.tokenizer, args.teams, args.prompt_tokens)
        prompt_tokens = [len(probe.tokenizer.encode(p)) for p in prompts]
    order = arrivals(args.teams, args.per_team, args.seed)
    results: dict[str, Any] = {}
    run = run_policy_http if args.http else run_policy
    for policy in POLICIES:
        results[policy] = await run(policy, root, args, prompts, order)
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
        "http": bool(args.http),
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
        f"{'over HTTP, anonymous conversations' if out.get('http') else 'by the API'}, "
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
    if out.get("http"):
        kept = min(r["conversations_kept"] for r in out["policies"].values())
        print(f"| conversations that kept their agent (least of the policies) | {kept:.3f} | 1 | |")
