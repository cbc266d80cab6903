"""Agent frameworks against ``kvactor serve`` on the default model (issue 27), over real
HTTP on 127.0.0.1: the OpenAI Agents SDK's tool loop to its final answer, pydantic-ai's
structured output (a tool call, its default), the Anthropic SDK's tool_use -> tool_result
round trip whole and streamed, and the openai SDK's json_schema answers and streamed
tool calls.

A 135M model is not wise: the tests force what the frameworks let them force
(``tool_choice``, one call a turn, bounded turns) and assert on the protocol (the calls
happened, their arguments validated, the final output validated), not on the answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import ServeProcess, metric, serve_process

from kvactor.actors.models import default_model_path

pytestmark = pytest.mark.slow

MULTIPLY = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """``kvactor serve`` on the default model, any model name taken (SDKs send theirs)."""
    tmp = tmp_path_factory.mktemp("clients")
    model = str(default_model_path(download=True))
    with serve_process(tmp, "--cache-dir", str(tmp / "cache"), model=model) as served:
        yield served


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the frameworks run on asyncio


async def test_the_openai_agents_sdk_runs_a_tool_loop_to_its_final_answer(
    server: ServeProcess,
) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing leaves the machine
    calls: list[tuple[int, int]] = []

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    settings = ModelSettings(
        tool_choice="required",  # the SDK resets it to auto after the call (no endless loop)
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
        extra_headers={"X-Agent-Id": "agents-sdk"},
    )
    agent = Agent(
        name="calc",
        instructions="Use the multiply tool, then answer with the number.",
        tools=[multiply],
        model=OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client),
        model_settings=settings,
    )
    try:
        result = await Runner.run(
            agent, "What is 6 times 7?", max_turns=3, run_config=RunConfig(tracing_disabled=True)
        )
    finally:
        await client.close()
    assert len(calls) == 1 and all(isinstance(x, int) for x in calls[0])
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    text = httpx.get(f"{server.base}/metrics").text
    assert metric(text, "kvactor_tool_call_turns_total") >= 1
    rows = {r["id"]: r for r in httpx.get(f"{server.base}/v1/agents").json()["data"]}
    assert rows["agents-sdk"]["tokens"] > 0


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


async def test_pydantic_ai_returns_a_validated_structured_output(server: ServeProcess) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    provider = OpenAIProvider(openai_client=client)
    agent = Agent(
        OpenAIChatModel("gpt-4o", provider=provider),
        output_type=City,  # asked for as a tool call (its default), so tool_choice required
        instructions="Answer about cities.",
        model_settings=ModelSettings(max_tokens=100, temperature=0, parallel_tool_calls=False),
    )
    try:
        result = await agent.run("What is the capital of France?")
    finally:
        await client.close()
    assert isinstance(result.output, City)
    parts = [
        p
        for m in result.all_messages()
        if isinstance(m, ModelResponse)
        for p in m.parts
        if isinstance(p, ToolCallPart)
    ]
    assert [p.tool_name for p in parts] == ["final_result"]
    City.model_validate_json(parts[0].args_as_json_str())


CALC_TOOL = {
    "name": "multiply",
    "description": "Multiply two integers.",
    "input_schema": MULTIPLY,
}


def test_the_anthropic_sdk_round_trips_tool_use_and_tool_result(server: ServeProcess) -> None:
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)
    ask: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 60,
        "system": "You compute with tools.",
        "tools": [CALC_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "What is 6 times 7?"}],
        "metadata": {"user_id": "claude"},
    }
    with client:
        done = client.messages.create(**ask)
        assert done.stop_reason == "tool_use"
        (use,) = [b for b in done.content if b.type == "tool_use"]
        jsonschema.validate(use.input, MULTIPLY)
        history = [*ask["messages"], {"role": "assistant", "content": done.content}]
        result = {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}],
        }
        answer = client.messages.create(
            **{**ask, "messages": [*history, result], "tool_choice": {"type": "none"}}
        )
        assert answer.content[0].type == "text" and answer.content[0].text
        assert answer.stop_reason in ("end_turn", "max_tokens")
        held = done.usage.input_tokens + done.usage.cache_read_input_tokens
        assert answer.usage.cache_read_input_tokens >= 0.95 * held
        # Streamed, on another agent: the same call, its input in input_json_delta pieces.
        deltas = 0
        with client.messages.stream(**{**ask, "metadata": {"user_id": "s"}}) as stream:
            for event in stream:
                deltas += event.type == "content_block_delta"
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and deltas > 1
        (streamed,) = [b for b in final.content if b.type == "tool_use"]
        assert (streamed.name, streamed.input) == (use.name, use.input)
        again = {**ask, "messages": [*history, result], "tool_choice": {"type": "none"}}
        with client.messages.stream(**again) as stream:
            text = "".join(stream.text_stream)
        # The same request whole, from the same cache (the stream left it where the answer
        # began): the same text. (The first answer extended the tool call's cache, a prefill
        # of other rows whose last bits may differ on some CPUs, and so its greedy text.)
        assert text == client.messages.create(**again).content[0].text


def test_the_openai_sdk_json_schema_and_streamed_tool_calls(server: ServeProcess) -> None:
    sdk = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    client: Any = sdk  # typed loosely: plain dicts, as test_server_tools.py's
    with sdk:
        parsed = client.chat.completions.parse(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "Name a city in Italy."}],
            response_format=City,
            max_tokens=80,
        )
        assert isinstance(parsed.choices[0].message.parsed, City)
        tool = {
            "type": "function",
            "function": {"name": "multiply", "description": "Multiply.", "parameters": MULTIPLY},
        }
        arguments: dict[int, str] = {}
        names: dict[int, str] = {}
        finish = None
        with client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "What is 6 times 7?"}],
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,  # else this model calls again until max_tokens
            stream=True,
            max_tokens=80,
        ) as stream:
            for chunk in stream:
                for call in chunk.choices[0].delta.tool_calls or []:
                    fn = call.function
                    if call.id is not None and fn is not None:
                        names[call.index] = fn.name or ""
                    piece = fn.arguments if fn is not None and fn.arguments else ""
                    arguments[call.index] = arguments.get(call.index, "") + piece
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and list(names.values()) == ["multiply"]
        for text in arguments.values():
            jsonschema.validate(json.loads(text), MULTIPLY)


def test_the_default_models_server_still_answers_plain_chat(server: ServeProcess) -> None:
    body = {"model": "anything", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert Path(server.stderr).exists()
