"""Structured output and tool loops on the default model: the cost of a grammar-constrained
decode step against a free one (batch 1 and 8), the host time of a token's mask, how
often constrained outputs validate, and how much of its cache a tool loop's result turn
keeps. Timing runs decode exactly ``--tokens`` steps either way (the free turns cannot
end early: EOS is banned; the constrained schema needs more tokens than that); rounds
alternate the variants, each figure its best round.

    python bench/structured.py [--model PATH] [--tokens 24] [--rounds 2] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
import jsonschema
from _results import write_json  # bench/ is the script's folder: on sys.path

BATCH = 8
PROMPT = "List some fruits as JSON."
# At least 40 strings: longer than any timing run, so constrained turns decode --tokens steps.
LONG = {
    "type": "object",
    "properties": {
        "fruits": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    },
    "required": ["fruits"],
}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "express": {"type": "boolean"},
        },
        "required": ["items", "express"],
    },
    {"enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "tags", "score"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "integer"},
            "reason": {"type": "string", "maxLength": 60},
        },
        "required": ["answer"],
    },
]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers and + - * /."""
    return expression


def lookup(filename: str) -> str:
    """Read a file of the notes folder."""
    return filename


async def _steps(session: Any, agents: int, constrained: bool, n: int, tag: str) -> list[float]:
    """Seconds per decode step of each of ``agents`` agents decoding together."""
    eos = sorted(session.tokenizer.eos_token_ids)
    options: dict[str, Any] = {"max_tokens": n}
    if constrained:
        options["response_format"] = LONG
    else:
        options["logit_bias"] = {t: -100 for t in eos}
    out: list[float] = []

    async def one(i: int) -> None:
        agent = await session.spawn_agent(f"{tag}-{i}")
        done = await agent.generate(f"{PROMPT} ({i})", **options)
        t = done.timings
        out.append(t.decode_s / max(t.generated_tokens - 1, 1))
        await session.forget(agent.name)

    async with anyio.create_task_group() as tg:
        for i in range(agents):
            tg.start_soon(one, i)
    return out


async def _schema_valid(session: Any) -> float:
    ok = 0

    async def one(i: int, schema: dict[str, Any]) -> None:
        nonlocal ok
        agent = await session.spawn_agent(f"valid-{i}")
        done = await agent.generate(
            f"Answer as JSON: {json.dumps(schema)}", response_format=schema, max_tokens=160
        )
        try:
            jsonschema.validate(json.loads(done.text), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass

    async with anyio.create_task_group() as tg:
        for i, schema in enumerate(SCHEMAS):
            tg.start_soon(one, i, schema)
    return ok / len(SCHEMAS)


async def _tool_loop_reuse(session: Any, agents: int = 3) -> list[float]:
    """Per agent: reused tokens of the turn that brings the tool results / the tokens its
    cache held before that turn."""
    ratios: list[float] = []
    tools = [calculator, lookup]
    for i in range(agents):
        agent = await session.spawn_agent(f"tools-{i}")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant with tools."},
            {"role": "user", "content": f"What is {i + 6} times 7? Use the calculator."},
        ]
        first = await agent.chat(messages, tools=tools, tool_choice="required", max_tokens=200)
        held = (await agent.cache_info()).tokens
        if not first.tool_calls:  # cut off before its call was complete: nothing to answer
            ratios.append(0.0)
            continue
        messages.append(
            {
                "role": "assistant",
                "content": first.text or None,
                "tool_calls": [c.message() for c in first.tool_calls],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": str((i + 6) * 7)}
            for c in first.tool_calls
        ]
        second = await agent.chat(messages, tools=tools, max_tokens=16)
        ratios.append(second.timings.reused_tokens / held)
    return ratios


async def main(model: str | None, n: int, rounds: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    runs: dict[str, list[float]] = {
        k: [] for k in ("free", "constrained", "free_b8", "constrained_b8")
    }
    async with kvactor.open(model, max_batch=BATCH) as session:
        await _steps(session, 1, True, 4, "warmup")  # the grammar's token table is built here
        before = await session.stats()
        for r in range(rounds):
            for constrained in (False, True):
                key = "constrained" if constrained else "free"
                runs[key].append(
                    statistics.median(await _steps(session, 1, constrained, n, f"{key}{r}"))
                )
                b8 = await _steps(session, BATCH, constrained, n, f"{key}b8{r}")
                runs[f"{key}_b8"].append(statistics.median(b8))
        after = await session.stats()
        masked = after.constrained_tokens - before.constrained_tokens
        mask_s = (after.mask_s - before.mask_s) / max(masked, 1)
        valid = await _schema_valid(session)
        reuse = await _tool_loop_reuse(session)
    best = {k: min(v) for k, v in runs.items()}
    return {
        "decode_step_s": round(best["free"], 5),
        "constrained_step_s": round(best["constrained"], 5),
        "mask_s_per_token": round(mask_s, 7),
        "overhead_ratio": round(best["constrained"] / best["free"], 3),
        "decode_step_s_b8": round(best["free_b8"], 5),
        "constrained_step_s_b8": round(best["constrained_b8"], 5),
        "overhead_ratio_b8": round(best["constrained_b8"] / best["free_b8"], 3),
        "schema_valid": round(valid, 3),
        "tool_loop_reuse": round(min(reuse), 4),
        "tool_loop_reuse_each": [round(x, 4) for x in reuse],
        "tokens": n,
        "rounds": rounds,
        "load_1m": round(load, 2),
        "runs": {k: [round(x, 5) for x in v] for k, v in runs.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH")
    args = parser.parse_args()
    started = time.perf_counter()
    result = anyio.run(main, args.model, args.tokens, args.rounds)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print("| measure | value | target |")
        print("|---|---:|---:|")
        for key, target in [
            ("decode_step_s", ""),
            ("constrained_step_s", ""),
            ("mask_s_per_token", ""),
            ("overhead_ratio", "<= 1.10"),
            ("overhead_ratio_b8", "<= 1.10"),
            ("schema_valid", "1.0"),
            ("tool_loop_reuse", ">= 0.95"),
        ]:
            print(f"| {key} | {result[key]} | {target} |")
        if args.json:
            write_json(args.json, result)
