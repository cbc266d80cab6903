"""Answers that do not depend on who else is running: the same turns one agent at a time
and all agents at once, then a new process resuming every agent warm for one more round;
greedy token ids compared turn by turn. With the batch-invariant decode
(``deterministic=True``) and without it (the default: one padded attention call,
projections of as many rows as the batch), side by side; the batch-8 decode rate of both;
and 30 short processes that must all exit with 0.

    python bench/invariance.py [--model PATH] [--agents 10] [--rounds 5] [--tokens 24]
                               [--exits 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
from _results import write_json  # bench/ is the script's folder: on sys.path

TOPICS = [
    "liability",
    "warranty",
    "patents",
    "trademarks",
    "redistribution",
    "termination",
    "attribution",
    "sublicensing",
    "jurisdiction",
    "notices",
    "contributions",
    "fees",
]
QUESTIONS = [
    "What does your clause require?",
    "Who benefits from it?",
    "What is the risk?",
    "How would you change it?",
    "Summarize your position.",
    "What is the final word?",
]


def paragraph(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"You are a lawyer reviewing section {i + 1} of a software licence, on {topic}. "
        f"Section {i + 1}: the licensor grants a worldwide, royalty-free, non-exclusive "
        f"licence to use, copy and modify the work, provided that every copy keeps this "
        f"notice on {topic}; the {topic} terms apply to each contributor separately, and "
        "any breach ends the rights granted here after thirty days of written notice."
    )


async def rounds(
    model: str | None,
    root: Path,
    agents: int,
    first: int,
    last: int,
    tokens: int,
    concurrent: bool,
    deterministic: bool,
) -> list[list[int]]:
    """Rounds ``first`` .. ``last - 1`` of every agent (resumed from ``root`` when warm):
    the token ids of each turn, agent by agent, round by round."""
    out: list[list[int]] = [[] for _ in range(agents * (last - first))]
    async with kvactor.open(
        model, cache_dir=root, max_batch=agents, deterministic=deterministic
    ) as session:
        team = [await session.spawn_agent(f"lawyer{i}", system=paragraph(i)) for i in range(agents)]

        async def turn(i: int, r: int) -> None:
            done = await team[i].generate(QUESTIONS[r % len(QUESTIONS)], max_tokens=tokens)
            out[(r - first) * agents + i] = done.token_ids

        for r in range(first, last):
            if concurrent:
                async with anyio.create_task_group() as tg:
                    for i in range(agents):
                        tg.start_soon(turn, i, r)
            else:
                for i in range(agents):
                    await turn(i, r)
    return out


def restarted(
    args: argparse.Namespace, root: Path, concurrent: bool, deterministic: bool
) -> tuple[list[list[int]], int]:
    """One more round in a new process: its turns and its exit code."""
    cmd = [
        sys.executable,
        __file__,
        "--resume",
        str(root),
        "--agents",
        str(args.agents),
        "--rounds",
        str(args.rounds),
        "--tokens",
        str(args.tokens),
    ]
    cmd += ["--concurrent"] if concurrent else []
    cmd += [] if deterministic else ["--plain"]
    cmd += ["--model", args.model] if args.model else []
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("[")]
    return (json.loads(lines[-1]) if lines else []), run.returncode


async def batch_tok_s(model: str | None, n: int, tokens: int, deterministic: bool) -> float:
    """Tokens/s of ``n`` agents decoding together (first token of any to the last)."""
    stamps: list[float] = []
    async with kvactor.open(model, max_batch=n, deterministic=deterministic) as session:
        team = [await session.spawn_agent(f"b{i}", system=paragraph(i)) for i in range(n)]
        for agent in team:  # prefilled first: the timed turns only decode
            await agent.generate("Ready?", max_tokens=1)

        async def one(agent: Any) -> None:
            async for _ in agent.stream("Explain your clause.", max_tokens=tokens):
                stamps.append(time.perf_counter())

        async with anyio.create_task_group() as tg:
            for agent in team:
                tg.start_soon(one, agent)
    return (len(stamps) - n) / (max(stamps) - min(stamps))


def exits(count: int) -> int:
    """Short processes (open, concurrent turns over warm caches, exit) that exit with 0."""
    script = (
        "import functools, anyio, kvactor, sys\n"
        "from kvactor.actors.models import make_tiny_model\n"
        "async def main():\n"
        "    m = functools.partial(make_tiny_model, 0, head_dim=64)\n"
        "    async with kvactor.open(m, cache_dir=sys.argv[1]) as s:\n"
        "        team = [await s.spawn_agent(f'a{i}') for i in range(4)]\n"
        "        async with anyio.create_task_group() as tg:\n"
        "            for a in team:\n"
        "                tg.start_soon(functools.partial(a.generate, 'go', max_tokens=6))\n"
        "anyio.run(main)\n"
    )
    clean = 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(count):
            run = subprocess.run(
                [sys.executable, "-c", script, tmp], capture_output=True, timeout=300
            )
            clean += run.returncode == 0
    return clean


async def compare(args: argparse.Namespace, tmp: Path, deterministic: bool) -> dict[str, Any]:
    """Every turn one at a time vs all at once, rounds and the restart, in this mode."""
    label = "inv" if deterministic else "plain"
    seq, conc = tmp / f"{label}-seq", tmp / f"{label}-conc"
    a = await rounds(
        args.model, seq, args.agents, 0, args.rounds, args.tokens, False, deterministic
    )
    b = await rounds(
        args.model, conc, args.agents, 0, args.rounds, args.tokens, True, deterministic
    )
    a6, code_a = restarted(args, seq, False, deterministic)
    b6, code_b = restarted(args, conc, True, deterministic)
    turns = list(zip(a + a6, b + b6, strict=False))
    same = sum(x == y for x, y in turns)
    return {
        "identical_turns": same,
        "turns": args.agents * (args.rounds + 1),
        "restart_exit_codes": [code_a, code_b],
        "identical_after_restart": sum(x == y for x, y in zip(a6, b6, strict=False)),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"agents": args.agents, "rounds": args.rounds, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        result.update(await compare(args, Path(tmp), True))
        if not args.skip_plain:
            result["plain"] = await compare(args, Path(tmp), False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(2):  # alternate against drift
        for on in (True, False):
            rates[on].append(await batch_tok_s(args.model, 8, 32, on))
    result["batch8_tok_s"] = round(max(rates[True]), 2)
    result["batch8_tok_s_plain"] = round(max(rates[False]), 2)
    result["cost_ratio"] = round(max(rates[False]) / max(rates[True]), 3)
    result["exits"] = args.exits
    result["clean_exits"] = exits(args.exits)
    return result


def resume(args: argparse.Namespace) -> None:
    out = anyio.run(
        rounds,
        args.model,
        Path(args.resume),
        args.agents,
        args.rounds,
        args.rounds + 1,
        args.tokens,
        args.concurrent,
        not args.plain,
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--exits", type=int, default=30)
    parser.add_argument("--skip-plain", action="store_true", help="only the invariant mode")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--concurrent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        resume(args)
        sys.exit(0)
    result = anyio.run(main, args)
    print("| mode | identical turns | after the restart | restart exit codes |")
    print("|---|---:|---:|---|")
    rows = [("deterministic=True (batch-invariant)", result)]
    if "plain" in result:
        rows.append(("deterministic=False (default)", result["plain"]))
    for name, r in rows:
        print(
            f"| {name} | {r['identical_turns']}/{r['turns']} | "
            f"{r['identical_after_restart']}/{args.agents} | {r['restart_exit_codes']} |"
        )
    print(
        f"batch-8 decode: {result['batch8_tok_s']:.1f} tok/s invariant, "
        f"{result['batch8_tok_s_plain']:.1f} plain (cost ratio {result['cost_ratio']:.3f})"
    )
    print(f"clean exits: {result['clean_exits']}/{result['exits']}")
    if args.json:
        write_json(args.json, result)
