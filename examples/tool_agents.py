"""Several agents calling real Python tools in a loop, on the default model.

Each agent gets a question, two tools (a calculator and a file lookup over a notes folder
this program creates) and runs the loop an agent framework runs: ask the model, run the
tool calls it makes, send the results back, until it answers in words. The first step
requires a call (``tool_choice="required"``: a grammar makes the model call a tool with
arguments that validate), later ones leave the choice to the model. Each result turn
EXTENDs the agent's cache: the line after each answer says how many tokens it reused.

    python examples/tool_agents.py [--model PATH] [--steps 2]
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import tempfile
from pathlib import Path
from typing import Annotated, Any

import kvactor  # first: it loads an optimized BLAS, which must precede mlx.core

# isort: split
import anyio
from pydantic import Field

# The arguments' schemas are grammars too: an expression of digits and operators, a file
# name among the notes (constrained turns always give arguments that validate).
Expression = Annotated[str, Field(pattern=r"^[0-9][0-9+*/(). -]{0,30}$")]

NOTES = {
    "lighthouse.txt": "The lighthouse keeper logs the lamp at dusk and dawn.",
    "recipes.txt": "Bread: 500 g flour, 350 g water, 10 g salt, 5 g yeast.",
    "trains.txt": "The night train leaves at 22:40 and arrives at 07:15.",
}
QUESTIONS = {
    "accountant": "What is 37 * 12 + 5? Use the calculator.",
    "baker": "How much flour goes into the bread? Look it up in recipes.txt.",
    "traveller": "When does the night train leave? The notes are in trains.txt.",
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: Expression) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def make_lookup(folder: Path) -> tuple[dict[str, Any], Any]:
    """The file lookup tool: its definition (OpenAI's shape) and the function."""

    def lookup(filename: str) -> str:
        path = folder / Path(filename).name  # never outside the folder
        if not path.is_file():
            return f"no such file; the files are: {', '.join(sorted(NOTES))}"
        return path.read_text(encoding="utf-8")

    definition = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Read a file of the notes folder by its name.",
            "parameters": {
                "type": "object",
                "properties": {"filename": {"enum": sorted(NOTES)}},
                "required": ["filename"],
            },
        },
    }
    return definition, lookup


async def run_agent(
    session: kvactor.Session, name: str, tools: list[Any], run: dict[str, Any], steps: int
) -> None:
    agent = await session.spawn_agent(name)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. Use the tools."},
        {"role": "user", "content": QUESTIONS[name]},
    ]
    for step in range(steps):
        choice = "required" if step == 0 else "auto"
        done = await agent.chat(
            messages, tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=128
        )
        if step:
            held = done.timings.reused_tokens
            print(f"[{name}] result turn reused {held} cached tokens ({done.match})")
        if not done.tool_calls:
            print(f"[{name}] answer: {done.text.strip()!r}")
            return
        messages.append(
            {
                "role": "assistant",
                "content": done.text or None,
                "tool_calls": [c.message() for c in done.tool_calls],
            }
        )
        for call in done.tool_calls:
            tool = run.get(call.name)
            try:
                result = tool(**call.arguments) if tool else f"no tool {call.name}"
            except TypeError as exc:
                result = f"error: {exc}"
            print(f"[{name}] calls {call.name}({json.dumps(call.arguments)}) -> {result!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = await agent.chat(messages, tools=tools, tool_choice="none", max_tokens=64)
    print(f"[{name}] answer: {final.text.strip()!r}")


async def main(model: str | None, steps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvactor-notes-") as tmp:
        folder = Path(tmp)
        for filename, text in NOTES.items():
            (folder / filename).write_text(text, encoding="utf-8")
        definition, lookup = make_lookup(folder)
        tools = [calculator, definition]
        run = {"calculator": calculator, "lookup": lookup}
        async with kvactor.open(model) as session, anyio.create_task_group() as tg:
            for name in QUESTIONS:  # the agents run at once: their turns share batches
                tg.start_soon(run_agent, session, name, tools, run, steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    anyio.run(main, args.model, args.steps)
